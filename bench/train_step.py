r"""Train-step throughput, MFU and memory of a stage, on batches of the batch contract.

  python -m bench.train_step --config configs/synthetic.py:tiny                # all stages
  python -m bench.train_step --config configs/synthetic.py --stage caption --steps 10
  python -m bench.train_step --config configs/synthetic.py --dtype both        # f32 and bf16
  python -m bench.train_step --config configs/clevr_change.py:paper --stage pretrain \
      --batch 8 --steps 1 --compile_only                                      # memory analysis
  python -m bench.train_step --config configs/synthetic.py --stage pretrain \
      --feature_cache alternate --steps 10     # without and with the feature cache, step by step

Prints one JSON line per (stage, dtype), each measured in a fresh process (so `peak_rss_gib` is
that measurement's own high-water mark; `--in_process` measures in this process instead):
config, stage, dtype, batch, step seconds (median and best), samples/s, tokens/s, model FLOPs
per step (XLA cost analysis of the compiled step), MFU against a matmul of the same precision
measured in the same process (median step: `mfu`; best step against the best matmul:
`mfu_best`), the compiled step's memory analysis (argument / output / temp GiB) and peak RSS.

Tokens per sample are the sequence positions the stage's transformer sees (frame tokens + text
slots + special tokens; pixels of one frame for the tokenizer). Random uint8 images and captions
stand in for data and a randomly initialised tokenizer for the frozen one: throughput does not
depend on the values. `--set key=value` overrides a config value (Python literal).

With `caption.train.scene_pairs` (the CLEVR presets) the stage-2 batch holds whole scenes as the
trainer feeds them: rows 2i and 2i + 1 share their before image, which the step encodes once
(`encodings.share_before`); `--set caption.train.scene_pairs=False` times every image encoded.

`--feature_cache on` times stages 1 and 2 as they run with the tokenizer feature cache
(`data.feature_cache`): the batch carries random cached features and codes, so the step encodes
only the corrupted frames (stage 1) or nothing (stage 2); `off` encodes the images as without
the cache; `both` measures off, then on (fresh processes); `alternate` compiles both steps in one
process and times them in turns, off, on, off, on, ..., `--steps` each, so a changing machine
load hits both alike: one line per variant, then one with the median of the per-pair ratios.
`--rounds R` repeats every measurement R times, in order.

`--variant NAME:KEY=VALUE,KEY=VALUE` (repeatable) compiles each named set of overrides (on top
of `--set`) in this process and times the variants in turns, `--steps` rounds, so that load
changes hit all alike: one line per variant (median and every step time, compiled memory), then
one with the peak RSS of the process (which covers all of them), e.g.

  python -m bench.train_step --config configs/clevr_change.py:paper --stage pretrain \
      --batch 8 --dtype bfloat16 --feature_cache on --steps 3 \
      --variant one: --variant micro4:pretrain.train.micro_batches=4
"""

import argparse
import importlib
import itertools
import os
import time

import jax
import numpy as np

from bench import common
from procap_jax import config_lib
from procap_jax import errors
from procap_jax import hostmem
from procap_jax import sharding
from procap_jax import train
from procap_jax.diagnostics import stand_ins

STAGES = ('tokenizer', 'pretrain', 'caption')


def load_config(spec: str, overrides: list[str] | tuple[str, ...] = ()):
  """`file.py[:preset]` -> ConfigDict, with `key.sub=value` overrides applied (an unknown key, a
  wrong type or an inconsistent config is a UserError, as in main) and 'auto' bf16
  switches resolved for this CPU (`config_lib.resolve_compute_path`; a bench's `--dtype` then
  sets config.compute_dtype, so 'auto' decides `tokenizer.frozen_dtype` there)."""
  path, _, arg = spec.partition(':')
  module = importlib.import_module(path.removesuffix('.py').replace('/', '.'))
  config = module.get_config(arg or None)
  for item in overrides:
    config_lib.apply_override(config, item)
  config_lib.validate(config)
  config_lib.resolve_compute_path(config)
  return config


def fill_vocab_sizes(config) -> None:
  """Vocabulary sizes that would come from the dataset (80 = CLEVR-Change's), in place."""
  if not config.pretrain.model.text_vocab_size:
    config.pretrain.model.text_vocab_size = 80
  if not config.caption.model.vocab_size:
    config.caption.model.vocab_size = 80
  config.caption.init_from_pretrain = False


