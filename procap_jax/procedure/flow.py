"""Motion between two frames: the estimation half of the engine of the `flow` method.

Dimensions: H x W image size, 2 flow components (dx, dy), 3 colour channels.

`estimate_motion(a, b)` finds, in both directions:
  1. dense optical flow (OpenCV DIS, finest scale) and the camera motion, a similarity
     transform fitted with RANSAC to the DIS flow of textured unchanged pixels (one transform
     for both directions, so the two camera flows agree); DIS is kept only where it explains the
     pixels clearly better than the camera motion (flat floors give DIS noise);
  2. a per-channel gain and offset between the two illuminations (to compare pixels across a
     light change);
  3. moved objects: small objects that move far defeat coarse-to-fine flow, so changed regions
     (large residual after 1-2) are template-matched against changed regions of the other
     image; a displacement is kept when it explains both sides and the explained pixels of a,
     shifted, overlap those of b (a real move, not a look-alike);
  4. forward-backward consistency: unmatched inconsistent flow goes back to the camera motion.
`synthesis.synthesize(a, b, t, motion)` renders the frames in between from the `Motion`. All
tunables are module constants below; docs/procedure.md has the measurements behind them.

Flow convention: `f_ab[y, x] = (dx, dy)` means pixel (x, y) of a shows the point at
(x + dx, y + dy) of b, so `warp(b, f_ab)` looks like a.
"""

import functools
from typing import NamedTuple, Sequence

import cv2
import numpy as np

# Tunables (intensities on the 0..255 scale; chosen on the synthetic val split at 32, 64 and
# 128 px, see docs/procedure.md).
WORK_MIN, WORK_MAX = 64, 128   # flows are estimated at a working size with sides in this range
CHANGED = 24.0                 # residual |a - warp(b)| above which a pixel is "changed"
TEXTURE = 20.0                 # Sobel magnitude of the pixels that fit the camera motion
LOCAL_GAIN = 4.0               # DIS flow replaces the camera flow where it lowers the error by this
MATCH_GAIN = 8.0               # a moved-object match must lower a pixel's error by this ...
MATCH_MEAN_GAIN = 30.0         # ... and the mean error of its pixels by this
MATCH_IOU = 0.5                # overlap of the matched pixels of a (shifted) and of b
MATCH_AREA = 0.004             # smallest matched region, as a fraction of the image
UNIQUE = 2.0                   # the second-best template position must be this much worse


def warp(image: np.ndarray, flow: np.ndarray, step: int = 1) -> np.ndarray:
  """Backward warp: out[y, x] = image[y + flow[y, x, 1], x + flow[y, x, 0]] (bilinear).

  Args:
    image: float32 [H, W, C] or [H, W].
    flow: float32 [H, W, 2].
    step: samples only every step-th row and column: the result is the full warp's
      [::step, ::step] (each output pixel depends on its own flow only), made without the rest.

  Returns:
    float32 with the shape of `image` (or of its [::step, ::step]); samples outside the image
    repeat the border.
  """
  gx, gy = pixel_grid(*flow.shape[:2])
  if step > 1:
    gx, gy, flow = gx[::step, ::step], gy[::step, ::step], flow[::step, ::step]
  return cv2.remap(image, gx + flow[..., 0], gy + flow[..., 1], cv2.INTER_LINEAR,
                   borderMode=cv2.BORDER_REPLICATE)


@functools.lru_cache(maxsize=8)
def pixel_grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
  """Pixel coordinates (x, y), float32 [H, W] each (read-only, cached)."""
  gx, gy = np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32))
  gx.flags.writeable = gy.flags.writeable = False
  return gx, gy


