"""Decoding and resizing user and dataset images, with clear errors.

Every image that enters procap-jax (dataset builders, the captioning CLI) goes through
`load_image`, so a missing, empty, corrupt, truncated or absurdly large file gives one
`UserError` sentence naming the file, never a PIL traceback. A file whose first bytes are those
of a PNG, JPEG, GIF, BMP, TIFF or WebP file but which lacks its end is named as truncated.

Images the model cannot use as they are get converted; with `notify=` (the caption command and
`procap_jax.caption.Captioner` pass one) each such image gets one line saying what was done, e.g.
`before.png: 16-bit grayscale, converted to 8-bit RGB`: every mode other than 8-bit RGB (an alpha
channel only when some pixel is not opaque: an opaque one loses nothing, as in CLEVR's renders),
16-bit RGB PNGs, and images under `MIN_SIDE` px on a side or under a quarter of the model's input
side (`model_size=`), which give the model too few pixels to see much.

Conversions to RGB (uint8 [H, W, 3]):
  * L, 1, P, CMYK, YCbCr, LAB, RGBX: PIL's own conversion.
  * RGBA, LA, PA, P with transparency: the alpha channel is DROPPED (colour kept as stored, not
    composited on a background). This matches the original PyTorch code (`.convert('RGB')`)
    and CLEVR's renders, whose alpha is fully opaque.
  * I;16 (16-bit grey): rescaled 0..65535 -> 0..255; I (32-bit int): the same when a value
    exceeds 255, else kept; F (float): values in [0, 1] are scaled by 255, else clipped.
  * Multi-frame files (GIF, APNG, TIFF): the first frame. EXIF orientation is not applied
    (the original pipelines do not apply it either).

Formats: the raster formats in `FORMATS`; others (EPS, PDF, ...) are refused as not images.

Size limit: images above `MAX_PIXELS` (100 megapixels) are refused from their header, before
any pixel is decoded; PIL's own decompression-bomb limit is set to the same value.
"""

import io
import os
from typing import Callable
import warnings

import numpy as np
import PIL
import PIL.Image

from procap_jax import errors

MAX_PIXELS = 100_000_000
PIL.Image.MAX_IMAGE_PIXELS = MAX_PIXELS
PIL.Image.init()  # Registers every plugin, so `formats=` below can name all of FORMATS.

# Raster formats only (JPEG includes MPO): EPS would start Ghostscript, and so on.
FORMATS = ('PNG', 'JPEG', 'GIF', 'BMP', 'DIB', 'TIFF', 'WEBP', 'PPM', 'TGA', 'ICO')
_ALPHA_MODES = ('RGBA', 'RGBa', 'LA', 'La', 'PA')
MIN_SIDE = 16  # images with a side below this many pixels get a notice (see `load_image`)

# How a file of each format starts, and (where the format has one) how a complete file ends:
# data with a known start but without its end was cut short.
_SIGNATURES = (
    ('PNG', (b'\x89PNG\r\n\x1a\n',), b'IEND\xaeB`\x82'),
    ('JPEG', (b'\xff\xd8\xff',), b'\xff\xd9'),
    ('GIF', (b'GIF87a', b'GIF89a'), b';'),
    ('BMP', (b'BM',), None),
    ('TIFF', (b'II*\x00', b'MM\x00*'), None),
    ('WEBP', (b'RIFF',), None),
)
# What each PIL mode is called in a notice.
_MODE_NAMES = {
    'L': 'grayscale', '1': '1-bit black and white', 'P': 'palette', 'PA': 'palette with alpha',
    'LA': 'grayscale with alpha', 'La': 'grayscale with alpha', 'RGBA': 'RGB with alpha',
    'RGBa': 'RGB with alpha', 'RGBX': 'RGBX', 'CMYK': 'CMYK', 'YCbCr': 'YCbCr', 'LAB': 'Lab',
    'HSV': 'HSV', 'I': '32-bit integer grayscale', 'F': '32-bit float grayscale',
}


