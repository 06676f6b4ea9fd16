"""Stage-1 clip corruptions: the negatives of the frame-consistency loss L_csy (pure jax).

Dimension legend: B batch, T frames, S image side, C = 3 channels (RGB, float in [0, 1]).

Per sample one corruption (index: name), drawn with `probs` (the original's `warp`,
dalle_beit.py, spec 4.4):
  0 replace  one random frame becomes a random frame of another sample of the batch
  1 shuffle  the T frames in a uniformly chosen non-identity order
  2 colour   one random frame: add U(-c, c) to all channels or to one of R/G/B (1/4 each),
             clamp to [0, 1]
  3 affine   one random frame: rotation U(-r, r) deg, translation U(-t, t) (normalised units),
             scale U(s0, s1); bilinear sampling, reflection padding, align_corners=False
             (torch affine_grid + grid_sample defaults)
"""

import itertools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ('replace', 'shuffle', 'colour', 'affine')


def non_identity_permutations(t: int) -> np.ndarray:
  """All permutations of range(t) except the identity, int32 [t! - 1, t] (lexicographic)."""
  if t < 2:
    raise ValueError(f'shuffling needs at least 2 frames, got {t}')
  if t > 8:
    raise ValueError(f'{t} frames: enumerating {t}! permutations is too large')
  return np.asarray(list(itertools.permutations(range(t)))[1:], np.int32)


def affine_theta(angle: jax.Array, tx: jax.Array, ty: jax.Array, scale: jax.Array) -> jax.Array:
  """The original's affine matrix [[s cos a, -s sin a, tx], [s sin a, s cos a, ty]].

  Args:
    angle: [B] radians.
    tx, ty: [B] translations in normalised [-1, 1] units.
    scale: [B].

  Returns:
    [B, 2, 3], mapping output to input normalised coordinates (torch affine_grid's theta).
  """
  c, s = scale * jnp.cos(angle), scale * jnp.sin(angle)
  return jnp.stack([jnp.stack([c, -s, tx], -1), jnp.stack([s, c, ty], -1)], -2)  # [B, 2, 3]


def _reflect(coord: jax.Array, size: int) -> jax.Array:
  """torch grid_sample reflection (align_corners=False): reflect about -0.5 and size - 0.5."""
  span = float(size)
  x = jnp.abs(coord + 0.5)
  extra = jnp.mod(x, span)
  flips = jnp.floor(x / span)
  x = jnp.where(jnp.mod(flips, 2) == 0, extra, span - extra) - 0.5
  return jnp.clip(x, 0.0, size - 1.0)


def affine_warp(images: jax.Array, theta: jax.Array) -> jax.Array:
  """torch `grid_sample(x, affine_grid(theta, x.shape), padding_mode='reflection')`.

  Bilinear, align_corners=False (torch's defaults), channels last.

  Args:
    images: [B, H, W, C].
    theta: [B, 2, 3].

  Returns:
    [B, H, W, C].
  """
  b, h, w, c = images.shape
  xs = (2.0 * jnp.arange(w) + 1.0) / w - 1.0  # [W] pixel centres, align_corners=False
  ys = (2.0 * jnp.arange(h) + 1.0) / h - 1.0  # [H]
  base = jnp.stack([jnp.broadcast_to(xs[None, :], (h, w)), jnp.broadcast_to(ys[:, None], (h, w)),
                    jnp.ones((h, w))], -1)  # [H, W, 3]
  grid = jnp.einsum('hwk,bjk->bhwj', base, theta)  # [B, H, W, 2] (x, y) normalised
  px = _reflect(((grid[..., 0] + 1.0) * w - 1.0) / 2.0, w)  # [B, H, W] input pixel coords
  py = _reflect(((grid[..., 1] + 1.0) * h - 1.0) / 2.0, h)  # [B, H, W]
  x0, y0 = jnp.floor(px), jnp.floor(py)
  wx, wy = px - x0, py - y0  # [B, H, W]
  x0, y0 = x0.astype(jnp.int32), y0.astype(jnp.int32)
  x1, y1 = jnp.minimum(x0 + 1, w - 1), jnp.minimum(y0 + 1, h - 1)
  flat = images.reshape(b, h * w, c)  # [B, H*W, C]

  def gather(yy, xx):
    idx = (yy * w + xx).reshape(b, h * w, 1)  # [B, H*W, 1]
    return jnp.take_along_axis(flat, idx, axis=1).reshape(b, h, w, c)  # [B, H, W, C]

  wx, wy = wx[..., None], wy[..., None]  # [B, H, W, 1]
  top = gather(y0, x0) * (1 - wx) + gather(y0, x1) * wx
  bottom = gather(y1, x0) * (1 - wx) + gather(y1, x1) * wx
  return (top * (1 - wy) + bottom * wy).astype(images.dtype)


