"""The frozen tokenizer's features and codes of every source frame, encoded once.

Stages 1 and 2 feed the frozen stage-0 tokenizer's encodings of their frames to the encoder.
With `data.feature_cache` those are computed once per tokenizer and dataset instead of at every
step, and stored as memory-mapped .npy files next to the dataset (n records of a split, h x w
token grid, C feature channels, N = h*w):

  <dataset dir>/feature_cache/<key>/<split>.features.npy   [n, 9, h, w, C] data.feature_cache_dtype
  <dataset dir>/feature_cache/<key>/<split>.codes.npy      int32 [n, 9, N]
  <dataset dir>/feature_cache/<key>/meta.json              what the key covers (written last)

Slot 0 holds the resized before image, 8 the after image and 1..7 the interior frames of
`data.frame_source`: every image the pipeline can put in `keyframes` (the sampler draws interior
frames 1..7 only, and no image is augmented before the tokenizer), so the pipeline gathers a
batch's encodings by `keyframe_index` (`pipeline.source_frames`). The encodings are those of
`procap_jax.models.encodings` (images / 255 in float32; features and codes from the same images).

The key hashes the tokenizer parameters, `config.tokenizer.model`, the dataset (name, builder
config, version), the image size, the frame source and the storage dtype: runs sharing a
tokenizer share the cache (the ablation runner copies one tokenizer into several runs), a
changed tokenizer makes a new one. Old caches are not deleted.

A build writes into `<key>.partial/` chunk by chunk and records the rows done in
`progress.json` after each chunk is flushed, so a killed build resumes where it stopped; the
finished folder is renamed to `<key>`. A lock file keeps two builds of one key apart; with
several processes, process 0 builds first while the others wait (`load`).
"""

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import zlib
from typing import Any, Iterator

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np

from procap_jax import errors
from procap_jax import progress
from procap_jax.data import pipeline
from procap_jax.models import vqgan
from procap_jax.models import encodings

FORMAT = 1  # bump when the stored layout or the encodings change
SPLITS = ('train', 'val', 'test')
DTYPES = ('float32', 'float16')
KEYS = ('keyframe_features', 'keyframe_codes')  # the batch keys the cache adds
_CHUNK = 8  # records encoded per call (72 frames) and written per progress step


# ----------------------------------------------------------------------------- key


_digest_memo: list = []  # [(leaves, digest)]: the last parameters hashed, kept alive with it


def params_digest(params: Any) -> str:
  """sha256 of a parameter tree (paths, dtypes, shapes and bytes), numpy or jax leaves."""
  leaves = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params))
  if _digest_memo and len(_digest_memo[0][0]) == len(leaves) and all(
      a is b for (_, a), (_, b) in zip(_digest_memo[0][0], leaves)):
    return _digest_memo[0][1]
  h = hashlib.sha256()
  for path, leaf in leaves:
    value = np.ascontiguousarray(jax.device_get(leaf))
    h.update(f'{jax.tree_util.keystr(path)}|{value.dtype}|{value.shape}|'.encode())
    h.update(value.tobytes())
  _digest_memo[:] = [(leaves, h.hexdigest())]
  return _digest_memo[0][1]


def describe(config, workdir: str, tokenizer_params: Any) -> dict:
  """Everything the cached values depend on (hashed into the cache's folder name)."""
  d = config.data
  if d.feature_cache_dtype not in DTYPES:
    raise errors.UserError(f'config.data.feature_cache_dtype is {d.feature_cache_dtype!r}; '
                           f'choose one of {", ".join(DTYPES)}')
  return {'format': FORMAT, 'dataset': d.name, 'builder_config': d.builder_config,
          'version': os.path.basename(pipeline.dataset_dir(config, workdir)),
          'image_size': int(d.image_size), 'frame_source': d.frame_source,
          'dtype': d.feature_cache_dtype,
          'tokenizer_model': json.loads(json.dumps(config.tokenizer.model.to_dict())),
          'tokenizer_params': params_digest(tokenizer_params)}


def cache_dir(config, workdir: str, tokenizer_params: Any) -> str:
  """`<dataset dir>/feature_cache/<key>` of this config and tokenizer (built or not)."""
  text = json.dumps(describe(config, workdir, tokenizer_params), sort_keys=True)
  key = hashlib.sha256(text.encode()).hexdigest()[:16]
  return os.path.join(pipeline.dataset_dir(config, workdir), 'feature_cache', key)


