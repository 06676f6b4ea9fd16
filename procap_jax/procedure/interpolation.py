"""Frame interpolation from (before, after) to 2^L + 1 frames: the ProCap pseudo-sequence.

Dimensions: T frames (2^L + 1, default 9), H x W image size, 2 flow components (dx, dy).

The original made its 9-frame sequences offline with VFIformer, recursively: the middle frame
from the endpoints, then the middle of each half, and so on. `interpolate` does the same with a
training-free midpoint. Methods (`METHODS`, name -> `(before, after, T) -> float32 [T, H, W, 3]`
on float32 RGB in [0, 255]; `recursive(midpoint_fn)` turns a midpoint into a method, e.g. a
learned interpolator later):

  flow         (default) recursive bisection with `flow_midpoint`: camera motion + dense DIS
               flow + matching of moved objects, flow projection to t, backward warps,
               occlusion-aware fusion; each level also tries half the parent level's moves.
  flow_direct  the same flows estimated once between the endpoints and projected to every
               t = k/(T-1) (not recursive; sharper on long moves, see docs/procedure.md).
  crossfade    linear blend, the baseline.
  oracle       the renderer's true frames: only the synthetic dataset has them (feature
               `oracle_frames`), so asking `interpolate` for them raises ValueError.

The flow engine lives in `procap_jax.procedure.flow`.
"""

from typing import Callable

import numpy as np
import PIL.Image

from procap_jax.procedure import flow
from procap_jax.procedure import synthesis

Method = Callable[[np.ndarray, np.ndarray, int], np.ndarray]
Midpoint = Callable[[np.ndarray, np.ndarray], np.ndarray]


# ----------------------------------------------------------------------------------- images
def to_rgb(image: np.ndarray) -> np.ndarray:
  """Converts an image array to RGB uint8.

  Args:
    image: [H, W] or [H, W, 1] grey, [H, W, 3] RGB or [H, W, 4] RGBA (alpha dropped, as
      `procap_jax.data.images.load_image`); uint8, bool, other integers (clipped to 0..255)
      or floats (scaled by 255 when all values lie in [0, 1], else clipped to 0..255).

  Returns:
    uint8 [H, W, 3].
  """
  a = np.asarray(image)
  if a.ndim == 3 and a.shape[-1] == 1:
    a = a[..., 0]
  if a.ndim == 2:
    a = np.stack([a] * 3, axis=-1)
  if a.ndim != 3 or a.shape[-1] not in (3, 4) or 0 in a.shape:
    raise ValueError(f'expected an image [H, W], [H, W, 1], [H, W, 3] or [H, W, 4], '
                     f'got shape {np.shape(image)}')
  a = a[..., :3]
  if a.dtype == np.uint8:
    return np.ascontiguousarray(a)
  if a.dtype == np.bool_:
    return a.astype(np.uint8) * 255
  if not np.issubdtype(a.dtype, np.number) or np.iscomplexobj(a):
    raise ValueError(f'unsupported image dtype {a.dtype}')
  floating = np.issubdtype(a.dtype, np.floating)
  a = np.nan_to_num(a.astype(np.float64))
  if floating and a.min() >= 0.0 and a.max() <= 1.0:
    a = a * 255.0
  return np.clip(np.rint(a), 0, 255).astype(np.uint8)


def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """Bilinear (antialiased) resize of uint8 [H, W, 3] to [height, width, 3], as `load_image`."""
  if image.shape[:2] == (height, width):
    return image
  pil = PIL.Image.fromarray(image).resize((width, height), PIL.Image.Resampling.BILINEAR)
  return np.asarray(pil, dtype=np.uint8)