class _Draws(NamedTuple):
  """The random choices of one batch's corruptions (see `corrupt`)."""
  kind: jax.Array          # [B] index into KINDS
  one_hot: jax.Array       # bool [B, T, 1, 1, 1], the frame a corruption replaces
  other: jax.Array         # [B] 'replace': the sample the new frame comes from
  source_frame: jax.Array  # [B] 'replace': which of its frames
  perm: jax.Array          # [B, T] 'shuffle': the order
  changed: jax.Array       # [B, S, S, 3] 'colour' / 'affine': the new frame


def _draw(rng: jax.Array, frames: jax.Array, probs: Sequence[float], max_rotation_deg: float,
          max_translation: float, scale_range: Sequence[float], color_shift: float) -> _Draws:
  b, t = frames.shape[:2]
  ks = jax.random.split(rng, 10)
  p = jnp.asarray(probs, jnp.float32)
  kind = jax.random.choice(ks[0], len(KINDS), (b,), p=p / p.sum()).astype(jnp.int32)
  which = jax.random.randint(ks[1], (b,), 0, t)  # the frame to corrupt
  one_hot = jax.nn.one_hot(which, t, dtype=bool)[:, :, None, None, None]  # [B, T, 1, 1, 1]
  rows = jnp.arange(b)
  picked = frames[rows, which]  # [B, S, S, 3]

  # 0: a random frame of another sample.
  if b > 1:
    other = (rows + 1 + jax.random.randint(ks[2], (b,), 0, b - 1)) % b
    source_frame = jax.random.randint(ks[3], (b,), 0, t)
  else:
    other = rows
    source_frame = (which + 1 + jax.random.randint(ks[3], (b,), 0, max(1, t - 1))) % t

  # 1: a non-identity permutation.
  perms = jnp.asarray(non_identity_permutations(t))  # [P, T]
  perm = perms[jax.random.randint(ks[4], (b,), 0, perms.shape[0])]  # [B, T]

  # 2: colour shift of all channels (0) or of R / G / B (1..3).
  shift = jax.random.uniform(ks[5], (b,), minval=-color_shift, maxval=color_shift)
  channel = jax.random.randint(ks[6], (b,), 0, 4)
  which_ch = (channel[:, None] == 0) | (channel[:, None] == jnp.arange(1, 4)[None])  # [B, 3]
  coloured = jnp.clip(picked + (shift[:, None] * which_ch)[:, None, None, :], 0.0, 1.0)

  # 3: affine warp.
  angle = jnp.deg2rad(jax.random.uniform(ks[7], (b,), minval=-max_rotation_deg,
                                         maxval=max_rotation_deg))
  txy = jax.random.uniform(ks[8], (2, b), minval=-max_translation, maxval=max_translation)
  scale = jax.random.uniform(ks[9], (b,), minval=scale_range[0], maxval=scale_range[1])
  warped = affine_warp(picked, affine_theta(angle, txy[0], txy[1], scale))  # [B, S, S, 3]
  changed = jnp.where((kind == 2)[:, None, None, None], coloured, warped)  # [B, S, S, 3]
  return _Draws(kind, one_hot, other, source_frame, perm, changed)


