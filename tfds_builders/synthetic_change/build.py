r"""Command line: build a synthetic_change config and print its statistics.

  python -m tfds_builders.synthetic_change.build --config tiny --data_dir D [--num_workers N]
  python -m tfds_builders.synthetic_change.build --config small --data_dir D \
      --beam_options='--runner=DirectRunner --direct_num_workers=2
                      --direct_running_mode=multi_processing'

Prints the image size, pairs per split and change type, caption counts and the build time
(or that the config was already prepared). Exits with status 2 and one sentence on a user
error (unknown config, unwritable data directory). In Python, call
`tfds_builders.synthetic_change.prepare(...)` instead (this module is the command line only).
"""

import argparse
import collections
import json
import time

import tensorflow_datasets as tfds

from procap_jax import errors
from procap_jax import progress
from tfds_builders.synthetic_change import scene
from tfds_builders.synthetic_change import synthetic_change_dataset_builder as builder_lib


def _text(x) -> str:
  return x.decode('utf-8') if isinstance(x, bytes) else str(x)


def statistics(builder: tfds.core.DatasetBuilder) -> dict:
  """Counts read back from a prepared builder.

  Returns:
    {config, image_size, interpolation, seed, splits: {split: {scenes, pairs, change_types,
    captions, captions_per_pair, distinct_captions}}, vocabulary}.
  """
  cfg = builder.builder_config
  names = builder.info.features['change_type'].names
  stats = {'config': cfg.name, 'image_size': cfg.image_size, 'interpolation': cfg.interpolation,
           'seed': cfg.seed, 'splits': {}}
  words = set()
  for split in scene.SPLITS:
    src = builder.as_data_source(split=split)
    types, scenes, distinct = collections.Counter(), set(), set()
    per_pair = []
    for i in progress.bar(range(len(src)), desc=f'reading {split}', unit='pair', mininterval=2.0,
                          leave=False):
      r = src[i]
      types[names[int(r['change_type'])]] += 1
      scenes.add(int(r['scene_id']))
      caps = [_text(c) for c in r['captions']]
      per_pair.append(len(caps))
      distinct.update(caps)
      for c in caps:
        words.update(c.split())
    stats['splits'][split] = {
        'scenes': len(scenes),
        'pairs': len(src),
        'change_types': {n: types[n] for n in names if types[n]},
        'captions': sum(per_pair),
        'captions_per_pair': [min(per_pair, default=0), max(per_pair, default=0)],
        'distinct_captions': len(distinct),
    }
  stats['vocabulary'] = len(words)
  return stats


def format_statistics(stats: dict) -> str:
  lines = [f"synthetic_change/{stats['config']}: {stats['image_size']}x{stats['image_size']} "
           f"RGB, interpolation {stats['interpolation']!r}, seed {stats['seed']}"]
  for split, s in stats['splits'].items():
    types = ', '.join(f'{k} {v}' for k, v in s['change_types'].items())
    lo, hi = s['captions_per_pair']
    lines.append(f"  {split:5s} {s['scenes']:6d} scenes {s['pairs']:6d} pairs ({types}); "
                 f"{s['captions']} captions ({lo}-{hi} per pair, {s['distinct_captions']} "
                 'distinct)')
  lines.append(f"  vocabulary: {stats['vocabulary']} words")
  if stats.get('build_seconds') is None:
    lines.append('  build time: not measured (already prepared)')
  elif stats.get('beam_options'):
    lines.append(f"  build time: {stats['build_seconds']:.1f} s on Beam ({stats['beam_options']})")
  else:
    lines.append(f"  build time: {stats['build_seconds']:.1f} s with {stats['workers']} "
                 'worker process(es)')
  return '\n'.join(lines)


@errors.exit_on_user_error
def main(argv: list[str] | None = None) -> None:
  """Builds the requested config (unless prepared) and prints its statistics."""
  parser = argparse.ArgumentParser(
      prog='python -m tfds_builders.synthetic_change.build', description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='small',
                      help=f'builder config: {", ".join(builder_lib.config_names())}')
  parser.add_argument('--data_dir', required=True, help='TFDS data directory')
  parser.add_argument('--num_workers', type=int, default=None,
                      help='rendering processes (default: every available core)')
  parser.add_argument('--beam_options', default='',
                      help="build in a Beam pipeline with these Beam flags, e.g. "
                      "'--runner=DirectRunner --direct_num_workers=2 "
                      "--direct_running_mode=multi_processing' (needs the [beam] extra)")
  parser.add_argument('--json', action='store_true', help='print the statistics as JSON')
  args = parser.parse_args(argv)

  builder_lib.check_config_name(args.config)
  existing = builder_lib.Builder(config=args.config, data_dir=args.data_dir)
  was_prepared = builder_lib.is_prepared(existing)
  t0 = time.perf_counter()
  builder = builder_lib.build(args.config, args.data_dir, num_workers=args.num_workers,
                              beam_options=args.beam_options)
  seconds = None if was_prepared else time.perf_counter() - t0
  stats = statistics(builder)
  stats['build_seconds'] = None if seconds is None else round(seconds, 1)
  cfg = builder.builder_config
  stats['workers'] = max(builder_lib.workers_for(cfg.num_scenes(s), args.num_workers)
                         for s in scene.SPLITS)
  stats['beam_options'] = args.beam_options
  print(json.dumps(stats) if args.json else format_statistics(stats), flush=True)


if __name__ == '__main__':
  main()
