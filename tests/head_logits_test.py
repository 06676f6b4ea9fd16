"""procap_jax.diagnostics.head_logits on hand-made logits."""

import numpy as np
import pytest

from procap_jax.diagnostics import head_logits


def test_best_threshold_separates_shifted_logits():
  # Every logit is below 0, so accuracy at 0 is chance; a threshold between the groups is perfect.
  pos, neg = np.array([-1.0, -1.1, -1.2]), np.array([-2.0, -2.5, -3.0])
  t = head_logits.best_threshold(pos, neg)
  assert -2.0 < t < -1.2
  s = head_logits.summary(pos, neg, t)
  assert s['acc_at_0'] == 0.5 and s['acc_at_threshold'] == 1.0
  assert s['auc'] == 1.0 and s['rank_acc'] == 1.0 and s['samples'] == 3


def test_per_clip_offset_ranks_but_no_threshold_decides():
  # Each clip adds its own offset to both logits: the pair ranks, a threshold cannot separate.
  offset = np.array([-4.0, -2.0, 0.0, 2.0, 4.0])
  pos, neg = offset + 0.5, offset - 0.5
  s = head_logits.summary(pos, neg, head_logits.best_threshold(pos, neg))
  assert s['rank_acc'] == 1.0
  assert s['acc_at_threshold'] == pytest.approx(0.6)  # the best a threshold does here
  assert s['auc'] == pytest.approx(0.6)    # 15 of 25 pairs ordered: only the own-clip pairs win
  assert s['pos_neg_corr'] == pytest.approx(1.0)


def test_ties_count_half_and_by_corruption():
  pos, neg = np.array([1.0, 0.0, 2.0, -1.0]), np.array([1.0, -1.0, 3.0, -2.0])
  assert head_logits.summary(pos, neg, 0.0)['rank_acc'] == pytest.approx((0.5 + 1 + 0 + 1) / 4)
  kinds = np.array([0, 0, 3, 3])
  out = head_logits.by_corruption(pos, neg, kinds)
  assert set(out) == {'replace', 'affine'}
  assert out['replace'] == {'count': 2, 'rank_acc': 0.75, 'neg_below_0': 0.5}
  assert out['affine'] == {'count': 2, 'rank_acc': 0.5, 'neg_below_0': 0.5}


def test_constant_logits_have_no_correlation():
  s = head_logits.summary(np.zeros(3), np.array([0.0, 1.0, 2.0]), 0.5)
  assert np.isnan(s['pos_neg_corr'])
