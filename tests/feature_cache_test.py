"""Tests for data/feature_cache.py: same losses as encoding, keying, resuming, corrupt files."""

import json
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import margins  # tests/ is on the path (pytest's default import mode)
from procap_jax import errors
from procap_jax.data import feature_cache
from procap_jax.data import pipeline
from procap_jax.data import vocab as vocab_lib
from procap_jax.diagnostics import stand_ins
from procap_jax.tasks import caption
from procap_jax.models import encodings
from procap_jax.tasks import pretrain


@pytest.fixture(scope='module')
def tokenizer_params():
  from configs import synthetic
  return stand_ins.random_tokenizer(synthetic.get_config('tiny'))


@pytest.fixture()
def config(tiny_data_dir, tmp_path):
  """The tiny config on a private copy of the session's tiny dataset (caches are written
  next to it)."""
  from configs import synthetic
  data = tmp_path / 'data'
  shutil.copytree(tiny_data_dir, data)
  c = synthetic.get_config('tiny')
  c.data.data_dir = str(data)
  c.data.feature_cache = True
  pipeline.resolve_vocab_sizes(c, str(tmp_path))
  return c


def _workdir(config) -> str:
  return os.path.dirname(config.data.data_dir)


def _one_batch(config, cache, split='val', batch_size=8):
  return next(iter(pipeline.make_eval_iterator(config, split, _workdir(config), batch_size,
                                               num_batches=1, shuffled=True, cache=cache)))


def _uncached(batch):
  return {k: v for k, v in batch.items() if k not in feature_cache.KEYS}


def test_cached_encodings_are_those_of_the_keyframes(config, tokenizer_params):
  cache = feature_cache.load(config, _workdir(config), tokenizer_params, build_missing=True)
  batch = _one_batch(config, cache)
  t, n = config.data.num_keyframes + 2, 8 * 8
  assert batch['keyframe_features'].shape == (8, t, 8, 8, 32)
  assert batch['keyframe_codes'].shape == (8, t, n) and batch['keyframe_codes'].dtype == np.int32
  tokenizer = pretrain.vqgan_tokenizer(config)
  features, codes = jax.jit(lambda p, b: encodings.clip_encodings(tokenizer, p, b))(
      tokenizer_params, _uncached(batch))
  np.testing.assert_allclose(batch['keyframe_features'], features, rtol=1e-5, atol=1e-5)
  # The cache's builder and this jit are two programs: their codes are equal where the nearest
  # code wins by more than float error can move the distances (with random weights, some codes
  # are within 1e-6 of a tie). The encoder's relative error, 16 ulps x sqrt(its longest sum, a
  # 3x3 conv over 64 channels) (tests/margins.py), is checked on the features (the same encoder
  # on [0, 1] images; 7 ulps measured); the codes see [-1, 1] images.
  rel = margins.sum_tolerance(1.0, 9 * 64, ulps=16)
  assert np.abs(batch['keyframe_features'] - features).max() <= rel * np.abs(features).max()
  images = encodings.images01(batch['keyframes']).reshape((-1,) + batch['keyframes'].shape[2:])
  clear = margins.clear_codes(tokenizer.model, tokenizer_params, images, rel).reshape(codes.shape)
  assert clear.mean() > 0.9, clear.mean()  # 98% here
  np.testing.assert_array_equal(batch['keyframe_codes'][clear], np.asarray(codes)[clear])
  # The training stream carries them too, in later epochs as well (batch 30: epoch 2 of 48
  # records), gathered by the record's index in the split and its keyframe_index.
  train = pipeline.make_train_dataset(config, _workdir(config), 4, seed=0, cache=cache)[30]
  features, codes = cache.split('train').arrays()
  assert train['keyframe_features'].shape == (4, t, 8, 8, 32)
  assert np.all(train['example_index'] < len(features))
  rows = train['example_index'][:, None], train['keyframe_index']
  np.testing.assert_array_equal(train['keyframe_features'], features[rows])
  np.testing.assert_array_equal(train['keyframe_codes'], codes[rows])