# ----------------------------------------------------------------------------- reading


def _corrupt(directory: str, what: str) -> errors.UserError:
  return errors.UserError(f'the tokenizer feature cache {directory} is corrupt or incomplete '
                          f'({what}); delete that folder and run again to rebuild it')


def _row_check(features: np.ndarray, codes: np.ndarray) -> list[int]:
  """crc32 of the first and last rows of a split (a cheap check that the files are the ones
  written, without reading them whole)."""
  rows = (0, len(features) - 1)
  return [zlib.crc32(np.ascontiguousarray(a[r]).tobytes()) for a in (features, codes)
          for r in rows]


class SplitCache:
  """One split's arrays, opened (read-only memory maps) on first use in each process."""

  def __init__(self, directory: str, split: str, meta: dict):
    self.paths = tuple(os.path.join(directory, f'{split}.{k}.npy') for k in ('features', 'codes'))
    self.directory, self.split, self.meta = directory, split, meta
    self._arrays = None

  def __getstate__(self) -> dict:
    return {k: v for k, v in self.__dict__.items() if k != '_arrays'} | {'_arrays': None}

  def arrays(self) -> tuple[np.ndarray, np.ndarray]:
    """(features [n, 9, h, w, C], codes int32 [n, 9, N]), checked against meta.json."""
    if self._arrays is None:
      m = self.meta
      n = m['rows'][self.split]
      want = ((n, pipeline.NUM_SOURCE_FRAMES, *m['grid'], m['channels']), m['dtype']), (
          (n, pipeline.NUM_SOURCE_FRAMES, m['grid'][0] * m['grid'][1]), 'int32')
      arrays = []
      for path, (shape, dtype) in zip(self.paths, want):
        try:
          a = np.load(path, mmap_mode='r')
        except (OSError, ValueError, EOFError) as e:
          raise _corrupt(self.directory, f'{os.path.basename(path)}: {e}') from None
        if a.shape != shape or a.dtype != np.dtype(dtype):
          raise _corrupt(self.directory, f'{os.path.basename(path)} holds {a.dtype} '
                                         f'{list(a.shape)} instead of {dtype} {list(shape)}')
        arrays.append(a)
      if n and _row_check(*arrays) != m['checks'][self.split]:
        raise _corrupt(self.directory, f'the {self.split} arrays differ from those written')
      self._arrays = tuple(arrays)
    return self._arrays

  def gather(self, index: int, keyframe_index: np.ndarray) -> dict:
    """The batch keys of record `index` at its keyframes [T]: features [T, h, w, C], codes
    int32 [T, N]."""
    features, codes = self.arrays()
    return {'keyframe_features': np.asarray(features[index, keyframe_index]),
            'keyframe_codes': np.asarray(codes[index, keyframe_index])}


class FeatureCache:
  """A built cache: `split(name)` gives that split's `SplitCache`."""

  def __init__(self, directory: str, meta: dict):
    self.directory, self.meta = directory, meta
    self._splits = {s: SplitCache(directory, s, meta) for s in meta['rows']}

  def split(self, name: str) -> SplitCache:
    return self._splits[name]


def open_cache(directory: str, expected: dict | None = None) -> FeatureCache:
  """Opens a built cache; UserError (one sentence) when it is corrupt or not this key's."""
  try:
    with open(os.path.join(directory, 'meta.json'), encoding='utf-8') as f:
      meta = json.load(f)
    rows, checks = dict(meta['rows']), dict(meta['checks'])
    if set(rows) != set(checks) or not all(isinstance(v, int) for v in rows.values()):
      raise ValueError('inconsistent rows')
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise _corrupt(directory, f'meta.json unreadable: {e}') from None
  if expected is not None and meta.get('describe') != expected:
    raise _corrupt(directory, 'meta.json describes another tokenizer or dataset')
  cache = FeatureCache(directory, meta)
  for split in rows:
    cache.split(split).arrays()
  return cache


# ----------------------------------------------------------------------------- building


