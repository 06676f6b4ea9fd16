"""procap_jax.diagnostics.code_statistics on hand-made codes."""

import math

import numpy as np

from procap_jax.diagnostics import code_statistics


def test_statistics_on_hand_made_codes():
  # 2 clips, 3 frames, 4 positions; codebook of 8.
  codes = np.array([
      [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 5, 5]],   # before/after keep 2 of 4
      [[4, 4, 4, 4], [4, 4, 0, 0], [4, 4, 4, 4]],   # keep 4 of 4
  ])
  train = np.array([[[4, 4, 1]]])                     # code 4 is train's most frequent
  s = code_statistics.statistics(codes, train, codebook_size=8)
  assert s['clips'] == 2 and s['tokens'] == 24
  assert math.isclose(s['most_frequent_code_acc'], 10 / 24)   # code 4 appears 10 times
  assert math.isclose(s['keep_before_after'], 6 / 8)
  # adjacent pairs: clip 0 (4 + 2 of 8), clip 1 (2 + 2 of 8) -> 10 of 16
  assert math.isclose(s['keep_adjacent'], 10 / 16)
  assert math.isclose(s['usage'], 6 / 8)                       # codes 0-5 used, 6 and 7 not
  counts = np.bincount(codes.ravel(), minlength=8)
  p = counts[counts > 0] / 24
  assert math.isclose(s['perplexity'], math.exp(-(p * np.log(p)).sum()), rel_tol=1e-5)  # f32
  assert 1.0 < s['perplexity'] < 6.0
