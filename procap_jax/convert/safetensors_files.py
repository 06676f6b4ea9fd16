"""Reads safetensors files (an 8-byte header length, the header's JSON, then raw little-endian
data) into numpy, checking every tensor's shape and offsets against the bytes the file holds."""

import json
import math
import struct

import ml_dtypes
import numpy as np

from procap_jax import errors

DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16,
          'I64': np.int64, 'I32': np.int32, 'I16': np.int16, 'I8': np.int8, 'U8': np.uint8,
          'BOOL': np.bool_}


class FormatError(errors.UserError):
  """The file is not a weight file the reader accepts (one sentence)."""


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def read(path: str) -> dict[str, np.ndarray]:
  """The tensors of a safetensors file, each checked to lie inside the file (so the file cannot
  expand: each tensor is at most a copy of its own bytes).

  Raises:
    FormatError: the file is truncated or its header is malformed (one sentence).
  """
  with open(path, 'rb') as f:
    raw = f.read()
  if len(raw) < 8:
    raise FormatError(f'{path} is a truncated safetensors file ({len(raw)} bytes)')
  (n,) = struct.unpack('<Q', raw[:8])
  if 8 + n > len(raw):
    raise FormatError(f'{path}: its safetensors header claims {n} bytes, the file holds '
                      f'{len(raw) - 8} after the length; it is truncated')
  try:
    header = json.loads(raw[8:8 + n])
  except ValueError:
    raise FormatError(f'{path} has a damaged safetensors header') from None
  if not isinstance(header, dict):
    raise FormatError(f'{path} has a damaged safetensors header (not a JSON object)')
  body, out = raw[8 + n:], {}
  for name, spec in header.items():
    if name == '__metadata__':
      continue
    if not isinstance(spec, dict) or spec.get('dtype') not in DTYPES:
      raise FormatError(f'{path}: tensor {name!r:.60} has dtype '
                        f'{spec.get("dtype") if isinstance(spec, dict) else None!r:.20}, which '
                        f'this reader does not know ({", ".join(DTYPES)})')
    offsets, shape = spec.get('data_offsets'), spec.get('shape')
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
            and isinstance(shape, list) and all(map(_is_int, shape))
            and min(shape, default=0) >= 0 and 0 <= offsets[0] <= offsets[1]):
      raise FormatError(f'{path}: tensor {name!r:.60} has a malformed shape or data_offsets')
    start, end = offsets
    dtype = np.dtype(DTYPES[spec['dtype']])
    claimed = dtype.itemsize * math.prod(shape)
    if end > len(body) or (end - start) != claimed:
      raise FormatError(f'{path}: tensor {name!r:.60} of shape {tuple(shape)} claims {claimed} '
                        f'bytes, holds {max(0, min(end, len(body)) - start)}; the file is '
                        'truncated or damaged')
    out[name] = np.frombuffer(body[start:end], dtype=dtype).reshape(shape).copy()
  return out
