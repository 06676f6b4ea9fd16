"""Tests for tasks/pretrain.py: loss values, swap, schedule, fused forwards, training, eval."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import margins  # tests/ is on the path (pytest's default import mode)
from configs import synthetic
from procap_jax import sharding
from procap_jax import train
from procap_jax.tasks import corruptions
from procap_jax.tasks import pretrain

S, P, T, K, C, L = 16, 4, 4, 16, 7, 4


@dataclasses.dataclass(frozen=True)
class PatchTokenizer:
  """A fake frozen tokenizer: random linear maps of P x P patches (features) and argmax codes."""

  def _patches(self, x):
    m = x.shape[0]
    g = S // P
    x = x.reshape(m, g, P, g, P, 3).transpose(0, 1, 3, 2, 4, 5)  # [M, g, g, P, P, 3]
    return x.reshape(m, g, g, P * P * 3)  # [M, g, g, P*P*3]

  def encode_features(self, params, x):
    return jnp.tanh(self._patches(x) @ params['feat'])  # [M, g, g, C]

  def encode_tokens(self, params, x):
    logits = self._patches(2.0 * x - 1.0) @ params['code']  # [M, g, g, K]
    return jnp.argmax(logits, -1).reshape(x.shape[0], -1).astype(jnp.int32)  # [M, g*g]


def _tokenizer_params():
  rng = np.random.default_rng(0)
  return {'feat': jnp.asarray(rng.normal(size=(P * P * 3, C)) * 0.3, jnp.float32),
          'code': jnp.asarray(rng.normal(size=(P * P * 3, K)), jnp.float32)}


def _config(**pretrain_overrides):
  config = synthetic.get_config('tiny')
  config.data.image_size = S
  config.data.num_keyframes = T - 2
  config.pretrain.model.update(dict(width=32, depth=2, heads=4, mlp_ratio=2, text_len=L,
                                    text_vocab_size=20, num_frames=T, grid=(S // P, S // P),
                                    feature_dim=C, codebook_size=K))
  config.pretrain.update(pretrain_overrides)
  return config


def _batch(rng, b):
  """Clips of a white square moving right over a coloured background; caption = colour, row."""
  palette = np.array([[.9, .2, .2], [.2, .9, .2], [.2, .2, .9], [.9, .9, .2]], np.float32)
  colour = rng.integers(0, 4, b)
  row = rng.integers(0, S // P, b)
  frames = np.broadcast_to(palette[colour][:, None, None, None] * 0.6, (b, T, S, S, 3)).copy()
  for i in range(b):
    for t in range(T):
      frames[i, t, row[i] * P:(row[i] + 1) * P, t * P:(t + 1) * P] = 1.0
  text = np.zeros((b, L), np.int32)
  text[:, 0], text[:, 1] = 8 + colour, 12 + row
  return {'keyframes': np.round(frames * 255).astype(np.uint8), 'encoder_text': text,
          'valid': np.ones(b, bool)}


TASK = pretrain.make_task(lambda config: PatchTokenizer())


def _positions(batch: dict) -> int:
  """Rows x (text + frame tokens): the length of the sums a parameter's gradient takes."""
  return len(batch['valid']) * (L + T * (S // P) ** 2)


@pytest.fixture(scope='module')
def setup():
  config = _config()
  model = TASK.build_model(config)
  batch = _batch(np.random.default_rng(0), 6)
  params = jax.jit(lambda k: TASK.init_params(model, config, k, batch))(jax.random.PRNGKey(0))
  return config, model, nn.meta.unbox(params), {'tokenizer': _tokenizer_params()}


def test_statistics_on_hand_made_logits():
  # Token logits log(1, 2, 1): softmax (1/4, 1/2, 1/4), so CE = ln 2 for code 1, ln 4 otherwise.
  logits = jnp.log(jnp.array([1.0, 2.0, 1.0]))
  frame_logits = jnp.broadcast_to(logits, (3, 2, 3))
  codes = jnp.array([[1, 0], [1, 1], [2, 1]])
  token_mask = jnp.array([[True, True], [True, False], [False, True]])
  fully = jnp.array([False, True, False])
  valid = jnp.array([True, True, True])
  rel_pos, rel_neg = jnp.array([1.0, 2.0, -1.0]), jnp.array([-1.0, -3.0, 1.0])
  vid_pos, vid_neg = jnp.array([0.0, 0.5, 2.0]), jnp.array([-2.0, 0.0, 0.0])
  sums = pretrain.statistics_from_logits(frame_logits, codes, token_mask, fully, valid, rel_pos,
                                         rel_neg, vid_pos, vid_neg)
  sp = lambda x: math.log1p(math.exp(x))  # BCE(x, 1) = sp(-x), BCE(x, 0) = sp(x)
  ln2, ln4 = math.log(2), math.log(4)
  np.testing.assert_allclose(sums['msm_ce'], ln2 + ln4 + ln2 + ln2, rtol=1e-6)
  assert float(sums['msm_count']) == 4 and float(sums['msm_correct']) == 3
  align = [sp(-1) + sp(-1), sp(-2) + sp(-3), sp(1) + sp(1)]
  csy = [sp(0) + sp(-2), sp(-0.5) + sp(0), sp(-2) + sp(0)]
  np.testing.assert_allclose(sums['align_sum'], align[0] + align[2], rtol=1e-6)
  assert float(sums['included']) == 2
  np.testing.assert_allclose(sums['csy_sum_all'], sum(csy), rtol=1e-6)
  np.testing.assert_allclose(sums['csy_sum_included'], csy[0] + csy[2], rtol=1e-6)

  for norm, csy_num in (('code', sum(csy)), ('mean', csy[0] + csy[2])):
    config = _config(csy_normalisation=norm)
    out = pretrain.losses_from_sums(sums, config)
    np.testing.assert_allclose(out['loss_msm'], (3 * ln2 + ln4) / 4, rtol=1e-6)
    np.testing.assert_allclose(out['loss_align'], (align[0] + align[2]) / 2, rtol=1e-6)
    # 'code': the fully masked sample is in the numerator, not in the divisor.
    np.testing.assert_allclose(out['loss_csy'], csy_num / 2, rtol=1e-6)
    np.testing.assert_allclose(out['loss'], 7 * out['loss_msm'] + 0.5 * out['loss_align'] +
                               0.5 * out['loss_csy'], rtol=1e-6)
    assert float(out['msm_acc']) == 0.75
    # Included samples 0 and 2: rel decisions right, right / wrong, wrong; vid decisions
    # wrong (0 is not > 0), right / right, wrong (0 is not < 0).
    assert float(out['match_acc']) == 0.5
    assert float(out['match_pair_acc']) == 0.5
    assert float(out['csy_acc']) == 0.5
    assert float(out['csy_pair_acc']) == 0.0
    # Ranked: rel+ > rel- for sample 0, not 2; vid+ > vid- for both, although only half the
    # consistency decisions fall on the right side of 0.
    assert float(out['match_rank_acc']) == 0.5
    assert float(out['csy_rank_acc']) == 1.0

  # A tie counts half: a head whose logits ignore the input ranks at chance, not at 0 or 1.
  tied = pretrain.losses_from_sums(pretrain.statistics_from_logits(
      frame_logits, codes, token_mask, fully, valid, rel_pos, rel_pos, vid_neg, vid_neg),
      _config())
  assert float(tied['match_rank_acc']) == 0.5 and float(tied['csy_rank_acc']) == 0.5
  # So does a tie an ulp apart (how the same value can come out on another CPU's kernels), while
  # a gap of 1e-3 still ranks.
  ulp = np.nextafter(np.asarray(vid_neg, np.float32), np.float32(np.inf))
  for pos, expected in ((ulp, 0.5), (np.asarray(vid_neg, np.float32) + 1e-3, 1.0)):
    out = pretrain.losses_from_sums(pretrain.statistics_from_logits(
        frame_logits, codes, token_mask, fully, valid, rel_pos, rel_pos, pos, vid_neg),
        _config())
    assert float(out['csy_rank_acc']) == expected

  # Padding rows contribute nothing; an all-masked batch divides by max(1, 0).
  none = pretrain.statistics_from_logits(frame_logits, codes, token_mask, jnp.ones(3, bool),
                                         jnp.zeros(3, bool), rel_pos, rel_neg, vid_pos, vid_neg)
  assert all(float(v) == 0 for v in none.values())
  assert float(pretrain.losses_from_sums(none, _config())['loss']) == 0


def test_swap_batch():
  np.testing.assert_array_equal(pretrain.swap_batch(jnp.arange(4)), [2, 3, 0, 1])
  np.testing.assert_array_equal(pretrain.swap_batch(jnp.arange(5)), [1, 2, 3, 4, 0])
  with pytest.raises(ValueError):
    pretrain.swap_batch(jnp.arange(1))


def test_learning_rate_schedule():
  config = _config()
  config.pretrain.train.update(dict(lr=1e-4, warmup_min=1e-6, warmup_steps=5000, warmup='log'))
  lr = pretrain.learning_rate(config)
  np.testing.assert_allclose(lr(0), 1e-6, rtol=1e-6)
  np.testing.assert_allclose(lr(1), 1e-6, rtol=1e-6)  # DeepSpeed's constructor steps once
  np.testing.assert_allclose(lr(100), 1e-6 + (1e-4 - 1e-6) * math.log(100) / math.log(5000),
                             rtol=1e-5)
  np.testing.assert_allclose(lr(5000), 1e-4, rtol=1e-5)
  np.testing.assert_allclose(lr(10 ** 6), 1e-4, rtol=1e-6)
  config.pretrain.train.warmup = 'linear'
  np.testing.assert_allclose(pretrain.learning_rate(config)(2501), (1e-6 + 1e-4) / 2, rtol=1e-5)
  # decay_steps: the last D updates of the run go linearly to 0; the warmup is untouched.
  config.pretrain.train.update(dict(warmup='log', decay_steps=2000))
  lr = pretrain.learning_rate(config, total_steps=10_000)
  np.testing.assert_allclose(lr(100), 1e-6 + (1e-4 - 1e-6) * math.log(100) / math.log(5000),
                             rtol=1e-5)
  np.testing.assert_allclose(lr(8000), 1e-4, rtol=1e-6)
  np.testing.assert_allclose(lr(9000), 0.5e-4, rtol=1e-5)
  np.testing.assert_allclose(lr(9999), 0.5e-7, rtol=1e-3)
  np.testing.assert_allclose(lr(10_000), 0.0, atol=1e-12)
  for bad in (-1, 10_001):
    config.pretrain.train.decay_steps = bad
    with pytest.raises(ValueError, match='decay_steps'):
      pretrain.learning_rate(config, total_steps=10_000)
  config.pretrain.train.update(dict(warmup='linear', decay_steps=0))
  # First Adam update: lr(0) * sign(g), after clipping the global norm.
  opt = pretrain.make_optimizer(config, 100)
  g = {'w': jnp.array([30.0, -40.0])}
  updates, _ = opt.update(g, opt.init(g))
  np.testing.assert_allclose(updates['w'], [-1e-6, 1e-6], rtol=1e-4)


def test_init_params_and_build_model(setup):
  config, model, _, _ = setup
  boxed = jax.eval_shape(lambda: TASK.init_params(model, config, jax.random.PRNGKey(0),
                                                   _batch(np.random.default_rng(0), 2)))
  assert isinstance(boxed['text_emb'], nn.LogicallyPartitioned)
  assert boxed['text_emb'].value.shape == (20 + L + 1, 32)
  bad = _config()
  bad.pretrain.model.text_vocab_size = 0
  with pytest.raises(ValueError):
    TASK.build_model(bad)
  assert isinstance(pretrain.TASK, train.Task) and pretrain.TASK.name == 'pretrain'


@pytest.mark.parametrize('inputs', ['masked', 'visible'])
def test_fused_forwards_give_the_same_losses(setup, inputs):
  config, model, params, constants = setup
  batch = _batch(np.random.default_rng(1), 6)
  results = []
  for fused in (True, False):
    cfg = _config(fused_forwards=fused, binary_inputs=inputs)
    loss, (metrics, _) = jax.jit(lambda p, b, r: TASK.loss_fn(p, {}, constants, b, r, cfg, model))(
        params, batch, jax.random.PRNGKey(3))
    results.append(jax.device_get(metrics))
  for k in results[0]:
    np.testing.assert_allclose(results[0][k], results[1][k], rtol=2e-5, atol=1e-6, err_msg=k)
  assert results[0]['loss_align'] > 0 and results[0]['loss_csy'] > 0


def test_visible_binary_inputs_change_only_the_binary_losses(setup):
  """'visible' keeps the masked reconstruction forward (same L_msm as 'masked') and judges the
  match on unmasked frames, so L_align no longer depends on the random masks (the key)."""
  _, model, params, constants = setup
  batch = _batch(np.random.default_rng(1), 6)
  out = {}
  for inputs in ('masked', 'visible'):
    cfg = _config(binary_inputs=inputs)
    loss = jax.jit(lambda p, b, r, cfg=cfg: TASK.loss_fn(p, {}, constants, b, r, cfg, model)[1][0])
    for seed in (3, 4):  # two keys: other masks
      out[inputs, seed] = jax.device_get(loss(params, batch, jax.random.PRNGKey(seed)))
  for seed in (3, 4):
    np.testing.assert_allclose(out['visible', seed]['loss_msm'], out['masked', seed]['loss_msm'],
                               rtol=1e-6)
  np.testing.assert_allclose(out['visible', 3]['loss_align'], out['visible', 4]['loss_align'],
                             rtol=1e-6)
  assert abs(out['masked', 3]['loss_align'] - out['masked', 4]['loss_align']) > 1e-5
  with pytest.raises(ValueError, match='binary_inputs'):
    TASK.loss_fn(params, {}, constants, batch, jax.random.PRNGKey(3),
                 _config(binary_inputs='both'), model)


def test_a_few_hundred_steps_reduce_every_loss(setup):
  config, model, params, constants = setup
  config = _config()
  config.pretrain.train.update(dict(lr=5e-3, warmup_steps=20))
  # On these toy clips a shuffle of mostly masked frames or a small warp of a flat background
  # is nearly invisible, so 300 steps train L_csy on the replace and colour negatives (every
  # corruption kind is tested in corruptions_test.py), with half the tokens kept.
  config.pretrain.corruption.probs = (0.5, 0.0, 0.5, 0.0)
  config.pretrain.masking.keep_prob_range = (0.5, 0.5)
  opt = TASK.make_optimizer(config, 300)

  @jax.jit
  def step(params, opt_state, batch, rng):
    grad_fn = jax.value_and_grad(TASK.loss_fn, has_aux=True)
    (_, (metrics, _)), grads = grad_fn(params, {}, constants, batch, rng, config, model)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics

  opt_state = opt.init(params)
  data = np.random.default_rng(2)
  history = []
  for i in range(300):
    params, opt_state, metrics = step(params, opt_state, _batch(data, 8),
                                      jax.random.fold_in(jax.random.PRNGKey(5), i))
    history.append(metrics)
  history = jax.device_get(history)
  for k in ('loss_msm', 'loss_align', 'loss_csy', 'loss'):
    first = np.mean([h[k] for h in history[:30]])
    last = np.mean([h[k] for h in history[-30:]])
    assert last < 0.85 * first, (k, first, last)
  assert np.mean([h['msm_acc'] for h in history[-30:]]) > 0.5


def test_evaluate_is_deterministic(setup):
  config, model, params, constants = setup
  state = train.TrainState(step=jnp.int32(0), params=params, opt_state=None, model_state={})
  batches = [_batch(np.random.default_rng(i), 6) for i in range(2)]
  padded = dict(batches[1])
  padded['valid'] = np.array([True] * 3 + [False] * 3)
  batches.append(padded)
  first = TASK.evaluate(state, constants, config, model, 'validation', '/nonexistent',
                        batches=iter(batches))
  second = TASK.evaluate(state, constants, config, model, 'validation', '/nonexistent',
                         batches=iter(batches))
  assert first == second
  assert set(first) == {'loss', 'loss_msm', 'loss_align', 'loss_csy', 'msm_acc', 'match_acc',
                        'csy_acc', 'match_pair_acc', 'csy_pair_acc', 'match_rank_acc',
                        'csy_rank_acc'}
  assert all(isinstance(v, float) and math.isfinite(v) for v in first.values())


def test_batch_logits_are_what_the_statistics_sum(setup):
  # bench.head_logits reads these logits; the logged metrics must be their sums.
  config, model, params, constants = setup
  batch = _batch(np.random.default_rng(3), 6)
  rng = jax.random.PRNGKey(5)
  out = pretrain.batch_logits(params, constants['tokenizer'], batch, rng, config, model,
                              PatchTokenizer())
  sums = pretrain.batch_statistics(params, constants['tokenizer'], batch, rng, config, model,
                                   PatchTokenizer())
  for k in ('rel_pos', 'rel_neg', 'vid_pos', 'vid_neg', 'corruption', 'fully_masked'):
    assert out[k].shape == (6,)
  assert set(np.asarray(out['corruption']).tolist()) <= set(range(len(corruptions.KINDS)))
  included = ~np.asarray(out['fully_masked'])
  p, n = np.asarray(out['vid_pos'])[included], np.asarray(out['vid_neg'])[included]
  tie = np.isclose(p, n, rtol=pretrain.RANK_TIE_RTOL, atol=pretrain.RANK_TIE_ATOL)
  np.testing.assert_allclose(sums['csy_rank_correct'], np.sum(np.where(tie, 0.5, p > n)))
  np.testing.assert_allclose(sums['csy_correct'], np.sum(p > 0) + np.sum(n < 0))


def test_loss_with_the_real_vqgan():
  """Shapes and API of the real tokenizer through the loss (traced only, not compiled)."""
  config = _config()
  config.data.image_size = 32
  config.pretrain.model.update(dict(grid=(8, 8), feature_dim=config.tokenizer.model.z_channels,
                                    codebook_size=config.tokenizer.model.n_embed))
  tokenizer = pretrain.vqgan_tokenizer(config)
  tok_params = jax.eval_shape(
      lambda: tokenizer.model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))))['params']
  model = pretrain.TASK.build_model(config)
  batch = {'keyframes': np.random.default_rng(0).integers(0, 256, (2, T, 32, 32, 3), np.uint8),
           'encoder_text': np.array([[9, 10, 0, 0], [11, 0, 0, 0]], np.int32),
           'valid': np.ones(2, bool)}
  params = jax.eval_shape(
      lambda: nn.meta.unbox(pretrain.TASK.init_params(model, config, jax.random.PRNGKey(1), batch)))
  loss, (metrics, _) = jax.eval_shape(
      lambda p, c: pretrain.TASK.loss_fn(p, {}, {'tokenizer': c}, batch, jax.random.PRNGKey(2),
                                         config, model), params, tok_params)
  assert loss.shape == () and loss.dtype == jnp.float32
  assert set(metrics) == {'loss', 'loss_msm', 'loss_align', 'loss_csy', 'msm_acc', 'match_acc',
                          'csy_acc', 'match_pair_acc', 'csy_pair_acc',
                          'match_rank_acc', 'csy_rank_acc'}


