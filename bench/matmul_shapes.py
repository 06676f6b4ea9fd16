r"""The paper-size stage-1 encoder's matmuls, timed alone: XLA:CPU (with and without oneDNN)
against torch, in one run on one machine.

  python -m bench.matmul_shapes                               # XLA only
  python -m bench.matmul_shapes --torch_python PY             # and torch (PY: a Python with torch)
  python -m bench.matmul_shapes --bf16                        # XLA also with bfloat16 operands,
                                                              # and the VQGAN's 3 x 3 convolutions

Why: at paper size our stage-1 step is slower than the original's although both do the same
FLOPs (docs/performance.md, "Against the original"); this separates the matmul library from
everything else. Shapes (f32) of the 12 x 768 encoder at the fused batch 24 over 811 tokens
(M = 24 x 811 rows): the QKV, output and MLP projections, and the per-head attention products
(288 = 24 x 12 heads of 811 x 64). Each is timed as a jitted function (XLA, `XLA_FLAGS` set per
variant in a fresh process) or under torch.no_grad (torch, `--threads` threads), median of
`--repeats` after one warm-up; one JSON line per (backend, shape) with GFLOP/s.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench import timing
from procap_jax import hostmem

M = 24 * 811
SHAPES = {  # name -> (batch or None, m, k, n): [b, m, k] @ [b, k, n]
    'qkv 19464x768 @ 768x2304': (None, M, 768, 2304),
    'out 19464x768 @ 768x768': (None, M, 768, 768),
    'mlp_up 19464x768 @ 768x3072': (None, M, 768, 3072),
    'mlp_down 19464x3072 @ 3072x768': (None, M, 3072, 768),
    'scores 288 x 811x64 @ 64x811': (288, 811, 64, 811),
    'context 288 x 811x811 @ 811x64': (288, 811, 811, 64),
    'square 2048x2048 @ 2048x2048': (None, 2048, 2048, 2048),
}


def _flops(b, m, k, n) -> float:
  return 2.0 * (b or 1) * m * k * n


def _record(backend: str, name: str, fn, repeats: int, precision: str = 'f32',
            flops: float | None = None) -> dict:
  """Times `fn()` (which must block) `repeats` times after one warm-up call; `flops` defaults
  to the matmul SHAPES[name]'s."""
  times = timing.time_all(fn, warmup=1, repeats=repeats)
  seconds = statistics.median(times)
  flops = _flops(*SHAPES[name]) if flops is None else flops
  return dict(backend=backend, shape=name, precision=precision, seconds=seconds,
              gflops=flops / seconds / 1e9)


def run_xla(repeats: int, bf16: bool = False) -> list[dict]:
  """f32; with `bf16` also bf16 operands with a bf16 result (jnp.matmul, what a plain bf16
  Dense asks for) and with a float32 result (procap_jax's accumulating products)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from procap_jax.models import accumulating as accumulating_lib  # after the XLA flags
  f = jax.jit(jnp.matmul)
  accumulating = jax.jit(lambda x, w: accumulating_lib.accumulating_einsum('bmk,bkn->bmn', x, w)
                         if x.ndim == 3 else accumulating_lib.accumulating_dot_general(
                             x, w, (((1,), (0,)), ((), ()))))
  variants = [('f32', jnp.float32, f)]
  if bf16:
    variants += [('bf16->bf16', jnp.bfloat16, f),
                 ('bf16->f32 (ours)', jnp.bfloat16, accumulating)]
  out = []
  for name, (b, m, k, n) in SHAPES.items():
    key = jax.random.PRNGKey(0)
    lead = (b,) if b else ()
    for precision, dtype, fn in variants:
      x = jax.random.normal(key, lead + (m, k), jnp.float32).astype(dtype)
      w = jax.random.normal(key, lead + (k, n), jnp.float32).astype(dtype)
      out.append(_record('xla', name, lambda: fn(x, w).block_until_ready(), repeats, precision))
  return out


CONVS = {  # name -> (batch, size, channels): 3 x 3 'SAME' convolutions of the paper VQGAN
    'conv3x3 8x224x224x128': (8, 224, 128),
    'conv3x3 8x56x56x256': (8, 56, 256),
    'conv3x3 16x64x64x32': (16, 64, 32),
}


def run_xla_convs(repeats: int) -> list[dict]:
  """The tokenizer's 3 x 3 convolutions, f32 and bf16 operands with a float32 result."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), 'SAME',
                                        dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
                                        preferred_element_type=jnp.float32)
  f = jax.jit(conv)
  out = []
  for name, (b, size, c) in CONVS.items():
    key = jax.random.PRNGKey(0)
    for precision, dtype in (('f32', jnp.float32), ('bf16->f32', jnp.bfloat16)):
      x = jax.random.normal(key, (b, size, size, c), jnp.float32).astype(dtype)
      w = jax.random.normal(key, (3, 3, c, c), jnp.float32).astype(dtype)
      out.append(_record('xla', name, lambda: f(x, w).block_until_ready(), repeats, precision,
                         flops=2.0 * b * size * size * c * c * 9))
  return out


def run_torch(repeats: int, threads: int) -> list[dict]:
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(threads)
  backend = f'torch {torch.__version__} ({threads} threads)'
  out = []
  with torch.no_grad():
    for name, (b, m, k, n) in SHAPES.items():
      lead = (b,) if b else ()
      x, w = torch.randn(*lead, m, k), torch.randn(*lead, k, n)
      out.append(_record(backend, name, lambda: torch.matmul(x, w), repeats))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--torch_python', default='', help='a Python with torch (optional)')
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  parser.add_argument('--bf16', action='store_true',
                      help='XLA also with bfloat16 operands (bf16 and float32 results)')
  parser.add_argument('--child', default='', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    records = (run_xla(args.repeats, args.bf16) if args.child == 'xla'
               else run_torch(args.repeats, args.threads))
    if args.child == 'xla' and args.bf16:
      records += run_xla_convs(args.repeats)
    for r in records:
      print(json.dumps(r), flush=True)
    return
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  runs = [('xla', sys.executable, ''), ('xla onednn', sys.executable, '--xla_cpu_use_onednn=true')]
  if args.torch_python:
    runs.append(('torch', args.torch_python, ''))
  for label, python, flags in runs:
    env = dict(os.environ, PYTHONPATH=here)
    if flags:
      env['XLA_FLAGS'] = ' '.join(f for f in (os.environ.get('XLA_FLAGS', ''), flags) if f)
    child = 'torch' if label == 'torch' else 'xla'
    extra = ['--bf16'] if args.bf16 and label == 'xla' else []
    proc = subprocess.run([python, '-m', 'bench.matmul_shapes', '--child', child, '--repeats',
                           str(args.repeats), '--threads', str(args.threads), *extra], cwd=here,
                          env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
      print(json.dumps(dict(variant=label, error=proc.stderr.strip().splitlines()[-1:])))
      continue
    for line in proc.stdout.splitlines():
      if line.startswith('{'):
        print(json.dumps(dict(json.loads(line), variant=label)), flush=True)


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