def prepare(config, stage: str, batch_size: int, mesh=None, cached: bool = False):
  """(step_fn, state, batch, constants, rng) ready to time, on `mesh` (default from config);
  `cached`: the batch carries the tokenizer feature cache's keys (stages 1 and 2)."""
  from procap_jax import stages
  fill_vocab_sizes(config)
  task = stages.TASKS[stage]
  mesh = mesh if mesh is not None else sharding.mesh_from_config(config)
  model = task.build_model(config)
  tx = task.make_optimizer(config, 1000)
  # Whole scenes when the config groups them, then the trainer's host_batch (stage 2: each
  # shared before image encoded once, `encodings.share_before`).
  scenes = stage == 'caption' and config.caption.train.get('scene_pairs', False)
  batch = train.host_batch(task, stand_ins.fake_batch(
      config, batch_size, feature_cache=cached and stage != 'tokenizer', scenes=scenes), mesh)
  state, state_sh = train.create_state(task, model, config, tx, jax.random.key(0), batch, mesh)
  tokenizer = None if stage == 'tokenizer' else stand_ins.random_tokenizer(config)
  constants = None if tokenizer is None else {'tokenizer': tokenizer}
  const_sh = jax.tree.map(lambda _: sharding.replicated(mesh), constants)
  constants = jax.device_put(constants, const_sh)
  batch_sh = {k: sharding.batch_sharding(mesh, v.ndim) for k, v in batch.items()}
  step = train.make_train_step(task, model, config, tx, state_sh, batch_sh, const_sh, mesh)
  dev_batch = sharding.shard_batch(batch, mesh)
  return step, state, dev_batch, constants, jax.random.key(1)


def tokens_per_sample(config, stage: str) -> int:
  """Sequence positions per sample: pixels of one frame (tokenizer), else frame tokens + text
  slots + special tokens of the procedure encoder."""
  if stage == 'tokenizer':
    frames = int(config.tokenizer.train.frames_per_example) or config.data.num_keyframes + 2
    return config.data.image_size ** 2 * frames
  gh, gw = config.pretrain.model.grid
  frames = (config.data.num_keyframes + 2) * gh * gw
  return frames + config.data.max_caption_len + 3


def compile_step(config_spec: str, stage: str, batch_size: int | None, dtype: str,
                 overrides: list[str] | tuple[str, ...], cached: bool) -> tuple:
  """(config, batch size, compiled step, state, batch, constants, rng, compile seconds); the
  batch size defaults to the stage's."""
  config = load_config(config_spec, overrides)
  config.compute_dtype = dtype
  batch_size = batch_size or int(config[stage].train.batch_size)
  step, state, batch, constants, rng = prepare(config, stage, batch_size, cached=cached)
  t0 = time.perf_counter()
  compiled = step.lower(state, batch, constants, rng).compile()
  return (config, batch_size, compiled, state, batch, constants, rng,
          time.perf_counter() - t0)


def run(config_spec: str, stage: str, steps: int, batch_size: int | None, dtype: str,
        overrides: list[str] | tuple[str, ...] = (), compile_only: bool = False,
        cached: bool = False) -> dict:
  """Measures one stage's train step; returns the JSON record (see the module docstring)."""
  config, batch_size, compiled, state, batch, constants, rng, compile_s = compile_step(
      config_spec, stage, batch_size, dtype, overrides, cached)
  flops = common.compiled_flops(compiled)
  record = {
      'bench': 'train_step', 'config': config_spec, 'stage': stage, 'dtype': dtype,
      'frozen_dtype': config.tokenizer.frozen_dtype,
      'devices': jax.device_count(), 'batch': batch_size, 'overrides': list(overrides) or None,
      'feature_cache': cached and stage != 'tokenizer',
      'compile_s': compile_s, 'step_gflop': flops / 1e9 if flops else None,
      **common.memory_gib(compiled),
  }
  if compile_only:
    record['peak_rss_gib'] = common.peak_rss_gib()
    return record
  peak = common.matmul_peak_flops(dtype)
  t0 = time.perf_counter()
  state, metrics = compiled(state, batch, constants, rng)
  jax.block_until_ready(metrics)
  first = time.perf_counter() - t0
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch, constants, rng)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  if not times:
    times = [first]
  peak = max(peak, common.matmul_peak_flops(dtype))
  rss = common.peak_rss_gib()  # before the FLOP twin below allocates its own state
  if _has_loops(config, stage):
    flops = _unlooped_flops(config_spec, stage, batch_size, dtype, overrides, cached)
    record['step_gflop'] = flops / 1e9 if flops else None
    record['flops_from'] = 'the same step without its loops'
  sec, best = float(np.median(times)), float(np.min(times))
  devices = jax.device_count()
  record.update({
      'steps_timed': len(times), 'step_s': sec, 'step_s_best': best, 'first_step_s': first,
      'samples_per_s': batch_size / sec,
      'tokens_per_s': batch_size * tokens_per_sample(config, stage) / sec,
      'matmul_peak_gflops': peak / 1e9,
      'mfu': (flops / sec) / (peak * devices) if flops else None,
      'mfu_best': (flops / best) / (peak * devices) if flops else None,
      'loss': float(metrics['loss']), 'peak_rss_gib': rss,
  })
  return record


