"""Tests of tasks/caption.py: loss and optimiser against hand computations, stage-1 restore,
evaluation helpers, and a tiny captioner that learns a two-caption toy task end to end."""

import dataclasses
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import margins  # tests/ is on the path (pytest's default import mode)
from configs import synthetic
from procap_jax import config_lib
from procap_jax import checkpointing
from procap_jax import errors
from procap_jax import evaluation
from procap_jax.data import pipeline
from procap_jax.data import vocab as vocab_lib
from procap_jax.models import captioner as captioner_lib
from procap_jax.models import procedure_encoder
from procap_jax.tasks import caption
from procap_jax.tasks import caption_loss
from procap_jax.tasks import caption_optimizer
from procap_jax.models import encodings

# ------------------------------------------------------------------ loss


def test_labels_match_vocab_decoder_labels():
  ids = np.array([[4, 9, 12, 5, 0, 0], [4, 8, 8, 8, 8, 5], [4, 5, 0, 0, 0, 0]], np.int32)
  np.testing.assert_array_equal(caption_loss.teacher_forcing_labels(jnp.asarray(ids)),
                                vocab_lib.decoder_labels(ids))


def test_label_smoothing_loss_by_hand():
  logits = np.array([[[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 0.4], [9.0, 9.0, 9.0, 9.0]]],
                    np.float32)  # [1, 3, 4]
  labels = np.array([[2, 0, -1]])
  total, count = caption_loss.label_smoothing_loss(jnp.asarray(logits), jnp.asarray(labels), 0.1)
  expected = 0.0
  for pos, gold in ((0, 2), (1, 0)):
    z = logits[0, pos]
    logp = z - np.log(np.exp(z).sum())
    q = np.full(4, 0.1 / 3)
    q[gold] = 0.9
    expected += float(np.sum(q * (np.log(q) - logp)))
  assert float(count) == 2
  assert float(total) == pytest.approx(expected, rel=1e-5)
  # no smoothing: plain summed cross-entropy
  ce, _ = caption_loss.label_smoothing_loss(jnp.asarray(logits), jnp.asarray(labels), 0.0)
  want = -sum(logits[0, p, g] - np.log(np.exp(logits[0, p]).sum()) for p, g in ((0, 2), (1, 0)))
  assert float(ce) == pytest.approx(want, rel=1e-5)


# ------------------------------------------------------------------ optimiser


def test_warmup_linear_schedule():
  sched = caption_optimizer.warmup_linear(2.0, 100, 0.1)
  got = [float(sched(s)) for s in (0, 5, 10, 55, 100, 120)]
  np.testing.assert_allclose(got, [0.0, 1.0, 2.0, 1.0, 0.0, 0.0], atol=1e-6)


def test_bert_adam_two_steps_by_hand():
  lr, wd, eps = 0.5, 0.01, 1e-6
  tx = caption_optimizer.bert_adam(caption_optimizer.warmup_linear(lr, 10, 0.1), weight_decay=wd,
                                   eps=eps)
  p0 = {'dense': {'kernel': np.array([1.0, -2.0], np.float32),
                  'bias': np.array([0.5, 0.25], np.float32)}}
  g1 = {'dense': {'kernel': np.array([0.3, -0.1], np.float32),
                  'bias': np.array([1.0, 2.0], np.float32)}}
  g2 = {'dense': {'kernel': np.array([-0.2, 0.4], np.float32),
                  'bias': np.array([0.5, -1.0], np.float32)}}
  state = tx.init(p0)
  u1, state = tx.update(g1, state, p0)
  p1 = optax.apply_updates(p0, u1)
  u2, state = tx.update(g2, state, p1)
  p2 = optax.apply_updates(p1, u2)
  for name, decayed in (('kernel', True), ('bias', False)):
    a, b = g1['dense'][name].astype(np.float64), g2['dense'][name].astype(np.float64)
    # step 0: x = 0 -> lr 0, nothing moves (but the moments are updated)
    np.testing.assert_allclose(p1['dense'][name], p0['dense'][name], rtol=0, atol=0)
    m = 0.9 * (0.1 * a) + 0.1 * b  # no bias correction
    v = 0.999 * (0.001 * a * a) + 0.001 * b * b
    lr_1 = lr * (1 - 0.1) / (1 - 0.1)  # x = 1/10 is not < 0.1: the decay branch, multiplier 1
    p = p0['dense'][name].astype(np.float64)
    step = m / (np.sqrt(v) + eps) + (wd * p if decayed else 0.0)
    np.testing.assert_allclose(p2['dense'][name], p - lr_1 * step, rtol=1e-5)


