r"""Train-step throughput, MFU and memory of a stage, on batches of the batch contract.

  python -m bench.train_step --config configs/synthetic.py:tiny                # all stages
  python -m bench.train_step --config configs/synthetic.py --stage caption --steps 10
  python -m bench.train_step --config configs/synthetic.py --dtype both        # f32 and bf16
  python -m bench.train_step --config configs/clevr_change.py:paper --stage pretrain \
      --batch 8 --steps 1 --compile_only                                      # memory analysis

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
"""

import argparse
import ast
import importlib
import time

import jax
import numpy as np

from bench import common
from procap_jax import sharding
from procap_jax import train
from procap_jax.diagnostics import stand_ins

STAGES = ('tokenizer', 'pretrain', 'caption')


def load_config(spec: str, overrides: list[str] | tuple[str, ...] = ()):
  """`file.py[:preset]` -> ConfigDict, with `key.sub=value` overrides applied."""
  path, _, arg = spec.partition(':')
  module = importlib.import_module(path.removesuffix('.py').replace('/', '.'))
  config = module.get_config(arg or None)
  for item in overrides:
    key, _, value = item.partition('=')
    node = config
    *parents, leaf = key.split('.')
    for part in parents:
      node = node[part]
    try:
      node[leaf] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      node[leaf] = value
  return config


def fill_vocab_sizes(config) -> None:
  """Vocabulary sizes that would come from the dataset (80 = CLEVR-Change's), in place."""
  if not config.pretrain.model.text_vocab_size:
    config.pretrain.model.text_vocab_size = 80
  if not config.caption.model.vocab_size:
    config.caption.model.vocab_size = 80
  config.caption.init_from_pretrain = False


def prepare(config, stage: str, batch_size: int, mesh=None):
  """(step_fn, state, batch, constants, rng) ready to time, on `mesh` (default from config)."""
  from procap_jax import stages
  fill_vocab_sizes(config)
  task = stages.TASKS[stage]
  mesh = mesh if mesh is not None else sharding.mesh_from_config(config)
  model = task.build_model(config)
  tx = task.make_optimizer(config, 1000)
  batch = stand_ins.fake_batch(config, batch_size)
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


def run(config_spec: str, stage: str, steps: int, batch_size: int | None, dtype: str,
        overrides: list[str] | tuple[str, ...] = (), compile_only: bool = False) -> dict:
  """Measures one stage's train step; returns the JSON record (see the module docstring)."""
  config = load_config(config_spec, overrides)
  config.compute_dtype = dtype
  batch_size = batch_size or int(config[stage].train.batch_size)
  step, state, batch, constants, rng = prepare(config, stage, batch_size)
  t0 = time.perf_counter()
  compiled = step.lower(state, batch, constants, rng).compile()
  compile_s = time.perf_counter() - t0
  flops = common.compiled_flops(compiled)
  record = {
      'bench': 'train_step', 'config': config_spec, 'stage': stage, 'dtype': dtype,
      'devices': jax.device_count(), 'batch': batch_size, 'overrides': list(overrides) or None,
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
    flops = _unlooped_flops(config_spec, stage, batch_size, dtype, overrides)
    record['step_gflop'] = flops / 1e9 if flops else None
    record['flops_from'] = 'the same step without scan_blocks / attention_chunk'
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


def _has_loops(config, stage: str) -> bool:
  """Whether the step runs the encoder blocks or attention chunks in XLA loops, whose bodies
  XLA's cost analysis counts once instead of once per iteration."""
  m = config.pretrain.model
  return stage != 'tokenizer' and bool(m.scan_blocks or m.attention_chunk)


def _unlooped_flops(config_spec: str, stage: str, batch_size: int, dtype: str,
                    overrides) -> float | None:
  """FLOPs of the same step compiled without the loops (same math, every iteration counted)."""
  config = load_config(config_spec, overrides)
  config.compute_dtype = dtype
  config.pretrain.model.scan_blocks, config.pretrain.model.attention_chunk = False, 0
  step, state, batch, constants, rng = prepare(config, stage, batch_size)
  return common.compiled_flops(step.lower(state, batch, constants, rng).compile())


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
  args = parser.parse_args()
  stages = STAGES if args.stage == 'all' else (args.stage,)
  dtypes = ('float32', 'bfloat16') if args.dtype == 'both' else (args.dtype,)
  for stage in stages:
    for dtype in dtypes:
      if args.in_process or (len(stages) == 1 and len(dtypes) == 1):
        common.emit(run(args.config, stage, args.steps, args.batch, dtype, args.set,
                        args.compile_only))
        continue
      child = ['--config', args.config, '--stage', stage, '--steps', str(args.steps),
               '--dtype', dtype, *(['--batch', str(args.batch)] if args.batch else []),
               *[f'--set={s}' for s in args.set],
               *(['--compile_only'] if args.compile_only else [])]
      for record in common.run_child('bench.train_step', child):
        common.emit(record)


if __name__ == '__main__':
  main()
