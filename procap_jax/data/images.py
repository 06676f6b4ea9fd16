"""Decoding and resizing user and dataset images, with clear errors.

Every image that enters procap-jax (dataset builders, the captioning CLI) goes through
`load_image`, so a missing, empty, corrupt, truncated or absurdly large file gives one
`UserError` sentence naming the file, never a PIL traceback.

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


def load_image(src: str | os.PathLike | bytes, size: int | None = None, *,
               name: str | None = None) -> np.ndarray:
  """Reads an image file or encoded bytes into an RGB uint8 array.

  Args:
    src: a path, or encoded image bytes (PNG, JPEG, GIF, BMP, TIFF, WebP: anything PIL reads).
    size: if given, the image is resized to `size` x `size` (bilinear, antialiased, aspect
      ratio not kept, as the original 224 x 224 resize).
    name: how to call the image in error messages (default: the path, or "data (N bytes)").

  Returns:
    uint8 [H, W, 3] (or [size, size, 3]).

  Raises:
    UserError: the file is missing, empty, not an image, corrupt or truncated, has a zero
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
      rgb = _to_rgb(img)
      if size is not None and rgb.size != (size, size):
        rgb = rgb.resize((int(size), int(size)), PIL.Image.Resampling.BILINEAR)
      out = np.asarray(rgb, dtype=np.uint8)
  except errors.UserError:
    raise
  except (PIL.Image.DecompressionBombWarning, PIL.Image.DecompressionBombError):
    raise errors.UserError(f'image {what} is larger than the limit of '
                           f'{MAX_PIXELS // 1_000_000} megapixels; downscale it first') from None
  except MemoryError:
    raise errors.UserError(f'image {what} is too large to decode in memory; '
                           'downscale it first') from None
  except PIL.UnidentifiedImageError:
    raise errors.UserError(f'{what} is not an image in a supported format '
                           f'({", ".join(FORMATS)}); check the file') from None
  except Exception as e:  # noqa: BLE001  PIL's decoders raise many types on bad data.
    detail = ' '.join(str(e).split())[:120]
    raise errors.UserError(f'image {what} cannot be decoded ({type(e).__name__}: {detail}); '
                           'the file is corrupt or truncated') from None
  if out.ndim != 3 or out.shape[-1] != 3 or out.shape[0] == 0 or out.shape[1] == 0:
    raise errors.UserError(f'image {what} decodes to an unusable shape {out.shape}; '
                           'replace it with a valid image')
  return np.ascontiguousarray(out)


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
