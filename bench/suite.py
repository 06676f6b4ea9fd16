r"""Every benchmark, each measurement in a fresh process: one JSON line per measurement.

  python -m bench.suite                          # tiny and the synthetic default (minutes)
  python -m bench.suite --sizes tiny,default,paper --out bench_results.jsonl

Sizes:
  tiny     configs/synthetic.py:tiny: train steps of every stage, inference, `tiny` build.
  default  configs/synthetic.py: train steps in float32 and bfloat16, inference, `small` build.
  paper    configs/clevr_change.py:paper: stage-1 and stage-2 train steps (a few steps), inference
           at batch 32, and the compiled memory of the sharded stage-1 step (bench.memory).

Each child is `python -m bench.<module> ...` (`common.run_child`), so `peak_rss_gib` is that
measurement's own high-water mark; a failing child gives one record with `error` and the suite
goes on. `--out` also appends the lines to a file.
"""

import argparse
import json

from bench import common

SYN = 'configs/synthetic.py'
PAPER = 'configs/clevr_change.py:paper'

PLAN = {
    'tiny': [
        ('bench.train_step', ['--config', f'{SYN}:tiny', '--steps', '3']),
        ('bench.caption_speed', ['--config', f'{SYN}:tiny', '--batch', '8']),
        ('bench.dataset_build', ['--config', 'tiny']),
    ],
    'default': [
        ('bench.train_step', ['--config', SYN, '--steps', '5', '--dtype', 'both']),
        ('bench.caption_speed', ['--config', SYN, '--batch', '32']),
        ('bench.caption_speed', ['--config', SYN, '--batch', '32', '--dtype', 'bfloat16']),
        ('bench.dataset_build', ['--config', 'small']),
    ],
    'paper': [
        ('bench.train_step', ['--config', PAPER, '--stage', 'pretrain', '--batch', '8',
                              '--steps', '2', '--dtype', 'both']),
        ('bench.train_step', ['--config', PAPER, '--stage', 'caption', '--batch', '32',
                              '--steps', '2', '--dtype', 'both']),
        ('bench.caption_speed', ['--config', PAPER, '--batch', '32', '--repeats', '2']),
        ('bench.memory', ['--config', PAPER, '--stage', 'pretrain', '--batch', '8']),
    ],
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--sizes', default='tiny,default',
                      help=f'comma-separated, from {", ".join(PLAN)}')
  parser.add_argument('--out', default='', help='also append the JSON lines to this file')
  args = parser.parse_args()
  sizes = [s for s in args.sizes.split(',') if s]
  unknown = [s for s in sizes if s not in PLAN]
  if unknown:
    parser.error(f'unknown size(s) {", ".join(unknown)}; choose from {", ".join(PLAN)}')
  for size in sizes:
    for module, child_args in PLAN[size]:
      for record in common.run_child(module, child_args):
        record.setdefault('size', size)
        common.emit(record)
        if args.out:
          with open(args.out, 'a', encoding='utf-8') as f:
            f.write(json.dumps(record) + '\n')


if __name__ == '__main__':
  main()
