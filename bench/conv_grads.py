r"""The tokenizer's convolution gradients: the library's against `conv_grads`' products, XLA:CPU.

  python -m bench.conv_grads                 # every shape, unrolled and inside a lax.map
  python -m bench.conv_grads --where loop --rounds 3

For each convolution shape the paper tokenizer (4 frames of 224 px, the `frames_chunk` of the
paper presets) and the synthetic default (16 frames of 64 px) train, times the gradient of a
float32 convolution with respect to its input and kernel, as `jax.lax.conv_general_dilated`
derives it (`library`) and as `procap_jax.models.conv_grads.conv` computes it (`products`), once
on the batch (`unrolled`) and once inside a `lax.map` over `--iterations` batches of
`--loop_batch` images (`loop`, as the chunked train step runs its chunks; the library's form
takes minutes there at 224 px, hence the smaller default), and prints one JSON line per shape and
place: median seconds over `--rounds` and their ratio. `procap_jax.models.conv_grads.MIN_PIXELS`
comes from the unrolled rows. `--side S` keeps the shapes of input side S; `--column_forms` also
times the products' kernel gradient as one im2col product of all nine taps' windows
(`im2col_s`: a form tried and not kept) and one tap at a time (`taps_s`: the fallback beyond
`conv_grads.COLUMN_BYTES`), against its default of one kernel row at a time (`products_s`).
"""

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from procap_jax import hostmem  # noqa: E402
from procap_jax.models import conv_grads  # noqa: E402

SHAPES = [  # (batch, input side, in channels, out channels, stride): 3x3 kernels
    (4, 224, 3, 128, 1), (4, 224, 128, 128, 1), (4, 225, 128, 128, 2), (4, 112, 128, 128, 1),
    (4, 113, 128, 128, 2), (4, 56, 256, 256, 1), (4, 57, 256, 256, 2), (4, 28, 256, 256, 1),
    (4, 14, 512, 512, 1), (16, 64, 3, 16, 1), (16, 64, 16, 16, 1), (16, 65, 16, 16, 2),
    (16, 32, 32, 32, 1), (16, 16, 32, 32, 1), (16, 8, 64, 64, 1),
]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _im2col_conv(x, kernel, strides, pads):
  return conv_grads.library(x, kernel, strides, pads)


def _im2col_fwd(x, kernel, strides, pads):
  return conv_grads.library(x, kernel, strides, pads), (x, kernel)


def _im2col_bwd(strides, pads, saved, g):
  """conv_grads' backward with the kernel gradient as one product of all taps' windows."""
  x, kernel = saved
  kh, kw = kernel.shape[:2]
  xp = jnp.pad(x, ((0, 0),) + tuple(pads) + ((0, 0),))
  out_h, out_w = g.shape[1:3]
  cols = jnp.concatenate([conv_grads.window(xp, a, b, out_h, out_w, strides)
                          for a in range(kh) for b in range(kw)], axis=-1)
  dk = jnp.einsum('nhwi,nhwo->io', cols, g).reshape(kernel.shape)
  return conv_grads.input_grad(g, kernel, x.shape, strides, pads), dk


_im2col_conv.defvjp(_im2col_fwd, _im2col_bwd)


def _time(fn, args, rounds):
  jax.block_until_ready(fn(*args))  # compiles
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--where', choices=['unrolled', 'loop', 'both'], default='both')
  parser.add_argument('--iterations', type=int, default=2, help='lax.map iterations (loop)')
  parser.add_argument('--loop_batch', type=int, default=1, help='images per iteration (loop)')
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--side', type=int, default=0, help='only shapes of this input side')
  parser.add_argument('--column_forms', action='store_true',
                      help='also the kernel gradient by kernel rows and by taps')
  args = parser.parse_args()
  places = ['unrolled', 'loop'] if args.where == 'both' else [args.where]
  for place in places:
    for n, side, ci, co, stride in SHAPES:
      if args.side and side != args.side:
        continue
      strides = (stride, stride)
      pads = conv_grads.explicit_pads((n, side, side, ci), (3, 3), strides,
                                      'SAME' if stride == 1 else 'VALID')
      lead = (args.iterations,) if place == 'loop' else ()
      n = args.loop_batch if place == 'loop' else n
      x = jax.random.normal(jax.random.key(0), lead + (n, side, side, ci))
      kernel = jax.random.normal(jax.random.key(1), (3, 3, ci, co)) / np.sqrt(9 * ci)

      def grad_of(conv):
        def loss(a, k):
          if place == 'loop':
            return jnp.sum(jax.lax.map(lambda xi: jnp.sum(conv(xi, k, strides, pads) ** 2), a))
          return jnp.sum(conv(a, k, strides, pads) ** 2)
        return jax.jit(jax.grad(loss, (0, 1)))

      seconds = {name: _time(grad_of(conv), (x, kernel), args.rounds)
                 for name, conv in (('library', conv_grads.library),
                                    ('products', conv_grads.conv))}
      out = conv_grads.out_side(side, 3, stride, pads[0])
      if args.column_forms:
        seconds['im2col'] = _time(grad_of(_im2col_conv), (x, kernel), args.rounds)
        default = conv_grads.COLUMN_BYTES
        conv_grads.COLUMN_BYTES = 0  # read while the backward is traced: one tap at a time
        seconds['taps'] = _time(grad_of(conv_grads.conv), (x, kernel), args.rounds)
        conv_grads.COLUMN_BYTES = default
      print(json.dumps({'bench': 'conv_grads', 'where': place, 'batch': n, 'side': side,
                        'out_side': out, 'in_channels': ci, 'out_channels': co,
                        'stride': stride, 'iterations': len(lead) and args.iterations,
                        **{f'{name}_s': round(t, 4) for name, t in seconds.items()},
                        'library_over_products': round(seconds['library'] / seconds['products'],
                                                       2)}), flush=True)


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
