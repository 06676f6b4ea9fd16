"""Weight files written by hand, without torch: the torch.save zip layout around a pickle made of
explicit opcodes, so a test can build any file, honest or hostile (a stride-0 tensor, a global
that is a shell call, a storage that holds less than it claims).

  Global('os', 'system')               a GLOBAL opcode (nothing is imported here)
  Call(Global(...), args)              GLOBAL, args tuple, REDUCE
  tensor(key, numel, size, stride)     torch._utils._rebuild_tensor_v2 over storage `key`
  save(path, obj, records)             archive/data.pkl + archive/data/<key> + archive/version
  save_state(path, {name: array})      a state dict, one float32 storage per tensor
"""

import dataclasses
import struct
import zipfile
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Global:
  module: str
  name: str


@dataclasses.dataclass(frozen=True)
class Call:
  func: Global
  args: tuple


@dataclasses.dataclass(frozen=True)
class PersistentId:
  value: tuple


_STORAGES = {np.dtype(np.float32): 'FloatStorage', np.dtype(np.float16): 'HalfStorage',
             np.dtype(np.int64): 'LongStorage'}


def _emit(obj: Any, out: list) -> None:
  if obj is None:
    out.append(b'N')
  elif isinstance(obj, bool):
    out.append(b'\x88' if obj else b'\x89')
  elif isinstance(obj, int):
    if -2**31 <= obj < 2**31:
      out.append(b'J' + struct.pack('<i', obj))
    else:
      raw = obj.to_bytes((obj.bit_length() + 8) // 8, 'little', signed=True)
      out.append(b'\x8a' + bytes([len(raw)]) + raw)  # LONG1
  elif isinstance(obj, float):
    out.append(b'G' + struct.pack('>d', obj))
  elif isinstance(obj, str):
    raw = obj.encode()
    out.append(b'X' + struct.pack('<I', len(raw)) + raw)
  elif isinstance(obj, tuple):
    out.append(b'(')
    for item in obj:
      _emit(item, out)
    out.append(b't')
  elif isinstance(obj, list):
    out.append(b'](')
    for item in obj:
      _emit(item, out)
    out.append(b'e')
  elif isinstance(obj, dict):
    out.append(b'}(')
    for key, value in obj.items():
      _emit(key, out)
      _emit(value, out)
    out.append(b'u')
  elif isinstance(obj, Global):
    out.append(b'c' + obj.module.encode() + b'\n' + obj.name.encode() + b'\n')
  elif isinstance(obj, Call):
    _emit(obj.func, out)
    _emit(tuple(obj.args), out)
    out.append(b'R')
  elif isinstance(obj, PersistentId):
    _emit(obj.value, out)
    out.append(b'Q')
  else:
    raise TypeError(f'cannot emit {type(obj)}')


def dumps(obj: Any) -> bytes:
  """A protocol-2 pickle of `obj` (dicts, lists, tuples, scalars, Global / Call / PersistentId)."""
  out = [b'\x80\x02']
  _emit(obj, out)
  out.append(b'.')
  return b''.join(out)


def tensor(key: str, numel: int, size: tuple, stride: tuple, offset: int = 0,
           storage: str = 'FloatStorage') -> Call:
  """What torch.save pickles for a tensor: a strided view of storage `key` of `numel` values."""
  pid = PersistentId(('storage', Global('torch', storage), key, 'cpu', numel))
  return Call(Global('torch._utils', '_rebuild_tensor_v2'),
              (pid, offset, tuple(size), tuple(stride), False,
               Call(Global('collections', 'OrderedDict'), ())))


def save(path, obj: Any, records: dict[str, bytes] | None = None) -> None:
  """A torch.save-style zip archive holding the pickle of `obj` and raw storage `records`."""
  with zipfile.ZipFile(path, 'w') as z:
    z.writestr('archive/data.pkl', dumps(obj))
    for key, raw in (records or {}).items():
      z.writestr(f'archive/data/{key}', raw)
    z.writestr('archive/version', '3\n')


def state_tree(state: dict[str, np.ndarray]) -> tuple[dict, dict[str, bytes]]:
  """(pickle tree, storage records) of a flat state dict, one little-endian storage each."""
  tree, records = {}, {}
  for i, (name, value) in enumerate(state.items()):
    value = np.ascontiguousarray(value)
    if value.dtype not in _STORAGES:
      value = value.astype(np.float32)
    stride = tuple(s // value.itemsize for s in value.strides)
    tree[name] = tensor(str(i), value.size, value.shape, stride, storage=_STORAGES[value.dtype])
    records[str(i)] = value.astype(value.dtype.newbyteorder('<')).tobytes()
  return tree, records


def save_state(path, state: dict[str, np.ndarray], extra: dict | None = None,
               key: str | None = None) -> None:
  """A state dict as torch.save writes it, with `extra` entries beside it (e.g. a Call), under
  `key` (e.g. 'weights') when given."""
  tree, records = state_tree(state)
  obj = {key: tree} if key else tree
  save(path, {**obj, **(extra or {})}, records)
