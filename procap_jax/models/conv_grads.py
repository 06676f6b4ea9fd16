"""A float32 NHWC convolution whose gradients avoid XLA:CPU's slow kernel-gradient convolution.

The forward pass is `lax.conv_general_dilated`. The backward pass writes both gradients as plain
products instead of the library's transposed convolutions:

- kernel gradient: every kernel tap (a, b) sees the strided window of the padded input that the
  tap multiplies, xp[:, a : a + s(Ho - 1) + 1 : s, b : ... : s, :]; the windows of one kernel row
  are laid side by side along the channels ([N, Ho, Wo, kw C]; one tap at a time when that
  would exceed `COLUMN_BYTES`) and contracted with the output gradient over N, Ho and Wo, kh
  matrix products of the convolution's own FLOPs (as fast as one im2col product of all kh kw
  windows or faster, in a third of its memory: `python -m bench.conv_grads --column_forms`);
- input gradient: at stride 1 the forward convolution of the output gradient with the flipped,
  transposed kernel; at larger strides each tap's product g @ w[a, b]^T placed back on its window
  (a pad with interior zeros) and summed.

On XLA:CPU, inside a `lax.map` (where the paper tokenizer's train step runs its frames,
`frames_chunk`), the library's gradients of every tokenizer convolution shape run 9-60 times
slower than these products; outside a loop the products are about twice as fast at 224 px and
up to 5 times slower on small images (docs/performance.md, "The tokenizer's
convolution gradients as products"). So `wanted` takes the
products inside an `in_loop()` context and for outputs of at least `MIN_PIXELS` pixels. The
values equal the library's up to the summation order (tests/conv_grads_test.py).
"""

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
from jax import lax

NHWC = ('NHWC', 'HWIO', 'NHWC')
# The largest buffer of one kernel row's windows in the kernel gradient (bytes); beyond it one
# tap at a time.
COLUMN_BYTES = 1 << 30
# Outside a loop the products pay from about this many output pixels on (112 px: 1.1x the
# library's speed, 224 px: 2x, 64 px: 0.2x; `python -m bench.conv_grads`).
MIN_PIXELS = 112 * 112
_state = threading.local()


@contextlib.contextmanager
def in_loop():
  """Within it (while a loop body is traced), `wanted` takes the products at every size."""
  _state.depth = getattr(_state, 'depth', 0) + 1
  try:
    yield
  finally:
    _state.depth -= 1


def wanted(out_h: int, out_w: int) -> bool:
  """Whether a convolution with this output side takes the products' gradients."""
  return getattr(_state, 'depth', 0) > 0 or out_h * out_w >= MIN_PIXELS


def out_side(side: int, kernel: int, stride: int, pad: tuple) -> int:
  return (side + pad[0] + pad[1] - kernel) // stride + 1


def explicit_pads(x_shape, kernel_shape, strides, padding) -> tuple:
  """((top, bottom), (left, right)) for a padding string or explicit pairs."""
  if isinstance(padding, str):
    return tuple(lax.padtype_to_pads(x_shape[1:3], kernel_shape[:2], strides, padding))
  return tuple((int(lo), int(hi)) for lo, hi in padding)


def supported(lhs, rhs, padding, lhs_dilation, rhs_dilation, dimension_numbers,
              feature_group_count, kwargs) -> bool:
  """Whether `conv` computes this `lax.conv_general_dilated` call: float32 NHWC/HWIO, no
  dilation or groups, non-negative padding."""
  if lhs.dtype != jnp.float32 or rhs.dtype != jnp.float32 or lhs.ndim != 4 or kwargs:
    return False
  if tuple(lhs_dilation or (1, 1)) != (1, 1) or tuple(rhs_dilation or (1, 1)) != (1, 1):
    return False
  if feature_group_count != 1:
    return False
  if dimension_numbers != lax.conv_dimension_numbers(lhs.shape, rhs.shape, NHWC):
    return False
  if not isinstance(padding, str) and any(p < 0 for pair in padding for p in pair):
    return False
  return True


