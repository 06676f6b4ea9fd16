"""Reads PyTorch weight files into numpy without torch and without running their pickles.

Accepted:
  - `torch.save` zip archives (`.pt`, `.pth`, `.bin`, Lightning `.ckpt`): `<root>/data.pkl` is a
    pickle whose tensors point (persistent ids) at raw storages `<root>/data/<key>`. Tensors come
    back as numpy arrays with their shape, strides and storage offset applied; tensors sharing a
    storage read it once. float16 / bfloat16 (ml_dtypes) / float32 / float64 / integer / bool.
  - TorchScript archives (`torch.jit.save`, e.g. OpenAI CLIP's `ViT-B-32.pt`): the module tree is
    in `<root>/data.pkl` as objects of `__torch__.*` classes whose attributes hold the parameters.
  - safetensors files (the header's JSON, then raw little-endian data).
Refused with one sentence: legacy (pre-1.6, non-zip) torch files, other pickles, anything else.

Safety: the unpickler resolves no global by import. A short allow-list maps torch's tensor and
storage rebuild functions (and TorchScript's list builders) to numpy code written here; every
other global (Lightning callbacks, argparse.Namespace, omegaconf, TorchScript classes, ...) becomes
an inert `Opaque` record of its name, arguments and state. No constructor or function from the
file is ever called.

Typical use: `state_dict(path)` -> `{'encoder.conv_in.weight': np.ndarray, ...}`.
"""

import collections
import io
import json
import os
import pickle
import struct
import zipfile
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from procap_jax import errors

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
_SAFETENSORS_DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16,
                       'BF16': ml_dtypes.bfloat16, 'I64': np.int64, 'I32': np.int32,
                       'I16': np.int16, 'I8': np.int8, 'U8': np.uint8, 'BOOL': np.bool_}
_LEGACY_MAGIC = b'\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19'  # pickled 0x1950a86a20f9469cfc6c
ACCEPTED = ('a torch.save zip archive (.pt/.pth/.ckpt, torch >= 1.6), a TorchScript archive '
            '(torch.jit.save, e.g. OpenAI CLIP ViT-B-32.pt) or a safetensors file')
# Where checkpoints keep their weights, tried in this order by `state_dict`.
STATE_KEYS = ('state_dict', 'model', 'weights', 'module', 'model_state_dict', 'net', 'params')


class FormatError(errors.UserError):
  """The file is not a weight file this reader accepts (one sentence)."""


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


def _rebuild_tensor(storage, offset, size, stride, *unused) -> np.ndarray:
  """torch._utils._rebuild_tensor_v2: a strided view of a storage, copied to a new array."""
  del unused
  if not isinstance(storage, np.ndarray):
    raise FormatError('a tensor in the file points at no storage; the file is damaged')
  size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
  if not size:
    return np.array(storage[int(offset)])
  extent = int(offset) + 1 + sum((n - 1) * s for n, s in zip(size, stride) if n > 0)
  if 0 not in size and extent > storage.size:
    raise FormatError(f'a tensor of shape {size} reaches past the end of its storage '
                      f'({storage.size} elements); the file is truncated or damaged')
  item = storage.dtype.itemsize
  view = np.lib.stride_tricks.as_strided(storage[int(offset):] if storage.size else storage,
                                         shape=size, strides=[s * item for s in stride],
                                         writeable=False)
  return np.array(view)


def _rebuild_parameter(data, *unused) -> np.ndarray:
  """torch._utils._rebuild_parameter(_with_state): the parameter's data."""
  del unused
  return data


def _identity_list(data, *unused):
  """torch.jit._pickle.build_*list / restore_type_tag: the value itself."""
  del unused
  return data


