r"""Time of building the tokenizer feature cache (`procap_jax/data/feature_cache.py`).

  python -m bench.feature_cache_build --config configs/synthetic.py --data_dir D
  python -m bench.feature_cache_build --config configs/synthetic.py --data_dir D \
      --set data.builder_config=tiny      # the default's 64 px encodings of the tiny records

Builds the config's dataset in D when it is missing (not timed), then builds the cache of a
randomly initialised tokenizer of `config.tokenizer.model` (the build's work does not depend on
the weights) in a fresh folder under D, and prints one JSON line: records and frames encoded,
seconds, records/s, the cache's size on disk and the load average before and after. The cache
is deleted afterwards unless `--keep`. `--set key=value` overrides a config value.
"""

import argparse
import json
import os
import shutil
import time

from bench import common
from bench import train_step
from procap_jax import hostmem
from procap_jax.data import feature_cache
from procap_jax.data import pipeline
from procap_jax.diagnostics import stand_ins


def run(config_spec: str, data_dir: str, keep: bool = False, overrides: tuple = ()) -> dict:
  """Builds the cache once; returns the JSON record (see the module docstring)."""
  from procap_jax import stages
  config = train_step.load_config(config_spec, overrides)
  config.data.data_dir = data_dir
  workdir = os.path.dirname(os.path.abspath(data_dir))
  stages.prepare_data(config, workdir)
  params = stand_ins.random_tokenizer(config)
  directory = feature_cache.cache_dir(config, workdir, params)
  shutil.rmtree(directory, ignore_errors=True)
  shutil.rmtree(directory + '.partial', ignore_errors=True)
  load_before = os.getloadavg()
  t0 = time.perf_counter()
  feature_cache.build(config, workdir, params)
  seconds = time.perf_counter() - t0
  records = sum(len(pipeline.open_source(config, workdir, s)) for s in feature_cache.SPLITS)
  size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
  if not keep:
    shutil.rmtree(directory)
  return {'bench': 'feature_cache_build', 'config': config_spec, 'overrides': list(overrides),
          'dataset': f'{config.data.name}/{config.data.builder_config}',
          'image_size': int(config.data.image_size), 'dtype': config.data.feature_cache_dtype,
          'records': records, 'frames': records * pipeline.NUM_SOURCE_FRAMES,
          'seconds': seconds, 'records_per_s': records / seconds, 'size_gib': size / 2**30,
          'load_before': [round(x, 2) for x in load_before],
          'load_after': [round(x, 2) for x in os.getloadavg()],
          'peak_rss_gib': common.peak_rss_gib()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/synthetic.py')
  parser.add_argument('--data_dir', required=True, help='dataset folder (built when missing)')
  parser.add_argument('--keep', action='store_true', help='keep the cache built')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                      help='config override, e.g. --set data.builder_config=tiny')
  args = parser.parse_args()
  print(json.dumps(run(args.config, args.data_dir, args.keep, tuple(args.set))), flush=True)


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