def _describe(src, name: str | None) -> str:
  if name:
    return str(name)
  if isinstance(src, (bytes, bytearray, memoryview)):
    return f'data ({len(src)} bytes)'
  return os.fspath(src)


def _read_bytes(src, what: str) -> bytes:
  """Returns the encoded bytes of `src` (a path or bytes); UserError on a bad file."""
  if isinstance(src, (bytes, bytearray, memoryview)):
    data = bytes(src)
  else:
    path = os.fspath(src)
    if not os.path.exists(path):
      raise errors.UserError(f'image file {what} does not exist; check the path')
    if os.path.isdir(path):
      raise errors.UserError(f'image path {what} is a directory, not an image file')
    try:
      with open(path, 'rb') as f:
        data = f.read()
    except OSError as e:
      raise errors.UserError(f'cannot read image file {what}: {e.strerror}') from None
  if not data:
    raise errors.UserError(f'image {what} is empty (0 bytes); replace it with a valid image')
  return data


def _to_rgb(img: PIL.Image.Image) -> PIL.Image.Image:
  """Converts any PIL mode to RGB (see the module docstring for the rules)."""
  mode = img.mode
  if mode == 'RGB':
    return img
  if mode in _ALPHA_MODES or (mode == 'P' and 'transparency' in img.info):
    return img.convert('RGBA').convert('RGB')
  if mode.startswith('I;16') or mode == 'I':
    a = np.asarray(img, dtype=np.float64)
    if mode != 'I' or (a.size and a.max() > 255):
      a = a / 257.0
    grey = np.clip(np.rint(a), 0, 255).astype(np.uint8)
    return PIL.Image.fromarray(np.stack([grey] * 3, axis=-1))
  if mode == 'F':
    a = np.nan_to_num(np.asarray(img, dtype=np.float64))
    if a.size and a.min() >= 0.0 and a.max() <= 1.0:
      a = a * 255.0
    grey = np.clip(np.rint(a), 0, 255).astype(np.uint8)
    return PIL.Image.fromarray(np.stack([grey] * 3, axis=-1))
  return img.convert('RGB')


def _sniff(data: bytes) -> tuple[str, bool | None] | None:
  """(format, complete) when `data` starts like a known format, else None. `complete` is
  whether the format's end marker is there (None for formats without one; WebP and BMP state
  their length, checked instead)."""
  for fmt, starts, end in _SIGNATURES:
    if any(data.startswith(start) for start in starts):
      if fmt == 'WEBP':
        if data[8:12] != b'WEBP':
          return None
        return fmt, len(data) >= 8 + int.from_bytes(data[4:8], 'little')
      if fmt == 'BMP':
        return fmt, len(data) >= int.from_bytes(data[2:6], 'little') if len(data) >= 6 else False
      if fmt == 'PNG':  # bytes after IEND are ignored by decoders
        return fmt, end in data
      return fmt, (data.rstrip(b'\x00').endswith(end) if end else None)
  return None


def _decode_failure(what: str, data: bytes, e: Exception) -> errors.UserError:
  """The one sentence for data PIL could not decode: truncated, corrupt or not an image."""
  sniffed = _sniff(data)
  detail = ' '.join(str(e).split())[:120]
  if sniffed is not None:
    fmt, complete = sniffed
    if complete is False:
      return errors.UserError(
          f'image {what} is truncated: a {fmt} file cut short after {len(data)} bytes (its end '
          'is missing); copy or download the whole file again')
    return errors.UserError(f'image {what} is a corrupt {fmt} file ({type(e).__name__}: '
                            f'{detail}); replace it with a valid image')
  if isinstance(e, PIL.UnidentifiedImageError):
    return errors.UserError(f'{what} is not an image in a supported format '
                            f'({", ".join(FORMATS)}); check the file')
  return errors.UserError(f'image {what} cannot be decoded ({type(e).__name__}: {detail}); '
                          'the file is corrupt or truncated')


def _png_bit_depth(data: bytes) -> int | None:
  """The bit depth in a PNG's IHDR (PIL reads 16-bit RGB as 8-bit 'RGB' without saying so)."""
  if data.startswith(b'\x89PNG\r\n\x1a\n') and data[12:16] == b'IHDR' and len(data) > 24:
    return data[24]
  return None


