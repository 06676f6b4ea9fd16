"""Tests for tasks/tokenizer.py: frame selection, the EMA codebook with dead-code restarts, a short
training run, the GAN switch, and the evaluation metrics on a fake iterator."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from PIL import Image

import margins  # tests/ is on the path (pytest's default import mode)
from configs import synthetic
from procap_jax import errors
from procap_jax import train
from procap_jax.tasks import tokenizer

S = 16  # image side of the test model
T = 4   # keyframes per example


def _config(**train_overrides) -> ml_collections.ConfigDict:
  config = synthetic.get_config('tiny')
  config.tokenizer.model.update(ch=8, ch_mult=(1, 2), attn_resolutions=(), resolution=S,
                                z_channels=8, embed_dim=8, n_embed=16)
  config.tokenizer.train.update(dict(lr=3e-3, warmup_steps=3, restart_every=10, steps=30,
                                     batch_size=4, eval_batches=2), **train_overrides)
  return config


def _scenes(n: int, seed: int = 0) -> np.ndarray:
  """uint8 [n, T, S, S, 3]: a coloured square on a grey floor moving across T frames."""
  rng = np.random.default_rng(seed)
  out = np.full((n, T, S, S, 3), 120, np.uint8)
  out[:, :, S // 2:] = 90
  for i in range(n):
    color = rng.integers(0, 256, 3)
    y, x0, x1 = rng.integers(2, S - 7), rng.integers(0, S - 6), rng.integers(0, S - 6)
    for t in range(T):
      x = round(x0 + (x1 - x0) * t / (T - 1))
      out[i, t, y:y + 5, x:x + 5] = color
  return out


def _params(model: nn.Module, config: ml_collections.ConfigDict, batch: dict,
            seed: int = 0) -> dict:
  """Unboxed parameters with init_params' tree, filled with numpy (compiling flax init is slow
  on the shared CPU): kernels ~ N(0, 1/fan_in), codes ~ U(-1/K, 1/K), norm scales 1, biases 0."""
  rng = np.random.default_rng(seed)
  abstract = jax.eval_shape(lambda r: tokenizer.init_params(model, config, r, batch),
                            jax.random.key(0))

  def fill(path, leaf):
    name = path[-1].key
    if name == 'scale':
      return jnp.ones(leaf.shape)
    if name == 'bias':
      return jnp.zeros(leaf.shape)
    if name == 'embedding':
      k = leaf.shape[0]
      return jnp.asarray(rng.uniform(-1 / k, 1 / k, leaf.shape), jnp.float32)
    return jnp.asarray(rng.normal(size=leaf.shape) / np.sqrt(np.prod(leaf.shape[:-1])),
                       jnp.float32)

  return jax.tree_util.tree_map_with_path(fill, nn.meta.unbox(abstract))


def _train_step(config, model, tx):
  """A jitted (params, opt_state, model_state, batch, rng) step like the trainer's."""

  def step(params, opt_state, model_state, batch, rng):
    (loss, (metrics, model_state)), grads = jax.value_and_grad(tokenizer.loss_fn, has_aux=True)(
        params, model_state, None, batch, rng, config, model)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, model_state, loss, metrics

  return jax.jit(step)


def test_task_interface_and_parameter_tree():
  assert tokenizer.TASK.name == 'tokenizer'
  config = _config()
  model = tokenizer.TASK.build_model(config)
  batch = {'keyframes': _scenes(2)}
  assert tokenizer.TASK.load_constants(config, 'unused') is None
  state = tokenizer.TASK.init_model_state(model, config, jax.random.key(0), batch)
  assert state['cluster_size'].shape == (16,) and state['embed_sum'].shape == (16, 8)
  assert int(state['step']) == 0
  boxed = jax.eval_shape(lambda r: tokenizer.TASK.init_params(model, config, r, batch),
                         jax.random.key(0))
  assert set(boxed) == {'encoder', 'decoder', 'quant_conv', 'post_quant_conv', 'quantize'}
  assert boxed['quantize']['embedding'].names == ('codebook', None)
  config.tokenizer.train.gan_weight = 0.1
  assert 'disc' in jax.eval_shape(lambda r: tokenizer.init_params(model, config, r, batch),
                                  jax.random.key(0))


