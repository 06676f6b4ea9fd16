"""Tests of procap_jax.procedure.scores (confidence files and feature functions)."""

import json

import numpy as np
import pytest

from procap_jax import errors
from procap_jax.procedure import interpolation
from procap_jax.procedure import scores


def _frames(seed=0, size=24, t=9):
  """A crossfade between two random block images: uint8 [T, size, size, 3]."""
  rng = np.random.default_rng(seed)
  a = np.repeat(np.repeat(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8), size // 4, 0),
                size // 4, 1)
  b = np.repeat(np.repeat(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8), size // 4, 0),
                size // 4, 1)
  return interpolation.interpolate(a, b, num_frames=t, method='crossfade')


def _random_scores(ids, rows=1, t=9, seed=0):
  rng = np.random.default_rng(seed)
  return {i: (rng.uniform(-1, 1, (rows, t)), rng.uniform(-1, 1, (rows, t))) for i in ids}


@pytest.mark.parametrize('style', ['flat', 'clevr'])
def test_round_trip(tmp_path, style):
  ids = ['000000c', '000000nc', '000017c', '000017nc'] if style == 'clevr' else ['a1', 'b-2', '7']
  written = _random_scores(ids, rows=3)
  path = str(tmp_path / 'scores.json')
  assert scores.write_scores(path, written, style) == style
  loaded = scores.load_scores(path)
  assert sorted(loaded) == sorted(ids)
  for i in ids:
    np.testing.assert_allclose(loaded[i][0], written[i][0].mean(0), atol=1e-6)
    np.testing.assert_allclose(loaded[i][1], written[i][1].mean(0), atol=1e-6)
  raw = json.load(open(path))
  if style == 'clevr':
    assert sorted(raw) == ['000000.png', '000017.png']
    assert sorted(raw['000017.png']) == ['nsc_sim_matrixes', 'sc_sim_matrixes']
  assert scores.load_scores(path, style=style).keys() == loaded.keys()


def test_auto_style_when_writing(tmp_path):
  path = str(tmp_path / 's.json')
  assert scores.write_scores(path, _random_scores(['000001c', '000001nc'])) == 'clevr'
  assert scores.write_scores(path, _random_scores(['000001c', 'img_7'])) == 'flat'
  with pytest.raises(ValueError):
    scores.write_scores(path, _random_scores(['img_7']), 'clevr')


def test_official_clevr_file_loads_to_our_pair_ids(tmp_path):
  # The official layout: "%06d.png" -> sc/nsc matrices, each [R, 9] (here R = 2), plus the
  # optional DINO keys, which are ignored.
  sc = {'bef_inter_sim': [[0.30] * 9, [0.50] * 9],
        'inter_aft_sim': [[0.1 * t for t in range(9)]] * 2,
        'bef_inter_dino_score': [[1.0] * 9]}
  nsc = {'bef_inter_sim': [[0.9] * 9], 'inter_aft_sim': [[0.8] * 9]}
  path = tmp_path / 'clevr_similarity_scores.json'
  path.write_text(json.dumps({'000123.png': {'sc_sim_matrixes': sc, 'nsc_sim_matrixes': nsc},
                              '004567.png': {'sc_sim_matrixes': sc}}))
  loaded = scores.load_scores(str(path))
  assert sorted(loaded) == ['000123c', '000123nc', '004567c']
  np.testing.assert_allclose(loaded['000123c'][0], [0.40] * 9)
  np.testing.assert_allclose(loaded['000123c'][1], [0.1 * t for t in range(9)])
  np.testing.assert_allclose(loaded['000123nc'][1], [0.8] * 9)


def test_official_flat_file(tmp_path):
  path = tmp_path / 'spot_similarity_scores.json'
  entry = {'bef_inter_sim': [[1, 2, 3]], 'inter_aft_sim': [[3, 2, 1]]}
  path.write_text(json.dumps({'1234': entry}))
  loaded = scores.load_scores(str(path))
  np.testing.assert_array_equal(loaded['1234'][0], [1, 2, 3])


@pytest.mark.parametrize('content', [
    None, '', '{not json', '[]', '{}', '{"a": {"bef_inter_sim": [[1, 2]]}}',
    '{"a": {"bef_inter_sim": [[1, 2]], "inter_aft_sim": [[1, 2, 3]]}}',
    '{"a": {"bef_inter_sim": "x", "inter_aft_sim": [[1]]}}',
    '{"a": {"bef_inter_sim": [[1, NaN]], "inter_aft_sim": [[1, 2]]}}',
    '{"000001.png": {"sc_sim_matrixes": {"bef_inter_sim": [[1]]}}}',
])
def test_missing_or_corrupt_files_raise_user_error(tmp_path, content):
  path = tmp_path / 'bad.json'
  if content is not None:
    path.write_text(content)
  with pytest.raises(errors.UserError) as info:
    scores.load_scores(str(path))
  assert str(path) in str(info.value) and '\n' not in str(info.value)


def test_stats_features_and_pair_scores():
  frames = _frames(seed=1)
  f = scores.stats_features(frames)
  assert f.shape[0] == 9 and f.dtype == np.float32
  np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, rtol=1e-5)
  bef, aft = scores.compute_pair_scores(frames, scores.stats_features)
  assert bef.shape == aft.shape == (1, 9)
  np.testing.assert_allclose([bef[0, 0], aft[0, -1]], [1.0, 1.0], rtol=1e-6)
  assert bef[0, -1] == pytest.approx(aft[0, 0])
  assert (bef >= -1e-6).all() and (bef <= 1 + 1e-6).all()
  # Frames near `before` resemble it more than frames near `after` do, and vice versa.
  assert bef[0, 1] > bef[0, 7] and aft[0, 7] > aft[0, 1]


def test_stats_features_see_a_moved_object():
  img = np.zeros((64, 64, 3), np.uint8)
  moved = img.copy()
  img[8:16, 8:16] = (255, 0, 0)
  moved[40:48, 40:48] = (255, 0, 0)
  f = scores.stats_features(np.stack([img, moved, img]))
  assert f[0] @ f[2] == pytest.approx(1.0)
  assert f[0] @ f[1] < 0.99       # same colours, another place: the spatial pyramid sees it


def test_identical_frames_score_one():
  frames = np.repeat(_frames()[:1], 9, axis=0)
  bef, aft = scores.compute_pair_scores(frames, scores.stats_features)
  np.testing.assert_allclose(bef, 1.0, rtol=1e-6)
  np.testing.assert_allclose(aft, 1.0, rtol=1e-6)


def test_encoder_feature_fn():
  calls = []

  def encode_features(x):   # a fake encoder: 4x4 mean pooling, [B, S, S, 3] -> [B, S/4, S/4, 3]
    calls.append(x.shape)
    assert x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0
    b, s = x.shape[:2]
    return x.reshape(b, s // 4, 4, s // 4, 4, 3).mean(axis=(2, 4))

  fn = scores.make_encoder_feature_fn(encode_features, image_size=16, grid=2)
  f = fn(_frames(size=24))
  assert calls == [(9, 16, 16, 3)]
  assert f.shape == (9, (1 + 4) * 3)
  np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, rtol=1e-5)
  bef, aft = scores.compute_pair_scores(_frames(size=24), fn)
  assert bef.shape == (1, 9) and bef[0, 0] == pytest.approx(1.0)


def _records(n=3):
  out = []
  for i in range(n):
    frames = _frames(seed=i, size=16)
    out.append({'pair_id': f'{i:06d}c'.encode(), 'before': frames[0], 'after': frames[-1],
                'frames': list(frames), 'oracle_frames': list(frames[::-1])})
  return out


def test_scores_for_split_sources():
  records = _records()
  got = {src: scores.scores_for_split(records, src, scores.stats_features, progress=False)
         for src in ('frames', 'oracle', 'crossfade')}
  assert sorted(got['frames']) == ['000000c', '000001c', '000002c']
  np.testing.assert_allclose(got['frames']['000001c'][0], got['crossfade']['000001c'][0], atol=1e-5)
  np.testing.assert_allclose(got['oracle']['000001c'][0], got['frames']['000001c'][1][:, ::-1],
                             atol=1e-5)
  empty = [dict(records[0], oracle_frames=[])]
  with pytest.raises(errors.UserError, match='no oracle frames'):
    scores.scores_for_split(empty, 'oracle', scores.stats_features, progress=False)


def test_scores_for_split_in_worker_processes_equal_one_process():
  records = _records(2 * scores._BLOCK + 5)  # three blocks, the last one short
  one = scores.scores_for_split(records, 'frames', scores.stats_features, progress=False)
  two = scores.scores_for_split(records, 'frames', scores.stats_features, progress=False,
                                workers=2)
  assert list(two) == list(one) and len(one) == len(records)
  for key, (bef, aft) in one.items():
    np.testing.assert_array_equal(two[key][0], bef)
    np.testing.assert_array_equal(two[key][1], aft)


def test_command(tmp_path, monkeypatch, capsys):
  import tensorflow_datasets as tfds
  seen = {}

  def data_source(name, data_dir, split):
    seen.update(name=name, data_dir=data_dir, split=split)
    return _records(2)

  monkeypatch.setattr(tfds, 'data_source', data_source)
  out = tmp_path / 'sub' / 'F.json'
  scores.main(['--data_dir', str(tmp_path), '--dataset', 'synthetic_change/tiny', '--split', 'val',
               '--source', 'frames', '--feature', 'stats', '--out', str(out)])
  assert seen == {'name': 'synthetic_change/tiny', 'data_dir': str(tmp_path), 'split': 'val'}
  assert sorted(scores.load_scores(str(out))) == ['000000c', '000001c']
  assert 'clevr style' in capsys.readouterr().out
