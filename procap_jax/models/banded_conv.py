"""The tokenizer's convolutions: bfloat16 3x3 ones in row bands (plain or Winograd F(2x2, 3x3)
products), the others through the library, with `conv_grads`' backward where it is faster.

Dimensions: B batch, H/W image rows/columns, C input channels, O output channels, R rows per
band. Layout NHWC, kernels HWIO. `conv_general_dilated` is what the VQGAN's `nn.Conv` layers
call (`vqgan_layers.conv`); measurements in docs/performance.md, "The tokenizer's convolutions in
row bands".
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from procap_jax.models import conv_grads


# Bytes of one row band's gathered operand [R + 2, W, 3 C] in `banded_conv3x3`: about what stays
# in the caches of the CPU this was measured on (docs/performance.md, "The tokenizer's
# convolutions in row bands").
BAND_BYTES = 2 * 2**20


def band_rows(height: int, width: int, channels: int, itemsize: int,
              budget: int = BAND_BYTES) -> int:
  """Rows per band: the largest divisor R of `height` whose [R + 2, width, 3 channels] operand
  fits `budget` bytes (at least 1)."""
  fit = budget // max(1, width * 3 * channels * itemsize) - 2
  return max([r for r in range(1, height + 1) if height % r == 0 and r <= fit] or [1])


def _side_by_side(parts: list[jax.Array]) -> jax.Array:
  """Concatenates along the last axis; bfloat16 goes through its 16-bit pattern, since XLA:CPU
  would otherwise convert the operands to float32 and back around the concatenation."""
  if parts[0].dtype != jnp.bfloat16:
    return jnp.concatenate(parts, axis=-1)
  bits = [lax.bitcast_convert_type(p, jnp.uint16) for p in parts]
  return lax.bitcast_convert_type(jnp.concatenate(bits, axis=-1), jnp.bfloat16)


def _band_out_side(side: int, stride: int) -> int:
  """Output side of `_band_product`: 'SAME' keeps it at stride 1, 'VALID' at stride 2."""
  return side if stride == 1 else (side - 3) // 2 + 1


def _map_bands(xp: jax.Array, window: tuple, rows: int, bands: int, body) -> jax.Array:
  """`body` of each band's window of the padded images xp, stacked over B x bands (a `lax.map`):
  band j of image i is the `window` that starts at row j * rows of xp[i]."""
  def band(index):
    start = (index // bands, (index % bands) * rows) + (0,) * len(window[1:])
    return body(lax.dynamic_slice(xp, start, (1,) + window)[0])

  return lax.map(band, jnp.arange(xp.shape[0] * bands))


def _band_product(x: jax.Array, kernel: jax.Array, rows: int, stride: int = 1) -> jax.Array:
  """3x3 convolution [B, H, W, C] x [3, 3, C, O] -> float32 [B, Ho, Wo, O] as a loop over
  `rows`-row bands of one image's output: each band lays its three column taps side by side
  ([rows of input, Wo, 3C], cache-sized) and sums three products with the kernel's rows.

  stride 1: 'SAME' padding (Ho, Wo = H, W). stride 2: 'VALID' (Ho = (H - 3) // 2 + 1; the taming
  downsample pads right and bottom first), read through an [H/2, 2, W/2, 2, C] view of the
  input, so that every tap is a plain slice: input row 2i + d is (i, d) for d < 2, (i + 1, 0)
  for d = 2, and the same for columns."""
  b, h, w, c = x.shape
  o = kernel.shape[-1]
  taps = kernel.reshape(3, 3 * c, o)  # row i: (column j, channel) -> out
  ho, wo = _band_out_side(h, stride), _band_out_side(w, stride)
  if stride == 1:
    xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))  # [B, H + 2, W + 2, C]
    window = (rows + 2, wo + 2, c)

    def operands(part):  # [R + 2, W + 2, C] -> three [R, W, 3C]
      cols = _side_by_side([part[:, j:j + wo] for j in range(3)])
      return [cols[i:i + rows] for i in range(3)]
  else:
    xp = jnp.pad(x, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)))
    xp = xp.reshape(b, xp.shape[1] // 2, 2, xp.shape[2] // 2, 2, c)[:, :ho + 1, :, :wo + 1]
    window = (rows + 1, 2, wo + 1, 2, c)

    def operands(part):  # [R + 1, 2, Wo + 1, 2, C] -> three [R, Wo, 3C]
      cols = [_side_by_side([p[:, :wo, 0], p[:, :wo, 1], p[:, 1:, 0]])
              for p in (part[:, 0], part[:, 1])]
      return [cols[0][:rows], cols[1][:rows], cols[0][1:]]

  def band(part):
    out = None
    for lhs, tap in zip(operands(part), taps):
      term = lax.dot_general(lhs, tap, (((2,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [R, Wo, O]
      out = term if out is None else out + term
    return out

  return _map_bands(xp, window, rows, ho // rows, band).reshape(b, ho, wo, o)


# Winograd F(2x2, 3x3) (Lavin and Gray, 2016): a 2x2 output tile is A^T [U * V] A with
# U = G g G^T (the kernel) and V = B^T d B (the 4x4 input tile d), 16 products instead of 36.
_WINOGRAD_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float32)
# bfloat16 stride-1 convolutions on images at least this wide run as Winograd products: on the
# CPU it was measured on, the paper encoder's 224 and 112 px ones (docs/performance.md, "The
# tokenizer's convolutions in row bands"); smaller ones stay plain bands.
WINOGRAD_MIN_SIDE = 112
# Bytes of one band's transformed tiles V [4, 4, R/2, W/2, C].
WINOGRAD_BYTES = 4 * 2**20


def winograd_rows(height: int, width: int, channels: int, itemsize: int) -> int:
  """Rows per Winograd band: the largest even divisor R of `height` whose transformed tiles
  (16 x R/2 x W/2 x channels) fit WINOGRAD_BYTES (at least 2)."""
  fit = [r for r in range(2, height + 1, 2)
         if height % r == 0 and 4 * r * width * channels * itemsize <= WINOGRAD_BYTES]
  return max(fit or [2])


def _winograd_lines(e0, o0, e1, o1):
  """B^T along one axis: the four transformed lines of tiles whose input lines are e0, o0, e1,
  o1 (even, odd, next even, next odd)."""
  return e0 - e1, o0 + e1, e1 - o0, o0 - o1


def _winograd_product(x: jax.Array, kernel: jax.Array, rows: int) -> jax.Array:
  """3x3 'SAME' stride-1 convolution [B, H, W, C] x [3, 3, C, O] -> float32 [B, H, W, O] (H, W
  even) as Winograd F(2x2, 3x3) in `rows`-row bands of one image: the band's 4x4 input tiles are
  transformed in float32 and rounded to x's dtype, multiplied with the transformed kernel in 16
  products (two calls of 8, one per core) with float32 results, and transformed back."""
  b, h, w, c = x.shape
  o = kernel.shape[-1]
  u = jnp.einsum('ai,ijco,bj->abco', _WINOGRAD_G, kernel.astype(jnp.float32),
                 _WINOGRAD_G).astype(x.dtype)  # [4, 4, C, O]
  xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))

  def band(part):  # [R + 2, W + 2, C]
    part = part.astype(jnp.float32)
    even, odd = part[0::2], part[1::2]  # [R/2 + 1, W + 2, C]
    v = []
    for line in _winograd_lines(even[:-1], odd[:-1], even[1:], odd[1:]):  # [R/2, W + 2, C]
      ce, co = line[:, 0::2], line[:, 1::2]
      v.append(jnp.stack(_winograd_lines(ce[:, :-1], co[:, :-1], ce[:, 1:], co[:, 1:])))
    v = jnp.stack(v).astype(x.dtype)  # [4, 4, R/2, W/2, C]
    m = jnp.concatenate([
        lax.dot_general(v[i:i + 2], u[i:i + 2], (((4,), (2,)), ((0, 1), (0, 1))),
                        preferred_element_type=jnp.float32) for i in (0, 2)])  # [4, 4, R/2, W/2, O]

    def back(t):  # A^T along the first axis: [4, ...] -> two [...]
      return t[0] + t[1] + t[2], t[1] - t[2] - t[3]

    y = jnp.stack([jnp.stack(back(r), axis=2) for r in back(m)], axis=1)  # [R/2, 2, W/2, 2, O]
    return y.reshape(rows, w, o)

  return _map_bands(xp, (rows + 2, w + 2, c), rows, h // rows, band).reshape(b, h, w, o)


def banded_conv3x3(x: jax.Array, kernel: jax.Array, stride: int = 1,
                   products: bool | None = None) -> jax.Array:
  """The 3x3 NHWC convolution in row bands, result in x's dtype: stride 1 with 'SAME' padding, or
  stride 2 with 'VALID' (the downsample's, after its right/bottom pad). Stride-1 convolutions of
  even sides of at least WINOGRAD_MIN_SIDE run as Winograd F(2x2, 3x3) products: 2.25 times
  fewer multiplications, about 2.5 times the rounding of the plain bands in bfloat16 (its
  transformed tiles are rounded to x's dtype).

  The plain bands give `lax.conv_general_dilated`'s values up to the summation order,
  accumulated in float32. On XLA:CPU it is faster than the library convolution for bfloat16
  operands (which run no faster than float32 there) and slower for float32 ones, so
  `conv_general_dilated` takes it for bfloat16 only. The backward is in float32: `conv_grads`'
  products when `products` is true (None: where `conv_grads.wanted`), else the library's."""
  if products is None:
    out = _band_out_side(x.shape[1], stride), _band_out_side(x.shape[2], stride)
    products = conv_grads.wanted(*out)
  return _banded(x, kernel, stride, bool(products))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _banded(x, kernel, stride, products):
  del products  # the backward's choice
  h, w, c = x.shape[1:]
  if stride == 1 and h % 2 == 0 and w % 2 == 0 and min(h, w) >= WINOGRAD_MIN_SIDE:
    rows = winograd_rows(h, w, c, x.dtype.itemsize)
    return _winograd_product(x, kernel, rows).astype(x.dtype)
  rows = band_rows(_band_out_side(h, stride), _band_out_side(w, stride), c, x.dtype.itemsize)
  return _band_product(x, kernel, rows, stride).astype(x.dtype)


def _banded_fwd(x, kernel, stride, products):
  return _banded(x, kernel, stride, products), (x, kernel)


def _banded_bwd(stride, products, saved, g):
  x, kernel = saved  # in float32 (the library's bfloat16 convolutions are no faster)
  x, kernel, g = (v.astype(jnp.float32) for v in (x, kernel, g))
  strides = (stride, stride)
  pads = conv_grads.explicit_pads(x.shape, kernel.shape, strides,
                                  'SAME' if stride == 1 else 'VALID')
  if products:
    grads = (conv_grads.input_grad(g, kernel, x.shape, strides, pads),
             conv_grads.kernel_grad(x, g, kernel.shape, strides, pads))
  else:
    grads = jax.vjp(lambda a, k: conv_grads.library(a, k, strides, pads), x, kernel)[1](g)
  return tuple(d.astype(v.dtype) for d, v in zip(grads, saved))


_banded.defvjp(_banded_fwd, _banded_bwd)


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, precision=None, **kwargs):
  """`lax.conv_general_dilated` for nn.Conv, with bfloat16 3x3 convolutions of at least 32 input
  channels computed by `banded_conv3x3` (stride 1 'SAME', and stride 2 'VALID': the downsample)
  and the other bfloat16 ones in float32 (on XLA:CPU the library's bfloat16 convolutions run no
  faster than its float32 ones: docs/performance.md, "The tokenizer's convolutions in row
  bands"). Float32 ones run the library's forward, with `conv_grads`' backward where
  `conv_grads.wanted` (inside the tokenizer's chunk loop, and on large images)."""
  strides = tuple(window_strides)
  banded = (lhs.dtype == jnp.bfloat16 and lhs.ndim == 4 and rhs.shape[:2] == (3, 3)
            and rhs.shape[2] >= 32
            and ((strides == (1, 1) and padding in ('SAME', ((1, 1), (1, 1))))
                 or (strides == (2, 2) and padding in ('VALID', ((0, 0), (0, 0)))
                     and min(lhs.shape[1:3]) >= 3))
            and tuple(lhs_dilation or (1, 1)) == (1, 1)
            and tuple(rhs_dilation or (1, 1)) == (1, 1) and feature_group_count == 1
            and not kwargs
            and dimension_numbers == lax.conv_dimension_numbers(lhs.shape, rhs.shape,
                                                                 conv_grads.NHWC))
  if banded:
    return banded_conv3x3(lhs, rhs, strides[0])
  if lhs.dtype == jnp.bfloat16:  # the library's bf16 convolutions run no faster than float32
    return conv_general_dilated(lhs.astype(jnp.float32), rhs.astype(jnp.float32), window_strides,
                                padding, lhs_dilation, rhs_dilation, dimension_numbers,
                                feature_group_count, precision, **kwargs).astype(lhs.dtype)
  if conv_grads.supported(lhs, rhs, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                         feature_group_count, kwargs):
    pads = conv_grads.explicit_pads(lhs.shape, rhs.shape, strides, padding)
    out = [conv_grads.out_side(lhs.shape[1 + i], rhs.shape[i], strides[i], pads[i])
           for i in range(2)]
    if conv_grads.wanted(*out):  # the library's values, faster gradients
      return conv_grads.conv(lhs, rhs, strides, pads)
  return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
                                  rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                                  feature_group_count=feature_group_count, precision=precision,
                                  **kwargs)