def _toy_params() -> dict:
  ones = lambda *s: np.ones(s, np.float32)  # noqa: E731
  return {
      'encoder': {'to_logits': {'dense': {'kernel': ones(3, 2), 'bias': ones(2)}},
                  'to_logits_rel': {'norm': {'scale': ones(3)}},
                  'to_logits_vid': {'dense': {'kernel': ones(3, 1)}},
                  'image_emb': ones(4, 3), 'image_mask': ones(3),
                  'resblocks_0': {'mlp': {'c_fc': {'kernel': ones(3, 3)}}}},
      'memory_mlp': {'dense_0': {'kernel': ones(3, 3)}},
      'decoder': {'output': {'kernel': ones(3, 5), 'bias': ones(5)}},
  }


def test_param_groups_frozen_heads_and_learning_rates():
  params = _toy_params()
  labels = caption_optimizer.param_labels(params)
  assert labels['encoder']['to_logits']['dense']['kernel'] == 'frozen'
  assert labels['encoder']['image_emb'] == 'frozen'
  assert labels['encoder']['image_mask'] == 'encoder'
  assert labels['memory_mlp']['dense_0']['kernel'] == 'decoder'
  mask = caption_optimizer.decay_mask(params)
  assert mask['encoder']['image_mask'] and not mask['decoder']['output']['bias']

  config = synthetic.get_config('tiny')
  config.caption.train.weight_decay = 0.0
  tx = caption_optimizer.make_optimizer(config, total_steps=10)
  state = tx.init(params)
  grads = jax.tree.map(lambda x: 0.01 * np.ones_like(x), params)
  new = params
  for _ in range(3):
    updates, state = tx.update(grads, state, new)
    new = optax.apply_updates(new, updates)
  for group in ('to_logits', 'to_logits_rel', 'to_logits_vid', 'image_emb'):
    for a, b in zip(jax.tree.leaves(params['encoder'][group]),
                    jax.tree.leaves(new['encoder'][group])):
      np.testing.assert_array_equal(a, b)
  enc = 1.0 - float(new['encoder']['image_mask'][0])
  dec = 1.0 - float(new['memory_mlp']['dense_0']['kernel'][0, 0])
  assert enc > 0 and dec > 0
  t = config.caption.train
  assert enc / dec == pytest.approx(t.lr_encoder / t.lr, rel=1e-5)


# ------------------------------------------------------------------ restoring stage 1


def _tiny_config(vocab_size: int = 13):
  config = synthetic.get_config('tiny')
  config.pretrain.model.update(dict(width=16, depth=1, heads=2, mlp_ratio=2, grid=(2, 2),
                                    feature_dim=3, codebook_size=8, text_vocab_size=vocab_size))
  config.caption.model.update(dict(hidden=16, heads=2, ffn=32, layers=1, dropout=0.0,
                                   vocab_size=vocab_size))
  config.caption.init_from_pretrain = False
  return config


def _batch(n: int = 2) -> dict:
  return {'caption_in': np.tile(np.array([[4, 8, 5] + [0] * 21], np.int32), (n, 1))}


def _init(model, config, batch, workdir=None):
  """init_params under jit, as the trainer calls it (much faster than op by op)."""
  return jax.jit(lambda r: caption.init_params(model, config, r, batch, workdir=workdir))(
      jax.random.key(0))


def _stage1_params(config, seed: int = 3, num_frames: int | None = None) -> dict:
  kwargs = config_lib.encoder_kwargs(config)
  if num_frames:
    kwargs['num_frames'] = num_frames
  encoder = procedure_encoder.ProcedureEncoder(**kwargs)
  t = kwargs['num_frames']
  init = jax.jit(lambda r: encoder.init(r, jnp.zeros((1, 24), jnp.int32),
                                        jnp.zeros((1, t, 2, 2, 3)), jnp.zeros((1, t, 4), bool),
                                        use_rel=True))
  return jax.tree.map(np.asarray, nn.meta.unbox(init(jax.random.key(seed))['params']))


def _fake_stage1(monkeypatch, params):
  def load(workdir, stage, which='best'):
    assert stage == 'pretrain'
    return {'params': params, 'model_state': {}, 'step': 7}

  monkeypatch.setattr(checkpointing, 'load_stage_variables', load)