def test_stage1_statistics_equal_with_and_without_the_cache(config, tokenizer_params):
  workdir = _workdir(config)
  cache = feature_cache.load(config, workdir, tokenizer_params, build_missing=True)
  batch = _one_batch(config, cache)
  model = pretrain.build_model(config)
  params = nn.meta.unbox(jax.jit(lambda k: pretrain.init_params(model, config, k, batch))(
      jax.random.key(0)))
  tokenizer = pretrain.vqgan_tokenizer(config)
  stats = jax.jit(lambda b, r: pretrain.batch_statistics(params, tokenizer_params, b, r, config,
                                                         model, tokenizer))
  for seed in range(3):  # draws with colour / affine corruptions (the one frame still encoded)
    rng = jax.random.key(seed)
    cached, encoded = stats(batch, rng), stats(_uncached(batch), rng)
    for k in pretrain.SUM_KEYS:
      np.testing.assert_allclose(cached[k], encoded[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_stage2_loss_and_captions_equal_with_and_without_the_cache(config, tokenizer_params):
  workdir = _workdir(config)
  config.caption.init_from_pretrain = False
  cache = feature_cache.load(config, workdir, tokenizer_params, build_missing=True)
  batch = _one_batch(config, cache, split='test')
  model = caption.build_model(config)
  params = nn.meta.unbox(jax.jit(lambda k: caption.init_params(model, config, k, batch))(
      jax.random.key(0)))
  tokenizer = caption.vqgan_tokenizer(config)
  loss = jax.jit(lambda b: caption.batch_loss(params, tokenizer_params, b, jax.random.key(1),
                                              config, model, tokenizer))
  (cached, m_cached), (encoded, m_encoded) = loss(batch), loss(_uncached(batch))
  np.testing.assert_allclose(cached, encoded, rtol=1e-5)
  constants = {'tokenizer': tokenizer_params}
  got = caption.generate(params, constants, config, model, batch['before'], batch['after'],
                         keyframe_features=batch['keyframe_features'])
  want = caption.generate(params, constants, config, model, batch['before'], batch['after'])

  # The accuracy and the captions count argmaxes, which two programs (cached vs encoded
  # features) give alike only where the top-2 logit gap exceeds twice the logits' float error:
  # 64 ulps x sqrt(ffn) of their scale (tests/margins.py), checked on the two feature sources.
  features = jax.jit(lambda b: encodings.pair_features(tokenizer, tokenizer_params, b))
  sources = (features(batch), features(_uncached(batch)))
  forward = jax.jit(lambda fb, fa, tokens, train: model.apply(
      {'params': params}, fb, fa, tokens, train=train, rngs={'dropout': jax.random.key(1)}),
                    static_argnames='train')  # batch_loss's logits with train=True
  train_logits = [np.asarray(forward(*f, jnp.asarray(batch['caption_in']), True))
                  for f in sources]
  eval_logits = [np.asarray(forward(*f, jnp.asarray(want[:, :-1]), False)) for f in sources]
  train_error, error = (margins.sum_tolerance(np.abs(b).max(), config.caption.model.ffn, ulps=64)
                        for _, b in (train_logits, eval_logits))
  assert np.abs(train_logits[0] - train_logits[1]).max() <= train_error  # 5e-7 here
  assert np.abs(eval_logits[0] - eval_logits[1]).max() <= error
  labels = np.asarray(caption._batch_labels(batch))  # pylint: disable=protected-access
  counted = labels != vocab_lib.IGNORE
  near = margins.top2_gap(train_logits[1], train_logits[1].argmax(-1)) <= 2 * train_error
  np.testing.assert_allclose(m_cached['accuracy'], m_encoded['accuracy'], rtol=0,
                             atol=(near & counted).sum() / counted.sum() + 1e-6)
  gaps = margins.greedy_gaps(eval_logits[1], want, vocab_lib.EOS, banned=(vocab_lib.UNK,))
  margins.assert_same_ids_with_margins(got, want, gaps, error, min_clear_rows=len(want))


def test_the_key_follows_tokenizer_and_data(config, tokenizer_params):
  workdir = _workdir(config)
  here = feature_cache.cache_dir(config, workdir, tokenizer_params)
  as_jax = jax.tree.map(jax.numpy.asarray, tokenizer_params)
  assert feature_cache.cache_dir(config, workdir, as_jax) == here  # numpy or device copy
  assert here.startswith(pipeline.dataset_dir(config, workdir))
  other = jax.tree.map(np.copy, tokenizer_params)
  leaf = other['encoder']['conv_in']['kernel']
  leaf.flat[0] += 1e-3
  assert feature_cache.cache_dir(config, workdir, other) != here
  for key, value in (('data.feature_cache_dtype', 'float16'), ('data.frame_source', 'crossfade'),
                     ('tokenizer.model.token_input_scale', 'unit')):
    changed = config.copy_and_resolve_references()
    section, name = key.rsplit('.', 1)
    node = changed
    for part in section.split('.'):
      node = node[part]
    node[name] = value
    assert feature_cache.cache_dir(changed, workdir, tokenizer_params) != here, key
  # Not built yet: evaluation gets None (and encodes the images), training builds it.
  assert feature_cache.load(config, workdir, tokenizer_params) is None
  config.data.feature_cache = False
  assert feature_cache.load(config, workdir, tokenizer_params, build_missing=True) is None
  assert not os.path.exists(here)


def test_a_killed_build_resumes_to_the_same_arrays(config, tokenizer_params, monkeypatch):
  workdir = _workdir(config)
  fresh = config.copy_and_resolve_references()
  fresh.data.data_dir = config.data.data_dir + '_fresh'
  shutil.copytree(config.data.data_dir, fresh.data.data_dir)
  reference = feature_cache.build(fresh, workdir, tokenizer_params, chunk=4)

  real, calls = feature_cache._encode, []  # pylint: disable=protected-access

  def dying(params, images, **kwargs):
    calls.append(isinstance(images, np.ndarray))  # False: the shape-only trace
    if sum(calls) == 3:
      raise KeyboardInterrupt  # as a kill between two chunks
    return real(params, images, **kwargs)

  monkeypatch.setattr(feature_cache, '_encode', dying)
  with pytest.raises(KeyboardInterrupt):
    feature_cache.build(config, workdir, tokenizer_params, chunk=4)
  final = feature_cache.cache_dir(config, workdir, tokenizer_params)
  partial = final + '.partial'
  with open(os.path.join(partial, 'progress.json'), encoding='utf-8') as f:
    assert json.load(f)['done']['train'] == 8  # two chunks of 4 records written
  assert not os.path.exists(final)
  # Rows past the progress marker are rewritten (a kill can cut a chunk's write).
  scribble = np.load(os.path.join(partial, 'train.features.npy'), mmap_mode='r+')
  scribble[8:12] = 7.0
  scribble.flush()
  del scribble

  calls.clear()
  counting = lambda p, x, **k: (calls.append(isinstance(x, np.ndarray)), real(p, x, **k))[1]
  monkeypatch.setattr(feature_cache, '_encode', counting)
  assert feature_cache.build(config, workdir, tokenizer_params, chunk=4) == final
  rows = {s: len(pipeline.open_source(config, workdir, s)) for s in feature_cache.SPLITS}
  # The two finished chunks were not encoded again.
  assert sum(calls) == sum(-(-n // 4) for n in rows.values()) - 2
  assert not os.path.exists(partial)
  for split in feature_cache.SPLITS:
    for kind in ('features', 'codes'):
      name = f'{split}.{kind}.npy'
      np.testing.assert_array_equal(np.load(os.path.join(final, name)),
                                    np.load(os.path.join(reference, name)), err_msg=name)


@pytest.mark.parametrize('damage', ['truncated', 'overwritten', 'meta'])
def test_a_corrupt_cache_is_one_sentence(config, tokenizer_params, damage, fault):
  workdir = _workdir(config)
  directory = feature_cache.build(config, workdir, tokenizer_params)
  path = os.path.join(directory, 'val.features.npy')
  if damage == 'truncated':
    os.truncate(path, os.path.getsize(path) // 2)
  elif damage == 'overwritten':
    with open(path, 'r+b') as f:
      f.seek(200)
      f.write(b'\xff' * 64)
  else:
    with open(os.path.join(directory, 'meta.json'), 'w', encoding='utf-8') as f:
      f.write('{"rows": ')
  with pytest.raises(errors.UserError) as e:
    feature_cache.load(config, workdir, tokenizer_params)
  message = str(e.value)
  assert 'corrupt' in message and 'delete that folder' in message and '\n' not in message
  assert directory in message
  fault('training (stage 1 / 2 start)', f'tokenizer feature cache file {damage}', message)


class _RecordingTokenizer:
  """A frozen-tokenizer stand-in that records which of its encodes were traced."""

  def __init__(self, one_pass: bool):
    self.one_pass, self.calls = one_pass, []

  def encode_features(self, params, x):
    self.calls.append('features')
    return x.mean(axis=(1, 2)) * params  # [M, 3]

  def encode_tokens(self, params, x):
    self.calls.append('tokens')
    return (x[:, 0, :4, 0] * 10).astype(np.int32)  # [M, 4]

  def encode_features_and_tokens(self, params, x):
    self.calls.append('both')
    return x.mean(axis=(1, 2)) * params, (x[:, 0, :4, 0] * 10).astype(np.int32)


@pytest.mark.parametrize('one_pass', [False, True])
def test_features_and_codes_take_one_pass_where_the_scales_allow(one_pass):
  """Stage 1 without the cache and the cache build ask a tokenizer whose features and codes see
  one input scale for both from one encoder pass; the original's two scales take two."""
  frames = np.random.default_rng(0).integers(0, 255, (2, 3, 8, 8, 3), dtype=np.uint8)
  tokenizer = _RecordingTokenizer(one_pass)
  features, codes = encodings.clip_encodings(tokenizer, 2.0, {'keyframes': frames})
  assert tokenizer.calls == (['both'] if one_pass else ['features', 'tokens'])
  assert features.shape == (2, 3, 3) and codes.shape == (2, 3, 4) and codes.dtype == np.int32
  images = encodings.images01(frames.reshape(6, 8, 8, 3))
  np.testing.assert_allclose(features.reshape(6, 3), images.mean(axis=(1, 2)) * 2.0, rtol=1e-6)
  tokenizer.calls.clear()
  features, codes = feature_cache._encode(2.0, frames[0], tokenizer)
  assert tokenizer.calls == (['both'] if one_pass else ['features', 'tokens'])
  assert features.shape == (3, 3) and codes.shape == (3, 4) and codes.dtype == np.int32
