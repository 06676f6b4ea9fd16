r"""Confidence ("filter") scores: files in the original format, and the features behind them.

Dimensions: T frames (9), R rows of a score matrix, D feature size.

File format (spec section 1.2), JSON, one entry per pair:
  flat (Spot-the-Diff / IER):  {key: {"bef_inter_sim": [[T floats] x R], "inter_aft_sim": [...]}}
  CLEVR:  {"%06d.png": {"sc_sim_matrixes": {the two keys above}, "nsc_sim_matrixes": {...}}}
so the official filter files drop in unchanged. The sampler reads d_start = mean over rows of
bef_inter_sim (sim(before, frame t)) and d_end = mean over rows of inter_aft_sim
(sim(frame t, after)). Our pair ids: flat keys as they are; CLEVR key "000123.png" gives
"000123c" (sc entry) and "000123nc" (nsc entry), as the dataset builders name pairs.

Our scores: cosine similarities of L2-normalised image features, so in [-1, 1] (in [0, 1] for
the non-negative `stats` features), one row (R = 1). Feature functions map uint8 frames
[T, H, W, 3] to L2-normalised float32 features [T, D]: `stats_features` needs no training;
`make_encoder_feature_fn` wraps a trained encoder (the VQ tokenizer's `encode_features`).

Command (a scores file for a TFDS dataset):

  python -m procap_jax.procedure.scores --data_dir D --dataset synthetic_change/tiny \
      --split train --source frames --feature stats --out F.json
"""

import argparse
import json
import multiprocessing
import os
import re
from typing import Callable

import cv2
import numpy as np

from procap_jax import errors
from procap_jax import progress as progress_lib
from procap_jax.procedure import interpolation

FeatureFn = Callable[[np.ndarray], np.ndarray]
BEF, AFT = 'bef_inter_sim', 'inter_aft_sim'
CLEVR_HALVES = {'c': 'sc_sim_matrixes', 'nc': 'nsc_sim_matrixes'}
_BLOCK = 64  # records per task of a parallel `scores_for_split`
_CLEVR_ID = re.compile(r'^(\d+)(c|nc)$')
_STATS_SIZE = 64          # frames are resized to this square before `stats_features`
_GRIDS = (1, 2, 4)        # spatial pyramid: cells per side


# ---------------------------------------------------------------------------------- features
def _normalise(x: np.ndarray) -> np.ndarray:
  """L2-normalises the rows of x [N, D] (zero rows stay zero)."""
  norm = np.linalg.norm(x, axis=-1, keepdims=True)
  return (x / np.maximum(norm, 1e-12)).astype(np.float32)


