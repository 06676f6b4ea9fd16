r"""Attention's forms side by side: forward + backward time of one attention call.

  python -m bench.attention_speed                       # paper size: B 6, S 811, H 12, Dh 64
  python -m bench.attention_speed --dtype bfloat16 --groups 1,2,4,8
  python -m bench.attention_speed --batch 24 --seq 283 --heads 4 --head_dim 32   # synthetic

Times `jax.grad` of sum(attention(q, k, v) * g) under `jax.checkpoint` (as inside the paper
presets' checkpointed block scan, so the forward runs twice) for: `full`
(`attention.dot_product_attention`: the whole [B, H, S, S] block at once), `chunk<C>`
(`attention.chunked_attention`, queries in chunks of C) and `group<G>`
(`attention.grouped_attention`, G (batch, head) pairs at a time). Rounds alternate the forms; one
JSON line per form with the median and best seconds, the GFLOP/s of the attention products (2
forward, 2 recomputed, 4 backward) and the gradient's relative difference from `full`'s.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from procap_jax import hostmem
from procap_jax.models import attention


def forms(chunks: list[int], groups: list[int], scale: float) -> dict:
  out = {'full': lambda q, k, v: attention.dot_product_attention(q, k, v, None, scale)}
  for c in chunks:
    out[f'chunk{c}'] = lambda q, k, v, c=c: attention.chunked_attention(q, k, v, None, c, scale)
  for g in groups:
    out[f'group{g}'] = lambda q, k, v, g=g: attention.grouped_attention(q, k, v, None, g, scale)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch', type=int, default=6, help='B (stage 1 at batch 2 fuses 3 x 2)')
  parser.add_argument('--seq', type=int, default=811)
  parser.add_argument('--heads', type=int, default=12)
  parser.add_argument('--head_dim', type=int, default=64)
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  parser.add_argument('--chunks', default='128')
  parser.add_argument('--groups', default='2,4')
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  parse = lambda s: [int(x) for x in s.split(',') if x]
  dtype = jnp.dtype(args.dtype)
  shape = (args.batch, args.seq, args.heads, args.head_dim)
  q, k, v, g = (jax.random.normal(key, shape).astype(dtype)
                for key in jax.random.split(jax.random.key(0), 4))
  scale = args.head_dim ** -0.5
  steps = {}
  grads = {}
  for name, fn in forms(parse(args.chunks), parse(args.groups), scale).items():
    loss = lambda q, k, v, fn=fn: jnp.sum(
        jax.checkpoint(fn)(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))
    steps[name] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    grads[name] = jax.block_until_ready(steps[name](q, k, v))  # compiles
  times = {name: [] for name in steps}
  for _ in range(args.rounds):
    for name, step in steps.items():
      t0 = time.perf_counter()
      jax.block_until_ready(step(q, k, v))
      times[name].append(time.perf_counter() - t0)
  flops = 8 * 2 * args.batch * args.heads * args.seq * args.seq * args.head_dim
  ref = [np.asarray(x, np.float32) for x in grads['full']]
  for name, ts in times.items():
    got = [np.asarray(x, np.float32) for x in grads[name]]
    diff = max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(got, ref))
    print(json.dumps({
        'bench': 'attention_speed', 'form': name, 'dtype': args.dtype, 'shape_bshd': shape,
        'step_s': float(np.median(ts)), 'step_s_best': float(np.min(ts)),
        'products_gflops': flops / float(np.median(ts)) / 1e9, 'grad_rel_diff': diff,
        'rounds': args.rounds}), flush=True)


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