def _absmax(x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """max over the last axis (channels or flow components) of |x - y|; [...]."""
  d = np.abs(x - y)
  return np.maximum.reduce([d[..., i] for i in range(d.shape[-1])])


def _gray(image: np.ndarray) -> np.ndarray:
  return cv2.cvtColor(np.clip(image + 0.5, 0, 255).astype(np.uint8), cv2.COLOR_RGB2GRAY)


def _shift(mask: np.ndarray, d: np.ndarray) -> np.ndarray:
  """Moves a boolean mask [H, W] by d = (dx, dy) (nearest pixel)."""
  m = np.float32([[1, 0, d[0]], [0, 1, d[1]]])
  return cv2.warpAffine(mask.astype(np.uint8), m, mask.shape[::-1], flags=cv2.INTER_NEAREST) > 0


def _dilate(mask: np.ndarray) -> np.ndarray:
  return cv2.dilate(mask.astype(np.uint8), np.ones((3, 3), np.uint8)) > 0


def _solid(mask: np.ndarray) -> np.ndarray:
  """Closes small gaps and fills the holes of a boolean mask [H, W] (a rigid object moves whole)."""
  m = cv2.morphologyEx(mask.astype(np.uint8), cv2.MORPH_CLOSE, np.ones((3, 3), np.uint8))
  background = np.pad(1 - m, 1, constant_values=1)   # a background ring around the image
  cv2.floodFill(background, None, (0, 0), 2)         # 2: background reachable from outside
  return background[1:-1, 1:-1] != 2


# ------------------------------------------------------------------------- flow estimation
class _Direction:
  """Flow from a to b [H, W, 2] with what it is built from; b is photometrically matched to a."""

  def __init__(self, a: np.ndarray, b: np.ndarray):
    self.a, self.b = a, b
    dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_FAST)
    dis.setFinestScale(0)
    dis.setPatchSize(8)
    dis.setPatchStride(4)
    gray_a = _gray(a)
    self.dis = dis.calc(gray_a, _gray(b), None).astype(np.float32)  # [H, W, 2]
    self.flow = self.dis
    self.matched = np.zeros(a.shape[:2], bool)   # pixels whose flow is a moved-object match
    self._fit_photometric()
    # Camera motion: a similarity fitted (RANSAC) to the DIS flow of textured, unchanged pixels.
    g = gray_a.astype(np.float32)
    texture = np.hypot(cv2.Sobel(g, cv2.CV_32F, 1, 0), cv2.Sobel(g, cv2.CV_32F, 0, 1))
    self.dis_residual = self.residual()   # [H, W], with b matched to a on the DIS flow
    reliable = (cv2.blur(self.dis_residual, (3, 3)) <= CHANGED) & (texture > TEXTURE)
    self.transform = _fit_similarity(self.flow, reliable)

  def set_camera(self, transform: np.ndarray) -> None:
    """Sets the camera motion (3x3, a -> b), once; DIS flow stays only where clearly better."""
    gx, gy = pixel_grid(*self.a.shape[:2])
    t = transform
    self.camera = np.stack([t[0, 0] * gx + t[0, 1] * gy + t[0, 2] - gx,
                            t[1, 0] * gx + t[1, 1] * gy + t[1, 2] - gy], -1).astype(np.float32)
    better = (cv2.blur(self.dis_residual, (5, 5)) + LOCAL_GAIN
              < cv2.blur(self.residual(self.camera), (5, 5)))
    self.flow = np.where(better[..., None], self.dis, self.camera)
    self._fit_photometric()

  def _fit_photometric(self) -> None:
    """Per-channel gain and offset mapping warp(b) to a (illumination changes); robust LS.

    Fitted on a grid of about 1024 pixels: two rounds, the second one without the outliers of
    the first.
    """
    step = max(1, round(np.sqrt(self.a.shape[0] * self.a.shape[1] / 1024)))
    x = warp(self.b, self.flow, step).reshape(-1, 3)
    y = self.a[::step, ::step].reshape(-1, 3)
    xk, yk = x, y   # the kept samples: all of them in the first round
    for first_round in (True, False):
      mx, my = xk.mean(0), yk.mean(0)
      dx = xk - mx
      vx = (dx ** 2).mean(0)
      gain = np.where(vx > 1e-3, (dx * (yk - my)).mean(0) / (vx + 1e-6), 1.0)
      gain = np.clip(gain, 0.5, 2.0)
      if first_round:   # the second round's outliers would be unused
        err = _absmax(y, x * gain + my - gain * mx)
        keep = err < max(3.0 * float(np.median(err)), 4.0)
        xk, yk = x[keep], y[keep]
    self.b_matched = (self.b * gain + (my - gain * mx)).astype(np.float32)  # ~ a

  def residual(self, flow: np.ndarray | None = None) -> np.ndarray:
    """max over channels of |a - warp(b_matched, flow)|, [H, W]."""
    return _absmax(self.a, warp(self.b_matched, self.flow if flow is None else flow))

  def explained(self, region: np.ndarray, d: np.ndarray,
                residual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pixels of `region` that the constant flow d explains.

    Returns (mask [H, W], gains): mask holds the pixels whose error d lowers by MATCH_GAIN and
    those whose flow is already about d; gains [N] are the error decreases of the former.
    """
    shifted = warp(self.b_matched, np.broadcast_to(d.astype(np.float32), self.flow.shape))
    err = cv2.blur(_absmax(self.a, shifted), (3, 3))
    better = region & (err + MATCH_GAIN < residual)
    already = region & (_absmax(self.flow, d) < 1.0) & (err <= CHANGED)
    return better | already, (residual - err)[better]


def _fit_similarity(flow: np.ndarray, valid: np.ndarray) -> np.ndarray | None:
  """A similarity transform (3x3) fitted with RANSAC to `flow` [H, W, 2] on `valid` pixels."""
  h, w = flow.shape[:2]
  gx, gy = pixel_grid(h, w)
  step = max(1, int(np.sqrt(h * w / 2000)))
  m = valid[::step, ::step]
  src = np.stack([gx[::step, ::step][m], gy[::step, ::step][m]], -1)
  if len(src) < 6:
    return None
  transform, _ = cv2.estimateAffinePartial2D(src, src + flow[::step, ::step][m],
                                             method=cv2.RANSAC, ransacReprojThreshold=1.0)
  return None if transform is None else np.vstack([transform, [0.0, 0.0, 1.0]])


def _changed_regions(residual: np.ndarray) -> list[tuple[tuple[int, int, int, int], np.ndarray]]:
  """Connected regions of changed pixels: [((x0, y0, x1, y1) box, mask [H, W])]."""
  h, w = residual.shape
  n, labels, stats, _ = cv2.connectedComponentsWithStats((residual > CHANGED).astype(np.uint8))
  out = []
  for i in range(1, n):
    x, y, bw, bh, area = stats[i]
    if area >= 3 and bw * bh <= 0.25 * h * w:   # big regions are lighting, not objects
      out.append(((x, y, x + bw, y + bh), labels == i))
  return out


def _find_match(a: np.ndarray, b: np.ndarray, box: tuple[int, int, int, int],
                regions_b: list) -> np.ndarray | None:
  """Displacement (dx, dy) of a's patch `box` (+2 px) to its best unique match near b's regions."""
  h, w = a.shape[:2]
  x0, y0, x1, y1 = max(box[0] - 2, 0), max(box[1] - 2, 0), min(box[2] + 2, w), min(box[3] + 2, h)
  patch = np.ascontiguousarray(a[y0:y1, x0:x1])
  ph, pw = patch.shape[:2]
  if patch.reshape(-1, 3).std(0).max() < 6.0:  # flat: matches anywhere
    return None
  best = None
  for (u0, v0, u1, v1), _ in regions_b:
    wx0, wy0 = max(u0 - pw + 1, 0), max(v0 - ph + 1, 0)   # every placement touching the region
    wx1, wy1 = min(u1 + pw - 1, w), min(v1 + ph - 1, h)
    if wx1 - wx0 < pw or wy1 - wy0 < ph:
      continue
    ssd = cv2.matchTemplate(np.ascontiguousarray(b[wy0:wy1, wx0:wx1]), patch, cv2.TM_SQDIFF)
    ssd /= ph * pw * 3
    low, _, (lx, ly), _ = cv2.minMaxLoc(ssd)
    r = max(2, min(ph, pw) // 2)
    others = ssd.copy()
    others[max(ly - r, 0):ly + r + 1, max(lx - r, 0):lx + r + 1] = np.inf
    if np.isfinite(others).any() and others.min() < UNIQUE * low + 1.0:
      continue
    dx, dy = float(lx), float(ly)   # sub-pixel: parabola through the neighbours
    if 0 < lx < ssd.shape[1] - 1 and (c := ssd[ly, lx - 1] - 2 * low + ssd[ly, lx + 1]) > 0:
      dx += 0.5 * (ssd[ly, lx - 1] - ssd[ly, lx + 1]) / c
    if 0 < ly < ssd.shape[0] - 1 and (c := ssd[ly - 1, lx] - 2 * low + ssd[ly + 1, lx]) > 0:
      dy += 0.5 * (ssd[ly - 1, lx] - ssd[ly + 1, lx]) / c
    if best is None or low < best[0]:
      best = (low, np.float32([wx0 + dx - x0, wy0 + dy - y0]))
  return None if best is None else best[1]


def _match_moved_objects(d0: _Direction, d1: _Direction,
                         hints: Sequence[np.ndarray] = ()) -> list[np.ndarray]:
  """Gives moved objects their (large) displacement in both flows, in place.

  Changed regions of a are template-matched near changed regions of b and vice versa; each
  hint (a displacement, e.g. half of one found between the parent frames of a recursion) is
  tried for every changed region of a too. A displacement d is kept when it explains enough
  pixels on both sides, by a clear margin, and the explained pixels of a, shifted by d, overlap
  those of b (a real move, not a look-alike). Returns the kept displacements.
  """
  h, w = d0.a.shape[:2]
  r0, r1 = cv2.blur(d0.residual(), (3, 3)), cv2.blur(d1.residual(), (3, 3))
  regions0, regions1 = _changed_regions(r0), _changed_regions(r1)
  if not regions0 or not regions1:
    return []
  candidates = []  # (d, region of a, region of b)
  for box, mask in regions0:
    found = _find_match(d0.a, d0.b_matched, box, regions1)
    for d in ([] if found is None else [found]) + list(hints):
      candidates.append((d, _dilate(mask), _dilate(_shift(_dilate(mask), d))))
  for box, mask in regions1:
    if (d := _find_match(d1.a, d1.b_matched, box, regions0)) is not None:
      candidates.append((-d, _dilate(_shift(_dilate(mask), d)), _dilate(mask)))
  accepted = []
  for d, region0, region1 in candidates:
    if _absmax(d0.flow[region0], d).mean() < 2.0:   # already explained
      continue
    s0, gains0 = d0.explained(region0, d, r0)
    s1, gains1 = d1.explained(region1, -d, r1)
    gains = np.concatenate([gains0, gains1])
    if (min(s0.sum(), s1.sum()) < max(4, MATCH_AREA * h * w) or not gains.size
        or gains.mean() < MATCH_MEAN_GAIN):
      continue
    moved = _shift(s0, d)
    if (moved & s1).sum() < MATCH_IOU * (moved | s1).sum():
      continue
    # The object moves whole: fill gaps and holes of the explained pixels and add a 1 px rim.
    s0, s1 = _dilate(_solid(s0)) & region0, _dilate(_solid(s1)) & region1
    accepted.append((gains.sum(), d, s0, s1))
  kept = []
  for _, d, s0, s1 in sorted(accepted, key=lambda c: -c[0]):
    m0 = (s0 | _shift(s1, -d)) & ~d0.matched   # both sides get the pixels the other side maps
    m1 = (s1 | _shift(s0, d)) & ~d1.matched    # onto, so the two flows stay consistent
    if m0.any() or m1.any():
      d0.flow[m0], d1.flow[m1] = d, -d
      d0.matched |= m0
      d1.matched |= m1
      kept.append(d)
  return kept


def consistency(f_ab: np.ndarray, f_ba: np.ndarray) -> np.ndarray:
  """1 where f_ab is forward-backward consistent with f_ba (Sundaram et al. 2010); [H, W]."""
  back = warp(f_ba, f_ab)
  sq = lambda f: f[..., 0] ** 2 + f[..., 1] ** 2
  return (sq(f_ab + back) < 0.01 * (sq(f_ab) + sq(back)) + 0.5).astype(np.float32)


class Motion(NamedTuple):
  """What happens between two frames a and b."""
  f_ab: np.ndarray   # float32 [H, W, 2], flow a -> b
  f_ba: np.ndarray   # float32 [H, W, 2], flow b -> a
  moves: list        # displacements (dx, dy) [2] of the moved objects found, a -> b


def estimate_motion(a: np.ndarray, b: np.ndarray, hints: Sequence[np.ndarray] = ()) -> Motion:
  """Bidirectional flow and illumination change between two float32 RGB images [H, W, 3].

  Args:
    a, b: the images, values in [0, 255].
    hints: displacements (dx, dy) in pixels worth trying for moved objects.

  Returns:
    The `Motion`; flows are estimated at a working size with sides in [WORK_MIN, WORK_MAX]
    and resized to H x W.
  """
  h, w = a.shape[:2]
  scale = 1.0
  if min(h, w) < WORK_MIN:
    scale = WORK_MIN / min(h, w)
  elif max(h, w) > WORK_MAX:
    scale = max(WORK_MAX / max(h, w), 16 / min(h, w))
  if scale != 1.0:
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    interp = cv2.INTER_CUBIC if scale > 1 else cv2.INTER_AREA
    a, b = cv2.resize(a, size, interpolation=interp), cv2.resize(b, size, interpolation=interp)
  d0, d1 = _Direction(a, b), _Direction(b, a)
  # One camera motion for both directions, so that the two camera flows are consistent.
  fits = [t for t in (d0.transform, None if d1.transform is None else np.linalg.inv(d1.transform))
          if t is not None]
  camera = np.mean(fits, axis=0) if fits else np.eye(3)
  d0.set_camera(camera)
  d1.set_camera(np.linalg.inv(camera))
  moves = _match_moved_objects(d0, d1, [np.float32(d) * scale for d in hints])
  for _ in range(4):  # unmatched inconsistent flow (e.g. DIS on a vanished object) -> camera
    bad = [(consistency(p.flow, q.flow) < 0.5) & ~p.matched
           & (_absmax(p.flow, p.camera) > 0.5) for p, q in ((d0, d1), (d1, d0))]
    for p, m in zip((d0, d1), bad):
      p.flow[m] = p.camera[m]
    if not any(m.any() for m in bad):
      break
  return Motion(_resize_flow(d0.flow, h, w), _resize_flow(d1.flow, h, w),
                [d / scale for d in moves])


def _resize_flow(flow: np.ndarray, h: int, w: int) -> np.ndarray:
  fh, fw = flow.shape[:2]
  if (fh, fw) == (h, w):
    return flow
  out = cv2.resize(flow, (w, h), interpolation=cv2.INTER_AREA if h < fh else cv2.INTER_LINEAR)
  return out * np.float32([w / fw, h / fh])
