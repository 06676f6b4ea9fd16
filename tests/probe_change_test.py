"""procap_jax.diagnostics.probe_consistency --task change (probe_change) on hand-made features."""

import numpy as np
import pytest

from procap_jax.diagnostics import head_logits
from procap_jax.diagnostics import probe_change
from procap_jax.diagnostics import probe_consistency


def test_difference_mlp_learns_a_local_change_and_records_are_complete():
  from configs import synthetic
  config = synthetic.get_config('tiny')
  config.pretrain.model.text_vocab_size = 40
  m = config.pretrain.model
  clean, change = probe_consistency.toy_change_clips(200, tuple(m.grid), m.feature_dim)
  pixels = clean[..., :12]  # any [M, T, h, w, 12] array stands in for patch statistics
  records = list(probe_change.probe_change(config, clean, change, n_train=160, steps=60,
                                                every=20, lr=1e-3, pixels=pixels))
  by_probe = {}
  for r in records:
    by_probe.setdefault(r['probe'], []).append(r)
    expected = {'probe', 'keep', 'step', 'samples', 'held_out_acc', 'chance', 'held_out_auc',
                'logit_mean', 'logit_std'}
    if r['probe'].startswith('change_encoder'):  # the state its head reads
      expected |= {'read_mean_norm', 'read_clip_std'}
      assert r['read_mean_norm'] > 0.0 and r['read_clip_std'] > 0.0
    assert set(r) == expected
    assert 0.0 <= r['held_out_acc'] <= 1.0
    assert 0.0 <= r['held_out_auc'] <= 1.0 and r['logit_std'] >= 0.0
    assert r['chance'] == pytest.approx(max(change[160:].mean(), 1 - change[160:].mean()))
  assert [r['step'] for r in by_probe['change_diff_mlp']] == [20, 40, 60]
  assert [r['step'] for r in by_probe['change_encoder_rel']] == [20, 40, 60]
  assert [r['step'] for r in by_probe['change_pixel_diff_mlp']] == [20, 40, 60]
  # the hand-made comparison sees the changed position at once
  assert by_probe['change_diff_mlp'][-1]['held_out_acc'] >= 0.9
  assert by_probe['change_diff_mlp'][-1]['held_out_auc'] >= 0.9


def test_auc_ranks_scores_with_ties_counted_half():
  labels = np.array([True, True, False, False])
  assert head_logits.roc_auc(np.array([3.0, 2.0, 1.0, 0.0]), labels) == 1.0
  assert head_logits.roc_auc(np.array([0.0, 1.0, 2.0, 3.0]), labels) == 0.0
  # one tie between a positive and a negative: 3 of 4 pairs ordered, the tie half
  assert head_logits.roc_auc(np.array([3.0, 1.0, 1.0, 0.0]), labels) == pytest.approx(0.875)
  assert head_logits.roc_auc(np.array([5.0, 5.0, 5.0, 5.0]), labels) == 0.5
  assert head_logits.roc_auc(np.array([1.0, 2.0]), np.array([True, True])) == 0.5


def _tiny_clips_and_fits(monkeypatch, m: int):
  """(tiny config, clips, labels, fits): `_fit_binary` is replaced by a recorder, so
  `probe_change` only builds its probes; fits[name] = (apply, params, keyword arguments)."""
  from configs import synthetic
  config = synthetic.get_config('tiny')
  config.pretrain.model.text_vocab_size = 40
  model = config.pretrain.model
  clean, change = probe_consistency.toy_change_clips(m, tuple(model.grid), model.feature_dim)
  fits = {}

  def record_fit(name, apply, params, *args, **kwargs):
    fits[name] = (apply, params, kwargs)
    return iter(())

  monkeypatch.setattr(probe_change, '_fit_binary', record_fit)
  return config, clean, change, fits


