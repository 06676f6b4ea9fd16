"""Scenes, changes and nuisances of the synthetic change benchmark (CLEVR-Change in 2D).

A scene is a set of CLEVR objects standing on a floor. A `Pair` is a before scene plus one
procedure: a semantic change (color, material, add, drop, move) or none, and a nuisance (camera
shift and/or illumination change). `Pair.at(t)` gives everything the renderer needs at time
t in [0, 1]: t = 0 is the before image, t = 1 the after image, and the procedure is continuous in
between (the object slides, the colour blends, metal fades in, ...).

World coordinates: (x, y) in [0, 1]^2, x right, y down (towards the viewer). The camera maps
world to image coordinates with a similarity transform about the image centre.

Every random draw comes from `scene_rng(seed, split, index)`, so any scene can be made alone.
"""

import dataclasses
import math

import numpy as np

SHAPES = ('cube', 'sphere', 'cylinder')
COLORS = {  # CLEVR's colour values (sRGB, 0..255)
    'gray': (87, 87, 87),
    'red': (173, 35, 35),
    'blue': (42, 75, 215),
    'green': (29, 105, 20),
    'brown': (129, 74, 25),
    'purple': (129, 38, 192),
    'cyan': (41, 208, 208),
    'yellow': (255, 238, 51),
}
MATERIALS = ('rubber', 'metal')
SIZES = ('small', 'large')
CHANGE_TYPES = ('color', 'material', 'add', 'drop', 'move')  # semantic changes, equally often
SPLITS = ('train', 'val', 'test')

# Difficulty: fixed once from CLEVR-Change's statistics (see README.md); never tuned.
MIN_OBJECTS, MAX_OBJECTS = 3, 6          # objects in the before scene, uniform
HALF_WIDTH = {'small': 0.06, 'large': 0.09}  # object half-width in world units at depth 0.5
PLACE_LO, PLACE_HI = 0.15, 0.85          # object centres lie in this square
GAP = 0.02                               # free space between bounding circles
MIN_MOVE = 0.22                          # smallest displacement of a moved object
SHIFT_MAX = 0.05                         # camera translation, fraction of the image side
SCALE_RANGE = (0.9, 1.1)                 # camera zoom
ROT_MAX = 6.0                            # camera rotation about the image centre, degrees
LIGHT_AZ_DELTA = (15.0, 45.0)            # illumination change: light azimuth delta, degrees
INTENSITY_RANGE = (0.85, 1.15)           # illumination change: intensity factor
WARMTH_DELTA = 0.6                       # illumination change: colour temperature delta
NUISANCES = ('viewpoint', 'illumination', 'both')  # same distribution for both pairs
FRAME_MARGIN = 0.01                      # objects stay this far inside the image


@dataclasses.dataclass(frozen=True)
class Object:
  """One CLEVR object; (x, y) is the centre of its silhouette in world coordinates."""
  shape: str
  color: str
  material: str
  size: str
  x: float
  y: float

  @property
  def attributes(self) -> tuple[str, str, str, str]:
    return (self.size, self.color, self.material, self.shape)

  def to_json(self) -> dict:
    return {'shape': self.shape, 'color': self.color, 'material': self.material,
            'size': self.size, 'position': [round(self.x, 4), round(self.y, 4)]}


@dataclasses.dataclass(frozen=True)
class Camera:
  """Similarity transform about the image centre: shift (tx, ty), zoom, rotation (degrees)."""
  tx: float = 0.0
  ty: float = 0.0
  scale: float = 1.0
  rot: float = 0.0

  def apply(self, x: float, y: float) -> tuple[float, float]:
    """World (x, y) -> image coordinates in [0, 1]."""
    c, s = math.cos(math.radians(self.rot)), math.sin(math.radians(self.rot))
    dx, dy = x - 0.5, y - 0.5
    return (0.5 + self.scale * (c * dx - s * dy) + self.tx,
            0.5 + self.scale * (s * dx + c * dy) + self.ty)


@dataclasses.dataclass(frozen=True)
class Light:
  """Key light: azimuth (degrees, > 0 from the right), intensity, warmth (> 0 warmer)."""
  azimuth: float = 0.0
  intensity: float = 1.0
  warmth: float = 0.0


@dataclasses.dataclass(frozen=True)
class Drawable:
  """An object as drawn at one instant: blended colour, metalness in [0, 1], opacity, growth."""
  shape: str
  size: str
  rgb: tuple[float, float, float]   # 0..1
  metal: float
  x: float
  y: float
  alpha: float = 1.0
  grow: float = 1.0