def flow_midpoint(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """The middle frame float32 [H, W, 3] of two float32 RGB images [H, W, 3] in [0, 255]."""
  return synthesis.synthesize(a, b, 0.5, flow.estimate_motion(a, b))


# -------------------------------------------------------------------------------- methods
def _levels(num_frames: int) -> int:
  """Returns L with num_frames == 2^L + 1; ValueError otherwise."""
  n = int(num_frames) - 1 if isinstance(num_frames, (int, np.integer)) else 0
  if isinstance(num_frames, bool) or n < 1 or n & (n - 1):
    raise ValueError(f'num_frames must be 2^L + 1 (2, 3, 5, 9, 17, ...), got {num_frames!r}')
  return n.bit_length() - 1


def recursive(midpoint_fn: Midpoint) -> Method:
  """Turns a midpoint interpolator into a T-frame method by recursive bisection.

  Frame T//2 is made from frames 0 and T-1, then frame T//4 from 0 and T//2, and so on; each
  new frame is rounded to integers first, as a stored frame would be.

  Args:
    midpoint_fn: maps two float32 [H, W, 3] images to their midpoint [H, W, 3].

  Returns:
    A method `(before, after, num_frames) -> float32 [T, H, W, 3]`.
  """

  def method(before: np.ndarray, after: np.ndarray, num_frames: int) -> np.ndarray:
    _levels(num_frames)
    frames = [before] + [None] * (num_frames - 2) + [after]
    step = num_frames - 1
    while step > 1:
      for lo in range(0, num_frames - 1, step):
        a, b = frames[lo], frames[lo + step]
        mid = a if np.array_equal(a, b) else np.clip(np.rint(midpoint_fn(a, b)), 0, 255)
        frames[lo + step // 2] = mid.astype(np.float32)
      step //= 2
    return np.stack(frames)

  return method


def flow_recursive(before: np.ndarray, after: np.ndarray, num_frames: int) -> np.ndarray:
  """`recursive(flow_midpoint)`, where each level also tries half the parent level's moves.

  Halving a move makes an object overlap its old place, where template matching is weak; the
  parent's displacement, halved, is then the candidate that finds it. Returns [T, H, W, 3].
  """
  _levels(num_frames)
  frames = [before] + [None] * (num_frames - 2) + [after]
  hints = {0: []}   # first frame of an interval -> displacements to try in it
  step = num_frames - 1
  while step > 1:
    for lo in range(0, num_frames - 1, step):
      a, b = frames[lo], frames[lo + step]
      mid, moves = a, []
      if not np.array_equal(a, b):
        motion = flow.estimate_motion(a, b, hints[lo])
        mid = np.clip(np.rint(synthesis.synthesize(a, b, 0.5, motion)), 0, 255).astype(np.float32)
        moves = motion.moves
      frames[lo + step // 2] = mid
      hints[lo] = hints[lo + step // 2] = [d / 2 for d in moves if np.hypot(*d) >= 3.0]
    step //= 2
  return np.stack(frames)


def flow_direct(before: np.ndarray, after: np.ndarray, num_frames: int) -> np.ndarray:
  """Flows estimated once between the endpoints, frames synthesised at every t; [T, H, W, 3]."""
  _levels(num_frames)
  if np.array_equal(before, after):
    return np.stack([before] * num_frames)
  motion = flow.estimate_motion(before, after)
  inner = [synthesis.synthesize(before, after, k / (num_frames - 1), motion)
           for k in range(1, num_frames - 1)]
  return np.stack([before, *inner, after])


def crossfade(before: np.ndarray, after: np.ndarray, num_frames: int) -> np.ndarray:
  """Linear blend: frame t = (1 - t) before + t after. Returns float32 [T, H, W, 3]."""
  _levels(num_frames)
  ts = np.linspace(0.0, 1.0, num_frames, dtype=np.float32)[:, None, None, None]
  return (1.0 - ts) * before[None] + ts * after[None]


def _oracle(before: np.ndarray, after: np.ndarray, num_frames: int) -> np.ndarray:
  raise ValueError(
      "method 'oracle' cannot be computed from two images: the renderer's true frames come "
      "from the synthetic dataset's `oracle_frames` feature (select them with "
      "config.data.frame_source = 'oracle')")


METHODS: dict[str, Method] = {
    'flow': flow_recursive,
    'flow_direct': flow_direct,
    'crossfade': crossfade,
    'oracle': _oracle,
}


def interpolate(before: np.ndarray, after: np.ndarray, num_frames: int = 9, method: str = 'flow',
                size: int | None = None) -> np.ndarray:
  """Interpolates a pseudo-sequence between two images.

  Args:
    before: the before image, [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] (see `to_rgb`).
    after: the after image, any size and any of the same layouts.
    num_frames: T = 2^L + 1 (9 in ProCap); ValueError otherwise.
    method: a key of `METHODS`; 'oracle' raises ValueError (see the module docstring).
    size: resize both images to size x size first; None keeps `before`'s size (and resizes
      `after` to it).

  Returns:
    uint8 [T, H, W, 3]; frame 0 is `before` and frame T-1 is `after` (after the conversions).
  """
  if method not in METHODS:
    raise ValueError(f'unknown interpolation method {method!r}; choose one of {sorted(METHODS)}')
  _levels(num_frames)
  if size is not None and (isinstance(size, bool) or int(size) != size or size <= 0):
    raise ValueError(f'size must be a positive integer or None, got {size!r}')
  a, b = to_rgb(before), to_rgb(after)
  h, w = (int(size), int(size)) if size is not None else a.shape[:2]
  a, b = resize(a, h, w), resize(b, h, w)
  frames = METHODS[method](a.astype(np.float32), b.astype(np.float32), num_frames)
  out = np.clip(np.rint(frames), 0, 255).astype(np.uint8)
  out[0], out[-1] = a, b
  return out
