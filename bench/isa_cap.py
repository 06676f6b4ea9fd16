r"""Does XLA's ISA cap reach the code that runs? A dot and an elementwise fusion under each cap.

  python -m bench.isa_cap                                   # caps: none, AVX2, SSE4_2
  python -m bench.isa_cap --caps none,AVX2 --rounds 2 --n 1024

Each measurement is a fresh process with `XLA_FLAGS=--xla_cpu_max_isa=<cap>` (XLA reads its
flags once per process), the caps in turns, round after round. A child times, as CPU seconds of
this process (`time.process_time`: both cores' work, so a busy shared machine inflates it less
than wall time), the best of `--repeats` calls of: an n x n x n dot in float32, the same with
bfloat16 operands and a float32 result (the bf16 switches' matmuls), and a 4096 x 4096 float32
elementwise fusion (tanh, exp, sin: code XLA generates itself). One JSON line per measurement
(GFLOP per CPU-second for the dots, CPU-ms for the fusion), each naming the CPU; a cap that takes
effect changes the figures of the code it reaches.
"""

import argparse
import os
import time

from bench import common

CAPS = ('none', 'AVX2', 'SSE4_2')


def _best_cpu_seconds(fn, args, repeats: int) -> float:
  fn(*args).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    t0 = time.process_time()
    fn(*args).block_until_ready()
    best = min(best, time.process_time() - t0)
  return best


def measure(n: int, repeats: int) -> dict:
  """This process's figures (under whatever XLA_FLAGS it started with)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  out = {'bench': 'isa_cap', 'n': n, 'jax': jax.__version__}
  for name, dtype in (('f32', jnp.float32), ('bf16', jnp.bfloat16)):
    a = jnp.asarray(rng.standard_normal((n, n)), dtype)
    dot = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    out[f'dot_{name}_gflop_per_cpu_s'] = 2 * n**3 / _best_cpu_seconds(dot, (a, a), repeats) / 1e9
  x = jnp.asarray(rng.standard_normal((4096, 4096)), jnp.float32)
  fusion = jax.jit(lambda v: jnp.tanh(v) * jnp.exp(-v * v) + jnp.sin(v))
  out['elementwise_cpu_ms'] = 1e3 * _best_cpu_seconds(fusion, (x,), repeats)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--caps', default=','.join(CAPS),
                      help="comma-separated --xla_cpu_max_isa values; 'none' for no cap")
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--n', type=int, default=1024)
  parser.add_argument('--repeats', type=int, default=15)
  parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    common.emit(measure(args.n, args.repeats))
    return
  inherited = [f for f in os.environ.get('XLA_FLAGS', '').split()
               if not f.startswith('--xla_cpu_max_isa=')]
  for round_ in range(args.rounds):
    for cap in args.caps.split(','):
      flags = inherited + ([] if cap == 'none' else [f'--xla_cpu_max_isa={cap}'])
      child = ['--child', '--n', str(args.n), '--repeats', str(args.repeats)]
      for record in common.run_child('bench.isa_cap', child, env={'XLA_FLAGS': ' '.join(flags)}):
        common.emit(dict(record, cap=cap, round=round_))


if __name__ == '__main__':
  main()
