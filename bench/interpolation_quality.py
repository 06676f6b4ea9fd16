r"""Interpolation quality against the renderer's true procedure (synthetic benchmark).

For every pair of a split, each method interpolates 9 frames from the before and after images;
frames t = 1/8 .. 7/8 are compared with the oracle frames at the same t (PSNR, and SSIM with an
11 x 11 Gaussian window, sigma 1.5, per channel). Prints one JSON line per (method, change type)
and one per method over all pairs ("change_type": "all"), with pairs per second (interpolation
only, one process; a ratio to crossfade is the stable figure on a shared machine).

Command (builds the config into --data_dir first unless it is already there):

  python -m bench.interpolation_quality --data_dir data --config small --split val
"""

import argparse
import collections
import json
import time

import numpy as np

from procap_jax.procedure import interpolation

_C1, _C2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2


def _gaussian(size: int = 11, sigma: float = 1.5) -> np.ndarray:
  x = np.arange(size) - (size - 1) / 2
  g = np.exp(-x ** 2 / (2 * sigma ** 2))
  return g / g.sum()


def _filter(x: np.ndarray, g: np.ndarray) -> np.ndarray:
  """Separable 'valid' filtering of x [H, W, C] with the 1-D kernel g on both spatial axes."""
  k = len(g)
  x = np.lib.stride_tricks.sliding_window_view(x, k, axis=0) @ g          # [H-k+1, W, C]
  return np.lib.stride_tricks.sliding_window_view(x, k, axis=1) @ g       # [H-k+1, W-k+1, C]


def ssim(x: np.ndarray, y: np.ndarray) -> float:
  """Mean SSIM (Wang et al. 2004) of two images [H, W, C] on the 0..255 scale."""
  x, y = x.astype(np.float64), y.astype(np.float64)
  g = _gaussian(min(11, x.shape[0], x.shape[1]))
  mx, my = _filter(x, g), _filter(y, g)
  sxx = _filter(x * x, g) - mx * mx
  syy = _filter(y * y, g) - my * my
  sxy = _filter(x * y, g) - mx * my
  s = ((2 * mx * my + _C1) * (2 * sxy + _C2)) / ((mx * mx + my * my + _C1) * (sxx + syy + _C2))
  return float(s.mean())


def psnr(x: np.ndarray, y: np.ndarray) -> float:
  """PSNR in dB of two uint8 images (capped at 100 dB for identical images)."""
  mse = np.mean((x.astype(np.float64) - y.astype(np.float64)) ** 2)
  return float(min(100.0, 10 * np.log10(255.0 ** 2 / max(mse, 1e-12))))


def _emit(record: dict) -> None:
  print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}),
        flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--data_dir', required=True, help='TFDS data directory')
  parser.add_argument('--config', default='small', help='synthetic_change config (tiny, small)')
  parser.add_argument('--split', default='val')
  parser.add_argument('--methods', default='flow,flow_direct,crossfade')
  parser.add_argument('--max_pairs', type=int, default=0, help='0: the whole split')
  args = parser.parse_args()

  from tfds_builders import synthetic_change  # pylint: disable=g-import-not-at-top (slow)
  builder = synthetic_change.prepare(args.config, args.data_dir)
  source = builder.as_data_source(args.split)
  names = builder.info.features['change_type'].names
  n = len(source) if args.max_pairs <= 0 else min(args.max_pairs, len(source))
  records = [source[i] for i in range(n)]
  for method in args.methods.split(','):
    per_type = collections.defaultdict(list)   # change type -> [(psnr [7], ssim [7])]
    seconds = 0.0
    for r in records:
      oracle = np.stack(r['oracle_frames'])
      t0 = time.perf_counter()
      frames = interpolation.interpolate(r['before'], r['after'], len(oracle), method=method)
      seconds += time.perf_counter() - t0
      inner = range(1, len(oracle) - 1)
      per_type[names[r['change_type']]].append(
          ([psnr(frames[t], oracle[t]) for t in inner],
           [ssim(frames[t], oracle[t]) for t in inner]))
    per_type['all'] = [v for k in list(per_type) for v in per_type[k]]
    for change_type, values in sorted(per_type.items()):
      p = np.array([v[0] for v in values])
      s = np.array([v[1] for v in values])
      _emit({'bench': 'interpolation_quality', 'config': args.config, 'split': args.split,
             'method': method, 'change_type': change_type, 'pairs': len(values),
             'psnr': float(p.mean()), 'ssim': float(s.mean()),
             'psnr_by_t': [round(float(v), 2) for v in p.mean(0)],
             'pairs_per_s': n / seconds if change_type == 'all' else None})


if __name__ == '__main__':
  main()
