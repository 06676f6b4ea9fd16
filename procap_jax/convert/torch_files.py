"""Reads PyTorch weight files into numpy without torch and without running their pickles.

Accepted:
  - `torch.save` zip archives (`.pt`, `.pth`, `.bin`, Lightning `.ckpt`): `<root>/data.pkl` is a
    pickle whose tensors point (persistent ids) at raw storages `<root>/data/<key>`. Tensors come
    back as numpy arrays with their shape, strides and storage offset applied; tensors sharing a
    storage read it once. float16 / bfloat16 (ml_dtypes) / float32 / float64 / integer / bool.
  - TorchScript archives (`torch.jit.save`, e.g. OpenAI CLIP's `ViT-B-32.pt`): the module tree is
    in `<root>/data.pkl` as objects of `__torch__.*` classes whose attributes hold the parameters.
  - safetensors files (the header's JSON, then raw little-endian data; `safetensors_files`).
Refused with one sentence: legacy (pre-1.6, non-zip) torch files, other pickles, anything else.

Checks: each tensor's shape, strides and offset against its storage's size, and each storage's
claimed size against its record, before anything is viewed; the bytes a file expands to (storages
read plus tensors made) may not exceed max_expansion x its size on disk (at least 16 MiB), so a
498-byte file claiming a 37 GiB stride-0 tensor is one sentence, not an allocation.

Safety: the unpickler resolves no global by import. A short allow-list maps torch's tensor and
storage rebuild functions (and TorchScript's list builders) to numpy code written here; every
other global (Lightning callbacks, argparse.Namespace, omegaconf, TorchScript classes, ...) becomes
an inert `Opaque` record of its name, arguments and state. No constructor or function from the
file is ever called. Such globals (except TorchScript's own `__torch__.*` class tags) are named
in one warning line on stderr; `strict=True` refuses the file instead.

Typical use: `state_dict(path)` -> `{'encoder.conv_in.weight': np.ndarray, ...}`.
"""

import collections
import io
import math
import os
import pickle
import sys
import zipfile
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from procap_jax import errors
from procap_jax.convert import safetensors_files

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
_LEGACY_MAGIC = b'\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19'  # pickled 0x1950a86a20f9469cfc6c
ACCEPTED = ('a torch.save zip archive (.pt/.pth/.ckpt, torch >= 1.6), a TorchScript archive '
            '(torch.jit.save, e.g. OpenAI CLIP ViT-B-32.pt) or a safetensors file')
# Where checkpoints keep their weights, tried in this order by `state_dict`.
# A file may expand to at most max(DEFAULT_MAX_EXPANSION x its size on disk, MIN_EXPANSION_LIMIT)
# bytes (storages read plus tensors made): a genuine checkpoint expands to about 2 x (each
# storage once, each tensor once); a tensor with stride 0 and a huge shape claims far more.
DEFAULT_MAX_EXPANSION = 4.0
MIN_EXPANSION_LIMIT = 1 << 24
STATE_KEYS = ('state_dict', 'model', 'weights', 'module', 'model_state_dict', 'net', 'params')


# The file is not a weight file this reader accepts (one sentence); one class for both formats.
FormatError = safetensors_files.FormatError


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


def _kind(path: str) -> str:
  """'zip' | 'safetensors', or raises FormatError naming what the file is."""
  if not os.path.isfile(path):
    raise FormatError(f'{path} does not exist or is not a file')
  with open(path, 'rb') as f:
    head = f.read(16)
  if not head:
    raise FormatError(f'{path} is empty; accepted: {ACCEPTED}')
  if zipfile.is_zipfile(path):
    return 'zip'
  if head.startswith(b'PK\x03\x04'):
    raise FormatError(f'{path} is a truncated zip archive ({os.path.getsize(path)} bytes, its '
                      'closing directory is missing); copy or download the whole file again')
  if head.startswith(_LEGACY_MAGIC):
    raise FormatError(f'{path} is a legacy (pre-1.6, non-zip) torch file, which cannot be read '
                      'without running its pickle; re-save it with torch.save(torch.load(f), f) '
                      f'in an environment with torch, or give {ACCEPTED}')
  if head[:1] == b'\x80':
    raise FormatError(f'{path} is a plain Python pickle, not a torch archive; accepted: '
                      f'{ACCEPTED}')
  if len(head) >= 9 and head[8:9] == b'{':
    return 'safetensors'
  raise FormatError(f'{path} is not a weight file this reader knows; accepted: {ACCEPTED}')


