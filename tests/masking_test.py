"""Tests for tasks/masking.py: strategy frequencies, per-strategy patterns, RandomErasing boxes."""

import math

import jax
import numpy as np
import pytest

from procap_jax.tasks import masking

T = 4
GRID = (4, 4)
N = 16
B = 20000


def _sample(probs, keep=(0.2, 0.2), batch=B, grid=GRID, seed=0):
  fn = jax.jit(lambda k: masking.sample_masks(k, batch, T, grid, strategy_probs=probs,
                                              keep_prob_range=keep, box_scale=(0.2, 0.8),
                                              box_ratio=(0.5, 2.0)))
  return jax.tree.map(np.asarray, fn(jax.random.PRNGKey(seed)))


@pytest.fixture(scope='module')
def default_masks():
  return _sample((0.7, 0.1, 0.1, 0.1, 0.0))


def _within(freq, p, n, sigmas=5):
  return abs(freq - p) <= sigmas * math.sqrt(p * (1 - p) / n) + 1e-9


def test_strategy_frequencies(default_masks):
  m = default_masks
  assert m.mask.shape == (B, T, N) and m.mask.dtype == bool
  assert m.fully_masked.shape == (B,)
  for s, p in enumerate((0.7, 0.1, 0.1, 0.1, 0.0)):
    assert _within(np.mean(m.strategy == s), p, B), (s, np.mean(m.strategy == s))


def test_random_strategy_masks_80_percent(default_masks):
  m = default_masks
  frac = m.mask[m.strategy == 0].mean()
  assert abs(frac - 0.8) < 0.005
  # Independent tokens: per-sample fraction varies, frames are not identical.
  rand = m.mask[m.strategy == 0]
  assert (rand[:, 0] != rand[:, 1]).any()


def test_keep_prob_range_is_uniform():
  m = _sample((1.0,), keep=(0.1, 0.5), batch=4000)
  per_sample = m.mask.reshape(4000, -1).mean(1)
  assert abs(per_sample.mean() - 0.7) < 0.01           # E[1 - U(0.1, 0.5)]
  assert per_sample.min() < 0.6 and per_sample.max() > 0.8


def test_all_strategy_and_fully_masked_flag(default_masks):
  m = default_masks
  assert m.mask[m.strategy == 1].all()
  assert m.fully_masked[m.strategy == 1].all()
  np.testing.assert_array_equal(m.fully_masked, m.mask.all(axis=(1, 2)))
  assert not m.fully_masked[m.strategy == 0].any()


def _is_rectangle(grid_mask):
  rows = np.nonzero(grid_mask.any(1))[0]
  cols = np.nonzero(grid_mask.any(0))[0]
  if rows.size == 0:
    return True
  block = grid_mask[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]
  return block.all() and grid_mask.sum() == block.size


def test_box_strategies_same_rectangle_in_every_frame(default_masks):
  m = default_masks
  for s, invert in ((2, False), (3, True)):
    masks = m.mask[m.strategy == s].reshape(-1, T, *GRID)
    assert (masks == masks[:, :1]).all()  # same place in every frame
    boxes = ~masks[:, 0] if invert else masks[:, 0]
    assert all(_is_rectangle(b) for b in boxes[:300])
    area = boxes.reshape(len(boxes), -1).mean(1)
    fitted = area > 0
    # Rounded box areas stay close to the 20-80% scale range; none covers a full side.
    assert area.max() <= 0.8 and area[fitted].min() >= 1 / N
    assert not boxes.all(axis=1).any() and not boxes.all(axis=2).any()


def test_stage2_pattern():
  m = _sample((0.0, 0.0, 0.0, 0.0, 1.0), batch=8)
  assert (m.strategy == 4).all()
  assert not m.mask[:, 0].any() and not m.mask[:, -1].any()
  assert m.mask[:, 1:-1].all()
  assert not m.fully_masked.any()


def _torchvision_box(rng, h, w, scale, ratio, tries=10):
  """torchvision RandomErasing.get_params on an h x w image (Python reference)."""
  area = h * w
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(tries):
    erase_area = area * rng.uniform(scale[0], scale[1])
    aspect = math.exp(rng.uniform(*log_ratio))
    bh = int(round(math.sqrt(erase_area * aspect)))
    bw = int(round(math.sqrt(erase_area / aspect)))
    if not (bh < h and bw < w):
      continue
    i = int(rng.integers(0, h - bh + 1))
    j = int(rng.integers(0, w - bw + 1))
    return i, j, bh, bw
  return 0, 0, 0, 0


@pytest.mark.parametrize('grid', [(14, 14), (4, 4), (5, 7)])
def test_random_box_matches_torchvision_distribution(grid):
  n = 6000
  h, w = grid
  boxes = np.asarray(jax.jit(jax.vmap(
      lambda k: masking.random_box(k, grid, (0.2, 0.8), (0.5, 2.0))))(
          jax.random.split(jax.random.PRNGKey(1), n)))
  rng = np.random.default_rng(0)
  ref = [_torchvision_box(rng, h, w, (0.2, 0.8), (0.5, 2.0)) for _ in range(n)]
  ref_h = np.array([r[2] for r in ref])
  ref_w = np.array([r[3] for r in ref])
  got_h = boxes.any(2).sum(1)
  got_w = boxes.any(1).sum(1)
  for got, want in ((got_h, ref_h), (got_w, ref_w), (got_h * got_w, ref_h * ref_w)):
    assert abs(got.mean() - want.mean()) < 4 * want.std() / math.sqrt(n) + 0.05
  assert abs((got_h == 0).mean() - (ref_h == 0).mean()) < 0.02  # no rectangle fits
  # Top-left corner is uniform over valid positions: mean coverage is centre-symmetric.
  cover = boxes.mean(0)
  np.testing.assert_allclose(cover, cover[::-1, ::-1], atol=0.03)