def test_select_frames():
  keyframes = np.arange(3 * T, dtype=np.uint8).reshape(3, T, 1, 1, 1) * np.ones((1, 1, 2, 2, 3),
                                                                               np.uint8)
  every = tokenizer.select_frames(jnp.asarray(keyframes), 0, jax.random.key(0))
  assert every.shape == (3 * T, 2, 2, 3)
  np.testing.assert_allclose(every[:, 0, 0, 0] * 255, np.arange(3 * T), atol=1e-4)
  two = tokenizer.select_frames(jnp.asarray(keyframes), 2, jax.random.key(1))
  ids = np.rint(np.asarray(two[:, 0, 0, 0]) * 255).astype(int).reshape(3, 2)  # [B, f]
  assert (ids // T == np.arange(3)[:, None]).all()  # each example keeps its own frames
  assert (ids[:, 0] != ids[:, 1]).all()  # distinct frames


def test_update_codebook_ema_and_dead_code_restart():
  tc = ml_collections.ConfigDict(dict(codebook_decay=0.5, dead_code_threshold=0.3,
                                      dead_code_restart=True, restart_every=5))
  codebook = jnp.array([[0.0, 0.0], [10.0, 10.0], [-5.0, 5.0], [7.0, -7.0]])
  state = dict(step=jnp.array(5, jnp.int32), cluster_size=jnp.array([1.0, 1.0, 0.0, 0.4]),
               embed_sum=jnp.array([[0.0, 0.0], [10.0, 10.0], [0.0, 0.0], [2.8, -2.8]]))
  z = jnp.array([[1.0, 1.0], [3.0, 1.0], [9.0, 9.0], [8.0, 2.0]]).reshape(1, 2, 2, 2)
  indices = jnp.array([[0, 0, 1, 1]])
  new_state, new_codebook, metrics = tokenizer.update_codebook(
      state, codebook, z, indices, jax.random.key(0), tc)
  # Codes 0 and 1: two uses each -> size 0.5 * 1 + 0.5 * 2 = 1.5.
  np.testing.assert_allclose(new_state['cluster_size'][:2], [1.5, 1.5])
  np.testing.assert_allclose(new_codebook[0], np.array([0.0 + 0.5 * 4, 0.5 * 2]) / 1.5)
  np.testing.assert_allclose(new_codebook[1], (np.array([5.0, 5.0]) + 0.5 * np.array([17, 11]))
                             / 1.5)
  # Codes 2 (never used) and 3 (EMA usage 0.2 < 0.3) are dead at this restart step (5 % 5 == 0):
  # they become encoder outputs of the batch, with statistics restarted at the threshold.
  z_rows = np.asarray(z).reshape(4, 2)
  for k in (2, 3):
    assert any(np.allclose(new_codebook[k], row) for row in z_rows)
    np.testing.assert_allclose(new_state['cluster_size'][k], 0.3)
    np.testing.assert_allclose(new_state['embed_sum'][k], 0.3 * np.asarray(new_codebook[k]),
                               rtol=1e-6)
  assert float(metrics['codes_restarted']) == 2.0
  assert int(new_state['step']) == 6
  # Off the restart step, dead codes keep their value (EMA only).
  state['step'] = jnp.array(6, jnp.int32)
  _, kept, metrics = tokenizer.update_codebook(state, codebook, z, indices, jax.random.key(0), tc)
  np.testing.assert_allclose(kept[2], codebook[2])
  np.testing.assert_allclose(kept[3], np.array([2.8, -2.8]) * 0.5 / 0.2)
  assert float(metrics['codes_restarted']) == 0.0
  tc.dead_code_restart = False
  state['step'] = jnp.array(5, jnp.int32)
  _, kept, _ = tokenizer.update_codebook(state, codebook, z, indices, jax.random.key(0), tc)
  np.testing.assert_allclose(kept[2], codebook[2])


def test_assignment_term_moves_parameter_to_target_with_sgd():
  param = jnp.array([[1.0, 2.0], [3.0, 4.0]])
  target = jnp.array([[0.5, 0.0], [3.0, -1.0]])
  value, grad = jax.value_and_grad(tokenizer.assignment_term)(param, target)
  assert float(value) == 0.0
  np.testing.assert_allclose(grad, param - target)
  updates, _ = optax.sgd(1.0).update(grad, optax.sgd(1.0).init(param))
  np.testing.assert_allclose(optax.apply_updates(param, updates), target)


def test_training_steps_lower_the_loss_and_keep_the_codebook_on_its_ema():
  config = _config()
  model = tokenizer.build_model(config)
  data = _scenes(12)
  params = _params(model, config, {'keyframes': data[:4]})
  tx = tokenizer.make_optimizer(config, config.tokenizer.train.steps)
  opt_state = tx.init(params)
  model_state = tokenizer.init_model_state(model, config, None, {'keyframes': data[:4]})
  step = _train_step(config, model, tx)
  rng = np.random.default_rng(0)
  losses = []
  for i in range(config.tokenizer.train.steps):
    batch = {'keyframes': data[rng.choice(len(data), 4, replace=False)]}
    params, opt_state, model_state, loss, metrics = step(params, opt_state, model_state, batch,
                                                         jax.random.key(i))
    losses.append(float(loss))
    if i == 0:
      # Step 0 restarts every unused code (data-dependent init); the SGD(1) codebook branch puts
      # the codebook exactly on the EMA statistics.
      assert float(metrics['codes_restarted']) > 0
      size = np.asarray(model_state['cluster_size'])
      assert (size > 0).all()
      np.testing.assert_allclose(params['quantize']['embedding'],
                                 np.asarray(model_state['embed_sum']) / size[:, None],
                                 rtol=1e-4, atol=1e-5)
  assert np.isfinite(losses).all()
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses
  assert float(metrics['codes_active']) > 0.25


def test_gan_switch_runs_one_step():
  config = _config(gan_weight=0.1, warmup_steps=0)
  model = tokenizer.build_model(config)
  batch = {'keyframes': _scenes(4)}
  params = _params(model, config, batch)
  assert 'disc' in params
  tx = tokenizer.make_optimizer(config, 10)
  state = tokenizer.init_model_state(model, config, None, batch)
  new_params, _, _, loss, metrics = _train_step(config, model, tx)(
      params, tx.init(params), state, batch, jax.random.key(0))
  assert np.isfinite(float(loss))
  assert {'gan_g', 'gan_d'} <= set(metrics)
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()) > 0, params, new_params)
  assert any(jax.tree.leaves(moved['disc'])) and any(jax.tree.leaves(moved['decoder']))