@pytest.mark.parametrize('use_queries', [True, False])
def test_init_params_restores_the_stage1_encoder(monkeypatch, use_queries):
  config = _tiny_config()
  config.caption.init_from_pretrain = True
  config.caption.model.use_queries = use_queries
  stage1 = _stage1_params(config)
  _fake_stage1(monkeypatch, stage1)
  model = caption.build_model(config)
  boxed = _init(model, config, _batch(), workdir='W')
  assert isinstance(boxed['encoder']['to_logits']['dense']['kernel'], nn.LogicallyPartitioned)
  params = nn.meta.unbox(boxed)
  pos = params['encoder']['target_pos_emb']['weights_0']
  want = stage1['target_pos_emb']['weights_0']
  # without queries the 2 slots keep the stage-1 rows of the before and after frames
  np.testing.assert_array_equal(pos, want if use_queries else want[[0, 3]])
  np.testing.assert_array_equal(params['encoder']['image_mask'], stage1['image_mask'])
  np.testing.assert_array_equal(params['encoder']['resblocks_0']['ln_1']['scale'],
                                stage1['resblocks_0']['ln_1']['scale'])
  assert set(params) == {'encoder', 'memory_mlp', 'decoder'}


def test_restore_rejects_a_mismatched_checkpoint(monkeypatch):
  config = _tiny_config()
  model = caption.build_model(config)
  params = _init(model, config, _batch())
  other = _tiny_config()
  other.pretrain.model.width = 8
  _fake_stage1(monkeypatch, _stage1_params(other))
  with pytest.raises(errors.UserError, match='pretrain stage'):
    caption.restore_pretrained_encoder(params, 'W')


def test_missing_stage1_checkpoint_names_the_stage(tmp_path):
  config = _tiny_config()
  config.caption.init_from_pretrain = True
  model = caption.build_model(config)
  with pytest.raises(errors.UserError, match='run the pretrain stage first'):
    _init(model, config, _batch(), workdir=str(tmp_path))
  # The trainer inits without a workdir (inside jit), then applies the restore hook outside.
  params = _init(model, config, _batch())
  with pytest.raises(errors.UserError, match='run the pretrain stage first'):
    caption.restore_init(params, config, str(tmp_path))
  config.caption.init_from_pretrain = False
  assert caption.restore_init(params, config, str(tmp_path)) is params


def test_build_model_needs_the_vocabulary_size():
  config = _tiny_config(vocab_size=0)
  with pytest.raises(ValueError, match='vocab_size'):
    caption.build_model(config)


# ------------------------------------------------------------------ evaluation helpers


def test_change_groups_and_flat_metrics():
  info = [{'pair_id': f'{i:06d}{s}', 'change_type': t, 'scene_id': i, 'captions': ['x']}
          for i, (s, t) in enumerate([('c', 1), ('nc', 0), ('c', 5), ('c', 1)])]
  groups = pipeline.change_groups(info, [r['pair_id'] for r in info[:3]])
  assert groups == {'color': ['000000c'], 'none': ['000001nc'], 'move': ['000002c'],
                    'change': ['000000c', '000002c'], 'no_change': ['000001nc']}
  assert 'change' not in pipeline.change_groups(info, ['000000c', '000002c'])
  flat = evaluation.flat_metrics({'all': {'Bleu_4': 0.5, 'CIDEr': 1.5, 'SPICE': None},
                               'color': {'CIDEr': 2.0}, 'notes': ['n']})
  assert flat == {'CIDEr': 1.5, 'Bleu_4': 0.5, 'color/CIDEr': 2.0}
  assert list(flat)[0] == 'CIDEr'


# ------------------------------------------------------------------ end to end on a toy task