def _read_zip(path: str, max_expansion: float | None = None) -> tuple[Any, bool, list[str]]:
  """(unpickled data.pkl, is_torchscript, foreign globals) of a torch zip archive."""
  try:
    archive = zipfile.ZipFile(path)
  except (zipfile.BadZipFile, OSError) as e:
    raise FormatError(f'{path} is a damaged zip archive ({e})') from None
  with archive:
    names = archive.namelist()
    pkl = [n for n in names if n.endswith('data.pkl') and n.count('/') == 1]
    if not pkl:
      raise FormatError(f'{path} is a zip archive without a data.pkl record, so not a torch '
                        f'file; accepted: {ACCEPTED}')
    root = pkl[0].split('/')[0]
    torchscript = any(n.startswith(f'{root}/code/') for n in names) or \
        f'{root}/constants.pkl' in names
    byteorder = 'little'
    if f'{root}/byteorder' in names:
      byteorder = archive.read(f'{root}/byteorder').decode(errors='replace').strip() or 'little'
    if byteorder not in ('little', 'big'):
      raise FormatError(f'{path} names the byte order {byteorder!r:.20}; the file is damaged')

    def read_record(key: str, size_only: bool = False):
      try:
        info = archive.getinfo(f'{root}/data/{key}')
      except KeyError:
        raise FormatError(f'{path} lacks the storage record data/{key}; the file is truncated '
                          'or damaged') from None
      return info.file_size if size_only else archive.read(info)

    pkl_size, disk = archive.getinfo(pkl[0]).file_size, os.path.getsize(path)
    if pkl_size > expansion_limit(disk, max_expansion):
      raise FormatError(f'{path}: its data.pkl claims {size_text(pkl_size)}, over the limit of '
                        f'{expansion_text(disk, max_expansion)}; it is damaged or hostile')
    try:
      unpickler = _Unpickler(archive.read(pkl[0]), read_record, byteorder, path, max_expansion)
      obj = unpickler.load()
    except errors.UserError:
      raise
    except MemoryError:
      raise FormatError(f'{path} needs more memory than this machine gives; it is damaged or '
                        'too large') from None
    except Exception as e:  # pylint: disable=broad-except  (hostile bytes: any failure is one)
      raise FormatError(f'{path} has a damaged data.pkl ({type(e).__name__}: {e})'[:300]) from None
  return obj, torchscript, unpickler.foreign


def _names(foreign: list[str]) -> str:
  return ', '.join(foreign[:6]) + (f' and {len(foreign) - 6} more' if len(foreign) > 6 else '')


def _refuse_if_strict(path: str, foreign: list[str], strict: bool) -> None:
  if foreign and strict:
    raise FormatError(f'{path} references code outside the weight-file allow-list '
                      f'({_names(foreign)}); strict mode refuses it (none of it was run); re-save '
                      'only the tensors, or read it without --strict')


def warn_foreign(path: str, foreign: list[str]) -> None:
  """One warning line on stderr naming the globals outside the allow-list (none: nothing)."""
  if foreign:
    print(f'warning: {path} references code outside the weight-file allow-list '
          f'({_names(foreign)}); none of it was run (kept as inert records) and only the tensors '
          'are used; --strict refuses such files', file=sys.stderr, flush=True)


class StateDict(dict):
  """A flat `{name: array}` dict that also carries `foreign`: the globals outside the
  allow-list its file's pickle named (none of them run)."""
  foreign: list[str] = []


