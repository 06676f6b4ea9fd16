"""Tests for tasks/corruptions.py: each corruption does what the original's `warp` does."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from procap_jax.tasks import corruptions

B, T, S = 5, 4, 9


def _frames(b=B, seed=0):
  return np.random.default_rng(seed).random((b, T, S, S, 3)).astype(np.float32)


_corrupt = jax.jit(corruptions.corrupt, static_argnames=('probs',))
_warp = jax.jit(corruptions.affine_warp)


def _run(kind, frames, seed=0):
  probs = tuple(float(i == kind) for i in range(4))
  out, kinds = _corrupt(jax.random.PRNGKey(seed), jnp.asarray(frames), probs=probs)
  out, kinds = np.asarray(out), np.asarray(kinds)
  assert (kinds == kind).all()
  assert out.shape == frames.shape
  return out


def _changed_frames(out, frames):
  return np.abs(out - frames).reshape(out.shape[0], T, -1).max(-1) > 0  # [B, T]


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_replace_takes_a_frame_of_another_sample(seed):
  frames = _frames(seed=seed)
  out = _run(0, frames, seed)
  changed = _changed_frames(out, frames)
  assert (changed.sum(1) == 1).all()
  for i in range(B):
    t = int(np.nonzero(changed[i])[0][0])
    sources = [(j, u) for j in range(B) for u in range(T)
               if np.array_equal(out[i, t], frames[j, u])]
    assert sources and all(j != i for j, _ in sources)


def test_shuffle_is_a_uniform_non_identity_permutation():
  n = 2300
  frames = np.broadcast_to(np.arange(T, dtype=np.float32)[None, :, None, None, None],
                           (n, T, 1, 1, 3))
  out = _run(1, np.ascontiguousarray(frames))
  perms = out[:, :, 0, 0, 0].astype(int)  # [n, T]: which source frame is at each slot
  assert all(sorted(p) == list(range(T)) for p in perms)
  assert not (perms == np.arange(T)).all(1).any()
  counts = {p: 0 for p in itertools.permutations(range(T))}
  for p in perms:
    counts[tuple(p)] += 1
  del counts[tuple(range(T))]
  expected = n / 23
  assert min(counts.values()) > expected - 5 * math.sqrt(expected)
  assert max(counts.values()) < expected + 5 * math.sqrt(expected)
  np.testing.assert_array_equal(corruptions.non_identity_permutations(3),
                                [[0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]])


def test_colour_shift_one_frame_clamped():
  n = 400
  frames = np.full((n, T, 3, 3, 3), 0.5, np.float32)
  frames[:, :, 0, 0] = (0.05, 0.95, 0.5)  # a pixel that clamps for large shifts
  out = _run(2, frames)
  changed = _changed_frames(out, frames)
  assert (changed.sum(1) <= 1).all() and changed.sum() > 0.95 * n
  assert out.min() >= 0.0 and out.max() <= 1.0
  kinds = {'all': 0, 'one': 0}
  for i in range(n):
    if not changed[i].any():
      continue
    t = int(np.nonzero(changed[i])[0][0])
    delta = out[i, t, 1, 1] - 0.5  # an unclamped pixel: the shift per channel
    assert np.abs(delta).max() <= 0.5 + 1e-6
    nonzero = np.abs(delta) > 0
    assert nonzero.sum() in (1, 3)
    if nonzero.sum() == 3:
      np.testing.assert_allclose(delta, delta[0], atol=1e-6)
    kinds['all' if nonzero.sum() == 3 else 'one'] += 1
    np.testing.assert_allclose(out[i, t, 0, 0], np.clip(frames[i, t, 0, 0] + delta, 0, 1),
                               atol=1e-6)
  assert abs(kinds['all'] / sum(kinds.values()) - 0.25) < 0.08  # all channels 1/4, R/G/B 3/4


def test_affine_changes_one_frame():
  frames = _frames()
  out = _run(3, frames)
  changed = _changed_frames(out, frames)
  assert (changed.sum(1) == 1).all()
  assert out.min() >= 0.0 and out.max() <= 1.0 + 1e-6


def _theta(angle=0.0, tx=0.0, ty=0.0, scale=1.0):
  return corruptions.affine_theta(*(jnp.atleast_1d(jnp.float32(v)) for v in (angle, tx, ty,
                                                                             scale)))


def test_affine_identity_returns_the_frame():
  img = _frames(1)[:, 0]
  np.testing.assert_allclose(_warp(jnp.asarray(img), _theta()), img, atol=1e-5)


@pytest.mark.parametrize('shift', [3, -2, 11])
def test_affine_translation_uses_reflection_padding(shift):
  h, w = 6, 8
  img = np.random.default_rng(3).random((1, h, w, 2)).astype(np.float32)
  # theta maps output to input coordinates: input x = output x + 2*shift/w, i.e. out[x] = in[x+s].
  out = np.asarray(_warp(jnp.asarray(img), _theta(tx=2.0 * shift / w)))
  padded = np.pad(img, ((0, 0), (0, 0), (w * 2, w * 2), (0, 0)), mode='symmetric')
  want = padded[:, :, 2 * w + shift:2 * w + shift + w]
  np.testing.assert_allclose(out, want, atol=1e-5)


def test_affine_quarter_turn_and_bilinear_midpoint():
  img = np.random.default_rng(4).random((1, 5, 5, 1)).astype(np.float32)
  out = np.asarray(_warp(jnp.asarray(img), _theta(angle=np.pi / 2)))
  # Output (x, y) samples input (-y, x): a quarter turn of the pixel grid.
  np.testing.assert_allclose(out[0, :, :, 0], np.rot90(img[0, :, :, 0], k=1), atol=1e-5)
  # Half-pixel shift: every output pixel averages two horizontal neighbours (reflected edge).
  img = np.random.default_rng(5).random((1, 4, 6, 1)).astype(np.float32)
  out = np.asarray(_warp(jnp.asarray(img), _theta(tx=1.0 / 6)))
  right = np.concatenate([img[:, :, 1:], img[:, :, -1:]], axis=2)
  np.testing.assert_allclose(out, 0.5 * (img + right), atol=1e-5)


def test_kind_frequencies():
  frames = np.zeros((4000, 2, 1, 1, 3), np.float32)
  _, kinds = _corrupt(jax.random.PRNGKey(0), jnp.asarray(frames), probs=(0.1, 0.2, 0.3, 0.4))
  freq = np.bincount(np.asarray(kinds), minlength=4) / 4000
  np.testing.assert_allclose(freq, (0.1, 0.2, 0.3, 0.4), atol=0.03)


def test_encoded_corruptions_equal_encoding_the_corrupted_clips():
  """corrupt_encoded gathers the encodings of moved frames and encodes only changed ones: the
  same result as encoding every frame of `corrupt`'s clips, with the same draws."""
  rng = np.random.default_rng(3)
  frames = jnp.asarray(rng.uniform(size=(6, 4, 8, 8, 3)), jnp.float32)

  def encode(images):  # a per-image function: 2 x 2 mean pooling and a channel mix
    pooled = images.reshape(images.shape[0], 4, 2, 4, 2, 3).mean(axis=(2, 4))
    return jnp.tanh(pooled @ jnp.asarray([[1.0, -2.0], [0.5, 1.0], [-1.0, 0.3]]))

  probs = (0.25, 0.25, 0.25, 0.25)
  for seed in range(4):
    key = jax.random.PRNGKey(seed)
    corrupted, kind = corruptions.corrupt(key, frames, probs=probs)
    want = encode(corrupted.reshape(-1, 8, 8, 3)).reshape(6, 4, 4, 4, 2)
    encoded = encode(frames.reshape(-1, 8, 8, 3)).reshape(6, 4, 4, 4, 2)
    got, got_kind = corruptions.corrupt_encoded(key, frames, encoded, encode, probs=probs)
    np.testing.assert_array_equal(got_kind, kind)
    np.testing.assert_allclose(got, want, atol=1e-6)