def _assemble(d: _Draws, clips: jax.Array, changed: jax.Array) -> jax.Array:
  """The corrupted clips from per-frame items [B, T, ...] (images or their features) and the
  new frame's item [B, ...] (used by 'colour' and 'affine')."""
  pad = (None,) * (clips.ndim - 2)
  one_hot = d.one_hot.reshape(d.one_hot.shape[:2] + (1,) * (clips.ndim - 2))
  replaced = jnp.where(one_hot, clips[d.other, d.source_frame][:, None], clips)
  shuffled = jnp.take_along_axis(clips, d.perm[(...,) + pad], axis=1)
  single = jnp.where(one_hot, changed[:, None], clips)
  k = d.kind[(slice(None),) + (None,) * (clips.ndim - 1)]  # [B, 1, ...]
  return jnp.where(k == 0, replaced, jnp.where(k == 1, shuffled, single))


def corrupt(rng: jax.Array, frames: jax.Array, *, probs: Sequence[float],
            max_rotation_deg: float = 30.0, max_translation: float = 0.1,
            scale_range: Sequence[float] = (0.9, 1.1),
            color_shift: float = 0.5) -> tuple[jax.Array, jax.Array]:
  """Corrupts every clip of the batch with one of KINDS.

  Args:
    rng: PRNG key.
    frames: float [B, T, S, S, 3] in [0, 1].
    probs: 4 weights for KINDS (normalised here).
    max_rotation_deg: rotation range of 'affine'.
    max_translation: translation range of 'affine' (normalised units, 1 = half the image).
    scale_range: scale range of 'affine'.
    color_shift: range of the 'colour' shift.

  Returns:
    (corrupted frames [B, T, S, S, 3], kind int32 [B] index into KINDS). With B = 1,
    'replace' takes another frame of the same clip (there is no other sample).
  """
  d = _draw(rng, frames, probs, max_rotation_deg, max_translation, scale_range, color_shift)
  return _assemble(d, frames, d.changed).astype(frames.dtype), d.kind


def corrupt_encoded(rng: jax.Array, frames: jax.Array, encoded: jax.Array,
                    encode: Callable[[jax.Array], jax.Array], *, probs: Sequence[float],
                    max_rotation_deg: float = 30.0, max_translation: float = 0.1,
                    scale_range: Sequence[float] = (0.9, 1.1),
                    color_shift: float = 0.5) -> tuple[jax.Array, jax.Array]:
  """What `encode` gives the clips `corrupt` makes (same rng, same draws), encoding one new
  frame per sample instead of T: 'replace' and 'shuffle' only move frames, so their encodings
  are gathered from `encoded`; 'colour' and 'affine' change one frame, whose image is encoded.

  Args:
    rng, frames, probs, ...: as `corrupt`.
    encoded: [B, T, ...] what `encode` gives each frame of `frames` ([B*T] images at a time).
    encode: a per-image function, [M, S, S, 3] -> [M, ...] (e.g. the frozen tokenizer's
      features; it must not mix images of a batch, as a GroupNorm CNN does not).

  Returns:
    (encoded corrupted clips [B, T, ...], kind int32 [B]).
  """
  d = _draw(rng, frames, probs, max_rotation_deg, max_translation, scale_range, color_shift)
  return _assemble(d, encoded, encode(d.changed).astype(encoded.dtype)), d.kind


def _options(config) -> dict:
  c = config.pretrain.corruption
  return dict(probs=tuple(c.probs), max_rotation_deg=c.max_rotation_deg,
              max_translation=c.max_translation, scale_range=tuple(c.scale_range),
              color_shift=c.color_shift)


def corrupt_from_config(rng: jax.Array, frames: jax.Array, config) -> tuple[jax.Array, jax.Array]:
  """`corrupt` with `config.pretrain.corruption`."""
  return corrupt(rng, frames, **_options(config))


def corrupt_encoded_from_config(rng: jax.Array, frames: jax.Array, encoded: jax.Array,
                                encode: Callable[[jax.Array], jax.Array],
                                config) -> tuple[jax.Array, jax.Array]:
  """`corrupt_encoded` with `config.pretrain.corruption`."""
  return corrupt_encoded(rng, frames, encoded, encode, **_options(config))
