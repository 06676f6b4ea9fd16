r"""Dataset build speed: pairs per second of the synthetic builder (render, interpolate, write).

  python -m bench.dataset_build                       # `tiny` (80 pairs), one worker per core
  python -m bench.dataset_build --config small --workers 2

Builds the config into a fresh temporary directory (removed afterwards) and prints one JSON
line: pairs (records over all splits), build seconds, `samples_per_s` = pairs/s,
`tokens_per_s` = frames/s (before, after and the 9 interpolated frames per pair) and this
process's peak RSS. Run it alone (or through `bench.suite`) for a per-measurement RSS; the
worker processes' peak is `children_peak_rss_gib`. `mfu` is null (no model).
"""

import argparse
import os
import resource
import shutil
import tempfile
import time

from bench import common

FRAMES_PER_PAIR = 2 + 9  # before, after and the stored 9-frame interpolation (incl. ends)


def measure(config_name: str, workers: int | None) -> dict:
  """Builds `synthetic_change/<config_name>` from scratch and times it."""
  from tfds_builders.synthetic_change import synthetic_change_dataset_builder as scb
  tmp = tempfile.mkdtemp(prefix='bench_build_')
  try:
    t0 = time.perf_counter()
    builder = scb.build(config_name, tmp, num_workers=workers)
    seconds = time.perf_counter() - t0
    pairs = sum(int(s.num_examples) for s in builder.info.splits.values())
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
  return {
      'bench': 'dataset_build', 'config': f'synthetic_change/{config_name}', 'batch': None,
      'workers': scb.resolve_workers(workers), 'pairs': pairs, 'build_s': seconds,
      'samples_per_s': pairs / seconds, 'tokens_per_s': pairs * FRAMES_PER_PAIR / seconds,
      'mfu': None, 'peak_rss_gib': common.peak_rss_gib(), 'children_peak_rss_gib': children,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='tiny', choices=('tiny', 'small', 'full'))
  parser.add_argument('--workers', type=int, default=None, help='default: one per core')
  args = parser.parse_args()
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  common.emit(measure(args.config, args.workers))


if __name__ == '__main__':
  main()