@pytest.mark.parametrize('gan_weight', [0.0, 0.1])
def test_frames_chunk_gives_the_same_loss_gradients_and_statistics(gan_weight):
  """frames_chunk runs the frames through the model 2 at a time in a checkpointed loop: the
  loss, every gradient (VQGAN and discriminator), the metrics and the EMA state equal the
  all-at-once step's."""
  batch = {'keyframes': _scenes(4)}
  results = []
  for chunk in (0, 2):
    config = _config(gan_weight=gan_weight, frames_per_example=2, frames_chunk=chunk)
    model = tokenizer.build_model(config)
    params = _params(model, config, batch)
    state = tokenizer.init_model_state(model, config, None, batch)
    fn = jax.jit(jax.value_and_grad(tokenizer.loss_fn, has_aux=True),
                 static_argnames=('config', 'model'))
    (loss, (metrics, new_state)), grads = fn(params, state, None, batch, jax.random.key(3),
                                             config=ml_collections.FrozenConfigDict(config),
                                             model=model)
    results.append((loss, metrics, new_state, grads))
  (loss0, m0, s0, g0), (loss1, m1, s1, g1) = results
  np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
  for k in m0:
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-4, atol=1e-6, err_msg=k)
  for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s0)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  overall = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g0))
  for path, a in jax.tree_util.tree_leaves_with_path(g1):
    b = g0
    for p in path:
      b = b[p.key]
    # Leaves whose true gradient is 0 (attention key biases, conv biases before a GroupNorm)
    # hold rounding noise: an absolute floor of a millionth of the largest gradient.
    bound = 1e-4 * float(jnp.abs(b).max()) + 1e-6 * overall
    assert float(jnp.abs(a - b).max()) <= bound, jax.tree_util.keystr(path)
  assert ('disc' in g1) == (gan_weight > 0)


