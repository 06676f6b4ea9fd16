"""Keyframe sampling from a pseudo-sequence: the original confidence rule, uniform and top-k.

Dimensions: T frames in the sequence (9), k sampled interior frames (2 in ProCap).

The original (spec section 2, stage-1 loader and stage-2 CLEVR dataset) scores every frame t by
how unevenly it sits between the endpoints, s[t] = (d_start[t] - d_end[t])^2, where
d_start[t] = sim(before, frame t) and d_end[t] = sim(frame t, after). On the interior frames
1..T-2 it takes w = 1 - softmax(s) (temperature 1) and draws k distinct interior frames without
replacement with probabilities proportional to w (torch.multinomial), re-drawn every time an
item is loaded. Frames about equally similar to both ends are favoured, softly: 1 - softmax is
close to (n-1)/n for every frame unless the s values differ by several units. See
docs/procedure.md for how peaked this is on our scores.

Draws are seeded per example and epoch (`keyframe_rng`), so a run is reproducible and resumes
with the same draws.
"""

import numpy as np

STRATEGIES = ('confidence', 'uniform', 'topk')


def _weights(d_start: np.ndarray, d_end: np.ndarray) -> np.ndarray:
  """w = 1 - softmax(s[1:T-1]), s = (d_start - d_end)^2; float64 [T-2] (sums to T-3)."""
  d_start = np.asarray(d_start, np.float64)
  d_end = np.asarray(d_end, np.float64)
  if d_start.ndim != 1 or d_start.shape != d_end.shape or d_start.size < 3:
    raise ValueError(f'd_start and d_end must be 1-D of the same length T >= 3, got shapes '
                     f'{d_start.shape} and {d_end.shape}')
  if not (np.isfinite(d_start).all() and np.isfinite(d_end).all()):
    raise ValueError('d_start and d_end must be finite')
  s = (d_start[1:-1] - d_end[1:-1]) ** 2
  e = np.exp(s - s.max())
  return 1.0 - e / e.sum()


def confidence_probabilities(d_start: np.ndarray, d_end: np.ndarray) -> np.ndarray:
  """The probability of each interior frame on the first confidence draw.

  Args:
    d_start: [T] similarity of the before image to each frame.
    d_end: [T] similarity of each frame to the after image.

  Returns:
    float64 [T-2]: w / sum(w) for frames 1..T-2 (uniform when T = 3, where w = [0]).
  """
  w = _weights(d_start, d_end)
  total = w.sum()
  return w / total if total > 0 else np.full_like(w, 1.0 / w.size)


def _check_k(k: int, interior: int) -> None:
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
    raise ValueError(f'k must be a non-negative integer, got {k!r}')
  if k > interior:
    raise ValueError(f'cannot sample k={k} distinct frames from {interior} interior frames')


def sample_keyframes(d_start: np.ndarray | None, d_end: np.ndarray | None, k: int,
                     rng: np.random.Generator, strategy: str = 'confidence',
                     num_frames: int = 9) -> np.ndarray:
  """Samples k interior keyframes and adds the two endpoints.

  Args:
    d_start: [T] similarities sim(before, frame t), or None when the pair has no scores (then
      the draw is uniform over the interior of `num_frames` frames, whatever the strategy).
    d_end: [T] similarities sim(frame t, after), or None.
    k: number of interior frames, 0 <= k <= T - 2.
    rng: the generator of this example and epoch (`keyframe_rng`); `topk` does not use it.
    strategy: 'confidence' (the original rule), 'uniform' (uniform over the interior, without
      replacement) or 'topk' (the k interior frames with the largest w, ties to the lower index).
    num_frames: T when the scores are None.

  Returns:
    int32 [k + 2]: [0, a, b, ..., T-1], interior indices distinct and increasing.
  """
  if strategy not in STRATEGIES:
    raise ValueError(f'unknown keyframe strategy {strategy!r}; choose one of {STRATEGIES}')
  if d_start is None or d_end is None:
    strategy, t = 'uniform', int(num_frames)
    if t < 2:
      raise ValueError(f'num_frames must be at least 2, got {num_frames}')
  else:
    t = len(d_start)
    w = _weights(d_start, d_end)
  _check_k(k, t - 2)
  if k == t - 2:
    chosen = np.arange(1, t - 1)
  elif strategy == 'uniform':
    chosen = 1 + rng.choice(t - 2, size=k, replace=False)
  elif strategy == 'topk':
    order = np.lexsort((np.arange(t - 2), -w))   # largest w first, then lowest index
    chosen = 1 + order[:k]
  else:
    p = confidence_probabilities(d_start, d_end)
    if np.count_nonzero(p) < k:  # a one-hot softmax zeroes one weight; keep k drawable
      p = (p + 1e-12) / (p + 1e-12).sum()
    chosen = 1 + rng.choice(t - 2, size=k, replace=False, p=p)
  return np.concatenate([[0], np.sort(chosen), [t - 1]]).astype(np.int32)


def keyframe_rng(seed: int, example_index: int, epoch: int) -> np.random.Generator:
  """The generator of one example in one epoch: independent streams, reproducible on resume.

  Args:
    seed: the run's data seed.
    example_index: index of the record in its split.
    epoch: epoch number (0 for evaluation).

  Returns:
    A numpy Generator seeded with SeedSequence([seed, example_index, epoch]).
  """
  parts = (seed, example_index, epoch)
  if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in parts):
    raise ValueError(f'seed, example_index and epoch must be non-negative integers, got {parts}')
  return np.random.default_rng(np.random.SeedSequence([int(v) for v in parts]))
