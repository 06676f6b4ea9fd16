r"""Command line: build one dataset config, without Beam (default) or on a Beam runner.

  python -m tfds_builders.build clevr_change/paper --data_dir D --manual_dir M
  python -m tfds_builders.build clevr_change/paper --data_dir D --manual_dir M \
      --beam_options='--runner=DirectRunner --direct_num_workers=2 \
                      --direct_running_mode=multi_processing'
  python -m tfds_builders.build synthetic_change/small --data_dir D --beam_options='...'

Datasets: synthetic_change (configs tiny, small, full; no manual directory), clevr_change,
spot_the_diff, image_editing_request (configs paper, cpu64, paper_h5, cpu64_h5, tiny32), levir_cc
(paper, cpu64, tiny32); a manual directory as each builder's README.md describes. The cluster commands (Flink, Spark) are in
docs/performance.md "Building datasets on Beam". A prepared config is reused, not rebuilt.
Prints one JSON line (dataset, data_dir, pairs per split, build seconds or null when it was
already prepared); exits with status 2 and one sentence on a user error.
"""

import argparse
import json
import os
import time

from procap_jax import errors
from tfds_builders import clevr_change
from tfds_builders import image_editing_request
from tfds_builders import levir_cc
from tfds_builders import spot_the_diff
from tfds_builders import synthetic_change

# name -> builder package (each exposes Builder and prepare).
DATASETS = {
    'synthetic_change': synthetic_change,
    'clevr_change': clevr_change,
    'spot_the_diff': spot_the_diff,
    'image_editing_request': image_editing_request,
    'levir_cc': levir_cc,
}


def build(dataset: str, data_dir: str, *, manual_dir: str = '', num_workers: int | None = None,
          beam_options: str = '') -> dict:
  """Prepares `dataset` ('<name>/<config>') in `data_dir`; returns the JSON line's fields."""
  name, _, config = dataset.partition('/')
  if name not in DATASETS or not config:
    raise errors.UserError(f'dataset {dataset!r} should be <name>/<config> with a name among '
                           f'{", ".join(DATASETS)}, e.g. clevr_change/paper')
  module = DATASETS[name]
  kwargs = dict(num_workers=num_workers, beam_options=beam_options)
  if name != 'synthetic_change':
    kwargs['manual_dir'] = manual_dir
  elif manual_dir:
    raise errors.UserError('synthetic_change is generated, it takes no --manual_dir')
  existing = os.path.join(data_dir, name, config)
  was_prepared = os.path.isdir(existing) and any(
      os.path.exists(os.path.join(existing, v, 'dataset_info.json')) for v in os.listdir(existing))
  t0 = time.perf_counter()
  builder = module.prepare(config, data_dir, **kwargs)
  seconds = None if was_prepared else round(time.perf_counter() - t0, 1)
  return {'dataset': f'{name}/{config}', 'data_dir': os.fspath(builder.data_dir),
          'pairs': {s: int(i.num_examples) for s, i in builder.info.splits.items()},
          'build_s': seconds, 'beam_options': beam_options}


@errors.exit_on_user_error
def main(argv: list[str] | None = None) -> None:
  """Parses the command line, builds, prints one JSON line."""
  parser = argparse.ArgumentParser(prog='python -m tfds_builders.build',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('dataset', help='<name>/<config>, e.g. clevr_change/paper')
  parser.add_argument('--data_dir', required=True, help='TFDS data directory')
  parser.add_argument('--manual_dir', default='', help='the original files (real datasets)')
  parser.add_argument('--num_workers', type=int, default=None,
                      help='without Beam: build processes (default: every available core)')
  parser.add_argument('--beam_options', default='',
                      help='build on Beam with these Beam flags (needs the [beam] extra)')
  args = parser.parse_args(argv)
  print(json.dumps(build(args.dataset, args.data_dir, manual_dir=args.manual_dir,
                         num_workers=args.num_workers, beam_options=args.beam_options)),
        flush=True)


if __name__ == '__main__':
  main()
