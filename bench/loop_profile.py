r"""Where the training loop's time goes: input pipeline, host-to-device transfer, step, retracing.

  python -m bench.loop_profile --config configs/synthetic.py --data_dir D --stage pretrain
  python -m bench.loop_profile --config configs/synthetic.py:tiny --data_dir D --steps 20

Runs the pieces of `procap_jax.train.run` on a built dataset (`--data_dir`, the TFDS data
directory; the synthetic builder's `small` for the default config): the grain input pipeline
(`pipeline.make_train_dataset` + `TrainIterator`, as in training), `sharding.shard_batch` and the
jitted step. A randomly initialised tokenizer stands in for the trained one (time does not depend
on the values). One JSON line per stage with, per step (median seconds):

  data_s     time blocked in `next(iterator)` while the step runs asynchronously (the real loop)
  put_s      host-to-device placement of the batch
  step_s     step time when synchronised after every step (compute only)
  loop_s     wall time per step of the real asynchronous loop (data + put + step overlapped)
  pipeline_only_samples_per_s  the input pipeline alone, no step running
  compiles   XLA compilations during the timed steps (0 = no retracing)
"""

import argparse
import time

import jax
import numpy as np

from bench import common
from bench import train_step as bench_step
from procap_jax import hostmem
from procap_jax import sharding
from procap_jax import stages
from procap_jax.data import pipeline

_COMPILES = []


def _count_compiles(event: str, duration: float, **_) -> None:
  del duration
  if 'backend_compile' in event:
    _COMPILES.append(event)


def profile(config_spec: str, data_dir: str, stage: str, steps: int, dtype: str) -> dict:
  """Times `steps` steps of one stage's loop; see the module docstring for the fields."""
  config = bench_step.load_config(config_spec)
  config.compute_dtype = dtype
  config.data.data_dir = data_dir
  config.caption.init_from_pretrain = False
  workdir = data_dir  # only used to find the dataset, vocabulary and scores (data_dir is set)
  pipeline.resolve_vocab_sizes(config, workdir)
  batch_size = int(config[stage].train.batch_size)
  ds = pipeline.make_train_dataset(config, workdir, batch_size, int(config.seed))
  # The step and state of bench.train_step (a contract batch of the same shapes stands in for
  # the example; the real batches come from `ds` below).
  step_fn, state, _, constants, rng = bench_step.prepare(config, stage, batch_size)
  mesh = sharding.mesh_from_config(config)

  # The input pipeline alone (fresh iterator, nothing else running).
  it = pipeline.TrainIterator(ds)
  next(it)
  t0 = time.perf_counter()
  for _ in range(steps):
    next(it)
  pipeline_only = steps * batch_size / (time.perf_counter() - t0)

  it = pipeline.TrainIterator(ds)
  state, metrics = step_fn(state, sharding.shard_batch(next(it), mesh), constants, rng)  # compile
  jax.block_until_ready(metrics)
  jax.monitoring.register_event_duration_secs_listener(_count_compiles)
  _COMPILES.clear()

  # Synchronised steps: attributes time to data, transfer and compute.
  data_s, put_s, step_s = [], [], []
  for _ in range(steps):
    t0 = time.perf_counter()
    host = next(it)
    t1 = time.perf_counter()
    batch = sharding.shard_batch(host, mesh)
    jax.block_until_ready(batch)
    t2 = time.perf_counter()
    state, metrics = step_fn(state, batch, constants, rng)
    jax.block_until_ready(metrics)
    t3 = time.perf_counter()
    data_s.append(t1 - t0)
    put_s.append(t2 - t1)
    step_s.append(t3 - t2)

  # The real loop: asynchronous dispatch, one sync at the end (as train.run between log steps).
  wait_s = []
  t_loop = time.perf_counter()
  for _ in range(steps):
    t0 = time.perf_counter()
    host = next(it)
    wait_s.append(time.perf_counter() - t0)
    state, metrics = step_fn(state, sharding.shard_batch(host, mesh), constants, rng)
  jax.block_until_ready(metrics)
  loop_s = (time.perf_counter() - t_loop) / steps
  compiles = len(_COMPILES)
  return {
      'bench': 'loop_profile', 'config': config_spec, 'stage': stage, 'dtype': dtype,
      'batch': batch_size, 'steps_timed': steps,
      'data_s': float(np.median(data_s)), 'put_s': float(np.median(put_s)),
      'step_s': float(np.median(step_s)), 'loop_s': loop_s,
      'data_wait_async_s': float(np.median(wait_s)),
      'samples_per_s': batch_size / loop_s,
      'tokens_per_s': batch_size * bench_step.tokens_per_sample(config, stage) / loop_s,
      'pipeline_only_samples_per_s': pipeline_only,
      'pipeline_share': float(np.median(data_s)) / max(1e-9, float(np.median(step_s))),
      'compiles': compiles, 'mfu': None, 'peak_rss_gib': common.peak_rss_gib(),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/synthetic.py')
  parser.add_argument('--data_dir', required=True, help='TFDS data dir holding the built dataset')
  parser.add_argument('--stage', default='all', choices=('all',) + tuple(stages.TASKS))
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  args = parser.parse_args()
  from absl import flags
  flags.FLAGS.mark_as_parsed()  # grain reads absl flags
  for stage in (tuple(stages.TASKS) if args.stage == 'all' else (args.stage,)):
    common.emit(profile(args.config, args.data_dir, stage, args.steps, args.dtype))


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
