"""Checks shared by the converters: every failure is one sentence naming the first bad key.

A converter maps a flat torch state dict (`{'a.b.weight': np.ndarray}`, from `torch_files`) to a
nested flax parameter dict. It then compares the result with the parameter tree the target
model expects (`check_tree`), so a wrong file or a wrong model size is reported before anything
is written.
"""

from typing import Any, Iterable, Mapping

import flax
import flax.linen as nn
import jax
import numpy as np

from procap_jax import errors


class ConversionError(errors.UserError):
  """A weight file does not fit the model it is converted into (one sentence)."""


def take(state: Mapping[str, np.ndarray], key: str, shape: tuple[int, ...] | None = None,
         *, source: str = 'the checkpoint') -> np.ndarray:
  """`state[key]` as float32 (integers keep their dtype), checked against `shape`.

  Args:
    state: flat state dict.
    key: the torch parameter name.
    shape: the expected torch-side shape (before any transpose), or None to skip the check.
    source: how the file is named in the error.

  Raises:
    ConversionError: the key is missing or has another shape.
  """
  if key not in state:
    hint = _missing_hint(state, key)
    raise ConversionError(f'{source} has no parameter {key!r}{hint}; it is not the file this '
                          'converter expects, or the model size differs')
  value = np.asarray(state[key])
  if shape is not None and tuple(value.shape) != tuple(shape):
    raise ConversionError(f'{source}: {key!r} has shape {tuple(value.shape)}, the model expects '
                          f'{tuple(shape)}; the file is for another model size or config')
  if np.issubdtype(value.dtype, np.floating) or value.dtype.kind == 'V':
    value = value.astype(np.float32)
  return value


def _missing_hint(state: Mapping[str, np.ndarray], key: str) -> str:
  """What the file has instead of `key`: the same key under another prefix, or the other
  entries of the same module (never unrelated keys that merely share the ending)."""
  moved = sorted(k for k in state if k.endswith('.' + key))[:2]
  if moved:
    return f' (it has {" and ".join(map(repr, moved))}: another prefix)'
  module = key.rsplit('.', 1)[0] if '.' in key else ''
  siblings = sorted(k.rsplit('.', 1)[-1] for k in state
                    if '.' in k and k.rsplit('.', 1)[0] == module)
  if module and siblings:
    return f' (module {module!r} has {", ".join(siblings[:4])})'
  return ''


def linear(state: Mapping[str, np.ndarray], prefix: str, shape_in: int | None = None,
           shape_out: int | None = None, *, bias: bool = True, source: str = 'the checkpoint'
           ) -> dict[str, np.ndarray]:
  """torch Linear `prefix.weight [out, in]` (+ `prefix.bias`) -> flax Dense {kernel [in, out],
  bias}."""
  shape = None if shape_in is None or shape_out is None else (shape_out, shape_in)
  out = {'kernel': take(state, f'{prefix}.weight', shape, source=source).T}
  if bias:
    out['bias'] = take(state, f'{prefix}.bias', None if shape_out is None else (shape_out,),
                       source=source)
  return out


def layer_norm(state: Mapping[str, np.ndarray], prefix: str, width: int | None = None, *,
               source: str = 'the checkpoint') -> dict[str, np.ndarray]:
  """torch LayerNorm / GroupNorm `prefix.{weight,bias}` -> flax {scale, bias}."""
  shape = None if width is None else (width,)
  return {'scale': take(state, f'{prefix}.weight', shape, source=source),
          'bias': take(state, f'{prefix}.bias', shape, source=source)}


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
  return flax.traverse_util.flatten_dict(nn.meta.unbox(tree) if tree is not None else {})


def check_tree(converted: Mapping[str, Any], expected: Any, *, what: str = 'the model') -> None:
  """Raises ConversionError unless `converted` has exactly `expected`'s paths and shapes.

  Args:
    converted: nested dict of arrays.
    expected: the target parameter tree (arrays, ShapeDtypeStructs or boxed leaves), e.g. from
      `jax.eval_shape(model.init, ...)['params']`.
    what: how the target is named in the error.
  """
  ours, theirs = _flat(expected), _flat(dict(converted))
  for path, leaf in ours.items():
    name = '/'.join(path)
    if path not in theirs:
      raise ConversionError(f'the converted weights have no {name!r}, which {what} needs')
    got, want = tuple(np.shape(theirs[path])), tuple(leaf.shape)
    if got != want:
      raise ConversionError(f'converted {name!r} has shape {got}, {what} expects {want}; the file '
                            'is for another model size or config')
  extra = [p for p in theirs if p not in ours]
  if extra:
    raise ConversionError(f'the converted weights have {"/".join(extra[0])!r}, which {what} does '
                          'not have; the file is for another model or config')


def unused_keys(state: Mapping[str, np.ndarray], used: Iterable[str],
                ignore_prefixes: tuple[str, ...] = ()) -> list[str]:
  """Keys of `state` that a converter did not read and does not knowingly ignore (sorted)."""
  used = set(used)
  return sorted(k for k in state if k not in used and not k.startswith(ignore_prefixes))


def as_jax(tree: Any) -> Any:
  """Nested dict of numpy arrays -> the same of jax arrays."""
  return jax.tree.map(jax.numpy.asarray, tree)


def merge_into(params: Any, converted: Mapping[str, Any], *, what: str = 'the model') -> Any:
  """`params` with every leaf that `converted` has replaced by it (boxed leaves stay boxed).

  Args:
    params: the freshly initialised parameter tree (leaves may be flax `AxisMetadata` boxes).
    converted: nested dict with a subset of `params`' paths (e.g. only the CLIP blocks).
    what: how the target is named in errors.

  Raises:
    ConversionError: a converted path that `params` does not have, or another shape.
  """
  ours = flax.traverse_util.flatten_dict(dict(params))
  for path, value in flax.traverse_util.flatten_dict(dict(converted)).items():
    name = '/'.join(path)
    if path not in ours:
      raise ConversionError(f'the converted weights have {name!r}, which {what} does not have; '
                            'the file is for another model or config')
    leaf = ours[path]
    target = nn.meta.unbox(leaf)
    if tuple(np.shape(value)) != tuple(target.shape):
      raise ConversionError(f'converted {name!r} has shape {tuple(np.shape(value))}, {what} '
                            f'expects {tuple(target.shape)}; the file is for another model size')
    value = jax.numpy.asarray(value, target.dtype)
    ours[path] = leaf.replace_boxed(value) if isinstance(leaf, nn.meta.AxisMetadata) else value
  return flax.traverse_util.unflatten_dict(ours)