def _params_on_a_4x2_mesh(config, model, batch):
  """(parameters initialised sharded by the config's rules over a (4, 2) mesh, the mesh)."""
  key = jax.random.PRNGKey(4)
  init = lambda k: TASK.init_params(model, config, k, batch)
  mesh = sharding.make_mesh(4, 2)
  shardings = sharding.logical_shardings(jax.eval_shape(init, key), mesh, config.sharding.rules)
  return jax.jit(lambda k: nn.meta.unbox(init(k)), out_shardings=shardings)(key), mesh


def test_sharded_loss_equals_single_device(setup):
  config, model, _, constants = setup
  batch = _batch(np.random.default_rng(7), 8)
  rng = jax.random.PRNGKey(6)
  params, mesh = _params_on_a_4x2_mesh(config, model, batch)
  assert any(len(p.sharding.device_set) == 8 and not p.sharding.is_fully_replicated
             for p in jax.tree.leaves(params))
  loss = jax.jit(lambda p, b: TASK.loss_fn(p, {}, constants, b, rng, config, model)[0])
  single = loss(jax.device_put(params, jax.devices()[0]), batch)
  sharded = loss(params, sharding.shard_batch(batch, mesh))
  np.testing.assert_allclose(single, sharded, rtol=1e-5)


@pytest.mark.parametrize('inputs,fused,micro', [('masked', True, 2), ('masked', False, 3),
                                                ('visible', True, 6)])