@dataclasses.dataclass(frozen=True)
class Pair:
  """A before scene and one procedure leading to the after scene."""
  objects: tuple[Object, ...]       # the before scene
  change_type: str                  # 'none' or one of CHANGE_TYPES
  target: int                       # index of the changed object in `objects`; -1 for add/none
  changed: Object | None            # the changed (or added) object as it is after
  camera0: Camera
  camera1: Camera
  light0: Light
  light1: Light
  nuisance: str                     # one of NUISANCES

  def after_objects(self) -> tuple[Object, ...]:
    """The after scene."""
    objs = list(self.objects)
    if self.change_type == 'add':
      objs.append(self.changed)
    elif self.change_type == 'drop':
      del objs[self.target]
    elif self.change_type != 'none':
      objs[self.target] = self.changed
    return tuple(objs)

  def at(self, t: float) -> tuple[list[Drawable], Camera, Light]:
    """The drawables, camera and light at time t in [0, 1] of the procedure."""
    items = []
    for i, o in enumerate(self.objects):
      if i == self.target:
        items.append(_changing(o, self.changed, self.change_type, t))
      else:
        items.append(_drawable(o))
    if self.change_type == 'add':
      items.append(dataclasses.replace(_drawable(self.changed), alpha=t, grow=0.5 + 0.5 * t))
    return items, _lerp_dataclass(self.camera0, self.camera1, t), _lerp_dataclass(
        self.light0, self.light1, t)


def _lerp(a: float, b: float, t: float) -> float:
  return a * (1.0 - t) + b * t


def _lerp_dataclass(a, b, t: float):
  """Field-wise linear interpolation of two instances of a dataclass of floats."""
  names = [f.name for f in dataclasses.fields(a)]
  return type(a)(*(_lerp(getattr(a, k), getattr(b, k), t) for k in names))


def _drawable(o: Object) -> Drawable:
  rgb = tuple(c / 255.0 for c in COLORS[o.color])
  return Drawable(o.shape, o.size, rgb, float(o.material == 'metal'), o.x, o.y)


def _changing(o: Object, new: Object | None, change_type: str, t: float) -> Drawable:
  d = _drawable(o)
  if change_type == 'color':
    rgb1 = _drawable(new).rgb
    return dataclasses.replace(d, rgb=tuple(_lerp(a, b, t) for a, b in zip(d.rgb, rgb1)))
  if change_type == 'material':
    return dataclasses.replace(d, metal=_lerp(d.metal, float(new.material == 'metal'), t))
  if change_type == 'drop':
    return dataclasses.replace(d, alpha=1.0 - t)
  if change_type == 'move':
    return dataclasses.replace(d, x=_lerp(o.x, new.x, t), y=_lerp(o.y, new.y, t))
  return d


def half_width(size: str, y: float) -> float:
  """Half-width of an object's silhouette in world units (mild perspective: nearer is larger)."""
  return HALF_WIDTH[size] * (0.85 + 0.3 * y)


def radius(size: str, y: float) -> float:
  """Radius of a circle around the silhouette (silhouettes fit in [-1, 1]^2 half-widths)."""
  return 1.25 * half_width(size, y)


def scene_rng(seed: int, split: str, index: int, stream: int = 0) -> np.random.Generator:
  """The generator of scene `index` of `split` (stream 0: the scene, 1: change-type blocks)."""
  return np.random.default_rng([seed, SPLITS.index(split), stream, index])


def change_type_of(seed: int, split: str, index: int) -> str:
  """The semantic change of scene `index`: a shuffled balanced cycle over blocks of 5 scenes."""
  block = scene_rng(seed, split, index // len(CHANGE_TYPES), stream=1).permutation(
      len(CHANGE_TYPES))
  return CHANGE_TYPES[int(block[index % len(CHANGE_TYPES)])]


def _clear(x: float, y: float, size: str, others: list[Object]) -> bool:
  r = radius(size, y)
  return all(math.hypot(x - o.x, y - o.y) >= r + radius(o.size, o.y) + GAP for o in others)


def _random_position(rng: np.random.Generator) -> tuple[float, float]:
  x, y = rng.uniform(PLACE_LO, PLACE_HI, size=2)
  return float(x), float(y)


def _random_attributes(rng: np.random.Generator, taken: set) -> tuple[str, str, str, str]:
  while True:
    attrs = (SIZES[rng.integers(2)], list(COLORS)[rng.integers(len(COLORS))],
             MATERIALS[rng.integers(2)], SHAPES[rng.integers(3)])
    if attrs not in taken:  # every object is unique, so a caption names exactly one object
      return attrs


def _place(rng: np.random.Generator, attrs, others: list[Object], tries: int = 200):
  size, color, material, shape = attrs
  for _ in range(tries):
    x, y = _random_position(rng)
    if _clear(x, y, size, others):
      return Object(shape, color, material, size, x, y)
  return None


def _sample_objects(rng: np.random.Generator, n: int) -> list[Object] | None:
  objs = []
  for _ in range(n):
    o = _place(rng, _random_attributes(rng, {p.attributes for p in objs}), objs)
    if o is None:
      return None
    objs.append(o)
  return objs


def _path_clear(o: Object, x1: float, y1: float, others: list[Object]) -> bool:
  for t in np.linspace(0.0, 1.0, 17):
    x, y = _lerp(o.x, x1, t), _lerp(o.y, y1, t)
    r = radius(o.size, y)
    if any(math.hypot(x - p.x, y - p.y) < r + radius(p.size, p.y) for p in others):
      return False
  return True