def _cell_sums(values: np.ndarray, grid: int) -> np.ndarray:
  """Sums values [S, S, C] over a grid x grid partition; returns [grid * grid * C]."""
  s, c = values.shape[0], values.shape[-1]
  return values.reshape(grid, s // grid, grid, s // grid, c).sum(axis=(1, 3)).reshape(-1)


def _cell_counts(labels: np.ndarray, num_labels: int, grid: int) -> np.ndarray:
  """Histogram of integer labels [S, S] in every cell of a grid x grid partition; float32
  [grid * grid * num_labels], laid out as `_cell_sums` of the labels' one-hot [S, S, L]."""
  s = labels.shape[0]
  cell = (np.arange(s) // (s // grid))                                  # [S] cell per row/column
  index = (cell[:, None] * grid + cell[None, :]) * num_labels + labels  # [S, S]
  return np.bincount(index.ravel(), minlength=grid * grid * num_labels).astype(np.float32)


def stats_features(frames: np.ndarray) -> np.ndarray:
  """Training-free image features: colour histograms and gradient statistics, several scales.

  Each frame is resized to 64 x 64. Blocks: a joint RGB histogram (4 x 4 x 4 bins) in every
  cell of 1x1, 2x2 and 4x4 grids (a spatial pyramid, so a moved object changes the feature);
  and, at 64, 32 and 16 px, a gradient-orientation histogram (8 bins, magnitude-weighted) in the
  same cells. Each block is L2-normalised, square-rooted (Hellinger) and the concatenation
  L2-normalised, so cosines lie in [0, 1].

  Args:
    frames: uint8 [T, H, W, 3].

  Returns:
    float32 [T, D], unit rows.
  """
  out = []
  for frame in np.asarray(frames):
    img = cv2.resize(interpolation.to_rgb(frame), (_STATS_SIZE, _STATS_SIZE),
                     interpolation=cv2.INTER_AREA)
    bins = (img // 64).astype(np.int64)                              # [S, S, 3] in 0..3
    colour = bins[..., 0] * 16 + bins[..., 1] * 4 + bins[..., 2]       # [S, S] in 0..63
    blocks = [np.concatenate([_cell_counts(colour, 64, g) for g in _GRIDS])]
    gray = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY).astype(np.float32) / 255.0
    for size in (64, 32, 16):
      g = cv2.resize(gray, (size, size), interpolation=cv2.INTER_AREA)
      gx, gy = cv2.Sobel(g, cv2.CV_32F, 1, 0), cv2.Sobel(g, cv2.CV_32F, 0, 1)
      magnitude, angle = np.hypot(gx, gy), np.arctan2(gy, gx) % np.pi
      orient = np.minimum((angle / np.pi * 8).astype(np.int64), 7)
      hist = np.eye(8, dtype=np.float32)[orient] * magnitude[..., None]   # [s, s, 8]
      blocks.append(np.concatenate([_cell_sums(hist, gr) for gr in _GRIDS]))
    out.append(np.concatenate([np.sqrt(_normalise(b[None])[0]) for b in blocks]))
  return _normalise(np.stack(out))


def make_encoder_feature_fn(encode_features: Callable[[np.ndarray], np.ndarray],
                            image_size: int | None = None, grid: int = 2) -> FeatureFn:
  """Wraps an image encoder as a feature function.

  Args:
    encode_features: maps float32 images [B, S, S, 3] in [0, 1] to features [B, h, w, C]
      (e.g. `lambda x: vqgan.apply(variables, x, method=vqgan.encode_features)`).
    image_size: S, the encoder's input size (frames are resized to it); None keeps their size.
    grid: the features are mean-pooled over the whole map and over a grid x grid partition (so
      positions still count), concatenated and L2-normalised.

  Returns:
    A function uint8 [T, H, W, 3] -> float32 [T, (1 + grid^2) C] with unit rows.
  """

  def feature_fn(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if image_size is not None and frames.shape[1:3] != (image_size, image_size):
      frames = np.stack([cv2.resize(f, (image_size, image_size), interpolation=cv2.INTER_AREA)
                         for f in frames])
    maps = np.asarray(encode_features(frames.astype(np.float32) / 255.0), np.float32)
    b, h, w, c = maps.shape
    pooled = [maps.mean(axis=(1, 2))]
    if grid > 1:
      ys = np.linspace(0, h, grid + 1).astype(int)
      xs = np.linspace(0, w, grid + 1).astype(int)
      for i in range(grid):
        for j in range(grid):
          cell = maps[:, ys[i]:max(ys[i + 1], ys[i] + 1), xs[j]:max(xs[j + 1], xs[j] + 1)]
          pooled.append(cell.mean(axis=(1, 2)))
    return _normalise(np.concatenate(pooled, axis=-1).reshape(b, -1))

  return feature_fn


FEATURES: dict[str, FeatureFn] = {'stats': stats_features}


def compute_pair_scores(frames: np.ndarray, feature_fn: FeatureFn) -> tuple[np.ndarray, np.ndarray]:
  """Similarities of every frame to the endpoints, as one score-matrix row each.

  Args:
    frames: uint8 [T, H, W, 3], frame 0 = before, T-1 = after.
    feature_fn: uint8 [T, H, W, 3] -> float [T, D].

  Returns:
    (bef_inter_sim [1, T], inter_aft_sim [1, T]), float64: cos(f(frame 0), f(frame t)) and
    cos(f(frame t), f(frame T-1)).
  """
  f = _normalise(np.asarray(feature_fn(frames), np.float64)).astype(np.float64)
  return (f @ f[0])[None], (f @ f[-1])[None]


# ------------------------------------------------------------------------------------- files
def _matrix(value, path: str, key: str, name: str) -> np.ndarray:
  """A score matrix [R, T] from JSON (a flat list is one row); UserError when malformed."""
  try:
    m = np.asarray(value, np.float64)
  except (TypeError, ValueError):
    m = np.zeros((0,))
  if m.ndim == 1:
    m = m[None]
  if m.ndim != 2 or 0 in m.shape or not np.isfinite(m).all():
    raise errors.UserError(f'scores file {path}: entry {key!r} has a malformed {name!r} (expected '
                           'a list of rows of finite numbers); fix or regenerate the file')
  return m


def _d_pair(entry, path: str, key: str) -> tuple[np.ndarray, np.ndarray]:
  if not isinstance(entry, dict) or BEF not in entry or AFT not in entry:
    raise errors.UserError(f'scores file {path}: entry {key!r} lacks {BEF!r} / {AFT!r}; fix or '
                           'regenerate the file')
  d_start = _matrix(entry[BEF], path, key, BEF).mean(axis=0)
  d_end = _matrix(entry[AFT], path, key, AFT).mean(axis=0)
  if d_start.shape != d_end.shape:
    raise errors.UserError(f'scores file {path}: entry {key!r} has {BEF!r} and {AFT!r} of '
                           'different lengths; fix or regenerate the file')
  return d_start, d_end


def _clevr_number(key: str, path: str) -> int:
  match = re.search(r'(\d+)(?:\.png)?$', key)
  if not match:
    raise errors.UserError(f'scores file {path}: CLEVR-style key {key!r} is not like '
                           '"000123.png"; fix or regenerate the file')
  return int(match.group(1))


def load_scores(path: str, style: str = 'auto') -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Reads a scores file (ours or an official filter file).

  Args:
    path: the JSON file.
    style: 'flat', 'clevr' or 'auto' (CLEVR when entries hold sc/nsc matrices).

  Returns:
    {pair_id: (d_start [T], d_end [T])}, the means over rows, float64.

  Raises:
    UserError: the file is missing, not JSON, or not in either format.
  """
  if style not in ('auto', 'flat', 'clevr'):
    raise ValueError(f"style must be 'auto', 'flat' or 'clevr', got {style!r}")
  data = errors.read_json(
      path, 'scores file',
      'compute it with `python -m procap_jax.procedure.scores` or fix the path', 'regenerate it')
  if not isinstance(data, dict) or not data:
    raise errors.UserError(f'scores file {path} is not a non-empty JSON object keyed by pair; '
                           'regenerate it')
  if style == 'auto':
    first = next(iter(data.values()))
    clevr = isinstance(first, dict) and any(h in first for h in CLEVR_HALVES.values())
    style = 'clevr' if clevr else 'flat'
  out = {}
  for key, entry in data.items():
    if style == 'flat':
      out[key] = _d_pair(entry, path, key)
      continue
    number = _clevr_number(key, path)
    if not isinstance(entry, dict) or not any(h in entry for h in CLEVR_HALVES.values()):
      raise errors.UserError(f'scores file {path}: CLEVR-style entry {key!r} has neither '
                             '"sc_sim_matrixes" nor "nsc_sim_matrixes"; fix or regenerate it')
    for suffix, half in CLEVR_HALVES.items():
      if half in entry:
        out[f'{number:06d}{suffix}'] = _d_pair(entry[half], path, f'{key}/{half}')
  return out


def write_scores(path: str, scores: dict[str, tuple[np.ndarray, np.ndarray]],
                 style: str = 'auto') -> str:
  """Writes a scores file atomically.

  Args:
    path: the JSON file to write.
    scores: {pair_id: (bef_inter_sim [R, T], inter_aft_sim [R, T])}.
    style: 'flat', 'clevr' (pair ids '%06d' + 'c'/'nc') or 'auto' (clevr when every id is so).

  Returns:
    The style written.
  """
  if style == 'auto':
    style = 'clevr' if scores and all(_CLEVR_ID.match(k) for k in scores) else 'flat'
  if style not in ('flat', 'clevr'):
    raise ValueError(f"style must be 'auto', 'flat' or 'clevr', got {style!r}")
  rows = lambda m: np.round(np.atleast_2d(np.asarray(m, np.float64)), 6).tolist()
  data = {}
  for pair_id in sorted(scores):
    bef, aft = scores[pair_id]
    entry = {BEF: rows(bef), AFT: rows(aft)}
    if style == 'flat':
      data[pair_id] = entry
      continue
    match = _CLEVR_ID.match(pair_id)
    if not match:
      raise ValueError(f'pair id {pair_id!r} is not CLEVR-style (%06d + c/nc)')
    data.setdefault(f'{int(match.group(1)):06d}.png', {})[CLEVR_HALVES[match.group(2)]] = entry
  errors.write_text_atomic(path, json.dumps(data, separators=(',', ':')) + '\n')
  return style


# --------------------------------------------------------------------------------- command
def _text(x) -> str:
  return x.decode('utf-8') if isinstance(x, bytes) else str(x)


def _pair_scores(record: dict, frames_from: str,
                 feature_fn: FeatureFn) -> tuple[str, tuple[np.ndarray, np.ndarray]]:
  """(pair id, scores) of one record; see `scores_for_split`."""
  if frames_from == 'crossfade':
    frames = interpolation.interpolate(record['before'], record['after'], method='crossfade')
  else:
    frames = record['oracle_frames' if frames_from == 'oracle' else 'frames']
    if len(frames) == 0:
      raise errors.UserError(f'record {_text(record["pair_id"])} has no {frames_from} frames '
                             '(oracle frames exist for the synthetic dataset only)')
    frames = np.stack([np.asarray(f) for f in frames])
  return _text(record['pair_id']), compute_pair_scores(frames, feature_fn)


_worker_args: tuple = ()  # (source, frames_from, feature_fn) in a `scores_for_split` worker


def _init_worker(*args) -> None:
  global _worker_args
  cv2.setNumThreads(1)
  _worker_args = args


def _score_rows(rows: tuple[int, int]) -> list:
  source, frames_from, feature_fn = _worker_args
  return [_pair_scores(source[i], frames_from, feature_fn) for i in range(*rows)]


def scores_for_split(source, frames_from: str, feature_fn: FeatureFn, progress: bool = True,
                     workers: int = 1) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Scores of every record of a split.

  Args:
    source: random-access records (`tfds.data_source`) with `pair_id` and `frames` /
      `oracle_frames` (sequences of uint8 [H, W, 3]) or `before` / `after`.
    frames_from: 'frames' (the stored interpolation), 'oracle' (the renderer's frames) or
      'crossfade' (blended from before / after).
    feature_fn: the image features.
    progress: show progress (`procap_jax.progress.bar`).
    workers: > 1 scores blocks of records in that many spawned processes (source and
      feature_fn must pickle, e.g. a TFDS data source and `stats_features`); same result.

  Returns:
    {pair_id: (bef_inter_sim [1, T], inter_aft_sim [1, T])}, in record order.
  """
  n = len(source)
  out = {}
  with progress_lib.bar(total=n, desc='scores', unit='pair', disable=not progress) as bar:
    if workers <= 1 or n < 2 * _BLOCK:
      for i in range(n):
        key, value = _pair_scores(source[i], frames_from, feature_fn)
        out[key] = value
        bar.update(1)
      return out
    blocks = [(i, min(i + _BLOCK, n)) for i in range(0, n, _BLOCK)]
    ctx = multiprocessing.get_context('spawn')  # safe with JAX / TFDS threads in the parent
    with ctx.Pool(workers, initializer=_init_worker,
                  initargs=(source, frames_from, feature_fn)) as pool:
      for (start, stop), part in zip(blocks, pool.imap(_score_rows, blocks)):
        out.update(part)
        bar.update(stop - start)
  return out


@errors.exit_on_user_error
def main(argv: list[str] | None = None) -> None:
  """Computes the scores file of one split of a TFDS dataset."""
  parser = argparse.ArgumentParser(prog='python -m procap_jax.procedure.scores',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('--data_dir', required=True, help='TFDS data directory')
  parser.add_argument('--dataset', required=True,
                      help='TFDS name/config, e.g. synthetic_change/tiny')
  parser.add_argument('--split', default='train')
  parser.add_argument('--source', default='frames', choices=('frames', 'oracle', 'crossfade'))
  parser.add_argument('--feature', default='stats', choices=sorted(FEATURES))
  parser.add_argument('--style', default='auto', choices=('auto', 'flat', 'clevr'))
  parser.add_argument('--out', required=True, help='the JSON file to write')
  parser.add_argument('--workers', type=int, default=len(os.sched_getaffinity(0)),
                      help='processes scoring records (default: every available core)')
  args = parser.parse_args(argv)
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (slow import)
  try:
    source = tfds.data_source(args.dataset, data_dir=args.data_dir, split=args.split)
  except Exception as e:  # noqa: BLE001  TFDS raises many types for a missing dataset
    raise errors.UserError(f'cannot read {args.dataset} split {args.split!r} in {args.data_dir} '
                           f'({type(e).__name__}); build the dataset first') from None
  scores = scores_for_split(source, args.source, FEATURES[args.feature], workers=args.workers)
  style = write_scores(args.out, scores, args.style)
  print(f'wrote {len(scores)} pairs ({style} style) to {args.out}')


if __name__ == '__main__':
  main()