def test_micro_batches_give_the_batch_loss_metrics_and_gradients(setup, inputs, fused, micro):
  """Gradient accumulation over micro-batches is the batch's loss and gradient: the masks,
  negatives (the whole batch's caption swap) and divisors stay the batch's. A padding row and
  a fully masked sample (the 'all' strategy on some rows) check the divisors."""
  _, model, params, constants = setup
  batch = _batch(np.random.default_rng(5), 6)
  batch['valid'][4] = False
  cfg = _config(binary_inputs=inputs, fused_forwards=fused)
  cfg.pretrain.masking.strategy_probs = (0.5, 0.5, 0.0, 0.0, 0.0)  # random | all frames
  rng = jax.random.PRNGKey(8)
  whole = jax.jit(jax.value_and_grad(
      lambda p: TASK.loss_fn(p, {}, constants, batch, rng, cfg, model), has_aux=True))(params)
  cfg_micro = _config(binary_inputs=inputs, fused_forwards=fused)
  cfg_micro.pretrain.masking.strategy_probs = cfg.pretrain.masking.strategy_probs
  cfg_micro.pretrain.train.micro_batches = micro
  parts = jax.jit(lambda p: TASK.value_and_grad(p, {}, constants, batch, rng, cfg_micro,
                                                model))(params)
  (loss, (metrics, _)), grads = jax.device_get(whole)
  (loss_m, (metrics_m, _)), grads_m = jax.device_get(parts)
  assert 0 < metrics['msm_acc'] < 1 or metrics['loss_msm'] > 0
  np.testing.assert_allclose(loss_m, loss, rtol=1e-5)
  for k in metrics:
    np.testing.assert_allclose(metrics_m[k], metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
  flat, flat_m = jax.tree.leaves(grads), jax.tree.leaves(grads_m)
  assert len(flat) == len(flat_m) and sum(float(np.abs(g).sum()) for g in flat) > 0
  # summed over the batch's positions in another order: a tolerance derived from that sum's
  # length and each leaf's scale (tests/margins.py), not a fixed atol
  margins.assert_trees_close(grads_m, grads, _positions(batch))


def test_micro_batches_must_divide_the_batch(setup):
  _, model, params, constants = setup
  cfg = _config()
  cfg.pretrain.train.micro_batches = 4
  with pytest.raises(ValueError, match='micro_batches'):
    TASK.value_and_grad(params, {}, constants, _batch(np.random.default_rng(5), 6),
                        jax.random.PRNGKey(8), cfg, model)


def test_micro_batches_on_a_sharded_mesh_equal_one_device(setup):
  config, model, _, constants = setup
  batch = _batch(np.random.default_rng(7), 8)
  rng = jax.random.PRNGKey(6)
  params, mesh = _params_on_a_4x2_mesh(config, model, batch)
  cfg = _config()
  cfg.pretrain.train.micro_batches = 2
  step = jax.jit(lambda p, b: TASK.value_and_grad(p, {}, constants, b, rng, cfg, model))
  (single, _), grads = jax.device_get(step(jax.device_put(params, jax.devices()[0]), batch))
  (sharded, _), grads_s = jax.device_get(step(params, sharding.shard_batch(batch, mesh)))
  np.testing.assert_allclose(sharded, single, rtol=1e-5)
  margins.assert_trees_close(grads_s, grads, _positions(batch))  # as in the test above


def test_frame_difference_keeps_fused_forwards_and_sharding_exact():
  """With `frame_difference='before'` (the synthetic default's switch) the fused batch-3B forward
  gives the unfused losses, and the loss on a (4, 2) mesh equals the single-device one: the
  difference is taken within each sample and its Dense is sharded by the same rules."""
  config = _config()
  config.pretrain.model.frame_difference = 'before'
  model = TASK.build_model(config)
  constants = {'tokenizer': _tokenizer_params()}
  batch = _batch(np.random.default_rng(7), 8)
  rng = jax.random.PRNGKey(6)
  params, mesh = _params_on_a_4x2_mesh(config, model, batch)
  assert 'diff_to_embedding' in params
  losses = []
  for fused in (True, False):
    cfg = _config(fused_forwards=fused)
    cfg.pretrain.model.frame_difference = 'before'
    loss = jax.jit(lambda p, b, c=cfg: TASK.loss_fn(p, {}, constants, b, rng, c, model)[0])
    losses.append(loss(jax.device_put(params, jax.devices()[0]), batch))
    if fused:
      np.testing.assert_allclose(loss(params, sharding.shard_batch(batch, mesh)), losses[0],
                                 rtol=1e-5)
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