def library(x, kernel, strides, pads):
  """`lax.conv_general_dilated` for NHWC x and an HWIO kernel."""
  return lax.conv_general_dilated(x, kernel, strides, pads,
                                  dimension_numbers=lax.conv_dimension_numbers(
                                      x.shape, kernel.shape, NHWC))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv(x: jax.Array, kernel: jax.Array, strides: tuple, pads: tuple) -> jax.Array:
  """`lax.conv_general_dilated(x, kernel, strides, pads)` for NHWC x and HWIO kernel, float32,
  with the gradients of the module docstring. strides: (sh, sw); pads: ((t, b), (l, r))."""
  return library(x, kernel, strides, pads)


def _fwd(x, kernel, strides, pads):
  return conv(x, kernel, strides, pads), (x, kernel)


def window(xp, a, b, out_h, out_w, strides):
  """The strided window of the padded input that kernel tap (a, b) multiplies: [N, Ho, Wo, C]."""
  n, _, _, c = xp.shape
  sh, sw = strides
  return lax.slice(xp, (0, a, b, 0), (n, a + sh * (out_h - 1) + 1, b + sw * (out_w - 1) + 1, c),
                   (1, sh, sw, 1))


def kernel_grad(x, g, kernel_shape, strides, pads):
  """d loss / d kernel [kh, kw, C, O] from the input x [N, H, W, C] and the output gradient g."""
  kh, kw, c, o = kernel_shape
  n, out_h, out_w, _ = g.shape
  xp = jnp.pad(x, ((0, 0),) + tuple(pads) + ((0, 0),))
  windows = [[window(xp, a, b, out_h, out_w, strides) for b in range(kw)] for a in range(kh)]
  column = n * out_h * out_w * c * x.dtype.itemsize
  if column * kw <= COLUMN_BYTES:
    rows = [jnp.einsum('nhwi,nhwo->io', jnp.concatenate(row, axis=-1), g) for row in windows]
    return jnp.stack(rows).reshape(kernel_shape)
  taps = [jnp.einsum('nhwi,nhwo->io', w, g) for row in windows for w in row]
  return jnp.stack(taps).reshape(kernel_shape)


def input_grad(g, kernel, x_shape, strides, pads):
  """d loss / d x [N, H, W, C] from the output gradient g [N, Ho, Wo, O] and the kernel."""
  kh, kw = kernel.shape[:2]
  (top, bottom), (left, right) = pads
  n, h, w, c = x_shape
  if tuple(strides) == (1, 1):
    flipped = jnp.flip(kernel, (0, 1)).transpose(0, 1, 3, 2)  # [kh, kw, O, C]
    # The full correlation of g with the flipped kernel, cropped to x's rows and columns.
    full = ((kh - 1 - top, kh - 1 - bottom), (kw - 1 - left, kw - 1 - right))
    if all(p >= 0 for pair in full for p in pair):
      return library(g, flipped, (1, 1), full)
  sh, sw = strides
  out_h, out_w = g.shape[1:3]
  hp, wp = h + top + bottom, w + left + right
  dxp = jnp.zeros((n, hp, wp, c), g.dtype)
  for a in range(kh):
    for b in range(kw):
      part = jnp.einsum('nhwo,io->nhwi', g, kernel[a, b])  # [N, Ho, Wo, C]
      span_h, span_w = sh * (out_h - 1) + 1, sw * (out_w - 1) + 1
      dxp = dxp + lax.pad(part, jnp.zeros((), g.dtype),
                          ((0, 0, 0), (a, hp - a - span_h, sh - 1),
                           (b, wp - b - span_w, sw - 1), (0, 0, 0)))
  return dxp[:, top:top + h, left:left + w]


def _bwd(strides, pads, saved, g):
  x, kernel = saved
  return (input_grad(g, kernel, x.shape, strides, pads),
          kernel_grad(x, g, kernel.shape, strides, pads))


conv.defvjp(_fwd, _bwd)
