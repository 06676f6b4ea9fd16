"""Tests for procap_jax.data.images: decoding, mode conversion, resizing, clear errors."""

import io
import os
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


def test_unreadable_file_is_one_sentence(tmp_path, monkeypatch, fault):
  path = tmp_path / 'locked.png'
  path.write_bytes(_PNG)
  path.chmod(0)
  if os.access(path, os.R_OK):
    # root reads a mode-000 file, so the permission error is raised where the file is opened
    real_open = open

    def denying_open(name, *args, **kwargs):
      if os.fspath(name) == os.fspath(path):
        raise PermissionError(13, 'Permission denied', os.fspath(name))
      return real_open(name, *args, **kwargs)

    monkeypatch.setattr('builtins.open', denying_open)
  with pytest.raises(errors.UserError, match=r'cannot read image file \S*locked.png: Permission '
                     'denied') as e:
    images.load_image(path)
  fault('image loading (caption command, builders)', 'an image file without read permission',
        str(e.value))


def test_truncated_and_not_an_image(tmp_path):
  path = tmp_path / 'cut.png'
  path.write_bytes(_PNG[:len(_PNG) // 2])
  with pytest.raises(errors.UserError, match=r'image \S*cut.png is truncated: a PNG file cut '
                     f'short after {len(_PNG) // 2} bytes'):
    images.load_image(path)
  with pytest.raises(errors.UserError, match='is truncated: a JPEG file'):
    images.load_image(_JPEG[:len(_JPEG) - 200])
  with pytest.raises(errors.UserError, match='not an image'):
    images.load_image(b'%!PS-Adobe-3.0 EPSF-3.0\n')


@pytest.mark.parametrize('data', [_PNG, images.encode_png(_rgb(300, 200))], ids=['small', 'large'])
def test_first_200_bytes_of_a_png_are_named_truncated(data):
  with pytest.raises(errors.UserError) as info:
    images.load_image(data[:200], name='before.png')
  assert str(info.value).startswith('image before.png is truncated: a PNG file cut short after '
                                    '200 bytes')


def test_first_200_bytes_of_a_real_clevr_png_are_named_truncated(fixtures_dir):
  """PIL cannot even read this file's header (it was 'not an image in a supported format')."""
  data = (fixtures_dir / 'clevr_change' / 'images' / 'CLEVR_default_000000.png').read_bytes()
  with pytest.raises(errors.UserError, match='is truncated: a PNG file cut short after 200'):
    images.load_image(data[:200], name='CLEVR_default_000000.png')


def test_complete_but_damaged_png_is_named_corrupt():
  start = _PNG.index(b'IDAT') + 4
  damaged = _PNG[:start] + bytes(64) + _PNG[start + 64:]  # IEND still there
  with pytest.raises(errors.UserError, match='is a corrupt PNG file'):
    images.load_image(damaged)


def _png16_rgb(width: int, height: int) -> bytes:
  """A 16-bit RGB PNG (PIL writes none: it reads them as 8-bit 'RGB')."""
  def chunk(kind: bytes, body: bytes) -> bytes:
    crc = struct.pack('>I', zlib.crc32(kind + body) & 0xFFFFFFFF)
    return struct.pack('>I', len(body)) + kind + body + crc
  rows = b''.join(b'\x00' + np.full((width, 3), 40000, '>u2').tobytes() for _ in range(height))
  return (b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', width, height, 16, 2,
                                                               0, 0, 0))
          + chunk(b'IDAT', zlib.compress(rows)) + chunk(b'IEND', b''))


def _transparent_rgba() -> PIL.Image.Image:
  a = np.full((20, 20, 4), 200, np.uint8)
  a[0, 0, 3] = 0
  return PIL.Image.fromarray(a, 'RGBA')


_NOTICES = [
    ('rgb', lambda: _encode(PIL.Image.fromarray(_rgb(20, 20))), None),
    ('16-bit grey', lambda: _encode(PIL.Image.fromarray(np.full((20, 20), 9000, np.uint16))),
     '16-bit grayscale, converted to 8-bit RGB'),
    ('16-bit rgb', lambda: _png16_rgb(20, 20), '16-bit RGB, converted to 8-bit RGB'),
    ('grey', lambda: _encode(PIL.Image.fromarray(_rgb(20, 20)).convert('L')),
     'grayscale, converted to 8-bit RGB'),
    ('palette', lambda: _encode(PIL.Image.fromarray(_rgb(20, 20)).convert('P')),
     'palette, converted to 8-bit RGB'),
    ('alpha', lambda: _encode(_transparent_rgba()),
     'RGB with alpha, converted to 8-bit RGB; its transparent pixels keep their stored colour'),
    ('opaque alpha', lambda: _encode(PIL.Image.fromarray(_rgb(20, 20)).convert('RGBA')), None),
    ('tiny', lambda: _encode(PIL.Image.fromarray(_rgb(8, 40))),
     'only 40 x 8 px (under 16 px on a side): too few pixels for a reliable caption'),
    ('tiny grey', lambda: _encode(PIL.Image.fromarray(_rgb(5, 5)).convert('L')),
     'grayscale, converted to 8-bit RGB; only 5 x 5 px (under 16 px on a side)'),
]


@pytest.mark.parametrize('what,make,expected', _NOTICES, ids=[n[0] for n in _NOTICES])
def test_conversions_give_one_notice_line(what, make, expected):
  del what
  lines = []
  out = images.load_image(make(), 32, name='before.png', notify=lines.append)
  assert out.shape == (32, 32, 3) and out.dtype == np.uint8
  if expected is None:
    assert lines == []
  else:
    assert len(lines) == 1 and lines[0].startswith(f'before.png: {expected}'), lines
  images.load_image(make(), 32, name='before.png')  # silent without notify


def test_small_for_the_model_input_notice():
  lines = []
  images.load_image(_encode(PIL.Image.fromarray(_rgb(30, 30))), name='b.png', notify=lines.append,
                    model_size=128)
  assert lines == ["b.png: only 30 x 30 px (under a quarter of the model's 128 x 128 input): too "
                   'few pixels for a reliable caption']
  lines.clear()
  images.load_image(_encode(PIL.Image.fromarray(_rgb(30, 30))), 64, notify=lines.append)
  assert lines == []


def test_from_image_arrays_and_pil():
  rgb = _rgb(20, 20)
  np.testing.assert_array_equal(images.from_image(rgb), rgb)
  pil = PIL.Image.fromarray(rgb).convert('L')
  lines = []
  np.testing.assert_array_equal(images.from_image(pil, 8, name='x', notify=lines.append),
                                images.load_image(_encode(pil), 8))
  assert lines == ['x: grayscale, converted to 8-bit RGB']
  np.testing.assert_array_equal(images.from_image(rgb[..., 0])[..., 2], rgb[..., 0])
  rgba = np.concatenate([rgb, np.full((20, 20, 1), 255, np.uint8)], -1)
  np.testing.assert_array_equal(images.from_image(rgba), rgb)
  for bad in (rgb.astype(np.float32), np.zeros((4, 4, 2), np.uint8), 'not an image'):
    with pytest.raises(errors.UserError, match='pass'):
      images.from_image(bad, name='after')


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
