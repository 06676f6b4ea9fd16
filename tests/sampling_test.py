"""Tests of procap_jax.procedure.sampling (the original confidence-based keyframe rule)."""

import collections
import itertools
import math

import numpy as np
import pytest

from procap_jax.procedure import sampling

# 9 frames; the interior differences d_start - d_end are 0.6, 0.4, 0.2, 0, -0.2, -0.4, -0.6.
D_START = np.array([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
D_END = D_START[::-1].copy()


def test_probabilities_match_the_formula_by_hand():
  # T = 4: s = [0, ln 3] on the interior -> softmax [1/4, 3/4] -> w = [3/4, 1/4] (sum 1).
  d_start = np.array([1.0, 0.5, 0.5 + math.sqrt(math.log(3.0)), 0.0])
  d_end = np.array([0.0, 0.5, 0.5, 1.0])
  np.testing.assert_allclose(sampling.confidence_probabilities(d_start, d_end), [0.75, 0.25])


def test_probabilities_nine_frames():
  s = np.array([0.36, 0.16, 0.04, 0.0, 0.04, 0.16, 0.36])
  w = 1.0 - np.exp(s) / np.exp(s).sum()
  p = sampling.confidence_probabilities(D_START, D_END)
  np.testing.assert_allclose(p, w / w.sum())
  assert p.shape == (7,)
  assert p.argmax() == 3                       # the frame equally close to both ends
  assert p.max() - p.min() < 0.01              # ... but only softly: cosine-scale scores


def test_peaked_when_differences_are_large():
  d_start = np.array([1, 4, 3, 2, 1, 0, -1, -2, 0], float)
  p = sampling.confidence_probabilities(d_start, np.zeros(9))
  assert p[0] < 1e-3                           # s = 16 dominates the softmax: w ~ 0
  np.testing.assert_allclose(p.sum(), 1.0)


def test_first_and_last_kept_distinct_and_sorted():
  rng = np.random.default_rng(0)
  for strategy in sampling.STRATEGIES:
    for k in range(0, 8):
      idx = sampling.sample_keyframes(D_START, D_END, k, rng, strategy)
      assert idx.dtype == np.int32 and idx.shape == (k + 2,)
      assert idx[0] == 0 and idx[-1] == 8
      assert np.all(np.diff(idx) > 0)


def test_single_draw_frequencies_follow_the_probabilities():
  d_start = np.array([1.0, 0.0, 1.0, 0.5, 0.0])   # s interior = [1, 0, 0.25]
  d_end = np.array([0.0, 1.0, 1.0, 0.0, 1.0])
  p = sampling.confidence_probabilities(d_start, d_end)
  rng = np.random.default_rng(1)
  n = 6000
  counts = np.bincount([sampling.sample_keyframes(d_start, d_end, 1, rng)[1] - 1
                        for _ in range(n)], minlength=3)
  np.testing.assert_allclose(counts / n, p, atol=0.025)


def test_pairs_are_drawn_without_replacement_proportionally():
  d_start = np.array([0.0, 2.0, 0.0, 1.0, 0.0, 0.0])   # s interior = [4, 0, 1, 0]
  d_end = np.zeros(6)
  p = sampling.confidence_probabilities(d_start, d_end)
  expected = {}
  for i, j in itertools.combinations(range(4), 2):   # sequential draws, renormalised
    expected[(i + 1, j + 1)] = p[i] * p[j] / (1 - p[i]) + p[j] * p[i] / (1 - p[j])
  rng = np.random.default_rng(2)
  n = 6000
  counts = collections.Counter(tuple(sampling.sample_keyframes(d_start, d_end, 2, rng)[1:3])
                               for _ in range(n))
  for pair, prob in expected.items():
    assert abs(counts[pair] / n - prob) < 0.025, (pair, counts[pair] / n, prob)


def test_seeding_reproduces_and_varies():
  def draws(seed, index, epoch):
    rng = sampling.keyframe_rng(seed, index, epoch)
    return [sampling.sample_keyframes(D_START, D_END, 2, rng).tolist() for _ in range(5)]

  assert draws(0, 5, 3) == draws(0, 5, 3)
  assert draws(0, 5, 3) != draws(1, 5, 3)
  a = [sampling.sample_keyframes(D_START, D_END, 2, sampling.keyframe_rng(0, i, 0)).tolist()
       for i in range(30)]
  b = [sampling.sample_keyframes(D_START, D_END, 2, sampling.keyframe_rng(0, i, 1)).tolist()
       for i in range(30)]
  assert a != b
  assert len({tuple(x) for x in a}) > 5
  with pytest.raises(ValueError):
    sampling.keyframe_rng(0, -1, 0)


def test_topk_is_deterministic_with_ties_to_the_lower_index():
  rng = np.random.default_rng(0)
  # s interior = [0.36, 0.16, 0.04, 0, 0.04, 0.16, 0.36]: largest w at 4, then 3 and 5 (tie).
  assert sampling.sample_keyframes(D_START, D_END, 1, rng, 'topk').tolist() == [0, 4, 8]
  assert sampling.sample_keyframes(D_START, D_END, 2, rng, 'topk').tolist() == [0, 3, 4, 8]
  assert sampling.sample_keyframes(D_START, D_END, 3, rng, 'topk').tolist() == [0, 3, 4, 5, 8]
  flat = np.zeros(9)
  assert sampling.sample_keyframes(flat, flat, 2, rng, 'topk').tolist() == [0, 1, 2, 8]


def test_uniform_and_missing_scores():
  rng = np.random.default_rng(3)
  n = 6000
  counts = np.zeros(9)
  for _ in range(n):
    counts[sampling.sample_keyframes(None, None, 2, rng, 'confidence', num_frames=9)] += 1
  assert counts[0] == counts[8] == n
  np.testing.assert_allclose(counts[1:8] / n, 2 / 7, atol=0.03)
  idx = sampling.sample_keyframes(D_START, D_END, 3, rng, 'uniform')
  assert idx.shape == (5,)
  assert sampling.sample_keyframes(None, None, 1, rng, num_frames=5)[-1] == 4


def test_all_interior_and_one_hot_softmax():
  rng = np.random.default_rng(4)
  assert sampling.sample_keyframes(D_START, D_END, 7, rng).tolist() == list(range(9))
  spiky = np.array([0, 100, 0, 0, 0], float)     # softmax one-hot: w = [0, 1, 1]
  for _ in range(20):
    idx = sampling.sample_keyframes(spiky, np.zeros(5), 2, rng)
    assert idx.tolist() == [0, 2, 3, 4]


def test_errors():
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match='cannot sample'):
    sampling.sample_keyframes(D_START, D_END, 8, rng)
  with pytest.raises(ValueError, match='strategy'):
    sampling.sample_keyframes(D_START, D_END, 2, rng, 'greedy')
  with pytest.raises(ValueError, match='same length'):
    sampling.sample_keyframes(D_START, D_END[:5], 2, rng)
  with pytest.raises(ValueError, match='non-negative'):
    sampling.sample_keyframes(D_START, D_END, -1, rng)