def test_frames_chunk_keeps_each_devices_frames_on_a_data_parallel_mesh():
  """With 16 frames split over 8 devices and chunks of 8, every chunk takes one frame from each
  device: the compiled loss and gradient gather no frames (when a chunk held consecutive
  frames, all on one device, the loop gathered every frame onto every device and each device
  ran the whole batch), and the per-frame outputs are in the frames' order, one device's."""
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  from procap_jax import sharding  # pylint: disable=import-outside-toplevel
  config = _config(frames_per_example=0, frames_chunk=8)
  model = tokenizer.build_model(config)
  scenes = _scenes(4)
  params = _params(model, config, {'keyframes': scenes})
  x = jnp.asarray(scenes.reshape((-1,) + scenes.shape[2:]), jnp.float32) / 255.0  # [16, ...]
  frozen = ml_collections.FrozenConfigDict(config)

  def terms(params, x):
    means, per_frame = tokenizer.chunked_frame_terms(params, x, jax.random.key(1), frozen, model)
    return means['l1'], per_frame['mse']

  grad = jax.value_and_grad(terms, has_aux=True)
  mesh = sharding.make_mesh(8, 1, devices=jax.devices()[:8])
  frames = NamedSharding(mesh, PartitionSpec('data'))
  on_mesh = jax.jit(grad, in_shardings=(sharding.replicated(mesh), frames))
  x_mesh = jax.device_put(x, frames)
  hlo = on_mesh.lower(params, x_mesh).compile().as_text()
  assert 'all-gather' not in hlo
  (l1, mse), g = on_mesh(params, x_mesh)
  (l1_one, mse_one), g_one = jax.jit(grad)(params, x)
  # The two programs sum each weight's gradient over the n = frames x pixels (at the largest
  # resolution) positions in another order (per device, then across devices): float32 error of
  # a few ulps x sqrt(n) of the leaf's scale (tests/margins.py), 6e-5 of its largest |value|
  # for n = 4,096, where a fixed atol of 1e-6 held on one CPU's reduction order only.
  n = x.shape[0] * x.shape[1] * x.shape[2]
  np.testing.assert_allclose(l1, l1_one, rtol=0, atol=margins.sum_tolerance(abs(l1_one), x.size))
  np.testing.assert_allclose(mse, mse_one, rtol=1e-4, atol=1e-7)
  whole = jax.jit(lambda x: tokenizer._frame_terms(  # pylint: disable=protected-access
      params, x, jax.random.key(1), frozen, model)[1]['mse'])(x)
  np.testing.assert_allclose(mse_one, whole, rtol=1e-4, atol=1e-7)
  margins.assert_trees_close(g, g_one, n)


def test_frames_chunk_must_divide_the_frames():
  config = _config(frames_chunk=3)
  model = tokenizer.build_model(config)
  batch = {'keyframes': _scenes(4)}
  params = _params(model, config, batch)
  state = tokenizer.init_model_state(model, config, None, batch)
  with pytest.raises(ValueError, match='frames_chunk=3 must divide the 4 frames'):
    tokenizer.loss_fn(params, state, None, batch, jax.random.key(0), config, model)


def test_psnr_and_usage_formulas():
  np.testing.assert_allclose(tokenizer.psnr_from_mse(0.01), 20.0, rtol=1e-6)
  np.testing.assert_allclose(tokenizer.psnr_from_mse(1e-4), 40.0, rtol=1e-6)
  np.testing.assert_allclose(tokenizer.psnr_from_mse(0.0), 100.0)  # perfect: floored mse
  usage, ppl = tokenizer.usage_stats(np.array([4, 4, 0, 0]))
  assert usage == 0.5 and ppl == pytest.approx(2.0, rel=1e-6)
  usage, ppl = tokenizer.usage_stats(np.array([3, 3, 3, 3]))
  assert usage == 1.0 and ppl == pytest.approx(4.0, rel=1e-6)
  usage, ppl = tokenizer.usage_stats(np.array([9, 0, 0, 0, 0]))
  assert usage == 0.2 and ppl == pytest.approx(1.0)
  p = np.array([1, 2, 5]) / 8
  assert tokenizer.usage_stats(np.array([1, 2, 5]))[1] == pytest.approx(
      np.exp(-np.sum(p * np.log(p))), rel=1e-6)


