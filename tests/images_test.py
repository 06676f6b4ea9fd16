"""Tests for procap_jax.data.images: decoding, mode conversion, resizing, clear errors."""

import io
import struct
import zlib

import hypothesis
from hypothesis import strategies as st
import numpy as np
import PIL.Image
import pytest

from procap_jax import errors
from procap_jax.data import images


def _encode(img: PIL.Image.Image, fmt: str = 'PNG', **kwargs) -> bytes:
  buf = io.BytesIO()
  img.save(buf, format=fmt, **kwargs)
  return buf.getvalue()


def _rgb(h: int = 13, w: int = 7, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


_PNG = _encode(PIL.Image.fromarray(_rgb(23, 17)))
_JPEG = _encode(PIL.Image.fromarray(_rgb(23, 17)), 'JPEG', quality=90)


def _patch_ihdr(png: bytes, width: int, height: int) -> bytes:
  """Rewrites the IHDR width/height of a PNG and fixes its CRC (no pixels allocated)."""
  assert png[12:16] == b'IHDR'
  body = struct.pack('>II', width, height) + png[24:29]
  crc = struct.pack('>I', zlib.crc32(b'IHDR' + body) & 0xFFFFFFFF)
  return png[:16] + body + crc + png[33:]


def _check_valid_or_user_error(data: bytes, size=None) -> None:
  try:
    out = images.load_image(data, size=size)
  except errors.UserError as e:
    assert str(e)
    return
  assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[-1] == 3
  assert out.shape[0] > 0 and out.shape[1] > 0
  if size is not None:
    assert out.shape == (size, size, 3)


def test_png_roundtrip_path_and_bytes(tmp_path):
  a = _rgb()
  path = tmp_path / 'x.png'
  path.write_bytes(images.encode_png(a))
  np.testing.assert_array_equal(images.load_image(path), a)
  np.testing.assert_array_equal(images.load_image(str(path)), a)
  np.testing.assert_array_equal(images.load_image(path.read_bytes()), a)


def test_encode_png_rejects_bad_arrays():
  with pytest.raises(ValueError):
    images.encode_png(np.zeros((4, 4, 3), np.float32))
  with pytest.raises(ValueError):
    images.encode_png(np.zeros((4, 4, 2), np.uint8))


def test_alpha_is_dropped_not_composited():
  rgba = np.zeros((5, 6, 4), np.uint8)
  rgba[..., 0], rgba[..., 1], rgba[..., 2], rgba[..., 3] = 200, 100, 50, 0
  out = images.load_image(_encode(PIL.Image.fromarray(rgba, 'RGBA')))
  np.testing.assert_array_equal(out, np.broadcast_to([200, 100, 50], (5, 6, 3)))
  la = PIL.Image.fromarray(np.stack([np.full((3, 4), 77, np.uint8),
                                     np.zeros((3, 4), np.uint8)], -1), 'LA')
  np.testing.assert_array_equal(images.load_image(_encode(la)), np.full((3, 4, 3), 77))


@pytest.mark.parametrize('mode', ['L', '1', 'P', 'CMYK'])
def test_modes_convert_to_rgb(mode):
  base = PIL.Image.fromarray(_rgb(9, 11))
  img = base.convert(mode)
  fmt = 'JPEG' if mode == 'CMYK' else 'PNG'
  out = images.load_image(_encode(img, fmt))
  assert out.shape == (9, 11, 3) and out.dtype == np.uint8
  if mode != 'CMYK':
    np.testing.assert_array_equal(out, np.asarray(img.convert('RGB')))


def test_palette_with_transparency():
  img = PIL.Image.new('P', (4, 3), 1)
  img.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
  img.info['transparency'] = 1
  out = images.load_image(_encode(img, transparency=1))
  np.testing.assert_array_equal(out, np.broadcast_to([10, 20, 30], (3, 4, 3)))


def test_sixteen_bit_grey_is_rescaled():
  a = np.array([[0, 257 * 128], [65535, 257]], np.uint16)
  out = images.load_image(_encode(PIL.Image.fromarray(a)))
  np.testing.assert_array_equal(out[..., 0], [[0, 128], [255, 1]])
  np.testing.assert_array_equal(out[..., 0], out[..., 2])


def test_32_bit_int_mode():
  small = PIL.Image.fromarray(np.array([[0, 100], [255, 7]], np.int32), 'I')
  np.testing.assert_array_equal(images.load_image(_encode(small, 'TIFF'))[..., 0],
                                [[0, 100], [255, 7]])  # already 8-bit values: kept
  wide = PIL.Image.fromarray(np.array([[0, 65535]], np.int32), 'I')
  np.testing.assert_array_equal(images.load_image(_encode(wide, 'TIFF'))[..., 0], [[0, 255]])


def test_float_mode():
  img = PIL.Image.fromarray(np.array([[0.0, 0.5], [1.0, 0.25]], np.float32), 'F')
  out = images.load_image(_encode(img, 'TIFF'))
  np.testing.assert_array_equal(out[..., 1], [[0, 128], [255, 64]])


def test_gif_first_frame():
  frames = [PIL.Image.fromarray(np.full((5, 5, 3), v, np.uint8)) for v in (10, 240)]
  buf = io.BytesIO()
  frames[0].save(buf, format='GIF', save_all=True, append_images=frames[1:])
  out = images.load_image(buf.getvalue())
  assert out.shape == (5, 5, 3) and abs(int(out[0, 0, 0]) - 10) <= 2


def test_resize_is_square_bilinear_antialiased():
  a = np.zeros((40, 60, 3), np.uint8)
  a[:, ::2] = 255  # one-pixel stripes: antialiasing averages them to grey
  out = images.load_image(images.encode_png(a), size=10)
  assert out.shape == (10, 10, 3)
  assert 100 < out.mean() < 155 and out.std() < 20
  same = images.load_image(images.encode_png(a), size=None)
  np.testing.assert_array_equal(same, a)
  with pytest.raises(ValueError):
    images.load_image(_PNG, size=0)


def test_missing_empty_directory(tmp_path):
  with pytest.raises(errors.UserError, match='does not exist'):
    images.load_image(tmp_path / 'nope.png')
  empty = tmp_path / 'empty.png'
  empty.write_bytes(b'')
  with pytest.raises(errors.UserError, match=r'empty.png is empty'):
    images.load_image(empty)
  with pytest.raises(errors.UserError, match='is a directory'):
    images.load_image(tmp_path)
  with pytest.raises(errors.UserError, match='empty'):
    images.load_image(b'')


def test_truncated_and_not_an_image(tmp_path):
  path = tmp_path / 'cut.png'
  path.write_bytes(_PNG[:len(_PNG) // 2])
  with pytest.raises(errors.UserError, match='cut.png cannot be decoded'):
    images.load_image(path)
  with pytest.raises(errors.UserError, match='cannot be decoded'):
    images.load_image(_JPEG[:len(_JPEG) - 200])
  with pytest.raises(errors.UserError, match='not an image'):
    images.load_image(b'%!PS-Adobe-3.0 EPSF-3.0\n')


def test_huge_image_refused_from_header():
  huge = _patch_ihdr(_PNG, 20000, 20000)
  with pytest.raises(errors.UserError, match='megapixels'):
    images.load_image(huge, name='huge.png')
  between = _patch_ihdr(_PNG, 11000, 10000)  # 110 MP: above our limit, below PIL's error
  with pytest.raises(errors.UserError, match='megapixels'):
    images.load_image(between)


def test_zero_width_image():
  with pytest.raises(errors.UserError):
    images.load_image(_patch_ihdr(_PNG, 0, 17), name='flat.png')


def test_message_names_the_file(tmp_path):
  path = tmp_path / 'holiday photo.jpg'
  path.write_bytes(b'not a jpeg at all')
  with pytest.raises(errors.UserError) as info:
    images.load_image(path)
  assert 'holiday photo.jpg' in str(info.value)
  assert '\n' not in str(info.value)


_SETTINGS = hypothesis.settings(max_examples=150, deadline=None, derandomize=True,
                                suppress_health_check=[hypothesis.HealthCheck.too_slow])


@_SETTINGS
@hypothesis.given(st.binary(max_size=600))
def test_random_bytes_never_crash(data):
  _check_valid_or_user_error(data)


@_SETTINGS
@hypothesis.given(st.sampled_from([_PNG, _JPEG]), st.integers(0, 10_000), st.booleans())
def test_random_truncations_never_crash(data, cut, resize):
  _check_valid_or_user_error(data[:cut % (len(data) + 1)], size=8 if resize else None)


@_SETTINGS
@hypothesis.given(st.sampled_from([_PNG, _JPEG]), st.lists(
    st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8))
def test_random_corruptions_never_crash(data, flips):
  b = bytearray(data)
  for pos, value in flips:
    b[pos % len(b)] = value
  _check_valid_or_user_error(bytes(b))


@_SETTINGS
@hypothesis.given(st.sampled_from([_PNG, _JPEG]), st.integers(0, 2**31 - 1),
                  st.integers(0, 2**31 - 1))
def test_random_header_sizes_never_crash(data, width, height):
  if data is _PNG:
    data = _patch_ihdr(data, width, height)
  _check_valid_or_user_error(data)
