"""Numpy renderer: pseudo-3D CLEVR objects on a softly lit floor, supersampled 2x.

Dimensions: S output side, N = 2 S supersampled side, h x w an object's bounding box.

Shapes are drawn so they differ even at 32-64 px: a cube is a front square with a lit top face
and a shaded side face (cabinet projection), a sphere a radially shaded disk, a cylinder a
cylindrically shaded body under an elliptic top. Rubber is matte (Lambert); metal adds a
reflected sky/floor gradient and a white specular highlight. Each object casts a soft shadow
away from the light. Shading uses a view space with x right, y up and z towards the viewer.
"""

import math
from typing import Sequence

import numpy as np

from tfds_builders.synthetic_change import scene

SUPERSAMPLE = 2
_FLOOR_RGB = np.array([0.60, 0.60, 0.62], np.float32)
_CUBE_DEPTH = 0.55        # depth offset of the cube's back faces, in half-widths
_CYLINDER_CAP = 0.30      # vertical radius of the cylinder's elliptic caps, in half-widths
_NORMALS = {              # view-space normals of flat faces
    'front': (0.0, 0.0, 1.0),
    'top': (0.0, 0.85, 0.53),
    'side': (0.85, 0.0, 0.53),
}


def render(items: Sequence[scene.Drawable], camera: scene.Camera, light: scene.Light,
           size: int) -> np.ndarray:
  """Renders one frame.

  Args:
    items: the objects to draw (any order; drawn back to front).
    camera: world -> image transform.
    light: the key light.
    size: S, the output image side in pixels.

  Returns:
    uint8 [S, S, 3].
  """
  n = size * SUPERSAMPLE
  light_dir, light_rgb = _light(light)
  img = _floor(camera, light, light_rgb, n)                                   # [N, N, 3]
  placed = []
  for d in items:
    if d.alpha <= 0.0:
      continue
    px, py = camera.apply(d.x, d.y)
    a = scene.half_width(d.size, d.y) * camera.scale * d.grow * n
    placed.append((py, px * n, py * n, a, d))
  for _, px, py, a, d in placed:
    _shadow(img, px, py, a, d.alpha, light_dir)
  for _, px, py, a, d in sorted(placed, key=lambda p: p[0]):
    _draw_object(img, px, py, a, d, light_dir, light_rgb)
  img = (img[0::2, 0::2] + img[0::2, 1::2] + img[1::2, 0::2] + img[1::2, 1::2])  # [S, S, 3]
  return np.clip(np.rint(img * (255.0 / 4.0)), 0, 255).astype(np.uint8)


def _light(light: scene.Light) -> tuple[np.ndarray, np.ndarray]:
  """Unit light direction [3] and light colour [3] (intensity times a warm/cool tint)."""
  az = np.radians(light.azimuth)
  direction = np.array([0.75 * np.sin(az), 0.75, 0.55], np.float32)
  direction /= np.linalg.norm(direction)
  tint = np.array([1.0 + 0.07 * light.warmth, 1.0, 1.0 - 0.07 * light.warmth], np.float32)
  return direction, (light.intensity * tint).astype(np.float32)


def _floor(camera: scene.Camera, light: scene.Light, light_rgb: np.ndarray,
           n: int) -> np.ndarray:
  """The lit floor [N, N, 3] from `camera`: lighter near the viewer, a soft spot under the light."""
  p = (np.arange(n, dtype=np.float32) + 0.5) / n - 0.5
  c, s = math.cos(math.radians(camera.rot)), math.sin(math.radians(camera.rot))
  u = (p[None, :] - camera.tx) / camera.scale                                  # [1, N]
  v = (p[:, None] - camera.ty) / camera.scale                                  # [N, 1]
  wx, wy = c * u + s * v + 0.5, -s * u + c * v + 0.5                           # [N, N] world
  spot_x = 0.5 + 0.35 * math.sin(math.radians(light.azimuth))
  spot = np.exp(((wx - spot_x) ** 2 + (wy - 0.3) ** 2) * (-1.0 / 0.12))
  shade = 0.80 + 0.22 * wy + 0.16 * spot                                       # [N, N]
  # shade * floor colour * light colour, one channel at a time (an [N, N] array times a scalar
  # is much faster than a product broadcast over 3 channels, and gives the same values).
  return np.stack([shade * _FLOOR_RGB[k] * light_rgb[k] for k in range(3)], axis=-1)


def _window(img: np.ndarray, cx: float, cy: float, rx: float, ry_top: float, ry_bottom: float):
  """Integer bounding box around (cx, cy) clipped to the image, and pixel-centre coordinates."""
  n = img.shape[0]
  x0, x1 = max(int(np.floor(cx - rx)) - 1, 0), min(int(np.ceil(cx + rx)) + 1, n)
  y0, y1 = max(int(np.floor(cy - ry_top)) - 1, 0), min(int(np.ceil(cy + ry_bottom)) + 1, n)
  xs = np.arange(x0, x1, dtype=np.float32) + 0.5
  ys = np.arange(y0, y1, dtype=np.float32) + 0.5
  return (slice(y0, y1), slice(x0, x1)), xs, ys


def _shadow(img: np.ndarray, px: float, py: float, a: float, alpha: float,
            light_dir: np.ndarray) -> None:
  """Darkens the floor under an object with a soft ellipse pushed away from the light."""
  cx = px - 0.6 * a * light_dir[0] / max(light_dir[1], 1e-3)
  cy = py + 0.85 * a
  rx, ry = 1.25 * a, 0.45 * a
  box, xs, ys = _window(img, cx, cy, rx, ry, ry)
  if xs.size == 0 or ys.size == 0:
    return
  d2 = ((xs[None, :] - cx) / rx) ** 2 + ((ys[:, None] - cy) / ry) ** 2          # [h, w]
  strength = 0.38 * alpha * np.clip(1.0 - d2, 0.0, 1.0) ** 1.5
  img[box] *= (1.0 - strength)[..., None]