def test_evaluate_on_fake_iterator(tmp_path):
  config = _config()
  model = tokenizer.build_model(config)
  data = _scenes(6, seed=1)
  params = _params(model, config, {'keyframes': data[:4]})
  garbage = np.full_like(data[:2], 255)
  batches = [{'keyframes': data[:4], 'valid': np.ones(4, bool)},
             {'keyframes': np.concatenate([data[4:], garbage]),
              'valid': np.array([True, True, False, False])}]
  state = train.TrainState(step=jnp.array(0), params=params, opt_state=None, model_state=None)
  metrics = tokenizer.evaluate(state, None, config, model, 'val', str(tmp_path), batches=batches)
  assert set(metrics) == {'psnr', 'l1', 'codebook_usage', 'perplexity', 'frames'}
  assert all(isinstance(v, float) for v in metrics.values())
  assert metrics['frames'] == 6 * T  # padding rows skipped

  frames = data.reshape(6 * T, S, S, 3).astype(np.float32) / 255  # [F, S, S, 3]
  out = model.apply({'params': params}, frames)
  rec = np.clip(np.asarray(out['reconstruction']), 0, 1)
  mse = np.mean((rec - frames) ** 2, axis=(1, 2, 3))
  assert metrics['psnr'] == pytest.approx(np.mean(-10 * np.log10(mse)), rel=1e-4)
  assert metrics['l1'] == pytest.approx(np.mean(np.abs(rec - frames)), rel=1e-4)
  counts = np.bincount(np.asarray(out['indices']).reshape(-1), minlength=16)
  usage, ppl = tokenizer.usage_stats(counts)
  assert metrics['codebook_usage'] == usage
  assert metrics['perplexity'] == pytest.approx(ppl, rel=1e-5)

  png = tmp_path / 'tokenizer' / 'reconstructions_val.png'
  image = np.asarray(Image.open(png))
  assert image.shape == (2 * S + 2, 8 * (S + 2) - 2, 3)
  np.testing.assert_array_equal(image[:S, :S], data[0, 0])  # top row: originals
  assert os.listdir(tmp_path / 'tokenizer') == ['reconstructions_val.png']  # no temp files


def test_evaluate_rejects_an_empty_split(tmp_path):
  config = _config()
  model = tokenizer.build_model(config)
  data = _scenes(1)
  params = _params(model, config, {'keyframes': data})
  state = train.TrainState(step=jnp.array(0), params=params, opt_state=None, model_state=None)
  batches = [{'keyframes': data, 'valid': np.zeros(1, bool)}]
  with pytest.raises(errors.UserError, match='no frames'):
    tokenizer.evaluate(state, None, config, model, 'val', str(tmp_path), batches=batches)


def test_schedule_warms_up_then_decays_to_zero():
  config = _config()
  tx = tokenizer.make_optimizer(config, 30)
  params = {'w': jnp.ones(3), 'quantize': {'embedding': jnp.ones((2, 2))}}
  state = tx.init(params)
  grads = {'w': jnp.full(3, 0.1), 'quantize': {'embedding': jnp.full((2, 2), 0.25)}}
  sizes = []
  for _ in range(30):
    updates, state = tx.update(grads, state, params)
    sizes.append(float(jnp.abs(updates['w']).max()))
    np.testing.assert_allclose(updates['quantize']['embedding'], -0.25)  # SGD(1): update = -grad
  assert sizes[0] == 0.0 and sizes[1] < sizes[2] < sizes[3]  # linear warmup over 3 steps
  assert sizes[3] == pytest.approx(3e-3, rel=1e-3)  # peak lr (Adam's first step is lr*sign)
  assert sizes[-1] < 0.05 * sizes[3]  # cosine decay towards 0 at 30
