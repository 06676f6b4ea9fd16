"""bench.probe_consistency --task change on hand-made features."""

import numpy as np
import pytest

from bench import probe_consistency


def _clips(m: int, grid: tuple[int, int], channels: int, seed: int = 0):
  """Random clips [m, 4, h, w, C]; in change clips one position of the after frame moves."""
  rng = np.random.default_rng(seed)
  h, w = grid
  clean = rng.normal(size=(m, 4, h, w, channels)).astype(np.float32)
  clean[:, -1] = clean[:, 0] + 0.05 * rng.normal(size=(m, h, w, channels))  # a nuisance
  change = rng.random(m) < 0.5
  for i in np.flatnonzero(change):
    y, x = rng.integers(h), rng.integers(w)
    clean[i, -1, y, x] += 3.0  # one object changes
  return clean, change


def test_difference_mlp_learns_a_local_change_and_records_are_complete():
  from configs import synthetic
  config = synthetic.get_config('tiny')
  config.pretrain.model.text_vocab_size = 40
  m = config.pretrain.model
  clean, change = _clips(200, tuple(m.grid), m.feature_dim)
  records = list(probe_consistency.probe_change(config, clean, change, n_train=160, steps=60,
                                                every=20, lr=1e-3))
  by_probe = {}
  for r in records:
    by_probe.setdefault(r['probe'], []).append(r)
    assert set(r) == {'probe', 'keep', 'step', 'samples', 'held_out_acc', 'chance'}
    assert 0.0 <= r['held_out_acc'] <= 1.0
    assert r['chance'] == pytest.approx(max(change[160:].mean(), 1 - change[160:].mean()))
  assert [r['step'] for r in by_probe['change_diff_mlp']] == [20, 40, 60]
  assert [r['step'] for r in by_probe['change_encoder_rel']] == [20, 40, 60]
  # the hand-made comparison sees the changed position at once
  assert by_probe['change_diff_mlp'][-1]['held_out_acc'] >= 0.9