def conversion_notice(img: PIL.Image.Image, *, bit_depth: int | None = None) -> str | None:
  """What `_to_rgb` does to `img`, as the words of a notice, or None when it loses nothing.

  Args:
    img: a decoded PIL image.
    bit_depth: the bit depth the file states (a 16-bit RGB PNG arrives in mode 'RGB').
  """
  mode = img.mode
  if mode.startswith('I;16'):
    return '16-bit grayscale, converted to 8-bit RGB'
  if mode == 'RGB':
    return '16-bit RGB, converted to 8-bit RGB' if bit_depth == 16 else None
  alpha = mode in _ALPHA_MODES or (mode == 'P' and 'transparency' in img.info)
  if mode in ('RGBA', 'RGBa') and img.getchannel('A').getextrema()[0] == 255:
    return None  # opaque alpha (CLEVR's renders): dropping it loses nothing
  name = _MODE_NAMES.get(mode, mode)
  if mode == 'P' and alpha:
    name = 'palette with transparency'
  if bit_depth == 16 and mode in ('RGBA', 'LA'):
    name = f'16-bit {name}'
  dropped = '; its transparent pixels keep their stored colour' if alpha else ''
  return f'{name}, converted to 8-bit RGB{dropped}'


def size_notice(width: int, height: int, model_size: int | None) -> str | None:
  """Words for an image too small for the model to see much (None when it is not)."""
  if min(width, height) < MIN_SIDE:
    reason = f'under {MIN_SIDE} px on a side'
  elif model_size and max(width, height) * 4 <= model_size:
    reason = f'under a quarter of the model\'s {model_size} x {model_size} input'
  else:
    return None
  return f'only {width} x {height} px ({reason}): too few pixels for a reliable caption'


def load_image(src: str | os.PathLike | bytes, size: int | None = None, *,
               name: str | None = None, notify: Callable[[str], None] | None = None,
               model_size: int | None = None) -> np.ndarray:
  """Reads an image file or encoded bytes into an RGB uint8 array.

  Args:
    src: a path, or encoded image bytes (PNG, JPEG, GIF, BMP, TIFF, WebP: anything PIL reads).
    size: if given, the image is resized to `size` x `size` (bilinear, antialiased, aspect
      ratio not kept, as the original 224 x 224 resize).
    name: how to call the image in error messages (default: the path, or "data (N bytes)").
    notify: called with one line `<name>: <what was done>` when the image is converted from
      another mode or bit depth, or is too small (see the module docstring); None: silent.
    model_size: the model's input side, for the too-small notice (default: `size`).

  Returns:
    uint8 [H, W, 3] (or [size, size, 3]).

  Raises:
    UserError: the file is missing, empty, not an image, truncated, corrupt, has a zero
      dimension, or is larger than `MAX_PIXELS`.
    ValueError: `size` is not a positive integer (a programming error).
  """
  if size is not None and (isinstance(size, bool) or not isinstance(size, (int, np.integer))
                           or size <= 0):
    raise ValueError(f'size must be a positive integer or None, got {size!r}')
  what = _describe(src, name)
  data = _read_bytes(src, what)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter('error', PIL.Image.DecompressionBombWarning)
      img = PIL.Image.open(io.BytesIO(data), formats=FORMATS)
      width, height = img.size
      if width <= 0 or height <= 0:
        raise errors.UserError(f'image {what} has a zero dimension ({width}x{height}); '
                               'replace it with a valid image')
      if width * height > MAX_PIXELS:
        raise errors.UserError(
            f'image {what} is {width}x{height} pixels, above the limit of '
            f'{MAX_PIXELS // 1_000_000} megapixels; downscale it first')
      img.load()  # Forces a full decode: truncated or corrupt data fails here.
      out = _finish(img, what, size, notify, model_size, _png_bit_depth(data))
  except errors.UserError:
    raise
  except (PIL.Image.DecompressionBombWarning, PIL.Image.DecompressionBombError):
    raise errors.UserError(f'image {what} is larger than the limit of '
                           f'{MAX_PIXELS // 1_000_000} megapixels; downscale it first') from None
  except MemoryError:
    raise errors.UserError(f'image {what} is too large to decode in memory; '
                           'downscale it first') from None
  except Exception as e:  # noqa: BLE001  PIL's decoders raise many types on bad data.
    raise _decode_failure(what, data, e) from None
  if out.ndim != 3 or out.shape[-1] != 3 or out.shape[0] == 0 or out.shape[1] == 0:
    raise errors.UserError(f'image {what} decodes to an unusable shape {out.shape}; '
                           'replace it with a valid image')
  return np.ascontiguousarray(out)


