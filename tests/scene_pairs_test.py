"""Whole-scene batches (`caption.train.scene_pairs`) and the before image a scene's two pairs
share, encoded once (`encodings.share_before`): the batches, the values, the trainer's hook."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import margins  # tests/ is on the path (pytest's default import mode)
from procap_jax import config_lib
from procap_jax import decoding
from procap_jax import errors
from procap_jax import sharding
from procap_jax import train
from procap_jax.data import pipeline
from procap_jax.data import vocab as vocab_lib
from procap_jax.diagnostics import stand_ins
from procap_jax.models import captioner as captioner_lib
from procap_jax.models import vqgan
from procap_jax.tasks import caption
from procap_jax.models import encodings


def _pairs(n: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  before = rng.integers(0, 256, (n // 2, 8, 8, 3), dtype=np.uint8).repeat(2, axis=0)
  after = rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
  return {'before': before, 'after': after, 'valid': np.ones([n], bool)}


# ------------------------------------------------------------------ share_before


def test_share_before_halves_only_batches_whose_row_pairs_share_it():
  batch = _pairs(6)
  shared = encodings.share_before(batch)
  np.testing.assert_array_equal(shared['before'], batch['before'][0::2])
  assert shared['after'] is batch['after'] and batch['before'].shape[0] == 6  # input untouched
  other = dict(batch, before=batch['before'].copy())
  other['before'][5, 0, 0, 0] ^= 1  # one pixel of one pair
  assert encodings.share_before(other) is other
  assert encodings.share_before(_pairs(6), rows_multiple=2)['before'].shape[0] == 6  # 3 rows
  assert encodings.share_before(_pairs(8), rows_multiple=2)['before'].shape[0] == 4
  odd = {k: v[:5] for k, v in batch.items()}
  assert encodings.share_before(odd) is odd
  cached = dict(batch, keyframe_features=np.zeros([6, 2, 1, 1, 1], np.float16))
  assert encodings.share_before(cached) is cached


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_shared_before_features_equal_each_pair_encoded_on_its_own(tiny_config, dtype):
  """The tiny VQGAN with random weights; in bf16 it encodes 8 images at a time, so 4 + 8 and
  8 + 8 images make differently padded chunks."""
  tokenizer = vqgan.frozen(tiny_config.tokenizer.model, dtype)
  params = stand_ins.random_tokenizer(tiny_config)
  s = tiny_config.data.image_size
  rng = np.random.default_rng(1)
  batch = {'before': rng.integers(0, 256, (4, s, s, 3), dtype=np.uint8).repeat(2, axis=0),
           'after': rng.integers(0, 256, (8, s, s, 3), dtype=np.uint8)}
  fn = jax.jit(lambda b: encodings.pair_features(tokenizer, params, b))
  want_b, want_a = fn(batch)
  got_b, got_a = fn(encodings.share_before(batch))
  np.testing.assert_allclose(got_b, want_b, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_a, want_a, rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(want_b[0] - want_b[2]).max()) > 1e-3  # the scenes differ
  with pytest.raises(ValueError, match='half as many'):
    fn(dict(batch, before=batch['before'][:3]))


def test_caption_loss_and_gradients_are_the_same_with_the_shared_before(tiny_config):
  config = tiny_config
  config.caption.model.vocab_size = 64
  config.caption.init_from_pretrain = False
  batch = stand_ins.fake_batch(config, 4, scenes=True)
  batch['caption_in'] = np.minimum(batch['caption_in'], 63)
  model = caption.build_model(config)
  params = nn.meta.unbox(caption.init_params(model, config, jax.random.key(0), batch))
  constants = {'tokenizer': stand_ins.random_tokenizer(config)}
  task = caption.TASK
  grad = jax.jit(lambda p, b: jax.value_and_grad(
      lambda q: task.loss_fn(q, {}, constants, b, jax.random.key(2), config, model),
      has_aux=True)(p))
  (loss, (metrics, _)), grads = grad(params, batch)
  shared = encodings.share_before(batch)
  assert shared['before'].shape[0] == 2
  (loss_s, (metrics_s, _)), grads_s = grad(params, shared)
  np.testing.assert_allclose(loss_s, loss, rtol=1e-5)
  np.testing.assert_allclose(metrics_s['accuracy'], metrics['accuracy'], rtol=1e-6)
  for g, g_s in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_s)):
    np.testing.assert_allclose(g_s, g, rtol=1e-4, atol=1e-6)


def test_the_caption_hook_shares_only_what_the_mesh_can_split(tiny_config):
  mesh = sharding.mesh_from_config(tiny_config)
  rows = mesh.shape['data']  # 8 devices in the tests
  batch = _pairs(2 * rows)
  assert caption.TASK.host_batch(batch, mesh)['before'].shape[0] == rows
  if rows > 1:
    small = _pairs(rows)
    assert caption.TASK.host_batch(small, mesh) is small


# ------------------------------------------------------------------ batches of whole scenes


def test_scene_batches_hold_both_pairs_of_each_scene(tiny_config, tmp_path):
  info = pipeline.load_split_info(tiny_config, 'train', str(tmp_path))
  n = len(info)
  ds = pipeline.make_train_dataset(tiny_config, str(tmp_path), 4, seed=0, scene_pairs=True)
  per_epoch = n // 4
  seen = []
  for i in range(per_epoch):
    batch = ds[i]
    index = batch['example_index']
    assert (index[0::2] % 2 == 0).all() and (index[1::2] == index[0::2] + 1).all()
    scenes = [info[int(j)]['scene_id'] for j in index]
    assert scenes[0::2] == scenes[1::2] and len(set(scenes)) == 2
    np.testing.assert_array_equal(batch['before'][0::2], batch['before'][1::2])
    assert encodings.share_before(batch)['before'].shape[0] == 2
    seen += index.tolist()
  assert sorted(seen) == list(range(per_epoch * 4))  # every record once per epoch
  again = pipeline.make_train_dataset(tiny_config, str(tmp_path), 4, seed=0, scene_pairs=True)
  for k, v in ds[3].items():
    np.testing.assert_array_equal(again[3][k], v)
  other = pipeline.make_train_dataset(tiny_config, str(tmp_path), 4, seed=1, scene_pairs=True)
  assert not np.array_equal(other[0]['example_index'], ds[0]['example_index'])


def test_scene_batch_iterator_state_resumes_to_the_next_batch(tiny_config, tmp_path):
  def iterator():
    return pipeline.TrainIterator(pipeline.make_train_dataset(
        tiny_config, str(tmp_path), 4, seed=5, scene_pairs=True))
  it = iterator()
  for _ in range(13):  # past the first epoch (12 batches of the 48 records)
    next(it)
  state = it.get_state()
  expected = next(it)
  again = iterator()
  again.set_state(state)
  got = next(again)
  for k in expected:
    np.testing.assert_array_equal(got[k], expected[k], k)


def test_scene_batches_assemble_from_process_rows(tiny_config, tmp_path):
  full = pipeline.make_train_dataset(tiny_config, str(tmp_path), 8, seed=2, scene_pairs=True)
  parts = [pipeline.make_train_dataset(tiny_config, str(tmp_path), 8, seed=2, rows=r,
                                       scene_pairs=True) for r in ((0, 4), (4, 8))]
  for k in full[1]:
    np.testing.assert_array_equal(np.concatenate([p[1][k] for p in parts]), full[1][k], k)
  with pytest.raises(errors.UserError, match='even number'):
    pipeline.make_train_dataset(tiny_config, str(tmp_path), 8, seed=2, rows=(0, 1),
                                scene_pairs=True)


def test_records_that_are_not_scene_pairs_are_refused(tiny_config, tmp_path, monkeypatch):
  src = pipeline.open_source(tiny_config, str(tmp_path), 'train')
  records = [dict(src[i], scene_id=i) for i in range(8)]  # every record its own scene
  monkeypatch.setattr(pipeline, 'open_source', lambda *args: records)
  ds = pipeline.make_train_dataset(tiny_config, str(tmp_path), 4, seed=0, scene_pairs=True)
  with pytest.raises(errors.UserError, match='caption.train.scene_pairs needs a dataset'):
    ds[0]


def test_scene_pairs_config_is_checked(tiny_config):
  tiny_config.caption.train.scene_pairs = True
  config_lib.validate(tiny_config)
  tiny_config.caption.train.batch_size = 7
  tiny_config.caption.train.micro_batches = 1
  with pytest.raises(errors.UserError, match='batch size must be even'):
    config_lib.validate(tiny_config)


# ------------------------------------------------------------------ the trainer


def test_the_trainer_feeds_the_step_the_shared_before(tiny_config, tmp_path):
  """A one-layer stand-in named 'caption' (so it reads `config.caption.train`) with the caption
  task's hook: its step sees B/2 before images, and trains."""
  seen = []

  def features(batch):
    before, after = encodings.pair_features(_MeanTokenizer(), {}, batch)
    return jnp.concatenate([before, after], axis=-1).reshape(after.shape[0], -1)

  def init_params(model, config, rng, batch):
    return model.init(rng, features(batch))['params']

  def loss_fn(params, model_state, constants, batch, rng, config, model):
    seen.append(jnp.shape(batch['before'])[0])  # at trace time
    return jnp.mean((model.apply({'params': params}, features(batch)) - 1.0) ** 2), (
        {}, model_state)

  task = train.Task(
      name='caption', build_model=lambda config: nn.Dense(1), init_params=init_params,
      loss_fn=loss_fn, make_optimizer=lambda config, total: optax.sgd(0.1),
      evaluate=lambda state, constants, config, model, split, workdir: {'loss': 1.0},
      host_batch=caption.TASK.host_batch)
  tr = tiny_config.caption.train
  # 16 pairs: their 8 before images still split over the tests' 8 devices
  tr.steps, tr.batch_size, tr.micro_batches, tr.log_every = 2, 16, 1, 1
  tr.eval_every = tr.checkpoint_every = 2
  tr.scene_pairs = True
  train.run(task, tiny_config, str(tmp_path))
  assert seen and set(seen) == {8}