@dataclasses.dataclass(frozen=True)
class FakeTokenizer:
  """2 x 2 average-pooled RGB as 'features'; decode paints each code's grey level."""

  def encode_features(self, params, images):
    b, s = images.shape[:2]
    return images.reshape(b, 2, s // 2, 2, s // 2, 3).mean((2, 4))  # [B, 2, 2, 3]

  def decode_tokens(self, params, ids):
    b = ids.shape[0]
    grey = ids.reshape(b, 2, 2, 1).astype(jnp.float32) / 8.0
    return jnp.broadcast_to(jnp.repeat(jnp.repeat(grey, 4, 1), 4, 2), (b, 8, 8, 3))


CAPTIONS = {1: 'the small cube turned red', 0: 'nothing has changed'}


def _toy_data(n: int = 8):
  types = np.array([1, 0] * (n // 2), np.int32)  # color change / none
  before = np.broadcast_to(np.array([60, 90, 200], np.uint8), (n, 32, 32, 3)).copy()
  after = before.copy()
  after[types == 1] = [255, 0, 0]
  vocab = vocab_lib.Vocab.build(list(CAPTIONS.values()), min_word_count=0)
  batch = {'before': before, 'after': after,
           'caption_in': np.stack([vocab.encode_decoder(CAPTIONS[t]) for t in types]),
           'change_type': types, 'example_index': np.arange(n, dtype=np.int32),
           'valid': np.ones(n, bool)}
  truth = {1: {'type': 'color', 'to': 'red', 'object': {'size': 'small', 'color': 'blue',
                                                         'material': 'metal', 'shape': 'cube'}},
           0: {'type': 'none'}}  # what CAPTIONS say, as the synthetic records store it
  info = [{'pair_id': f'{i:06d}{"c" if t else "nc"}', 'scene_id': i, 'change_type': int(t),
           'captions': [CAPTIONS[t]], 'change_params': truth[int(t)]}
          for i, t in enumerate(types)]
  return batch, info, vocab


def test_tiny_captioner_learns_two_captions(tmp_path):
  batch, info, vocab = _toy_data()
  config = _tiny_config(vocab.size)
  config.caption.train.update(dict(lr=1e-2, lr_encoder=4e-3))
  steps = 40
  task = caption.make_task(lambda c: FakeTokenizer())
  model = caption.build_model(config)
  params = nn.meta.unbox(_init(model, config, batch))
  constants = {'tokenizer': {}}
  tx = caption_optimizer.make_optimizer(config, steps)
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, rng):
    def loss_fn(p):
      return task.loss_fn(p, {}, constants, batch, rng, config, model)

    (loss, (metrics, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics

  start = params
  first = None
  for i in range(steps):
    params, opt_state, metrics = train_step(params, opt_state, jax.random.key(i))
    first = first if first is not None else float(metrics['loss_per_word'])
  assert float(metrics['loss_per_word']) < 0.5 * first
  for head in caption_optimizer.FROZEN_ENCODER_MODULES:
    for a, b in zip(jax.tree.leaves(start['encoder'][head]),
                    jax.tree.leaves(params['encoder'][head])):
      np.testing.assert_array_equal(a, b)

  tokens = caption.generate(params, constants, config, model, batch['before'], batch['after'],
                            FakeTokenizer())
  assert [vocab.decode(t) for t in tokens] == [CAPTIONS[int(t)] for t in batch['change_type']]
  config.caption.decoding.encode_rows = 3  # 8 pairs: 3 calls and one padding copy
  rows_tokens = caption.generate(params, constants, config, model, batch['before'],
                                 batch['after'], FakeTokenizer())
  # Two programs (the encoder on 3 pairs at a time vs all 8): the same words where each has a
  # top-2 logit gap above twice the logits' float error, 64 ulps x sqrt(ffn) of their scale
  # (tests/margins.py), checked on the two memories' teacher-forced logits.
  fb, fa = encodings.pair_features(FakeTokenizer(), {}, batch)

  @jax.jit
  def logits(tokens):
    return [model.apply({'params': params}, captioner_lib.encode_memory(
        model, params, fb, fa, rows), tokens, method='decode_logits') for rows in (0, 3)]

  whole, by_rows = map(np.asarray, logits(jnp.asarray(tokens[:, :-1])))
  error = margins.sum_tolerance(np.abs(whole).max(), config.caption.model.ffn, ulps=64)
  assert np.abs(by_rows - whole).max() <= error
  gaps = margins.greedy_gaps(whole, tokens, vocab_lib.EOS, banned=(vocab_lib.UNK,))
  margins.assert_same_ids_with_margins(rows_tokens, tokens, gaps, error,
                                       min_clear_rows=len(tokens))

  state = type('State', (), {'params': params})()
  metrics = task.evaluate(state, constants, config, model, 'val', str(tmp_path), batches=[batch],
                          info=info, vocab=vocab)
  assert metrics['Bleu_4'] == pytest.approx(1.0, abs=1e-6)
  assert {'CIDEr', 'ROUGE_L', 'color/CIDEr', 'none/CIDEr', 'change/Bleu_4',
          'no_change/Bleu_4'} <= set(metrics)
  assert 'METEOR' not in metrics  # only on test
  assert metrics['semantic/decision'] == metrics['semantic/color/new_value'] == 1.0
  with open(tmp_path / 'caption' / 'predictions_val.json', encoding='utf-8') as f:
    written = json.load(f)
  assert written[0] == {'image_id': '000000c', 'caption': CAPTIONS[1]}

  frames = caption.imagine_frames(params, constants, config, model, batch['before'][:2],
                                  batch['after'][:2], FakeTokenizer())
  assert frames.shape == (2, config.data.num_keyframes, 8, 8, 3)


@pytest.mark.parametrize('rows', [1, 3, 5])
def test_encode_memory_a_few_pairs_at_a_time_equals_the_whole_batch(rows):
  batch, _, vocab = _toy_data(4)
  config = _tiny_config(vocab.size)
  model = caption.build_model(config)
  params = nn.meta.unbox(_init(model, config, batch))
  rng = np.random.default_rng(rows)  # 7 pairs: at rows 3, 3 calls and two padding copies
  before, after = (jnp.asarray(rng.normal(size=(7, 2, 2, 3)), jnp.float32) for _ in range(2))
  whole = captioner_lib.encode_memory(model, params, before, after)
  chunked = jax.jit(lambda p, b, a: captioner_lib.encode_memory(model, p, b, a, rows))(
      params, before, after)
  assert chunked.shape == whole.shape
  np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)
  # each pair's memory is its own: a pair's row differs from its neighbour's
  assert float(jnp.abs(whole[0] - whole[1]).max()) > 1e-3


def test_memory_of_the_ends_is_the_before_and_after_slots_of_the_whole_memory():
  # memory_frames='ends' (not the original's): the same parameters and encoder, and the decoder
  # reads only the before and after slots; the queries still change them through the encoder.
  batch, _, vocab = _toy_data(4)
  config = _tiny_config(vocab.size)
  model = caption.build_model(config)
  params = nn.meta.unbox(_init(model, config, batch))
  config.caption.model.memory_frames = 'ends'
  ends_model = caption.build_model(config)
  assert jax.tree.structure(nn.meta.unbox(_init(ends_model, config, batch))) == (
      jax.tree.structure(params))
  rng = np.random.default_rng(0)
  before, after = (jnp.asarray(rng.normal(size=(3, 2, 2, 3)), jnp.float32) for _ in range(2))
  whole = captioner_lib.encode_memory(model, params, before, after)  # [B, (k + 2) * 4, H]
  ends = captioner_lib.encode_memory(ends_model, params, before, after)
  n = 4  # the 2 x 2 grid's tokens per frame
  assert whole.shape[1] == (config.data.num_keyframes + 2) * n and ends.shape[1] == 2 * n
  np.testing.assert_allclose(ends, jnp.concatenate([whole[:, :n], whole[:, -n:]], 1),
                             rtol=1e-5, atol=1e-5)
  # the queries are still in the encoder: another query vector moves the before slots
  mask = params['encoder']['image_mask']  # not a constant shift: LayerNorm would remove it
  mask = mask + jnp.asarray(rng.normal(size=mask.shape), mask.dtype)
  moved = dict(params, encoder=dict(params['encoder'], image_mask=mask))
  shifted = captioner_lib.encode_memory(ends_model, moved, before, after)
  assert float(jnp.abs(shifted[:, :n] - ends[:, :n]).max()) > 1e-4


def test_invalid_rows_do_not_count():
  batch, _, vocab = _toy_data(4)
  config = _tiny_config(vocab.size)
  model = caption.build_model(config)
  params = nn.meta.unbox(_init(model, config, batch))
  task = caption.make_task(lambda c: FakeTokenizer())
  loss_fn = jax.jit(lambda p, b: task.loss_fn(p, {}, {'tokenizer': {}}, b, jax.random.key(0),
                                              config, model)[1][0])
  metrics = loss_fn(params, dict(batch, valid=np.array([True, True, False, False])))
  want = loss_fn(params, {k: v[:2] for k, v in batch.items()})
  assert float(metrics['tokens']) == float(want['tokens']) == 6 + 4
  assert float(metrics['loss_sum']) == pytest.approx(float(want['loss_sum']), rel=1e-5)
  assert math.isfinite(float(metrics['loss_per_word']))


def test_change_head_loss_by_hand_and_off_by_default():
  """The change head's cross-entropy over the valid rows, its accuracy, and the total loss
  (caption loss + weight x the head's mean, with 'mean'); without the head the captioner's
  parameters are the original's (no change_* entries)."""
  batch, _, vocab = _toy_data(4)
  batch = dict(batch, valid=np.array([True, True, True, False]))
  plain = _tiny_config(vocab.size)
  assert not any('change' in k for k in caption.build_model(plain).init(
      jax.random.key(0), jnp.zeros([1, 2, 2, 3]), jnp.zeros([1, 2, 2, 3]),
      jnp.asarray(batch['caption_in'][:1]))['params'])
  logits = jnp.log(jnp.asarray([[0.7, 0.1, 0.1, 0.1, 0, 0, 0], [0.2, 0.6, 0.1, 0.1, 0, 0, 0],
                                [0.5, 0.2, 0.1, 0.2, 0, 0, 0], [0.1, 0.1, 0.1, 0.7, 0, 0, 0]])
                   + 1e-9)
  assert captioner_lib.NUM_CHANGE_TYPES == len(pipeline.CHANGE_TYPES)
  ce, right, rows = caption_loss.change_type_loss(logits, batch)  # types 1, 0, 1, (0 padding)
  assert float(rows) == 3 and float(right) == 0  # argmaxes 0, 1, 0: all wrong
  assert float(ce) == pytest.approx(-np.log(0.1) - np.log(0.2) - np.log(0.2), rel=1e-5)

  config = _tiny_config(vocab.size)
  config.caption.model.change_head = 8
  config.caption.train.update(dict(change_loss=0.5, loss_reduction='mean'))
  model = caption.build_model(config)
  params = nn.meta.unbox(_init(model, config, batch))
  assert {'change_hidden', 'change_out'} <= set(params)
  task = caption.make_task(lambda c: FakeTokenizer())
  loss, (metrics, _) = jax.jit(lambda p: task.loss_fn(p, {}, {'tokenizer': {}}, batch,
                                                      jax.random.key(0), config, model))(params)
  assert 0.0 <= float(metrics['change_accuracy']) <= 1.0 and float(metrics['change_loss']) > 0
  assert float(loss) == pytest.approx(
      float(metrics['loss_per_word']) + 0.5 * float(metrics['change_loss']), rel=1e-5)


@pytest.mark.parametrize('reduction,micro,change', [('sum', 2, 0.0), ('mean', 4, 0.0),
                                                    ('mean', 2, 0.5), ('sum', 4, 0.5)])
def test_micro_batches_give_the_batch_loss_metrics_and_gradients(reduction, micro, change):
  """Without dropout, gradient accumulation over micro-batches is the batch's loss, metrics
  and gradients ('mean' divides by the whole batch's words; a padding row counts nothing), the
  change head's loss included."""
  batch, _, vocab = _toy_data(8)
  batch = dict(batch, valid=np.array([True] * 7 + [False]))
  config = _tiny_config(vocab.size)
  config.caption.train.loss_reduction = reduction
  config.caption.model.change_head = 8 if change else 0
  config.caption.train.change_loss = change
  model = caption.build_model(config)
  params = nn.meta.unbox(_init(model, config, batch))
  task = caption.make_task(lambda c: FakeTokenizer())
  rng = jax.random.key(0)
  whole = jax.jit(jax.value_and_grad(
      lambda p: task.loss_fn(p, {}, {'tokenizer': {}}, batch, rng, config, model),
      has_aux=True))(params)
  micro_config = _tiny_config(vocab.size)
  micro_config.caption.train.loss_reduction = reduction
  micro_config.caption.train.micro_batches = micro
  micro_config.caption.model.change_head = config.caption.model.change_head
  micro_config.caption.train.change_loss = change
  parts = jax.jit(lambda p: task.value_and_grad(p, {}, {'tokenizer': {}}, batch, rng,
                                                micro_config, model))(params)
  (loss, (metrics, _)), grads = jax.device_get(whole)
  (loss_m, (metrics_m, _)), grads_m = jax.device_get(parts)
  np.testing.assert_allclose(loss_m, loss, rtol=1e-5)
  for k in metrics:
    np.testing.assert_allclose(metrics_m[k], metrics[k], rtol=1e-5, err_msg=k)
  flat, flat_m = jax.tree.leaves(grads), jax.tree.leaves(grads_m)
  assert len(flat) == len(flat_m) and sum(float(np.abs(g).sum()) for g in flat) > 0
  # summed over the batch's words in another order: a tolerance derived from that sum's length
  # and each leaf's scale (tests/margins.py), not a fixed atol
  margins.assert_trees_close(grads_m, grads, batch['caption_in'].size)
  micro_config.caption.train.micro_batches = 3
  with pytest.raises(ValueError, match='micro_batches'):
    task.value_and_grad(params, {}, {'tokenizer': {}}, batch, rng, micro_config, model)
