r"""Train-step throughput, MFU and peak memory of a stage, on batches of the batch contract.

  python -m bench.train_step --config configs/synthetic.py:tiny --stage pretrain
  python -m bench.train_step --config configs/synthetic.py --stage caption --steps 10
  python -m bench.train_step --config configs/clevr_change.py:paper --stage pretrain --steps 2
  python -m bench.train_step ... --dtype bfloat16        # bf16 compute, f32 params/accumulation

Prints one JSON line: config, stage, batch, step seconds, samples/s, tokens/s, model FLOPs per
step (XLA cost analysis of the compiled step), MFU against a matmul of the same precision
measured in this process, peak RSS. Random uint8 images and captions stand in for data and a
randomly initialised tokenizer for the frozen one: throughput does not depend on the values.
"""

import argparse
import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from procap_jax import sharding
from procap_jax import train
from procap_jax.models import vqgan


def load_config(spec: str):
  path, _, arg = spec.partition(':')
  module = importlib.import_module(path.removesuffix('.py').replace('/', '.'))
  return module.get_config(arg or None)


def fake_batch(config, batch_size: int, seed: int = 0) -> dict:
  """A batch of the contract with random content."""
  rng = np.random.default_rng(seed)
  s, t, l = config.data.image_size, config.data.num_keyframes + 2, config.data.max_caption_len
  frames = rng.integers(0, 256, (batch_size, t, s, s, 3), dtype=np.uint8)
  caption = rng.integers(8, 40, (batch_size, l)).astype(np.int32)
  caption[:, 0] = 4
  caption[:, 12] = 5
  caption[:, 13:] = 0
  return {
      'before': frames[:, 0], 'after': frames[:, -1], 'keyframes': frames,
      'keyframe_index': np.tile(np.linspace(0, 8, t).astype(np.int32), (batch_size, 1)),
      'caption_in': caption, 'encoder_text': np.where(caption > 7, caption, 0).astype(np.int32),
      'change_type': rng.integers(0, 6, batch_size).astype(np.int32),
      'example_index': np.arange(batch_size, dtype=np.int32),
      'valid': np.ones(batch_size, bool),
  }


def random_tokenizer(config) -> dict:
  model = vqgan.VQGAN(**config.tokenizer.model)
  s = config.data.image_size
  variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros([1, s, s, 3]))
  return jax.tree.map(np.asarray, jax.device_get(nn_unbox(variables['params'])))


def nn_unbox(tree):
  import flax.linen as nn
  return nn.meta.unbox(tree)


def prepare(config, stage: str, batch_size: int):
  """(task, model, step_fn, state, batch, constants, rng) ready to time."""
  from procap_jax import stages
  if not config.pretrain.model.text_vocab_size:
    config.pretrain.model.text_vocab_size = 80
  if not config.caption.model.vocab_size:
    config.caption.model.vocab_size = 80
  config.caption.init_from_pretrain = False
  task = stages.TASKS[stage]
  mesh = sharding.mesh_from_config(config)
  model = task.build_model(config)
  tx = task.make_optimizer(config, 1000)
  batch = fake_batch(config, batch_size)
  state, state_sh = train.create_state(task, model, config, tx, jax.random.key(0), batch, mesh)
  constants = None if stage == 'tokenizer' else {'tokenizer': random_tokenizer(config)}
  const_sh = jax.tree.map(lambda _: sharding.replicated(mesh), constants)
  constants = jax.device_put(constants, const_sh)
  batch_sh = {k: sharding.batch_sharding(mesh, v.ndim) for k, v in batch.items()}
  step = train.make_train_step(task, model, config, tx, state_sh, batch_sh, const_sh, mesh)
  dev_batch = sharding.shard_batch(batch, mesh)
  return step, state, dev_batch, constants, jax.random.key(1)


def tokens_per_sample(config, stage: str) -> int:
  if stage == 'tokenizer':
    return config.data.image_size ** 2  # pixels of one frame (frames_per_example frames)
  gh, gw = config.pretrain.model.grid
  frames = (config.data.num_keyframes + 2) * gh * gw
  return frames + config.data.max_caption_len + 3


def run(config_spec: str, stage: str, steps: int, batch_size: int | None, dtype: str) -> dict:
  config = load_config(config_spec)
  config.compute_dtype = dtype
  batch_size = batch_size or int(config[stage].train.batch_size)
  step, state, batch, constants, rng = prepare(config, stage, batch_size)
  flops = common.compiled_flops(step, state, batch, constants, rng)
  t0 = time.perf_counter()
  state, metrics = step(state, batch, constants, rng)
  jax.block_until_ready(metrics)
  compile_and_first = time.perf_counter() - t0
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, metrics = step(state, batch, constants, rng)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  sec = float(np.median(times))
  peak = common.matmul_peak_flops(dtype)
  record = {
      'bench': 'train_step', 'config': config_spec, 'stage': stage, 'dtype': dtype,
      'devices': jax.device_count(), 'batch': batch_size, 'steps_timed': steps,
      'step_s': sec, 'first_step_s': compile_and_first, 'samples_per_s': batch_size / sec,
      'tokens_per_s': batch_size * tokens_per_sample(config, stage) / sec,
      'step_gflop': flops / 1e9 if flops else None,
      'matmul_peak_gflops': peak / 1e9,
      'mfu': (flops / sec) / (peak * jax.device_count()) if flops else None,
      'loss': float(metrics['loss']), 'peak_rss_gib': common.peak_rss_gib(),
  }
  return record


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/synthetic.py:tiny')
  parser.add_argument('--stage', default='all', choices=('all', 'tokenizer', 'pretrain', 'caption'))
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--batch', type=int, default=None)
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  args = parser.parse_args()
  for stage in (('tokenizer', 'pretrain', 'caption') if args.stage == 'all' else (args.stage,)):
    common.emit(run(args.config, stage, args.steps, args.batch, args.dtype))


if __name__ == '__main__':
  main()
