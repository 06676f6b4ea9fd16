"""The pickle reader behind `torch_files`: torch's tensor and storage rebuild functions (and
TorchScript's list builders) mapped to numpy code written here, every other global an inert
`Opaque` record; no global is resolved by import and nothing from the file is called. Also the
expansion limit (bytes a file may expand to) that it and `torch_files` check.
"""

import collections
import io
import math
import os
import pickle
from typing import Any

import ml_dtypes
import numpy as np

from procap_jax.convert import safetensors_files

# The file is not a weight file this reader accepts (one sentence).
FormatError = safetensors_files.FormatError

# torch storage class name -> numpy dtype (torch.<Name>Storage, as `torch.save` pickles them).
_STORAGE_DTYPES = {
    'DoubleStorage': np.float64, 'FloatStorage': np.float32, 'HalfStorage': np.float16,
    'BFloat16Storage': ml_dtypes.bfloat16, 'LongStorage': np.int64, 'IntStorage': np.int32,
    'ShortStorage': np.int16, 'CharStorage': np.int8, 'ByteStorage': np.uint8,
    'BoolStorage': np.bool_,
}
# torch dtype names (torch.float32 pickles as GLOBAL torch float32 in some paths) -> numpy.
_DTYPE_NAMES = {'float64': np.float64, 'float32': np.float32, 'float16': np.float16,
                'bfloat16': ml_dtypes.bfloat16, 'int64': np.int64, 'int32': np.int32,
                'int16': np.int16, 'int8': np.int8, 'uint8': np.uint8, 'bool': np.bool_}
# A file may expand to at most max(DEFAULT_MAX_EXPANSION x its size on disk, MIN_EXPANSION_LIMIT)
# bytes (storages read plus tensors made): a genuine checkpoint expands to about 2 x (each
# storage once, each tensor once); a tensor with stride 0 and a huge shape claims far more.
DEFAULT_MAX_EXPANSION = 4.0
MIN_EXPANSION_LIMIT = 1 << 24


class Opaque:
  """An object of a class the reader does not run: its name, arguments and pickled state, and
  the items or elements pickle fills a dict or list subclass with (e.g. an EasyDict config)."""

  def __init__(self, name: str, args: tuple = ()):
    self.name, self.args, self.state = name, args, None
    self.items: dict = {}
    self.elements: list = []

  def __setstate__(self, state: Any) -> None:
    self.state = state

  def __setitem__(self, key: Any, value: Any) -> None:
    self.items[key] = value

  def append(self, value: Any) -> None:
    self.elements.append(value)

  def extend(self, values: Any) -> None:
    self.elements.extend(values)

  def __repr__(self) -> str:
    return f'Opaque({self.name})'


def _opaque_class(name: str) -> type:
  """A class standing in for global `name`: calling or NEWOBJ-ing it makes an Opaque."""

  class Stand(Opaque):
    def __new__(cls, *args, **kwargs):
      del kwargs
      obj = object.__new__(Opaque)
      Opaque.__init__(obj, name, args)
      return obj

  Stand.__name__ = name.rsplit('.', 1)[-1]
  return Stand


class _StorageType:
  """Marker for torch.<Name>Storage in a persistent id."""

  def __init__(self, dtype):
    self.dtype = np.dtype(dtype)


def _rebuild_parameter(data, *unused) -> np.ndarray:
  """torch._utils._rebuild_parameter(_with_state): the parameter's data."""
  del unused
  return data


def _identity_list(data, *unused):
  """torch.jit._pickle.build_*list / restore_type_tag: the value itself."""
  del unused
  return data


# The tensor rebuilders are the unpickler's own methods (they check and count what they make).
_REBUILD_TENSOR = {('torch._utils', '_rebuild_tensor_v2'), ('torch._utils', '_rebuild_tensor')}
_ALLOWED = {
    ('torch._utils', '_rebuild_parameter'): _rebuild_parameter,
    ('torch._utils', '_rebuild_parameter_with_state'): _rebuild_parameter,
    ('collections', 'OrderedDict'): collections.OrderedDict,
    ('torch.jit._pickle', 'build_intlist'): _identity_list,
    ('torch.jit._pickle', 'build_doublelist'): _identity_list,
    ('torch.jit._pickle', 'build_boollist'): _identity_list,
    ('torch.jit._pickle', 'build_tensorlist'): _identity_list,
    ('torch.jit._pickle', 'build_genericlist'): _identity_list,
    ('torch.jit._pickle', 'restore_type_tag'): _identity_list,
}


