"""The batch contract, determinism and iterator state of the grain pipeline."""

import numpy as np
import pytest

from procap_jax import errors
from procap_jax.data import pipeline
from procap_jax.tasks import pretrain


def _check_contract(batch, config, b):
  s = config.data.image_size
  t = config.data.num_keyframes + 2
  expected = {
      'before': (np.uint8, (b, s, s, 3)), 'after': (np.uint8, (b, s, s, 3)),
      'keyframes': (np.uint8, (b, t, s, s, 3)), 'keyframe_index': (np.int32, (b, t)),
      'caption_in': (np.int32, (b, 24)), 'encoder_text': (np.int32, (b, 24)),
      'change_type': (np.int32, (b,)), 'example_index': (np.int32, (b,)),
      'valid': (np.bool_, (b,)),
  }
  assert set(batch) == set(expected)
  for k, (dtype, shape) in expected.items():
    assert batch[k].dtype == dtype, k
    assert batch[k].shape == shape, k


def test_records_decode_their_frames_lazily_to_the_same_images(tiny_data_dir):
  from procap_jax.data import datasets
  lazy = datasets.data_source('synthetic_change', 'tiny', tiny_data_dir, 'val')
  eager = datasets.get_builder('synthetic_change', 'tiny', tiny_data_dir).as_data_source(
      split='val')
  for i in (0, len(lazy) - 1):
    got, want = lazy[i], eager[i]
    assert set(got) == set(want)
    for key in ('frames', 'oracle_frames'):
      assert isinstance(got[key], datasets.LazyImages) and len(got[key]) == len(want[key]) == 9
      np.testing.assert_array_equal(np.stack(got[key]), np.stack(want[key]))
      np.testing.assert_array_equal(got[key][-1], want[key][8])
      np.testing.assert_array_equal(np.stack(got[key][2:5]), np.stack(want[key][2:5]))
    for key in ('before', 'after'):
      np.testing.assert_array_equal(got[key], want[key])


def test_train_batches_follow_the_contract(tiny_config, tmp_path):
  ds = pipeline.make_train_dataset(tiny_config, str(tmp_path), 4, seed=0)
  batch = ds[0]
  _check_contract(batch, tiny_config, 4)
  idx = batch['keyframe_index']
  assert (idx[:, 0] == 0).all() and (idx[:, -1] == 8).all()
  assert (np.diff(idx, axis=1) > 0).all()
  # before/after are the first and last keyframes.
  np.testing.assert_array_equal(batch['keyframes'][:, 0], batch['before'])
  np.testing.assert_array_equal(batch['keyframes'][:, -1], batch['after'])
  assert (batch['caption_in'][:, 0] == 4).all()  # [BOS]


def test_train_batches_are_deterministic(tiny_config, tmp_path):
  a = pipeline.make_train_dataset(tiny_config, str(tmp_path), 4, seed=3)
  b = pipeline.make_train_dataset(tiny_config, str(tmp_path), 4, seed=3)
  for i in (0, 5):
    for k in a[i]:
      np.testing.assert_array_equal(a[i][k], b[i][k])
  c = pipeline.make_train_dataset(tiny_config, str(tmp_path), 4, seed=4)
  assert not np.array_equal(a[0]['example_index'], c[0]['example_index'])


def test_process_rows_assemble_the_global_batch(tiny_config, tmp_path):
  """Multi-process reading: each process's rows of global batch i, stacked in process order,
  are exactly the one-process batch i (stage 1's swapped captions pair rows across processes)."""
  full = pipeline.make_train_dataset(tiny_config, str(tmp_path), 8, seed=1)
  parts = [pipeline.make_train_dataset(tiny_config, str(tmp_path), 8, seed=1, rows=r)
           for r in ((0, 2), (2, 4), (4, 6), (6, 8))]
  for i in (0, 3):
    for k in full[i]:
      np.testing.assert_array_equal(np.concatenate([p[i][k] for p in parts]), full[i][k], k)
  with pytest.raises(errors.UserError, match='do not split'):
    pipeline.make_train_dataset(tiny_config, str(tmp_path), 8, seed=1, rows=(0, 3))


def test_iterator_state_reproduces_the_next_batch(tiny_config, tmp_path):
  it = pipeline.make_train_iterator(tiny_config, str(tmp_path), 4, seed=0)
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = next(it)
  it2 = pipeline.make_train_iterator(tiny_config, str(tmp_path), 4, seed=0)
  it2.set_state(state)
  got = next(it2)
  for k in expected:
    np.testing.assert_array_equal(expected[k], got[k])


