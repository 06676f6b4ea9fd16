"""Tests of procap_jax.procedure.interpolation (and the flow engine behind `flow`)."""

import numpy as np
import PIL.Image
import pytest

from procap_jax.procedure import flow
from procap_jax.procedure import interpolation

METHODS = ('flow', 'flow_direct', 'crossfade')


def _square_pair(size=64, side=8, x0=8, x1=24, y=28):
  """A white side x side square on black at column x0 (before) and x1 (after)."""
  before = np.zeros((size, size, 3), np.uint8)
  after = np.zeros((size, size, 3), np.uint8)
  before[y:y + side, x0:x0 + side] = 255
  after[y:y + side, x1:x1 + side] = 255
  return before, after


def _scene(h=29, w=37, seed=0):
  """A small coloured scene: a grey gradient floor and three coloured blocks."""
  rng = np.random.default_rng(seed)
  img = np.zeros((h, w, 3), np.float32) + np.linspace(90, 150, h)[:, None, None]
  for _ in range(3):
    y, x = rng.integers(0, h - 6), rng.integers(0, w - 6)
    img[y:y + 5, x:x + 5] = rng.integers(0, 256, 3)
  return img.astype(np.uint8)


def _bright_centroid_x(frame: np.ndarray, threshold: int = 190):
  """(x centroid, count) of the pixels brighter than threshold in channel 0."""
  ys, xs = np.nonzero(frame[..., 0] > threshold)
  return (xs.mean() if xs.size else None), xs.size


@pytest.mark.parametrize('method', METHODS)
def test_shape_dtype_range_and_endpoints(method):
  before, after = _scene(seed=1), _scene(seed=2)
  frames = interpolation.interpolate(before, after, num_frames=9, method=method)
  assert frames.shape == (9, 29, 37, 3)
  assert frames.dtype == np.uint8
  np.testing.assert_array_equal(frames[0], before)
  np.testing.assert_array_equal(frames[-1], after)


@pytest.mark.parametrize('method', METHODS)
def test_identical_images_give_identical_frames(method):
  image = _scene(seed=3)
  frames = interpolation.interpolate(image, image.copy(), method=method)
  for f in frames:
    np.testing.assert_array_equal(f, image)


@pytest.mark.parametrize('num_frames', [2, 3, 5, 17])
def test_other_lengths(num_frames):
  before, after = _square_pair(size=32, side=6, x0=4, x1=16)
  frames = interpolation.interpolate(before, after, num_frames=num_frames)
  assert frames.shape == (num_frames, 32, 32, 3)


@pytest.mark.parametrize('num_frames', [0, 1, 4, 6, 8, 10, True, 9.0])
def test_bad_num_frames(num_frames):
  image = _scene()
  with pytest.raises(ValueError, match='2\\^L \\+ 1'):
    interpolation.interpolate(image, image, num_frames=num_frames)


def test_oracle_and_unknown_methods_raise():
  image = _scene()
  with pytest.raises(ValueError, match='oracle_frames'):
    interpolation.interpolate(image, image, method='oracle')
  with pytest.raises(ValueError, match='unknown interpolation method'):
    interpolation.interpolate(image, image, method='vfiformer')


def test_crossfade_values():
  before = np.zeros((3, 5, 3), np.uint8)
  after = np.full((3, 5, 3), 200, np.uint8)
  frames = interpolation.interpolate(before, after, num_frames=5, method='crossfade')
  np.testing.assert_array_equal(frames[:, 0, 0, 0], [0, 50, 100, 150, 200])


def test_conversions_grey_rgba_float_and_size():
  rgb = _scene(h=20, w=24, seed=4)
  grey = rgb[..., 0]
  rgba = np.concatenate([rgb, np.full((20, 24, 1), 7, np.uint8)], -1)
  # 2-D grey and [H, W, 1] become three equal channels; alpha is dropped.
  for before in (grey, grey[..., None]):
    frames = interpolation.interpolate(before, rgba, method='crossfade')
    assert frames.shape == (9, 20, 24, 3)
    np.testing.assert_array_equal(frames[0], np.stack([grey] * 3, -1))
    np.testing.assert_array_equal(frames[-1], rgb)
  # Floats in [0, 1] are scaled by 255.
  frames = interpolation.interpolate(rgb / 255.0, rgb, method='crossfade')
  np.testing.assert_array_equal(frames[0], rgb)
  # `after` takes `before`'s size; `size` resizes both to a square.
  big_after = np.asarray(PIL.Image.fromarray(rgb).resize((48, 40)))
  assert interpolation.interpolate(rgb, big_after).shape == (9, 20, 24, 3)
  frames = interpolation.interpolate(rgb, big_after, size=16, method='flow')
  assert frames.shape == (9, 16, 16, 3)
  np.testing.assert_array_equal(frames[0], interpolation.resize(rgb, 16, 16))
  with pytest.raises(ValueError):
    interpolation.interpolate(rgb, rgb, size=0)
  with pytest.raises(ValueError, match='shape'):
    interpolation.interpolate(np.zeros((4, 4, 2), np.uint8), rgb)


