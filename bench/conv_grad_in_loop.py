r"""A convolution's gradients inside a loop (`lax.map`) against the same work unrolled, XLA:CPU.

  python -m bench.conv_grad_in_loop                  # 224 px x 128 channels, 2 images, 3 rounds
  python -m bench.conv_grad_in_loop --side 56 --channels 256

The paper tokenizer's train step runs its frames through the VQGAN `frames_chunk` at a time in a
checkpointed `lax.map` (`procap_jax.tasks.tokenizer.chunked_frame_terms`), the loop being what
bounds its memory. This times the gradient of one 3x3 'SAME' float32 convolution with respect to
its kernel (`dw`) and to its input (`dx`) on `--images` images, one image per loop iteration
against the same images as separate calls in one program, and prints one JSON line per form
(median seconds over `--rounds`). `products_dw` is the loop again with the kernel gradient
written as nine products over the pixels (one per tap of the 3x3 kernel, each a padded input
window against the output gradient), the form a fix would give the tokenizer's convolutions.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from procap_jax import hostmem


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--side', type=int, default=224)
  parser.add_argument('--channels', type=int, default=128)
  parser.add_argument('--images', type=int, default=2)
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  c, n = args.channels, args.images
  kernel = jax.random.normal(jax.random.key(1), (3, 3, c, c)) / np.sqrt(9 * c)
  x = jax.random.normal(jax.random.key(0), (n, 1, args.side, args.side, c))

  def conv(w, xi):  # xi [1, S, S, C]
    return jax.lax.conv_general_dilated(xi, w, (1, 1), 'SAME',
                                        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))

  def loss(w, xi):
    return jnp.sum(conv(w, xi) ** 2)

  def looped(w, xs):
    return jnp.sum(jax.lax.map(lambda xi: loss(w, xi), xs))

  def unrolled(w, xs):
    return sum(loss(w, xs[i]) for i in range(xs.shape[0]))

  def products_dw(w, xs):
    def one(xi):  # the kernel gradient of loss(w, xi), tap by tap
      g = 2.0 * conv(w, xi)  # d loss / d y
      xp = jnp.pad(xi, ((0, 0), (1, 1), (1, 1), (0, 0)))
      s = xi.shape[1]
      taps = [jnp.einsum('nhwi,nhwo->io', xp[:, a:a + s, b:b + s], g)
              for a in range(3) for b in range(3)]
      return jnp.stack(taps).reshape(w.shape)
    return jnp.sum(jax.lax.map(one, xs), axis=0)

  forms = {f'{name}_{wrt}': jax.jit(jax.grad(fn, argnums=0 if wrt == 'dw' else 1))
           for wrt in ('dw', 'dx') for name, fn in (('unrolled', unrolled), ('loop', looped))}
  forms['products_dw'] = jax.jit(products_dw)
  outs = {name: jax.block_until_ready(fn(kernel, x)) for name, fn in forms.items()}  # compiles
  times = {name: [] for name in forms}
  for _ in range(args.rounds):
    for name, fn in forms.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(kernel, x))
      times[name].append(time.perf_counter() - t0)
  for name, ts in times.items():
    ref = outs['unrolled_dw' if name == 'products_dw' else name.replace('loop', 'unrolled')]
    rel = float(np.linalg.norm(np.asarray(outs[name]) - np.asarray(ref)) / np.linalg.norm(ref))
    print(json.dumps({'bench': 'conv_grad_in_loop', 'form': name, 'side': args.side,
                      'channels': c, 'images': n, 'step_s': float(np.median(ts)),
                      'step_s_all': [round(t, 3) for t in ts], 'rel_diff_from_unrolled': rel}),
          flush=True)


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