def _finish(img: PIL.Image.Image, what: str, size: int | None,
            notify: Callable[[str], None] | None, model_size: int | None,
            bit_depth: int | None = None) -> np.ndarray:
  """A decoded image -> RGB uint8 (resized when `size`), with its notice when `notify`."""
  if notify is not None:
    notes = [conversion_notice(img, bit_depth=bit_depth),
             size_notice(img.size[0], img.size[1], model_size or size)]
    if any(notes):
      notify(f'{what}: ' + '; '.join(n for n in notes if n))
  rgb = _to_rgb(img)
  if size is not None and rgb.size != (size, size):
    rgb = rgb.resize((int(size), int(size)), PIL.Image.Resampling.BILINEAR)
  return np.asarray(rgb, dtype=np.uint8)


def from_image(image: 'PIL.Image.Image | np.ndarray', size: int | None = None, *,
               name: str = 'image', notify: Callable[[str], None] | None = None,
               model_size: int | None = None) -> np.ndarray:
  """`load_image` for an image already in memory: the same conversions, resize and notices.

  Args:
    image: a PIL image (any mode), or a uint8 array [H, W] (grey), [H, W, 1], [H, W, 3] (RGB)
      or [H, W, 4] (RGBA).
    size, notify, model_size: as `load_image`.
    name: how to call the image in messages.

  Returns:
    uint8 [H, W, 3] (or [size, size, 3]).

  Raises:
    UserError: an array of another dtype or shape, or an empty image.
  """
  if isinstance(image, np.ndarray):
    a = image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image
    if a.dtype != np.uint8 or not (a.ndim == 2 or (a.ndim == 3 and a.shape[-1] in (3, 4))):
      raise errors.UserError(
          f'{name} is a {image.dtype} array of shape {image.shape}; pass uint8 [H, W, 3] RGB '
          '(or [H, W] grey, [H, W, 4] RGBA), a PIL image or an image file')
    image = PIL.Image.fromarray(np.ascontiguousarray(a))
  if not isinstance(image, PIL.Image.Image):
    raise errors.UserError(f'{name} is a {type(image).__name__}; pass an image file path, a PIL '
                           'image or a uint8 [H, W, 3] array')
  if image.size[0] <= 0 or image.size[1] <= 0:
    raise errors.UserError(f'{name} has a zero dimension ({image.size[0]}x{image.size[1]})')
  return np.ascontiguousarray(_finish(image, name, size, notify, model_size))


def encode_png(array: np.ndarray, compress_level: int = 1) -> bytes:
  """Encodes an image array as PNG bytes.

  Args:
    array: uint8 [H, W, 3] (RGB) or [H, W] (grey).
    compress_level: zlib level 0-9; 1 is about 4x faster than PIL's default 6 for about 20%
      larger files, which suits dataset builds.

  Returns:
    The PNG file as bytes.
  """
  a = np.asarray(array)
  if a.dtype != np.uint8:
    raise ValueError(f'encode_png expects uint8, got {a.dtype}')
  if not (a.ndim == 2 or (a.ndim == 3 and a.shape[-1] == 3)):
    raise ValueError(f'encode_png expects [H, W, 3] or [H, W], got shape {a.shape}')
  buf = io.BytesIO()
  PIL.Image.fromarray(np.ascontiguousarray(a)).save(buf, format='PNG',
                                                    compress_level=compress_level)
  return buf.getvalue()