def test_eval_iterator_pads_last_batch(tiny_config, tmp_path):
  info = pipeline.load_split_info(tiny_config, 'val', str(tmp_path))
  n = len(info)
  batches = list(pipeline.make_eval_iterator(tiny_config, 'val', str(tmp_path), 5))
  assert sum(int(b['valid'].sum()) for b in batches) == n
  assert len(batches) == -(-n // 5)
  _check_contract(batches[0], tiny_config, 5)
  again = list(pipeline.make_eval_iterator(tiny_config, 'val', str(tmp_path), 5))
  np.testing.assert_array_equal(batches[0]['keyframes'], again[0]['keyframes'])


def test_shuffled_eval_iterator_mixes_the_swap_partners(tiny_config, tmp_path):
  """Stage-1 validation reads a fixed permutation: every record once, the same rows as record
  order, and a no-change clip's swap partner (half a batch away) is not always no-change."""
  b = 4
  plain = list(pipeline.make_eval_iterator(tiny_config, 'val', str(tmp_path), b))
  mixed = list(pipeline.make_eval_iterator(tiny_config, 'val', str(tmp_path), b, shuffled=True))
  again = list(pipeline.make_eval_iterator(tiny_config, 'val', str(tmp_path), b, shuffled=True))
  index = lambda bs: np.concatenate([x['example_index'][x['valid']] for x in bs])
  assert sorted(index(mixed)) == sorted(index(plain))
  assert not np.array_equal(index(mixed), index(plain))
  np.testing.assert_array_equal(index(mixed), index(again))
  by_index = {int(i): r for x in plain for i, r in zip(x['example_index'], x['keyframes'])}
  for x in mixed:  # the same deterministic keyframes whatever the order
    for i, r in zip(x['example_index'], x['keyframes']):
      np.testing.assert_array_equal(r, by_index[int(i)])
  none = pipeline.CHANGE_TYPES.index('none')

  def partner_kinds(bs):
    kinds = set()
    for x in bs:
      if x['valid'].all():
        ct = x['change_type'] == none
        kinds |= set(zip(ct.tolist(), np.asarray(pretrain.swap_batch(ct)).tolist()))
    return kinds

  assert partner_kinds(plain) <= {(True, True), (False, False)}  # why shuffling is needed
  assert {(True, False), (False, True)} & partner_kinds(mixed)


def test_split_info(tiny_config, tmp_path):
  info = pipeline.load_split_info(tiny_config, 'test', str(tmp_path))
  assert info and all(r['captions'] for r in info)
  assert all(r['pair_id'].endswith(('c', 'nc')) for r in info)


def test_vocab_is_saved_next_to_the_dataset(tiny_config, tmp_path):
  vocab = pipeline.load_vocab(tiny_config, str(tmp_path))
  assert vocab.size > 8
  import os
  assert os.path.exists(os.path.join(pipeline.dataset_dir(tiny_config, str(tmp_path)),
                                     'word2idx.json'))


def test_missing_dataset_is_a_user_error(tmp_path):
  from configs import synthetic
  config = synthetic.get_config('tiny')
  config.data.data_dir = str(tmp_path / 'nothing')
  with pytest.raises(errors.UserError, match='not built'):
    pipeline.open_source(config, str(tmp_path), 'train')


def test_oracle_and_crossfade_sources(tiny_config, tmp_path):
  for source in ('oracle', 'crossfade'):
    tiny_config.data.frame_source = source
    batch = pipeline.make_train_dataset(tiny_config, str(tmp_path), 2, seed=0)[0]
    _check_contract(batch, tiny_config, 2)


def test_clip_bpe_encoder_text(tiny_config, tmp_path):
  """data.encoder_text='clip_bpe': the batch's encoder_text is the caption's CLIP BPE ids (cut to
  24, 0-padded) and the encoder text table is CLIP's 49408 ids."""
  import pathlib
  from procap_jax.data import bpe
  merges = str(pathlib.Path(__file__).parent / 'parity' / 'fixtures' / 'bpe_merges.txt')
  tiny_config.data.encoder_text = 'clip_bpe'
  tiny_config.data.bpe_merges_file = merges
  pipeline.resolve_vocab_sizes(tiny_config, str(tmp_path))
  assert tiny_config.pretrain.model.text_vocab_size == bpe.VOCAB_SIZE
  batch = next(pipeline.make_eval_iterator(tiny_config, 'val', str(tmp_path), 4))
  _check_contract(batch, tiny_config, 4)
  info = pipeline.load_split_info(tiny_config, 'val', str(tmp_path))
  tok = bpe.Bpe.from_file(merges)
  for row, i in zip(batch['encoder_text'], batch['example_index']):
    np.testing.assert_array_equal(row, tok.encode_fixed(info[i]['captions'][0]))
  words = pipeline.load_vocab(tiny_config, str(tmp_path))
  assert not np.array_equal(batch['encoder_text'][0],
                            words.encode_encoder_text(info[0]['captions'][0]))
  train = pipeline.make_train_dataset(tiny_config, str(tmp_path), 4, seed=0)[0]
  assert train['encoder_text'].shape == (4, 24) and train['encoder_text'].max() > 511


def test_clip_bpe_needs_the_clip_table_and_the_merges_file(tiny_config, tmp_path):
  tiny_config.data.encoder_text = 'clip_bpe'
  tiny_config.pretrain.model.text_vocab_size = 40
  with pytest.raises(errors.UserError, match='49408'):
    pipeline.resolve_vocab_sizes(tiny_config, str(tmp_path))
  tiny_config.pretrain.model.text_vocab_size = 0
  tiny_config.data.bpe_merges_file = str(tmp_path / 'missing.txt')
  with pytest.raises(errors.UserError, match='bpe_merges_file'):
    pipeline.make_transform(tiny_config, str(tmp_path), train=True)


def test_resolve_fills_the_vocabulary_sizes_once_and_freezes(tiny_config, tmp_path):
  """main's config: both vocabulary sizes from the caption vocabulary (also in the caller's
  config, which config.json records), then frozen, so no library code changes it later."""
  assert tiny_config.pretrain.model.text_vocab_size == tiny_config.caption.model.vocab_size == 0
  resolved = pipeline.resolve(tiny_config, str(tmp_path))
  size = pipeline.load_vocab(tiny_config, str(tmp_path)).size
  assert resolved.pretrain.model.text_vocab_size == resolved.caption.model.vocab_size == size > 4
  assert tiny_config.caption.model.vocab_size == size
  with pytest.raises((AttributeError, TypeError, ValueError)):
    resolved.caption.model.vocab_size = 1
  assert pipeline.resolve(resolved.as_configdict(), str(tmp_path)) == resolved  # idempotent