def _apply_change(rng: np.random.Generator, objs: list[Object], change_type: str):
  """Picks the target and its new state; returns (target, changed) or None when impossible."""
  taken = {o.attributes for o in objs}
  if change_type == 'add':
    added = _place(rng, _random_attributes(rng, taken), objs)
    return None if added is None else (-1, added)
  for target in rng.permutation(len(objs)):
    o, others = objs[target], [p for i, p in enumerate(objs) if i != target]
    other_attrs = {p.attributes for p in others}
    if change_type == 'drop':
      return int(target), None
    if change_type == 'color':
      colors = [c for c in COLORS if c != o.color and (o.size, c, o.material, o.shape)
                not in other_attrs]
      if colors:
        return int(target), dataclasses.replace(o, color=colors[rng.integers(len(colors))])
    elif change_type == 'material':
      m = MATERIALS[1 - MATERIALS.index(o.material)]
      if (o.size, o.color, m, o.shape) not in other_attrs:
        return int(target), dataclasses.replace(o, material=m)
    elif change_type == 'move':
      for _ in range(100):
        x, y = _random_position(rng)
        if (math.hypot(x - o.x, y - o.y) >= MIN_MOVE and _clear(x, y, o.size, others)
            and _path_clear(o, x, y, others)):
          return int(target), dataclasses.replace(o, x=x, y=y)
  return None


def _sample_light(rng: np.random.Generator) -> Light:
  return Light(float(rng.uniform(-50.0, 50.0)), float(rng.uniform(0.95, 1.05)),
               float(rng.uniform(-0.3, 0.3)))


def _sample_nuisance(rng: np.random.Generator, light0: Light, kind: str) -> tuple[Camera, Light]:
  camera, light = Camera(), light0
  if kind in ('viewpoint', 'both'):
    while True:
      camera = Camera(float(rng.uniform(-SHIFT_MAX, SHIFT_MAX)),
                      float(rng.uniform(-SHIFT_MAX, SHIFT_MAX)),
                      float(math.exp(rng.uniform(*np.log(SCALE_RANGE)))),
                      float(rng.uniform(-ROT_MAX, ROT_MAX)))
      if _mean_displacement(camera) >= 0.02:  # a visible shift (>= ~1.3 px at 64 px)
        break
  if kind in ('illumination', 'both'):
    delta = rng.uniform(*LIGHT_AZ_DELTA) * (1 if rng.uniform() < 0.5 else -1)
    az = light0.azimuth + delta
    if abs(az) > 70.0:
      az = light0.azimuth - delta
    light = Light(float(az), float(light0.intensity * rng.uniform(*INTENSITY_RANGE)),
                  float(np.clip(light0.warmth + rng.uniform(-WARMTH_DELTA, WARMTH_DELTA), -1, 1)))
  return camera, light


def _mean_displacement(camera: Camera) -> float:
  pts = [(x, y) for x in (0.25, 0.5, 0.75) for y in (0.25, 0.5, 0.75)]
  return float(np.mean([math.hypot(*np.subtract(camera.apply(x, y), (x, y))) for x, y in pts]))


def inside_frame(pair: Pair) -> bool:
  """True when every object stays inside the image in each of the 9 frames of the procedure."""
  for t in np.linspace(0.0, 1.0, 9):
    items, cam, _ = pair.at(float(t))
    for d in items:
      px, py = cam.apply(d.x, d.y)
      r = radius(d.size, d.y) * cam.scale * d.grow
      if min(px - r, py - r) < FRAME_MARGIN or max(px + r, py + r) > 1.0 - FRAME_MARGIN:
        return False
  return True


def sample_pairs(seed: int, split: str, index: int) -> tuple[Pair, Pair]:
  """The change pair and the distractor pair of scene `index` of `split` (same before image).

  Args:
    seed: the builder config's seed.
    split: 'train', 'val' or 'test'.
    index: scene index within the split.

  Returns:
    (change pair, distractor pair).
  """
  rng = scene_rng(seed, split, index)
  change_type = change_type_of(seed, split, index)
  num_objects = int(rng.integers(MIN_OBJECTS, MAX_OBJECTS + 1))
  while True:  # rejection sampling; every draw comes from `rng`, so the result is deterministic
    objs = _sample_objects(rng, num_objects)
    if objs is None:
      continue
    change = _apply_change(rng, objs, change_type)
    if change is None:
      continue
    light0 = _sample_light(rng)
    kind_c, kind_n = NUISANCES[rng.integers(3)], NUISANCES[rng.integers(3)]
    cam_c, light_c = _sample_nuisance(rng, light0, kind_c)
    cam_n, light_n = _sample_nuisance(rng, light0, kind_n)
    target, changed = change
    pair = Pair(tuple(objs), change_type, target, changed, Camera(), cam_c, light0, light_c, kind_c)
    distractor = Pair(tuple(objs), 'none', -1, None, Camera(), cam_n, light0, light_n, kind_n)
    if inside_frame(pair) and inside_frame(distractor):
      return pair, distractor