@functools.partial(jax.jit, static_argnames=('tokenizer',))
def _encode(params: Any, images: jax.Array, tokenizer: vqgan.Frozen):
  """uint8 [M, S, S, 3] -> (features [M, h, w, C], codes int32 [M, N]), as the stages encode."""
  features, codes = encodings.encode_both(tokenizer, params, encodings.images01(images))
  return features, codes.astype(jnp.int32)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
  with open(path, 'a', encoding='utf-8') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _file_bytes(shape: tuple, dtype: str) -> int:
  return int(np.prod(shape)) * np.dtype(dtype).itemsize


def build(config, workdir: str, tokenizer_params: Any, *, tokenizer: Any = None,
          chunk: int = _CHUNK) -> str:
  """Builds the cache of this config and tokenizer when missing (resuming a killed build).

  Args:
    config: the run config.
    workdir: the run's workdir (finds the dataset).
    tokenizer_params: the frozen tokenizer's parameters.
    tokenizer: the frozen tokenizer (`encode_features`, `encode_tokens`; hashable); None = the
      VQGAN of `config.tokenizer.model`.
    chunk: records encoded per call and per progress step.

  Returns:
    The cache folder.

  Raises:
    UserError: not enough disk space, or a record without the 9 source frames.
  """
  expected = describe(config, workdir, tokenizer_params)
  final = cache_dir(config, workdir, tokenizer_params)
  if os.path.exists(os.path.join(final, 'meta.json')):
    return final
  partial = final + '.partial'
  errors.check_writable_dir(os.path.dirname(final), 'set config.data.data_dir to a writable '
                            'folder or config.data.feature_cache=False')
  with _locked(final + '.lock'):
    if os.path.exists(os.path.join(final, 'meta.json')):  # built while we waited
      return final
    _build_locked(config, workdir, tokenizer_params, tokenizer or vqgan.frozen(
        config.tokenizer.model), expected, partial, chunk)
    if os.path.exists(final):  # a folder left without meta.json: not a cache
      shutil.rmtree(final)
    os.replace(partial, final)
  return final


def _build_locked(config, workdir, tokenizer_params, tokenizer, expected, partial,
                  chunk) -> None:
  s = int(config.data.image_size)
  probe = jax.ShapeDtypeStruct((1, s, s, 3), jnp.uint8)
  f_shape, _ = jax.eval_shape(lambda p, x: _encode(p, x, tokenizer=tokenizer), tokenizer_params,
                              probe)
  grid, channels = tuple(f_shape.shape[1:3]), int(f_shape.shape[3])
  sources = {split: pipeline.open_source(config, workdir, split) for split in SPLITS}
  rows = {split: len(src) for split, src in sources.items()}
  progress_path = os.path.join(partial, 'progress.json')
  done = {split: 0 for split in SPLITS}
  if os.path.exists(progress_path):
    try:
      with open(progress_path, encoding='utf-8') as f:
        saved = json.load(f)
      if saved['describe'] == expected and saved['rows'] == rows:
        done = {split: int(saved['done'][split]) for split in SPLITS}
    except (OSError, ValueError, KeyError, TypeError):
      pass  # unreadable: start again
  if not any(done.values()) and os.path.exists(partial):
    shutil.rmtree(partial)
  os.makedirs(partial, exist_ok=True)

  dtype = expected['dtype']
  nine = pipeline.NUM_SOURCE_FRAMES
  shapes = {split: ((n, nine, *grid, channels), (n, nine, grid[0] * grid[1]))
            for split, n in rows.items()}
  _check_space(partial, shapes, dtype)
  total, start = sum(rows.values()), sum(done.values())
  size = sum(_file_bytes(fs, dtype) + _file_bytes(cs, 'int32') for fs, cs in shapes.values())
  print(f'tokenizer feature cache: encoding {total} records x {nine} frames into {partial} '
        f'({size / 2**30:.2f} GiB)', flush=True)
  checks = {}
  with progress.bar(total=total, initial=start, unit='record', desc='feature cache',
                    dynamic_ncols=True) as bar:
    for split in SPLITS:
      paths = [os.path.join(partial, f'{split}.{k}.npy') for k in ('features', 'codes')]
      mode = 'r+' if done[split] else 'w+'
      features = np.lib.format.open_memmap(paths[0], mode, dtype, shapes[split][0])
      codes = np.lib.format.open_memmap(paths[1], mode, np.int32, shapes[split][1])
      for first, images in _chunks(config, sources[split], done[split], chunk):
        m = len(images)  # [m, 9, S, S, 3]
        padded = np.concatenate([images, np.zeros((chunk - m,) + images.shape[1:], np.uint8)])
        f, c = _encode(tokenizer_params, padded.reshape((-1, s, s, 3)), tokenizer=tokenizer)
        features[first:first + m] = np.asarray(f).reshape((chunk, nine) + f.shape[1:])[:m]
        codes[first:first + m] = np.asarray(c).reshape(chunk, nine, -1)[:m]
        features.flush()
        codes.flush()
        done[split] = first + m
        errors.write_text_atomic(progress_path, json.dumps(
            {'describe': expected, 'rows': rows, 'done': done}))
        bar.update(m)
      checks[split] = _row_check(features, codes) if rows[split] else []
      del features, codes
  meta = {'describe': expected, 'rows': rows, 'grid': list(grid), 'channels': channels,
          'dtype': dtype, 'checks': checks}
  errors.write_text_atomic(os.path.join(partial, 'meta.json'), json.dumps(meta, indent=1))
  os.remove(progress_path)