def _polygon_sdf(u: np.ndarray, v: np.ndarray, verts) -> np.ndarray:
  """Approximate signed distance to a convex polygon (vertices counter-clockwise on screen)."""
  d = None
  for (x0, y0), (x1, y1) in zip(verts, verts[1:] + verts[:1]):
    ex, ey = x1 - x0, y1 - y0
    nx, ny = -ey, ex  # outward normal for this orientation (y down)
    norm = np.hypot(nx, ny)
    e = ((u - x0) * nx + (v - y0) * ny) / norm
    d = e if d is None else np.maximum(d, e)
  return d


def _cube(u: np.ndarray, v: np.ndarray):
  """Silhouette distance and per-pixel face normals of a cube; u, v in half-widths."""
  k = _CUBE_DEPTH
  f = 2.0 - k
  front = [(-1.0, 1.0 - f), (-1.0, 1.0), (-1.0 + f, 1.0), (-1.0 + f, 1.0 - f)]
  top = [(-1.0, 1.0 - f), (-1.0 + f, 1.0 - f), (1.0, -1.0), (-1.0 + k, -1.0)]
  side = [(-1.0 + f, 1.0 - f), (-1.0 + f, 1.0), (1.0, 1.0 - k), (1.0, -1.0)]
  faces = np.stack([_polygon_sdf(u, v, p) for p in (front, top, side)])      # [3, h, w]
  which = np.argmin(faces, axis=0)                                             # [h, w]
  normals = np.array([_NORMALS['front'], _NORMALS['top'], _NORMALS['side']], np.float32)
  return faces.min(axis=0), normals[which], True


def _sphere(u: np.ndarray, v: np.ndarray):
  r2 = u * u + v * v
  nz = np.sqrt(np.clip(1.0 - r2, 0.0, 1.0))
  return np.sqrt(r2) - 1.0, np.stack([u, -v, nz], axis=-1), False


def _cylinder(u: np.ndarray, v: np.ndarray):
  e = _CYLINDER_CAP
  body = np.maximum(np.abs(u) - 1.0, np.abs(v) - (1.0 - e))
  top = (np.sqrt(u * u + ((v + 1.0 - e) / e) ** 2) - 1.0) * e
  bottom = (np.sqrt(u * u + ((v - 1.0 + e) / e) ** 2) - 1.0) * e
  uc = np.clip(u, -1.0, 1.0)
  side = np.stack([uc, np.zeros_like(uc), np.sqrt(1.0 - uc * uc)], axis=-1)   # [h, w, 3]
  normals = np.where((top < 0.0)[..., None], np.array(_NORMALS['top'], np.float32), side)
  return np.minimum(np.minimum(body, top), bottom), normals, False


_SHAPES = {'cube': _cube, 'sphere': _sphere, 'cylinder': _cylinder}


def _draw_object(img: np.ndarray, px: float, py: float, a: float, d: scene.Drawable,
                 light_dir: np.ndarray, light_rgb: np.ndarray) -> None:
  box, xs, ys = _window(img, px, py, a, a, a)
  if xs.size == 0 or ys.size == 0 or a <= 0.0:
    return
  u = np.broadcast_to((xs[None, :] - px) / a, (ys.size, xs.size))             # [h, w]
  v = np.broadcast_to((ys[:, None] - py) / a, (ys.size, xs.size))             # [h, w]
  sdf, normals, flat = _SHAPES[d.shape](u, v)
  if flat:  # gently curved faces, so metal highlights move across them
    normals = normals + 0.3 * np.stack([u, -v, np.zeros_like(u)], axis=-1)
  normals = normals / np.linalg.norm(normals, axis=-1, keepdims=True)
  rgb = _shade(normals, np.asarray(d.rgb, np.float32), d.metal, light_dir) * light_rgb
  coverage = np.clip(0.5 - sdf * a, 0.0, 1.0)[..., None] * d.alpha             # [h, w, 1]
  img[box] = img[box] * (1.0 - coverage) + rgb * coverage


def _shade(normals: np.ndarray, albedo: np.ndarray, metal: float,
           light_dir: np.ndarray) -> np.ndarray:
  """Blend of matte (rubber) and reflective (metal) shading. normals [h, w, 3] -> [h, w, 3]."""
  ndl = np.clip(normals @ light_dir, 0.0, 1.0)[..., None]                      # [h, w, 1]
  rubber = albedo * (0.42 + 0.68 * ndl)
  if metal <= 0.0:
    return rubber
  half = light_dir + np.array([0.0, 0.0, 1.0], np.float32)
  half /= np.linalg.norm(half)
  spec = np.clip(normals @ half, 0.0, 1.0)[..., None] ** 20                    # [h, w, 1]
  # Reflected view ray r = 2 n_z n - z: a bright sky above the horizon, the dark floor below,
  # and a bright vertical window towards the light (streaks on cylinders, bands on cubes).
  rx = 2.0 * normals[..., 2:3] * normals[..., 0:1]
  ry = 2.0 * normals[..., 2:3] * normals[..., 1:2]
  sky = np.clip((ry + 0.05) / 0.5, 0.0, 1.0)
  window = np.exp(-((rx - light_dir[0]) ** 2) / 0.03) * np.clip(ry + 0.6, 0.0, 1.0)
  env = 0.05 + 0.8 * sky * sky * (3.0 - 2.0 * sky) + 0.6 * window
  shiny = albedo * (0.08 + 0.3 * ndl + 0.8 * env) + 0.7 * spec + 0.25 * window
  return rubber * (1.0 - metal) + shiny * metal