_ALLOWED = {
    ('torch._utils', '_rebuild_tensor_v2'): _rebuild_tensor,
    ('torch._utils', '_rebuild_tensor'): _rebuild_tensor,
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
  """Unpickler over one archive: storages from `read_record`, globals from the allow-list."""

  def __init__(self, data: bytes, read_record, byteorder: str):
    super().__init__(io.BytesIO(data))
    self._read_record = read_record
    self._byteorder = byteorder
    self._storages: dict[str, np.ndarray] = {}

  def find_class(self, module: str, name: str) -> Any:
    if (module, name) in _ALLOWED:
      return _ALLOWED[(module, name)]
    if module == 'torch' and name in _STORAGE_DTYPES:
      return _StorageType(_STORAGE_DTYPES[name])
    if module == 'torch' and name in _DTYPE_NAMES:
      return _StorageType(_DTYPE_NAMES[name])
    return _opaque_class(f'{module}.{name}')

  def persistent_load(self, pid: Any) -> Any:
    if not (isinstance(pid, tuple) and pid and pid[0] == 'storage' and len(pid) >= 3):
      raise FormatError(f'the file refers to an external object {pid!r:.60} this reader does not '
                        'know; it is not a plain torch weight file')
    storage_type, key = pid[1], str(pid[2])
    if key not in self._storages:
      if not isinstance(storage_type, _StorageType):
        raise FormatError(f'storage {key} of the file has a type this reader does not know '
                          f'({storage_type!r}); accepted: {", ".join(_STORAGE_DTYPES)}')
      raw = self._read_record(key)
      dtype = storage_type.dtype.newbyteorder('<' if self._byteorder == 'little' else '>')
      if len(raw) % dtype.itemsize:
        raise FormatError(f'storage {key} has {len(raw)} bytes, not a whole number of '
                          f'{dtype.name} values; the file is damaged')
      self._storages[key] = np.frombuffer(raw, dtype=dtype).astype(storage_type.dtype)
    return self._storages[key]


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


def _read_zip(path: str) -> tuple[Any, bool]:
  """(unpickled data.pkl, is_torchscript) of a torch zip archive."""
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
      byteorder = archive.read(f'{root}/byteorder').decode().strip() or 'little'

    def read_record(key: str) -> bytes:
      try:
        return archive.read(f'{root}/data/{key}')
      except KeyError:
        raise FormatError(f'{path} lacks the storage record data/{key}; the file is truncated '
                          'or damaged') from None

    try:
      obj = _Unpickler(archive.read(pkl[0]), read_record, byteorder).load()
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, ValueError, TypeError) as e:
      raise FormatError(f'{path} has a damaged data.pkl ({type(e).__name__}: {e})') from None
  return obj, torchscript


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  with open(path, 'rb') as f:
    raw = f.read()
  (n,) = struct.unpack('<Q', raw[:8])
  try:
    header = json.loads(raw[8:8 + n])
  except ValueError:
    raise FormatError(f'{path} has a damaged safetensors header') from None
  body, out = raw[8 + n:], {}
  for name, spec in header.items():
    if name == '__metadata__':
      continue
    if spec.get('dtype') not in _SAFETENSORS_DTYPES:
      raise FormatError(f'{path}: tensor {name!r} has dtype {spec.get("dtype")}, which this '
                        f'reader does not know ({", ".join(_SAFETENSORS_DTYPES)})')
    start, end = spec['data_offsets']
    dtype = np.dtype(_SAFETENSORS_DTYPES[spec['dtype']])
    if end > len(body) or (end - start) != dtype.itemsize * int(np.prod(spec['shape'])):
      raise FormatError(f'{path}: tensor {name!r} does not fit the file; it is truncated')
    out[name] = np.frombuffer(body[start:end], dtype=dtype).reshape(spec['shape']).copy()
  return out


def load(path: str) -> Any:
  """The file's object tree: dicts, lists and numbers as pickled, tensors as numpy arrays,
  other objects as `Opaque`. A TorchScript archive gives its root module as an Opaque whose
  `state` dict holds the attributes (submodules, parameters)."""
  if _kind(path) == 'safetensors':
    return _read_safetensors(path)
  return _read_zip(path)[0]


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


def state_dict(path: str, key: str | None = None) -> dict[str, np.ndarray]:
  """The flat `{dotted name: array}` weights of a file.

  Args:
    path: the weight file (see the module docstring for what is accepted).
    key: where the weights sit in a checkpoint dict (e.g. 'model'); None looks for the first of
      STATE_KEYS that holds tensors, else takes the whole dict. A prefix `module.` (DDP) on
      every name is removed.

  Raises:
    FormatError: the file is not accepted, or holds no tensors where expected.
  """
  if _kind(path) == 'safetensors':
    flat = _read_safetensors(path)
  else:
    obj, torchscript = _read_zip(path)
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
  return flat
