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
other global (Lightning callbacks, argparse.Namespace, omegaconf, TorchScript classes, ...)
becomes an inert `Opaque` record (`torch_pickle`) of its name, arguments and state. No constructor
or function from the file is ever called. Such globals (except TorchScript's own `__torch__.*`
class tags) are named in one warning line on stderr; `strict=True` refuses the file instead.

Typical use: `state_dict(path)` -> `{'encoder.conv_in.weight': np.ndarray, ...}`.
"""

import os
import sys
import zipfile
from typing import Any, Mapping

import numpy as np

from procap_jax import errors
from procap_jax.convert import safetensors_files
from procap_jax.convert import torch_pickle
_LEGACY_MAGIC = b'\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19'  # pickled 0x1950a86a20f9469cfc6c
ACCEPTED = ('a torch.save zip archive (.pt/.pth/.ckpt, torch >= 1.6), a TorchScript archive '
            '(torch.jit.save, e.g. OpenAI CLIP ViT-B-32.pt) or a safetensors file')
# Where checkpoints keep their weights, tried in this order by `state_dict`.
STATE_KEYS = ('state_dict', 'model', 'weights', 'module', 'model_state_dict', 'net', 'params')


# The file is not a weight file this reader accepts (one sentence); one class for both formats.
FormatError = safetensors_files.FormatError


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
    if pkl_size > torch_pickle.expansion_limit(disk, max_expansion):
      raise FormatError(f'{path}: its data.pkl claims {torch_pickle.size_text(pkl_size)}, over '
                        f'the limit of {torch_pickle.expansion_text(disk, max_expansion)}; it is '
                        'damaged or hostile')
    try:
      unpickler = torch_pickle._Unpickler(archive.read(pkl[0]), read_record, byteorder, path,
                                          max_expansion)
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
  other objects as `torch_pickle.Opaque`. A TorchScript archive gives its root module as an
  Opaque whose `state` dict holds the attributes (submodules, parameters). strict and
  max_expansion: see `state_dict`."""
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
  attrs = obj.state if isinstance(obj, torch_pickle.Opaque) else obj
  if not isinstance(attrs, Mapping):
    return
  for name, value in attrs.items():
    if not isinstance(name, str):
      continue
    if isinstance(value, np.ndarray):
      out.setdefault(prefix + name, value)
    elif isinstance(value, (torch_pickle.Opaque, dict)):
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
      torch_pickle.MIN_EXPANSION_LIMIT bytes); None = torch_pickle.DEFAULT_MAX_EXPANSION.
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