def _chunks(config, src, start: int, chunk: int) -> Iterator[tuple[int, np.ndarray]]:
  """(first record index, uint8 [<= chunk, 9, S, S, 3]) from record `start` on; the records are
  decoded on 2 threads while the tokenizer encodes."""
  if start >= len(src):
    return
  ds = grain.MapDataset.source(src)[start:].map(lambda r: pipeline.source_frames(config, r))
  ds = ds.batch(chunk, drop_remainder=False)
  first = start
  for images in ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=2)):
    yield first, np.asarray(images)
    first += len(images)


def _check_space(directory: str, shapes: dict, dtype: str) -> None:
  """UserError when the files still to be allocated do not fit the free disk space."""
  need = 0
  for split, (f_shape, c_shape) in shapes.items():
    for kind, shape, dt in (('features', f_shape, dtype), ('codes', c_shape, 'int32')):
      path = os.path.join(directory, f'{split}.{kind}.npy')
      have = os.stat(path).st_blocks * 512 if os.path.exists(path) else 0
      need += max(0, _file_bytes(shape, dt) - have)
  free = shutil.disk_usage(directory).free
  if need > free:
    raise errors.UserError(
        f'the tokenizer feature cache needs {need / 2**30:.1f} GiB more in {directory} but only '
        f'{free / 2**30:.1f} GiB are free; free space, set config.data.feature_cache_dtype='
        "'float16' (half the size) or config.data.feature_cache=False")


# ----------------------------------------------------------------------------- entry point


def load(config, workdir: str, tokenizer_params: Any, *, build_missing: bool = False,
         tokenizer: Any = None) -> FeatureCache | None:
  """The cache of this config and tokenizer, or None when `data.feature_cache` is off.

  Args:
    config: the run config.
    workdir: the run's workdir (finds the dataset).
    tokenizer_params: the frozen tokenizer's parameters (numpy or jax leaves).
    build_missing: build a missing cache (training); False returns None instead (evaluation
      builds nothing and then encodes the images). With several processes every process must
      call it (process 0 builds first, the others wait, then build what they still lack).
    tokenizer: the frozen tokenizer a build uses (None = the VQGAN of the config).
  """
  if not config.data.feature_cache:
    return None
  if build_missing:
    if jax.process_count() == 1:
      build(config, workdir, tokenizer_params, tokenizer=tokenizer)
    else:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      if jax.process_index() == 0:
        build(config, workdir, tokenizer_params, tokenizer=tokenizer)
      multihost_utils.sync_global_devices('procap_jax.data.feature_cache.load')
      if jax.process_index() != 0:
        build(config, workdir, tokenizer_params, tokenizer=tokenizer)  # at once if shared
  directory = cache_dir(config, workdir, tokenizer_params)
  if not os.path.exists(os.path.join(directory, 'meta.json')):
    return None
  cache = open_cache(directory, describe(config, workdir, tokenizer_params))
  for split, n in cache.meta['rows'].items():
    if n != len(pipeline.open_source(config, workdir, split)):
      raise _corrupt(directory, f'{n} {split} records cached, the dataset has another number')
  return cache
