r"""Compiled memory of a sharded train step on a fake-device mesh (no step is run).

  python -m bench.memory                                   # paper-size stage 1, batch 8
  python -m bench.memory --config configs/clevr_change.py:paper --stage caption --batch 32
  python -m bench.memory --devices 8 --mesh 1,8 --mesh 8,1 --rules config --rules fsdp

Creates `--devices` fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count, set
before jax starts), builds the sharded train state with `procap_jax.train.create_state` on each
(data, model) mesh and compiles the step. One JSON line per (mesh, rules):

  params_gib_total / params_gib_per_device        parameters (float32)
  opt_state_gib_total / opt_state_gib_per_device  optimiser state
  argument_gib / output_gib / temp_gib            XLA's memory analysis of the compiled step,
                                                  per device (arguments = state + batch +
                                                  frozen tokenizer; temp = activations and
                                                  everything else live inside the step)

Rules: `config` is `config.sharding.rules` (heads / mlp / vocab / conv_out over 'model');
`fsdp` is `procap_jax.sharding.fsdp_rules` of it: every parameter axis over 'model', so the
parameters and the optimiser state are split over 'model' and gathered where used.
"""

import os
import sys


def _device_count(argv: list[str]) -> int:
  for i, arg in enumerate(argv):
    if arg.startswith('--devices='):
      return int(arg.split('=', 1)[1])
    if arg == '--devices' and i + 1 < len(argv):
      return int(argv[i + 1])
  return 8


if __name__ == '__main__':
  from procap_jax import hostmem
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_'
                             f'device_count={_device_count(sys.argv)}').strip()
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from bench import common  # noqa: E402
from bench import train_step as bench_step  # noqa: E402
from procap_jax import sharding  # noqa: E402


def _gib(tree, per_device: bool) -> float:
  """Bytes of a pytree of arrays (whole arrays, or the largest shard on one device)."""
  total = 0
  for x in jax.tree.leaves(tree):
    if per_device:
      total += max(s.data.nbytes for s in x.addressable_shards)
    else:
      total += x.nbytes
  return total / 2**30


def measure(config_spec: str, stage: str, batch: int, mesh_shape: tuple[int, int], rules: str,
            dtype: str, overrides: list[str] | tuple[str, ...] = ()) -> dict:
  """Compiles the sharded step of `stage` on a (data, model) mesh; returns the JSON record."""
  config = bench_step.load_config(config_spec, overrides)
  config.compute_dtype = dtype
  if rules == 'fsdp':
    config.sharding.rules = sharding.fsdp_rules(config.sharding.rules)
  n = mesh_shape[0] * mesh_shape[1]
  mesh = sharding.make_mesh(*mesh_shape, devices=jax.devices()[:n])
  step, state, dev_batch, constants, rng = bench_step.prepare(config, stage, batch, mesh=mesh)
  t0 = time.perf_counter()
  compiled = step.lower(state, dev_batch, constants, rng).compile()
  sharded = sum('model' in str(x.sharding.spec) for x in jax.tree.leaves(state.params))
  return {
      'bench': 'memory', 'config': config_spec, 'stage': stage, 'dtype': dtype, 'batch': batch,
      'mesh': list(mesh_shape), 'rules': rules, 'overrides': list(overrides) or None,
      'params_gib_total': _gib(state.params, False),
      'params_gib_per_device': _gib(state.params, True),
      'opt_state_gib_total': _gib(state.opt_state, False),
      'opt_state_gib_per_device': _gib(state.opt_state, True),
      'param_leaves': len(jax.tree.leaves(state.params)), 'param_leaves_over_model': sharded,
      **common.memory_gib(compiled), 'compile_s': time.perf_counter() - t0,
      'samples_per_s': None, 'tokens_per_s': None, 'mfu': None,
      'peak_rss_gib': common.peak_rss_gib(),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/clevr_change.py:paper')
  parser.add_argument('--stage', default='pretrain', choices=bench_step.STAGES)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--devices', type=int, default=8)
  parser.add_argument('--mesh', action='append', default=None, metavar='DATA,MODEL',
                      help='mesh shape(s); default 1,8 and 8,1')
  parser.add_argument('--rules', action='append', default=None, choices=('config', 'fsdp'))
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE')
  args = parser.parse_args()
  meshes = [tuple(int(v) for v in m.split(',')) for m in (args.mesh or ['1,8', '8,1'])]
  for shape in meshes:
    for rules in args.rules or ['fsdp']:
      common.emit(measure(args.config, args.stage, args.batch, shape, rules, args.dtype,
                          args.set))


if __name__ == '__main__':
  main()
