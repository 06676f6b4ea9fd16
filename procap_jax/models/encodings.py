"""The frozen tokenizer's encodings of a batch, for stages 1 and 2 (pure jax).

Dimension legend: B batch, T frames, S image side, h x w token grid, N = h*w, C channels.

One code path for both sources: a batch that carries the tokenizer feature cache's keys
(`keyframe_features`, `keyframe_codes`: `procap_jax.data.feature_cache`) is read from them;
otherwise its images are encoded here, every step. Both give the same values (the cache stores
what `encode_clips` computes, frame by frame; float16 storage rounds the features).
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

CACHED = 'keyframe_features'  # present in a batch iff it carries the cache's encodings


def images01(images: Any) -> jax.Array:
  """uint8 images -> float32 in [0, 1] (what the frozen tokenizer is given)."""
  return jnp.asarray(images, jnp.float32) / 255.0


def encode_clips(fn: Callable, params: Any, frames: jax.Array) -> Any:
  """Applies a per-image tokenizer function to clips [B, T, S, S, 3] -> [B, T, ...] (each array
  of its output, when it gives several)."""
  b, t = frames.shape[:2]
  out = fn(params, frames.reshape((b * t,) + frames.shape[2:]))  # [B*T, ...]
  return jax.tree.map(lambda o: jax.lax.stop_gradient(o.reshape((b, t) + o.shape[1:])), out)


def clip_encodings(tokenizer: Any, params: Any, batch: dict,
                   frames: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(features float32 [B, T, h, w, C], codes int32 [B, T, N]) of the batch's keyframes.

  Args:
    tokenizer: the frozen tokenizer (`encode_features`, `encode_tokens`; and
      `encode_features_and_tokens` where its `one_pass` is true).
    params: its parameters.
    batch: the batch contract; the cache's keys when present, else `keyframes`.
    frames: `images01(batch['keyframes'])` when the caller has it already.
  """
  if CACHED in batch:
    features = jnp.asarray(batch[CACHED], jnp.float32)
    return jax.lax.stop_gradient(features), jnp.asarray(batch['keyframe_codes'], jnp.int32)
  frames = images01(batch['keyframes']) if frames is None else frames  # [B, T, S, S, 3]
  features, codes = encode_both(tokenizer, params, frames, encode_clips)
  return features, codes.astype(jnp.int32)


def encode_both(tokenizer: Any, params: Any, images: jax.Array,
                apply: Callable = lambda fn, p, x: fn(p, x)) -> tuple[Any, Any]:
  """(features, codes) of `images` through `apply(fn, params, images)`: one encoder pass when
  the tokenizer's features and codes see the same input scale (`one_pass`), else two (the
  original's quirk: features from [0, 1] images, codes from [-1, 1] ones)."""
  if getattr(tokenizer, 'one_pass', False):
    return apply(tokenizer.encode_features_and_tokens, params, images)
  return (apply(tokenizer.encode_features, params, images),
          apply(tokenizer.encode_tokens, params, images))


def pair_features(tokenizer: Any, params: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Frozen features [B, h, w, C] of the before and after images: keyframes 0 and T-1 of the
  cache when the batch carries it, else one tokenizer call on `before` and `after`.

  A batch whose `before` has half as many rows as `after` (made by `share_before`) gives before
  row i to pairs 2i and 2i + 1: each shared before image is encoded once."""
  if CACHED in batch:
    features = jax.lax.stop_gradient(jnp.asarray(batch[CACHED], jnp.float32))  # [B, T, h, w, C]
    return features[:, 0], features[:, -1]
  before, after = jnp.asarray(batch['before']), jnp.asarray(batch['after'])
  nb, b = before.shape[0], after.shape[0]
  if nb != b and 2 * nb != b:
    raise ValueError(f'a batch has {nb} before and {b} after images; before needs as many rows '
                     'as after, or half as many (shared by rows 2i and 2i + 1)')
  images = images01(jnp.concatenate([before, after]))
  feats = jax.lax.stop_gradient(tokenizer.encode_features(params, images))  # [nb + B, h, w, C]
  feats_b = feats[:nb] if nb == b else jnp.repeat(feats[:nb], 2, axis=0)
  return feats_b, feats[nb:]  # [B, h, w, C] each


def share_before(batch: dict, rows_multiple: int = 1) -> dict:
  """A host batch (numpy) whose rows 2i and 2i + 1 have equal before images for every i (a
  scene's change pair and its distractor: `caption.train.scene_pairs`, or a CLEVR split read in
  record order) with `before` cut to rows 0, 2, 4, ..., so that `pair_features` encodes each once
  and gives the same features; any other batch as it is. `rows_multiple`: the halved `before`
  must still split over this many devices (the mesh's data axis), else the batch is kept. The
  images are compared byte for byte.
  """
  if CACHED in batch or 'before' not in batch or 'after' not in batch:
    return batch
  before = np.asarray(batch['before'])
  b = before.shape[0]
  if (b < 2 or b % 2 or (b // 2) % rows_multiple or np.asarray(batch['after']).shape[0] != b
      or not np.array_equal(before[0::2], before[1::2])):
    return batch
  return dict(batch, before=before[0::2])