def _time_in_turns(runs: dict, steps: int) -> None:
  """Runs every compiled step of `runs` once per round, in order, for `steps` rounds,
  appending each step's seconds to its `times` (and carrying its donated state)."""
  for _ in range(steps):
    for r in runs.values():
      t0 = time.perf_counter()
      r['state'], metrics = r['compiled'](r['state'], r['batch'], r['constants'], r['rng'])
      jax.block_until_ready(metrics)
      r['times'].append(time.perf_counter() - t0)


def run_alternating(config_spec: str, stage: str, steps: int, batch_size: int | None, dtype: str,
                    overrides: list[str] | tuple[str, ...] = ()) -> list[dict]:
  """Times the stage's step without and with the feature cache in turns, in this process.

  Returns:
    One record per variant (step_s: median of its `steps` steps) and a `ratio` record: the
    median over the pairs of (cached step / uncached step) and the load average before/after.
  """
  load_before = os.getloadavg()
  runs = {}
  for cached in (False, True):
    _, batch_size, compiled, state, batch, constants, rng, compile_s = compile_step(
        config_spec, stage, batch_size, dtype, overrides, cached)
    state, metrics = compiled(state, batch, constants, rng)  # warm-up
    jax.block_until_ready(metrics)
    runs[cached] = dict(compiled=compiled, state=state, batch=batch, constants=constants,
                        rng=rng, times=[], compile_s=compile_s,
                        flops=common.compiled_flops(compiled))
  _time_in_turns(runs, steps)
  records = []
  for cached, r in runs.items():
    sec = float(np.median(r['times']))
    records.append({
        'bench': 'train_step', 'config': config_spec, 'stage': stage, 'dtype': dtype,
        'batch': batch_size, 'overrides': list(overrides) or None, 'feature_cache': cached,
        'alternating': True, 'steps_timed': len(r['times']), 'step_s': sec,
        'step_s_best': float(np.min(r['times'])), 'compile_s': r['compile_s'],
        'samples_per_s': batch_size / sec,
        'step_gflop': r['flops'] / 1e9 if r['flops'] else None})
  ratios = [on / off for off, on in zip(runs[False]['times'], runs[True]['times'])]
  records.append({'bench': 'train_step', 'config': config_spec, 'stage': stage,
                  'dtype': dtype, 'batch': batch_size, 'cached_over_uncached': float(
                      np.median(ratios)), 'pairs': len(ratios),
                  'load_before': [round(x, 2) for x in load_before],
                  'load_after': [round(x, 2) for x in os.getloadavg()],
                  'peak_rss_gib': common.peak_rss_gib()})
  return records


def run_variants(config_spec: str, stage: str, steps: int, batch_size: int | None, dtype: str,
                 overrides: list[str] | tuple[str, ...], cached: bool,
                 variants: dict[str, list[str]]) -> list[dict]:
  """Times the stage's step under each variant's overrides in turns, in this process.

  Returns:
    One record per variant (step_s: median of its `steps` steps; step_times: all of them;
    the compiled step's memory analysis) and one with the process's peak RSS and load.
  """
  load_before = os.getloadavg()
  runs = {}
  for name, extra in variants.items():
    _, size, compiled, state, batch, constants, rng, compile_s = compile_step(
        config_spec, stage, batch_size, dtype, list(overrides) + extra, cached)
    state, metrics = compiled(state, batch, constants, rng)  # warm-up
    jax.block_until_ready(metrics)
    runs[name] = dict(compiled=compiled, state=state, batch=batch, constants=constants, rng=rng,
                      times=[], compile_s=compile_s, size=size, loss=float(metrics['loss']))
  _time_in_turns(runs, steps)
  records = []
  for name, r in runs.items():
    sec = float(np.median(r['times']))
    records.append({
        'bench': 'train_step', 'config': config_spec, 'stage': stage, 'dtype': dtype,
        'batch': r['size'], 'overrides': list(overrides) or None, 'variant': name,
        'variant_overrides': variants[name], 'feature_cache': cached and stage != 'tokenizer',
        'steps_timed': len(r['times']), 'step_s': sec,
        'step_times': [round(t, 3) for t in r['times']], 'compile_s': r['compile_s'],
        'samples_per_s': r['size'] / sec, 'first_loss': r['loss'],
        **common.memory_gib(r['compiled'])})
  records.append({'bench': 'train_step', 'config': config_spec, 'stage': stage, 'dtype': dtype,
                  'variants': list(variants), 'load_before': [round(x, 2) for x in load_before],
                  'load_after': [round(x, 2) for x in os.getloadavg()],
                  'peak_rss_gib': common.peak_rss_gib()})
  return records