def load(path: str, *, strict: bool = False, max_expansion: float | None = None) -> Any:
  """The file's object tree: dicts, lists and numbers as pickled, tensors as numpy arrays,
  other objects as `Opaque`. A TorchScript archive gives its root module as an Opaque whose
  `state` dict holds the attributes (submodules, parameters). strict and max_expansion: see
  `state_dict`."""
  if _kind(path) == 'safetensors':
    return safetensors_files.read(path)
  obj, _, foreign = _read_zip(path, max_expansion)
  _refuse_if_strict(path, foreign, strict)
  warn_foreign(path, foreign)
  return obj


def _module_tensors(obj: Any, prefix: str, out: dict, seen: set) -> None:
  """Tensor attributes of a TorchScript module tree, named as its state_dict names them."""
  if id(obj) in seen:
    return
  seen.add(id(obj))
  attrs = obj.state if isinstance(obj, Opaque) else obj
  if not isinstance(attrs, Mapping):
    return
  for name, value in attrs.items():
    if not isinstance(name, str):
      continue
    if isinstance(value, np.ndarray):
      out.setdefault(prefix + name, value)
    elif isinstance(value, (Opaque, dict)):
      _module_tensors(value, f'{prefix}{name}.', out, seen)


def _flatten(tree: Mapping, prefix: str = '') -> dict[str, np.ndarray]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, np.ndarray):
      out[f'{prefix}{k}'] = v
    elif isinstance(v, Mapping):
      out.update(_flatten(v, f'{prefix}{k}.'))
  return out


def _is_state(tree: Any) -> bool:
  """Whether `tree` is a dict holding tensors (other values, e.g. a step count, are dropped)."""
  return isinstance(tree, Mapping) and bool(_flatten(tree))


def state_dict(path: str, key: str | None = None, *, strict: bool = False,
               max_expansion: float | None = None, warn: bool = True) -> StateDict:
  """The flat `{dotted name: array}` weights of a file.

  Args:
    path: the weight file (see the module docstring for what is accepted).
    key: where the weights sit in a checkpoint dict (e.g. 'model'); None looks for the first of
      STATE_KEYS that holds tensors, else takes the whole dict. A prefix `module.` (DDP) on
      every name is removed.
    strict: refuse a file whose pickle names globals outside the allow-list (by default they
      are read as inert records and one warning line on stderr names them).
    max_expansion: the file may expand to this many times its size on disk (at least
      MIN_EXPANSION_LIMIT bytes); None = DEFAULT_MAX_EXPANSION.
    warn: print the warning line about foreign globals here (False: the caller does, e.g. once
      it has checked the file is the kind it wants, with `warn_foreign(path, result.foreign)`).

  Raises:
    FormatError: the file is not accepted, or holds no tensors where expected.
  """
  foreign = []
  if _kind(path) == 'safetensors':
    flat = safetensors_files.read(path)
  else:
    obj, torchscript, foreign = _read_zip(path, max_expansion)
    _refuse_if_strict(path, foreign, strict)
    if torchscript:
      flat = {}
      _module_tensors(obj, '', flat, set())
    else:
      if isinstance(obj, Mapping) and key is not None:
        if key not in obj:
          raise FormatError(f'{path} has no entry {key!r} (it has {", ".join(map(str, obj))})')
        obj = obj[key]
      elif isinstance(obj, Mapping) and not all(isinstance(v, np.ndarray) for v in obj.values()):
        obj = next((obj[k] for k in STATE_KEYS if k in obj and _is_state(obj[k])), obj)
      flat = _flatten(obj) if isinstance(obj, Mapping) else {}
  if not flat:
    raise FormatError(f'{path} holds no tensors' + (f' under {key!r}' if key else '')
                      + '; it is not a weight file')
  if all(k.startswith('module.') for k in flat):
    flat = {k[len('module.'):]: v for k, v in flat.items()}
  out = StateDict(flat)
  out.foreign = foreign
  if warn:
    warn_foreign(path, foreign)
  return out