class _Unpickler(pickle.Unpickler):
  """Unpickler over one archive: storages from `read_record`, globals from the allow-list.

  Every tensor's shape, strides and offset are checked against its storage's size before it is
  viewed, and the bytes the file expands to (storages read plus tensors made) are counted against
  `budget`, so a small file cannot make the reader allocate more than that."""

  def __init__(self, data: bytes, read_record, byteorder: str, path: str,
               max_expansion: float | None):
    super().__init__(io.BytesIO(data))
    self._read_record = read_record
    self._byteorder = byteorder
    self._path = path
    self._limit_text = expansion_text(os.path.getsize(path), max_expansion)
    self._budget = expansion_limit(os.path.getsize(path), max_expansion)
    self._spent = 0
    self._storages: dict[str, np.ndarray] = {}
    self._storage_keys: dict[int, str] = {}
    self.foreign: list[str] = []  # globals outside the allow-list, in the order first met

  def find_class(self, module: str, name: str) -> Any:
    if (module, name) in _REBUILD_TENSOR:
      return self._rebuild_tensor
    if (module, name) in _ALLOWED:
      return _ALLOWED[(module, name)]
    if module == 'torch' and name in _STORAGE_DTYPES:
      return _StorageType(_STORAGE_DTYPES[name])
    if module == 'torch' and name in _DTYPE_NAMES:
      return _StorageType(_DTYPE_NAMES[name])
    full = f'{module}.{name}'
    if not module.startswith('__torch__') and full not in self.foreign:
      self.foreign.append(full)  # TorchScript's own class tags are not Python code
    return _opaque_class(full)

  def _spend(self, nbytes: int, what: str) -> None:
    self._spent += nbytes
    if self._spent > self._budget:
      raise FormatError(
          f'{self._path} would expand past the reader\'s limit of {self._limit_text}: {what} '
          f'alone claims {size_text(nbytes)}; it is damaged or hostile (raise max_expansion only '
          'for a file you trust)')

  def persistent_load(self, pid: Any) -> Any:
    if not (isinstance(pid, tuple) and pid and pid[0] == 'storage' and len(pid) >= 3):
      raise FormatError(f'{self._path} refers to an external object {pid!r:.60} this reader does '
                        'not know; it is not a plain torch weight file')
    storage_type, key = pid[1], str(pid[2])
    if key not in self._storages:
      if not isinstance(storage_type, _StorageType):
        raise FormatError(f'{self._path}: storage {key} has a type this reader does not know '
                          f'({storage_type!r:.60}); accepted: {", ".join(_STORAGE_DTYPES)}')
      dtype = storage_type.dtype.newbyteorder('<' if self._byteorder == 'little' else '>')
      size = self._record_size(key)
      if len(pid) >= 5 and isinstance(pid[4], int) and pid[4] * dtype.itemsize > size:
        raise FormatError(f'{self._path}: storage {key} claims {pid[4] * dtype.itemsize} bytes '
                          f'({pid[4]} {dtype.name} values), holds {size}; the file is truncated '
                          'or damaged')
      self._spend(size, f'storage {key}')
      raw = self._read_record(key)
      if len(raw) % dtype.itemsize:
        raise FormatError(f'{self._path}: storage {key} has {len(raw)} bytes, not a whole number '
                          f'of {dtype.name} values; the file is damaged')
      self._storages[key] = np.frombuffer(raw, dtype=dtype).astype(storage_type.dtype)
      self._storage_keys[id(self._storages[key])] = key
    return self._storages[key]

  def _record_size(self, key: str) -> int:
    return self._read_record(key, size_only=True)

  def _rebuild_tensor(self, storage, offset, size, stride, *unused) -> np.ndarray:
    """torch._utils._rebuild_tensor_v2: a strided view of a storage, checked, then copied."""
    del unused
    if not isinstance(storage, np.ndarray):
      raise FormatError(f'a tensor in {self._path} points at no storage; the file is damaged')
    key = self._storage_keys.get(id(storage), '?')
    sequences = isinstance(size, (tuple, list)) and isinstance(stride, (tuple, list))
    if not (_is_int(offset) and sequences and all(map(_is_int, size))
            and all(map(_is_int, stride)) and len(size) == len(stride) and offset >= 0
            and min(size, default=0) >= 0 and min(stride, default=0) >= 0):
      raise FormatError(f'{self._path}: a tensor of storage {key} has a malformed shape '
                        f'{size!r:.60}, strides {stride!r:.60} or offset {offset!r:.20}; the file '
                        'is damaged')
    size, stride, offset = tuple(int(s) for s in size), tuple(int(s) for s in stride), int(offset)
    item = storage.dtype.itemsize
    numel = math.prod(size)
    if numel == 0:
      needed = offset
    else:
      needed = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
    if needed > storage.size:
      raise FormatError(f'{self._path}: a tensor of shape {size} with strides {stride} at offset '
                        f'{offset} claims {needed * item} bytes of storage {key}, which holds '
                        f'{storage.size * item}; the file is truncated or damaged')
    self._spend(numel * item, f'a tensor of shape {size}')
    if not size:
      return np.array(storage[offset])
    view = np.lib.stride_tricks.as_strided(storage[offset:] if storage.size else storage,
                                           shape=size, strides=[s * item for s in stride],
                                           writeable=False)
    return np.array(view)


def size_text(nbytes: int) -> str:
  """`nbytes` for a sentence: '498 bytes', '16 MiB', '37.3 GiB'."""
  for unit, scale in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
    if nbytes >= scale:
      return f'{nbytes / scale:.3g} {unit}'
  return f'{nbytes} bytes'


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def expansion_text(file_size: int, max_expansion: float | None = None) -> str:
  """How the expansion limit of a file of `file_size` bytes reads in a sentence."""
  factor = DEFAULT_MAX_EXPANSION if max_expansion is None else max_expansion
  return (f'{size_text(expansion_limit(file_size, factor))} (max_expansion {factor:g} x its '
          f'{size_text(file_size)} on disk, at least {size_text(MIN_EXPANSION_LIMIT)})')


def expansion_limit(file_size: int, max_expansion: float | None = None) -> int:
  """The most bytes a file of `file_size` bytes may expand to (storages plus tensors)."""
  factor = DEFAULT_MAX_EXPANSION if max_expansion is None else max_expansion
  return max(int(factor * file_size), MIN_EXPANSION_LIMIT)
