"""One scene -> its two TFDS examples: render, interpolate, encode, caption.

Runs in the builder's worker processes, so it depends on numpy, PIL and the interpolation
module only (no TFDS). `scene_examples` is a pure function of its arguments: the same scene
always gives the same bytes.
"""

import dataclasses
import json

import cv2
import numpy as np

from procap_jax.procedure import interpolation
from tfds_builders.synthetic_change import captions as captions_lib
from tfds_builders.synthetic_change import render
from tfds_builders.synthetic_change import scene

NUM_FRAMES = 9


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a worker needs to make the scenes of one split."""
  seed: int
  image_size: int
  interpolation: str
  split: str
  first_scene_id: int   # scene id of the split's scene 0 (splits use disjoint id ranges)


def init_worker() -> None:
  """Worker initializer: one thread per process (the pool already uses every core)."""
  cv2.setNumThreads(1)


def encode_png(image: np.ndarray) -> bytes:
  """uint8 [H, W, 3] RGB -> PNG bytes (deterministic; fast zlib level, images are tiny)."""
  ok, buf = cv2.imencode('.png', np.ascontiguousarray(image[..., ::-1]),
                         [cv2.IMWRITE_PNG_COMPRESSION, 1])
  if not ok:
    raise RuntimeError('PNG encoding failed')
  return buf.tobytes()


def oracle_frames(pair: scene.Pair, size: int) -> list[np.ndarray]:
  """The renderer's true procedure: NUM_FRAMES uint8 [S, S, 3] frames at t = 0, 1/8, ..., 1."""
  return [render.render(*pair.at(k / (NUM_FRAMES - 1)), size) for k in range(NUM_FRAMES)]


def scene_examples(task: tuple[Spec, int]) -> list[tuple[int, dict]]:
  """Makes the change pair and the distractor pair of one scene.

  Args:
    task: (spec, index of the scene within its split).

  Returns:
    [(key, example), (key, example)]: the change pair then the distractor; keys are
    2 * scene_id and 2 * scene_id + 1, so records are ordered by scene.
  """
  spec, index = task
  scene_id = spec.first_scene_id + index
  change, distractor = scene.sample_pairs(spec.seed, spec.split, index)
  out = []
  before = None
  for k, (pair, suffix) in enumerate(((change, 'c'), (distractor, 'nc'))):
    frames = oracle_frames(pair, spec.image_size)
    if before is None:
      before = frames[0]
    assert np.array_equal(frames[0], before)  # both pairs share the before image
    interp = interpolation.interpolate(frames[0], frames[-1], num_frames=NUM_FRAMES,
                                       method=spec.interpolation)
    oracle_png = [encode_png(f) for f in frames]
    out.append((2 * scene_id + k, {
        'pair_id': f'{scene_id:06d}{suffix}',
        'scene_id': scene_id,
        'change_type': pair.change_type,
        'before': oracle_png[0],
        'after': oracle_png[-1],
        'frames': [encode_png(f) for f in interp],
        'oracle_frames': oracle_png,
        'captions': captions_lib.captions(pair),
        'change_params': json.dumps(change_params(pair), sort_keys=True),
    }))
  return out


def _bbox(obj: scene.Object | None, camera: scene.Camera) -> list[float] | None:
  """The object's box [x0, y0, x1, y1] in image coordinates in [0, 1]; None when absent."""
  if obj is None:
    return None
  px, py = camera.apply(obj.x, obj.y)
  a = scene.half_width(obj.size, obj.y) * camera.scale
  return [round(v, 4) for v in (px - a, py - a, px + a, py + a)]


def _rounded(obj) -> dict:
  return {k: round(v, 4) for k, v in dataclasses.asdict(obj).items()}


def change_params(pair: scene.Pair) -> dict:
  """What happened in a pair, as JSON-ready values.

  Keys: type; nuisance (viewpoint / illumination / both); camera and light before and after;
  num_objects [before, after]; scene (the before objects). Change pairs add `object` (the
  changed object as it was before; the added object for add), `from` / `to` (colour,
  material, or [x, y] world positions for move) and `bbox_before` / `bbox_after` (its box in
  each image, null where absent).
  """
  after = pair.after_objects()
  params = {
      'type': pair.change_type,
      'nuisance': pair.nuisance,
      'camera_before': _rounded(pair.camera0),
      'camera_after': _rounded(pair.camera1),
      'light_before': _rounded(pair.light0),
      'light_after': _rounded(pair.light1),
      'num_objects': [len(pair.objects), len(after)],
      'scene': [o.to_json() for o in pair.objects],
  }
  if pair.change_type == 'none':
    return params
  old = pair.objects[pair.target] if pair.target >= 0 else None
  new = pair.changed
  params['object'] = (old or new).to_json()
  params['bbox_before'] = _bbox(old, pair.camera0)
  params['bbox_after'] = _bbox(new, pair.camera1)
  if pair.change_type == 'color':
    params['from'], params['to'] = old.color, new.color
  elif pair.change_type == 'material':
    params['from'], params['to'] = old.material, new.material
  elif pair.change_type == 'move':
    params['from'] = [round(old.x, 4), round(old.y, 4)]
    params['to'] = [round(new.x, 4), round(new.y, 4)]
  return params