def test_flow_places_a_moved_square_at_the_midpoint_and_crossfade_does_not():
  before, after = _square_pair()   # left edge 8 -> 24: at t = 1/2 the left edge is at 16
  mid_x = 16 + 3.5                 # centroid of an 8 px square whose left edge is at 16
  for method in ('flow', 'flow_direct'):
    frames = interpolation.interpolate(before, after, method=method)
    x, count = _bright_centroid_x(frames[4])
    assert x is not None and abs(x - mid_x) <= 2.0, (method, x)
    assert 32 <= count <= 96, (method, count)   # one whole square, not two halves
    # Every frame shows one square moving left to right at constant speed.
    xs = [_bright_centroid_x(f)[0] for f in frames]
    assert all(x is not None for x in xs), (method, xs)
    np.testing.assert_allclose(xs, 11.5 + 2.0 * np.arange(9), atol=2.0)
  crossfade = interpolation.interpolate(before, after, method='crossfade')
  assert _bright_centroid_x(crossfade[4])[1] == 0  # two half-bright ghosts, no square


def test_flow_follows_a_camera_shift():
  rng = np.random.default_rng(0)
  texture = PIL.Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).resize(
      (80, 80), PIL.Image.Resampling.BICUBIC)
  texture = np.asarray(texture)
  before, truth, after = texture[8:72, 8:72], texture[8:72, 10:74], texture[8:72, 12:76]

  def psnr(x, y):
    mse = np.mean((x.astype(float) - y.astype(float)) ** 2)
    return 10 * np.log10(255.0 ** 2 / max(mse, 1e-10))

  flow_mid = interpolation.interpolate(before, after, num_frames=3)[1]
  fade_mid = interpolation.interpolate(before, after, num_frames=3, method='crossfade')[1]
  inner = np.s_[4:-4, 4:-4]
  assert psnr(flow_mid[inner], truth[inner]) > 30.0
  assert psnr(flow_mid[inner], truth[inner]) > psnr(fade_mid[inner], truth[inner]) + 5.0


def test_estimate_motion_finds_the_move_in_both_directions():
  before, after = (x.astype(np.float32) for x in _square_pair())
  motion = flow.estimate_motion(before, after)
  np.testing.assert_allclose(motion.f_ab[31, 11], [16.0, 0.0], atol=0.5)
  np.testing.assert_allclose(motion.f_ba[31, 27], [-16.0, 0.0], atol=0.5)
  assert len(motion.moves) == 1


def test_recursive_bisection_order():
  calls = []

  def midpoint(a, b):
    calls.append((a[0, 0, 0], b[0, 0, 0]))
    return (a + b) / 2

  method = interpolation.recursive(midpoint)
  before = np.zeros((2, 2, 3), np.float32)
  after = np.full((2, 2, 3), 64.0, np.float32)
  frames = method(before, after, 9)
  np.testing.assert_array_equal(frames[:, 0, 0, 0], np.arange(9) * 8.0)
  assert calls[:3] == [(0.0, 64.0), (0.0, 32.0), (32.0, 64.0)]   # frame 4, then 2 and 6
  assert len(calls) == 7


def test_real_clevr_pair(fixtures_dir):
  root = fixtures_dir / 'clevr_change'
  before = np.asarray(PIL.Image.open(root / 'images' / 'CLEVR_default_000000.png').convert('RGB'))
  after = PIL.Image.open(root / 'sc_images' / 'CLEVR_semantic_000000.png').convert('RGBA')
  after = np.asarray(after)
  frames = interpolation.interpolate(before, after, size=64)
  assert frames.shape == (9, 64, 64, 3) and frames.dtype == np.uint8
  np.testing.assert_array_equal(frames[0], interpolation.resize(before, 64, 64))
  # The middle frame lies between the endpoints: closer to each than they are to each other.
  d = lambda x, y: np.abs(x.astype(float) - y.astype(float)).mean()
  assert d(frames[4], frames[0]) < d(frames[0], frames[-1])
  assert d(frames[4], frames[-1]) < d(frames[0], frames[-1])
