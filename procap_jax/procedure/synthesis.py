"""The frames between two frames from their `flow.Motion`: the synthesis half of the `flow` method.

Dimensions: H x W image size, 2 flow components (dx, dy), 3 colour channels, 6 values carried
per pixel (two flows and two visibilities).

`synthesize(a, b, t, motion)` projects both flows to time t (splatting, moving and consistent
pixels in front), warps both endpoints backwards with cv2.remap and fuses them with
occlusion-aware weights (an occluded sample is replaced by the other endpoint's, shifted by the
smooth local light change). The flow convention is `flow`'s.
"""

import cv2
import numpy as np

from procap_jax.procedure import flow


def _nearest_fill(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
  """Replaces the invalid pixels of values [H, W, ...] by the value of the nearest valid pixel."""
  if valid.all() or not valid.any():
    return values
  _, labels = cv2.distanceTransformWithLabels((~valid).astype(np.uint8), cv2.DIST_L2, 5,
                                              labelType=cv2.DIST_LABEL_PIXEL)
  ys, xs = np.nonzero(valid)
  lut_y, lut_x = np.zeros(labels.max() + 1, np.int64), np.zeros(labels.max() + 1, np.int64)
  lut_y[labels[ys, xs]], lut_x[labels[ys, xs]] = ys, xs
  return values[lut_y[labels], lut_x[labels]]


def _project(f01: np.ndarray, f10: np.ndarray, c0: np.ndarray, c1: np.ndarray,
             t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Flows from time t to both endpoints, by splatting each endpoint's pixels to time t.

  Every pixel of frame 0 lands at x + t f01 and every pixel of frame 1 at x + (1 - t) f10; where
  several land on one pixel, a consistent one beats an inconsistent one, then the larger motion
  wins (moving objects are in front of the static floor; near things move more under a camera
  move). Holes take their nearest neighbour. Returns ft0, ft1 [H, W, 2] and the visibilities
  v0, v1 [H, W] of the pixel in frame 0 and frame 1.
  """
  h, w = f01.shape[:2]
  gx, gy = flow.pixel_grid(h, w)
  one = np.ones((h, w, 1), np.float32)
  # Per source pixel (those of frame 0, then those of frame 1): (ft0 [2], ft1 [2], v0, v1) it
  # carries to its target at time t.
  carried = np.concatenate([
      np.concatenate([-t * f01, (1 - t) * f01, one, c0[..., None]], -1).reshape(-1, 6),
      np.concatenate([t * f10, -(1 - t) * f10, c1[..., None], one], -1).reshape(-1, 6)])
  sources, targets, priorities = [], [], []   # per source pixel landing inside the image
  for k, (f, c, s) in enumerate(((f01, c0, t), (f10, c1, 1 - t))):
    tx = np.rint(gx + s * f[..., 0]).astype(np.int64)
    ty = np.rint(gy + s * f[..., 1]).astype(np.int64)
    inside = (tx >= 0) & (tx < w) & (ty >= 0) & (ty < h)
    sources.append(np.flatnonzero(inside) + k * h * w)   # its row of `carried`
    targets.append((ty * w + tx)[inside])
    priorities.append((c * 1e4 + np.hypot(f[..., 0], f[..., 1]))[inside])
  sources, targets, priorities = (np.concatenate(x) for x in (sources, targets, priorities))
  # Per target pixel, the winner: the highest priority, and the last source among equals.
  best = np.full(h * w, -np.inf, priorities.dtype)
  np.maximum.at(best, targets, priorities)
  candidates = np.flatnonzero(priorities == best[targets])
  winner = np.full(h * w, -1)   # per pixel at time t: its winner (an index into sources)
  np.maximum.at(winner, targets[candidates], candidates)
  filled = winner >= 0
  source = np.where(filled, sources[winner], -1)   # per pixel: the row of `carried` it shows
  source = _nearest_fill(source.reshape(h, w), filled.reshape(h, w))
  out = np.take(carried, source, axis=0)   # [H, W, 6]
  return out[..., 0:2], out[..., 2:4], out[..., 4], out[..., 5]


def synthesize(a: np.ndarray, b: np.ndarray, t: float, motion: flow.Motion) -> np.ndarray:
  """The frame float32 [H, W, 3] at time t in (0, 1) between the endpoints a, b [H, W, 3].

  Both endpoints are backward-warped to t and blended with weights (1 - t, t). Where one
  sample is not visible (forward-backward inconsistent: occluded, or a flow failure), the other
  endpoint's sample stands in for it, shifted by the local colour difference between the two
  warps (a smooth field fitted where both are visible: the light change); where neither is
  visible, the two are blended as they are.
  """
  f_ab, f_ba = motion.f_ab, motion.f_ba
  c_ab, c_ba = flow.consistency(f_ab, f_ba), flow.consistency(f_ba, f_ab)
  ft0, ft1, v0, v1 = _project(f_ab, f_ba, c_ab, c_ba, t)
  neither = (v0 + v1) < 0.5
  v0, v1 = np.where(neither, 1.0, v0)[..., None], np.where(neither, 1.0, v1)[..., None]
  from_a, from_b = flow.warp(a, ft0), flow.warp(b, ft1)
  both = v0 * v1
  sigma = 0.1 * max(a.shape[:2])
  num = cv2.GaussianBlur((from_b - from_a) * both, (0, 0), sigma)
  den = cv2.GaussianBlur(both[..., 0], (0, 0), sigma)[..., None]
  light = np.where(den > 1e-3, num / np.maximum(den, 1e-3), 0.0)   # b - a, smooth  [H, W, 3]
  from_a, from_b = (v0 * from_a + (1 - v0) * (from_b - light),
                    v1 * from_b + (1 - v1) * (from_a + light))
  return (1 - t) * from_a + t * from_b
