"""One example of a real-dataset builder (`common.PairsBuilder`): a pair's frames loaded from the
authors' h5 pseudo-sequences or interpolated from its before and after images, as PNG bytes.

A task is (manual_dir, pair, image size, method, num_frames); the pair is a `common.Pair`.
"""

import os
from typing import Any

import h5py
import numpy as np
import PIL.Image

from procap_jax import errors
from procap_jax.data import images
from procap_jax.procedure import interpolation

_H5_FILES: dict[str, h5py.File] = {}  # open h5 files of this process, by path


def _resize(frame: np.ndarray, size: int) -> np.ndarray:
  if frame.shape[:2] == (size, size):
    return frame
  return np.asarray(PIL.Image.fromarray(frame).resize((size, size), PIL.Image.Resampling.BILINEAR))


def _h5_frames(path: str, key: str, size: int, num_frames: int) -> np.ndarray:
  if path not in _H5_FILES:
    _H5_FILES[path] = h5py.File(path, 'r')
  try:
    arr = np.asarray(_H5_FILES[path][key])
  except KeyError:
    raise errors.UserError(f'{path} has no key {key!r}; download the file again') from None
  if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[:2] != (num_frames, 3):
    raise errors.UserError(f'{path} key {key!r} holds {arr.dtype} {list(arr.shape)}; expected '
                           f'uint8 [{num_frames}, 3, H, W] (the authors\' pseudo-sequence layout)')
  return np.stack([_resize(np.ascontiguousarray(f.transpose(1, 2, 0)), size) for f in arr])


def make_example(task: tuple[str, Any, int, str, int]) -> tuple[str, dict]:
  """Loads (or interpolates) one pair's frames and returns (key, feature dict of PNG bytes)."""
  manual_dir, pair, size, method, num_frames = task
  if method == 'h5':
    frames = _h5_frames(os.path.join(manual_dir, pair.h5_file), pair.h5_key, size, num_frames)
  else:
    before = images.load_image(os.path.join(manual_dir, pair.before), size)
    after = images.load_image(os.path.join(manual_dir, pair.after), size)
    frames = interpolation.interpolate(before, after, num_frames=num_frames, method=method,
                                       size=size)
  if frames.shape != (num_frames, size, size, 3) or frames.dtype != np.uint8:
    raise RuntimeError(f'{pair.pair_id}: frames are {frames.dtype} {frames.shape}, expected '
                       f'uint8 {(num_frames, size, size, 3)}')
  pngs = [images.encode_png(f) for f in frames]
  return pair.pair_id, {
      'pair_id': pair.pair_id, 'scene_id': pair.scene_id, 'change_type': pair.change_type,
      'before': pngs[0], 'after': pngs[-1], 'frames': pngs, 'oracle_frames': [],
      'captions': list(pair.captions), 'change_params': '{}',
  }


def indexed_example(task: tuple[int, tuple[str, Any, int, str, int]]) -> list[tuple[int, dict]]:
  """The Beam path's `make_example`: (index in the split, task) -> [(index, example)].

  Integer keys in split order: the records the sequential writer stores, which numbers the
  pair-id keys in order since shuffling is disabled.
  """
  index, example_task = task
  return [(index, make_example(example_task)[1])]