def test_encoder_probe_starts_from_given_parameters(monkeypatch):
  import jax
  config, clean, change, fits = _tiny_clips_and_fits(monkeypatch, 40)
  list(probe_change.probe_change(config, clean, change, 32, 1, 1, 1e-3))
  scratch = fits['change_encoder_rel'][1]['encoder']
  given = jax.tree.map(lambda x: np.full(x.shape, 0.5, np.float32), scratch)
  list(probe_change.probe_change(config, clean, change, 32, 1, 1, 1e-3, init_params=given))
  leaves = jax.tree.leaves(fits['change_encoder_rel'][1]['encoder'])
  assert len(leaves) == len(jax.tree.leaves(scratch))
  assert all(np.all(np.asarray(x) == 0.5) for x in leaves)
  assert not all(np.all(np.asarray(x) == 0.5) for x in jax.tree.leaves(scratch))


@pytest.mark.parametrize('head', ['rel', 'vid', 'max'])
def test_encoder_probe_reads_the_state_its_head_scores(head, monkeypatch):
  """`read` returns the hidden state the head turns into the logit: the [REL] or [VID] row
  through that head's LayerNorm + Dense, or the frame token whose score is the max."""
  import jax
  config, clean, change, fits = _tiny_clips_and_fits(monkeypatch, 8)
  m = config.pretrain.model
  list(probe_change.probe_change(config, clean, change, 4, 1, 1, 1e-3, head=head))
  apply, params, kwargs = fits[f'change_encoder_{head}']
  if head == 'max':  # a non-zero readout, so the tokens' scores differ
    params['max_readout']['w'] = jax.random.normal(jax.random.key(1), (m.width,))
  logits = np.asarray(apply(params, clean))
  read_logits, state = (np.asarray(v) for v in kwargs['read'](params, clean))
  np.testing.assert_allclose(read_logits, logits, rtol=1e-5, atol=1e-5)
  assert state.shape == (8, m.width)
  if head == 'max':
    scored = state @ np.asarray(params['max_readout']['w']) + float(params['max_readout']['b'])
  else:
    head_params = params['encoder'][f'to_logits_{head}']
    normed = (state - state.mean(-1, keepdims=True)) / np.sqrt(state.var(-1, keepdims=True) + 1e-5)
    normed = normed * np.asarray(head_params['norm']['scale']) + np.asarray(
        head_params['norm']['bias'])
    scored = (normed @ np.asarray(head_params['dense']['kernel']))[:, 0] + np.asarray(
        head_params['dense']['bias'])[0]
  np.testing.assert_allclose(scored, logits, rtol=1e-4, atol=1e-4)
  assert np.std(logits) > 0.0  # the clips differ, so a wrong row or token would show


def test_toy_clips_move_one_token_of_the_after_frame_in_change_clips_only():
  clean, change = probe_consistency.toy_change_clips(64, (4, 5), 6, seed=3)
  assert clean.shape == (64, 4, 4, 5, 6) and clean.dtype == np.float32
  assert 0 < change.sum() < 64
  moved = np.abs(clean[:, -1] - clean[:, 0]).max(-1) > 1.0  # [M, h, w]: tokens that moved
  assert np.array_equal(moved.sum((1, 2)), change.astype(int))
  assert np.allclose(np.abs(clean[:, -1] - clean[:, 0])[moved], 3.0, atol=0.5)
  # the middle frames are the procedure: 1/3 and 2/3 of the way from before to after
  for t, f in ((1, 1 / 3), (2, 2 / 3)):
    np.testing.assert_allclose(clean[:, t] - clean[:, 0], f * (clean[:, -1] - clean[:, 0]),
                               atol=0.4)
  # the change survives a per-token LayerNorm (the encoder's first operation on a feature)
  norm = lambda v: (v - v.mean(-1, keepdims=True)) / v.std(-1, keepdims=True)
  normed = np.abs(norm(clean[:, -1]) - norm(clean[:, 0])).max(-1)  # [M, h, w]
  assert normed[moved].min() > np.percentile(normed[~moved], 99)
  assert np.median(normed[moved]) > 10 * np.median(normed[~moved])