def _has_loops(config, stage: str) -> bool:
  """Whether the step runs the encoder blocks, attention chunks / groups, micro-batches or the
  tokenizer's frame chunks in XLA loops, whose bodies XLA's cost analysis counts once instead of
  once per iteration."""
  if stage == 'tokenizer':
    return int(config.tokenizer.train.get('frames_chunk', 0)) > 0
  m = config.pretrain.model
  micro = config[stage].train.get('micro_batches', 1) > 1
  return bool(m.scan_blocks or m.attention_chunk or m.attention_group or micro)


def _unlooped_flops(config_spec: str, stage: str, batch_size: int, dtype: str,
                    overrides, cached: bool = False) -> float | None:
  """FLOPs of the same step compiled without the loops (same math, every iteration counted)."""
  config = load_config(config_spec, overrides)
  config.compute_dtype = dtype
  m = config.pretrain.model
  m.scan_blocks, m.attention_chunk, m.attention_group = False, 0, 0
  if stage == 'tokenizer':
    config.tokenizer.train.frames_chunk = 0
  else:
    config[stage].train.micro_batches = 1
  step, state, batch, constants, rng = prepare(config, stage, batch_size, cached=cached)
  return common.compiled_flops(step.lower(state, batch, constants, rng).compile())


@errors.exit_on_user_error
def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/synthetic.py:tiny')
  parser.add_argument('--stage', default='all', choices=('all',) + STAGES)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--batch', type=int, default=None)
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16', 'both'))
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                      help='config override, e.g. --set pretrain.fused_forwards=False')
  parser.add_argument('--compile_only', action='store_true',
                      help='only compile: FLOPs and the memory analysis, no timing')
  parser.add_argument('--in_process', action='store_true',
                      help='measure in this process (peak RSS then covers every measurement)')
  parser.add_argument('--feature_cache', default='off',
                      choices=('off', 'on', 'both', 'alternate'),
                      help='time stages 1 and 2 reading the tokenizer feature cache (on), '
                      'encoding the images (off), both in turn, or alternate step by step')
  parser.add_argument('--rounds', type=int, default=1,
                      help='repeat every measurement this many times, in order')
  parser.add_argument('--variant', action='append', default=[],
                      metavar='NAME:KEY=VALUE,KEY=VALUE',
                      help='time these named override sets in turns in one process')
  args = parser.parse_args()
  load_config(args.config, args.set)  # a bad config or override: one sentence, before any child
  stages = STAGES if args.stage == 'all' else (args.stage,)
  dtypes = ('float32', 'bfloat16') if args.dtype == 'both' else (args.dtype,)
  if args.variant:
    if args.feature_cache not in ('off', 'on'):
      parser.error('--variant takes --feature_cache off or on')
    variants = {}
    for spec in args.variant:
      name, sep, sets = spec.partition(':')
      if not name or not sep:
        parser.error(f'--variant {spec!r}: expected NAME:KEY=VALUE,... (NAME: for none)')
      variants[name] = [item for item in sets.split(',') if item]
    for round_, stage, dtype in itertools.product(range(args.rounds), stages, dtypes):
      for record in run_variants(args.config, stage, args.steps, args.batch, dtype, args.set,
                                 args.feature_cache == 'on', variants):
        common.emit(dict(record, round=round_))
    return
  if args.feature_cache == 'alternate':
    for round_, stage, dtype in itertools.product(range(args.rounds), stages, dtypes):
      for record in run_alternating(args.config, stage, args.steps, args.batch, dtype, args.set):
        common.emit(dict(record, round=round_))
    return
  caches = {'off': (False,), 'on': (True,), 'both': (False, True)}[args.feature_cache]
  single = len(stages) == 1 and len(dtypes) == 1 and len(caches) == 1 and args.rounds == 1
  for round_, stage, dtype, cached in itertools.product(range(args.rounds), stages, dtypes,
                                                        caches):
    if args.in_process or single:
      record = run(args.config, stage, args.steps, args.batch, dtype, args.set,
                   args.compile_only, cached)
      common.emit(dict(record, round=round_))
      continue
    child = ['--config', args.config, '--stage', stage, '--steps', str(args.steps),
             '--dtype', dtype, *(['--batch', str(args.batch)] if args.batch else []),
             *[f'--set={s}' for s in args.set],
             *(['--compile_only'] if args.compile_only else []),
             '--feature_cache', 'on' if cached else 'off']
    for record in common.run_child('bench.train_step', child):
      common.emit(dict(record, round=round_))


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