class _MeanTokenizer:
  def encode_features(self, params, images):
    return images.mean(axis=(1, 2), keepdims=True)  # [N, 1, 1, 3]


def test_decoding_encodes_a_shared_before_once_and_writes_the_same_captions(tiny_config):
  config = tiny_config
  config.caption.model.vocab_size = 64
  config.caption.init_from_pretrain = False
  batch = stand_ins.fake_batch(config, 16, seed=3, scenes=True)
  model = caption.build_model(config)
  params = nn.meta.unbox(caption.init_params(model, config, jax.random.key(4), batch))
  # larger weights than the init's, so that the untrained captioner's words depend on the pair
  # a decoder with larger weights than the init's, so that the untrained captioner's words
  # depend on the pair (at the init's scale every pair gets the same caption); scaling the
  # encoder too made it amplify a float rounding difference in the features ~1e5 times
  params['decoder'] = jax.tree.map(lambda x: x * 4.0, params['decoder'])
  constants = {'tokenizer': stand_ins.random_tokenizer(config)}
  tokenizer = caption.vqgan_tokenizer(config)
  got = caption.generate(params, constants, config, model, batch['before'], batch['after'],
                         tokenizer)
  settings = config_lib.decoding_settings(config)
  whole = {'before': batch['before'], 'after': batch['after']}
  shared = {'before': batch['before'][0::2], 'after': batch['after']}
  compiled = caption._generate.lower(  # pylint: disable=protected-access
      params, constants['tokenizer'], shared, model=model, tokenizer=tokenizer, **settings)
  assert compiled.out_info.shape == got.shape  # the shared form is the one generate calls
  want = np.asarray(caption._generate(  # pylint: disable=protected-access
      params, constants['tokenizer'], whole, model=model, tokenizer=tokenizer, **settings))

  # Equal greedy ids from two programs need margins: each word's top-2 logit gap (teacher-forced
  # on `want`, whole-batch features) above twice the float error of either program's logits.
  # That error: the logits come through the decoder's layers, each a sum of up to ffn terms
  # erring a few ulps x sqrt(ffn) of the logits' scale; 64 ulps covers the layers. Checked
  # against the largest difference between that forward pass and the cached greedy decoding of
  # the shared-before features, so a CPU whose rounding differs more fails here, not on a word.
  @jax.jit
  def logits(whole, shared, tokens):
    fb, fa = encodings.pair_features(tokenizer, constants['tokenizer'], whole)
    forward = model.apply({'params': params}, fb, fa, tokens[:, :-1])  # [B, L-1, V]
    fb, fa = encodings.pair_features(tokenizer, constants['tokenizer'], shared)
    cache = model.apply({'params': params}, captioner_lib.encode_memory(model, params, fb, fa),
                        method='init_cache')
    step = lambda c, t, p: model.apply({'params': params}, c, t, p, method='decode_step')
    _, cached = decoding.greedy(step, cache, tokens.shape[0], max_len=tokens.shape[1],
                                return_logits=True)  # [B, L-1, V]
    return forward, cached

  forward, cached = map(np.asarray, logits(whole, shared, jnp.asarray(want)))
  gaps = margins.greedy_gaps(forward, want, vocab_lib.EOS, banned=(vocab_lib.UNK,))
  error = margins.sum_tolerance(np.abs(forward).max(), config.caption.model.ffn, ulps=64)
  assert np.all(gaps > -2 * error)  # `want`'s words are the forward pass's argmax
  assert np.abs(cached - forward)[np.isfinite(gaps)].max() <= error
  # all 16 rows have gaps above 2 * error (the smallest 0.013, 2 * error 0.008); a row whose
  # margin another model would lose is compared up to its near-tie
  margins.assert_same_ids_with_margins(got, want, gaps, error, min_clear_rows=12)
  assert len({tuple(r) for r in got}) > 1  # not one caption for every pair
