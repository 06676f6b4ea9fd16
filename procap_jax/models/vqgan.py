"""VQGAN image tokenizer: a flax.linen port of taming-transformers' `VQModel`.

Dimensions: B batch, S image side, h/w token grid (S / 2**(len(ch_mult) - 1)), C channels,
D code width (embed_dim), Z encoder output width (z_channels), K codebook size (n_embed).
Layout is NHWC throughout; images enter as float32 in [0, 1].

Architecture (taming/modules/diffusionmodules/model.py, taming/models/vqgan.py):
  Encoder: conv_in -> per level i: num_res_blocks x (ResnetBlock [+ AttnBlock when the level's
    resolution is in attn_resolutions]) then Downsample (not after the last level) -> mid
    (ResnetBlock, AttnBlock, ResnetBlock) -> GroupNorm -> swish -> conv_out (Z channels).
  quant_conv (1x1, Z -> D) -> VectorQuantizer (K x D) -> post_quant_conv (1x1, D -> Z).
  Decoder: conv_in -> mid -> per level i from last to first: (num_res_blocks + 1) x
    (ResnetBlock [+ AttnBlock]) then Upsample (not after level 0) -> GroupNorm -> swish ->
    conv_out (3 channels).
  Downsample zero-pads right and bottom by one pixel, then a 3x3 stride-2 VALID conv; Upsample is
  nearest x2 followed by a 3x3 conv. The level resolution is tracked with integer halving exactly as
  taming, so at 224 px with ch_mult (1, 1, 2, 2, 4) the levels run 224-112-56-28-14 and
  attn_resolutions=(16,) never fires: only the mid blocks have attention (14 x 14 = 196 tokens).

GroupNorm: taming uses 32 groups (eps 1e-6). Small configs have fewer than 32 channels, so the
group count here is gcd(32, C): 32 whenever C is a multiple of 32 (every taming config), else the
largest power-of-two divisor of C (e.g. 16 groups for C = 16, 16 for C = 48).

Input scaling (the original's quirk, docs/architecture.md): taming trains and tokenises on 2x - 1.
  `token_input_scale`   'signed' (original): encode_tokens/__call__ feed 2x - 1; 'unit' feeds x.
  `feature_input_scale` 'unit' (original ProCap quirk): encode_features feeds x in [0, 1] unchanged;
                        'signed' feeds 2x - 1 like the tokens.
The decoder produces the [-1, 1] space; outputs are mapped back with (y + 1) / 2.

Quantizer losses follow taming's legacy `VectorQuantizer2`: both terms are the mean squared
distance between z and its code; `commitment_loss` carries the gradient to the encoder
(||sg(z_q) - z||^2) and `codebook_loss` to the codebook (||z_q - sg(z)||^2). The legacy total is
`quant_loss = commitment_loss + beta * codebook_loss` (legacy puts beta on the codebook term;
standard VQ-VAE puts it on the commitment term). The tokenizer task chooses how to combine them.

Checkpoint conversion from taming: the module tree and names are taming's (`down.{i}` ->
`down_{i}`, conv OIHW -> HWIO, GroupNorm weight -> scale); `procap_jax.convert.taming` derives the
key table from this module, and `tests/parity_vqgan_test.py` checks codes, features and images
against taming's own `VQModel` (docs/fidelity.md, "Weights from the original").
"""

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec
import numpy as np

from procap_jax.models import conv_grads

CONV_AXES = (None, None, 'conv_in', 'conv_out')
# PyTorch's default Conv2d initialisation (kaiming_uniform with a = sqrt(5)).
_conv_init = nn.initializers.variance_scaling(1.0 / 3.0, 'fan_in', 'uniform')


def paper_config() -> dict[str, Any]:
  """The original's tokenizer (vqgan.1024.224.config.yml, resolution overwritten to 224)."""
  return dict(ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, attn_resolutions=(16,),
              resolution=224, z_channels=256, embed_dim=256, n_embed=1024, dropout=0.0,
              beta=0.25, feature_input_scale='unit', token_input_scale='signed')


def num_groups(channels: int) -> int:
  """GroupNorm group count: taming's 32 when it divides `channels`, else gcd(32, channels)."""
  return math.gcd(32, channels)


# Bytes of one row band's gathered operand [R + 2, W, 3 C] in `banded_conv3x3`: about what stays
# in the caches of the CPU this was measured on (docs/performance.md, "The tokenizer's
# convolutions in row bands").
BAND_BYTES = 2 * 2**20
# Images per encode call of the bfloat16 frozen tokenizer: the band loops' float32 results and
# padded copies of 64 images at 224 px took paper-size inference from 8 to 15.6 GiB; 8 images at
# a time bound them and were faster per image (docs/performance.md, same section).
BFLOAT16_CHUNK = 8


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


def conv(features: int, kernel: int, name: str, dtype: Any, strides: int = 1,
         padding: Any = 'SAME') -> nn.Conv:
  """A taming Conv2d: NHWC, HWIO kernel with logical axes (None, None, conv_in, conv_out);
  bfloat16 3x3 convolutions run in row bands (`conv_general_dilated`)."""
  return nn.Conv(features, (kernel, kernel), strides=strides, padding=padding, dtype=dtype,
                 conv_general_dilated=conv_general_dilated,
                 kernel_init=nn.with_logical_partitioning(_conv_init, CONV_AXES),
                 bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('conv_out',)),
                 name=name)


class ChannelSumsGroupNorm(nn.Module):
  """taming's GroupNorm (eps 1e-6, affine, float32 output) for bfloat16 models, with flax
  GroupNorm's parameters ('scale', 'bias') and one-pass statistics: each channel's sum and sum of
  squares over the pixels (float32), then per group, var = E[x^2] - E[x]^2 (at least 0), and the
  norm applied as one per-channel x * a + b. On XLA:CPU these reductions are faster than flax's
  over [pixels, group, channel in group] (docs/performance.md, "The tokenizer's convolutions in
  row bands")."""
  num_groups: int
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """[B, ..., C] -> float32 [B, ..., C]."""
    b, c, g = x.shape[0], x.shape[-1], self.num_groups
    scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
                       (c,), jnp.float32)
    bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)),
                      (c,), jnp.float32)
    x = x.astype(jnp.float32)
    flat = x.reshape(b, -1, c)  # [B, P, C]
    sums = jnp.stack([flat.sum(1), (flat * flat).sum(1)], 1)  # [B, 2, C]
    moments = sums.reshape(b, 2, g, c // g).sum(-1) / (flat.shape[1] * (c // g))  # [B, 2, G]
    mean = moments[:, 0]
    var = jnp.maximum(moments[:, 1] - mean * mean, 0.0)
    a = jnp.repeat(lax.rsqrt(var + self.epsilon), c // g, axis=-1) * scale  # [B, C]
    shift = bias - jnp.repeat(mean, c // g, axis=-1) * a
    expand = (b,) + (1,) * (x.ndim - 2) + (c,)
    return x * a.reshape(expand) + shift.reshape(expand)


def group_norm(channels: int, name: str, dtype: Any = jnp.float32) -> nn.Module:
  """taming's Normalize: GroupNorm(eps 1e-6, affine), computed in float32. Float32 models run
  flax's GroupNorm with two-pass statistics (the original's values); bfloat16 models (`dtype`)
  `ChannelSumsGroupNorm`'s one pass (mean of x and of x squared, from per-channel sums): the
  second pass and flax's layout of the reductions cost about 14 % of the bf16 encode's time
  (docs/performance.md, "The tokenizer's convolutions in row bands")."""
  if dtype == jnp.bfloat16:
    return ChannelSumsGroupNorm(num_groups(channels), name=name)
  return nn.GroupNorm(num_groups=num_groups(channels), epsilon=1e-6, dtype=jnp.float32,
                      use_fast_variance=False,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)),
                      name=name)


def pad_right_bottom(x: jax.Array) -> jax.Array:
  """Zero-pads [B, H, W, C] to [B, H + 1, W + 1, C] (taming's F.pad(x, (0, 1, 0, 1)))."""
  return jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))


class ResnetBlock(nn.Module):
  """norm1-swish-conv1-norm2-swish-dropout-conv2 plus a (1x1 nin_shortcut) residual."""
  out_channels: int
  dropout: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    """[B, H, W, C_in] -> [B, H, W, out_channels]."""
    h = nn.swish(group_norm(x.shape[-1], 'norm1', self.dtype)(x))
    h = conv(self.out_channels, 3, 'conv1', self.dtype)(h)
    h = nn.swish(group_norm(self.out_channels, 'norm2', self.dtype)(h))
    h = nn.Dropout(self.dropout, deterministic=not train)(h)
    h = conv(self.out_channels, 3, 'conv2', self.dtype)(h)
    if x.shape[-1] != self.out_channels:
      x = conv(self.out_channels, 1, 'nin_shortcut', self.dtype)(x)
    return x + h


class AttnBlock(nn.Module):
  """Single-head spatial self-attention with 1x1 q/k/v/proj_out convs and a residual."""
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """[B, H, W, C] -> [B, H, W, C]."""
    b, hh, ww, c = x.shape
    h = group_norm(c, 'norm', self.dtype)(x)
    q, k, v = (conv(c, 1, n, self.dtype)(h).reshape(b, hh * ww, c)  # [B, H*W, C]
               for n in ('q', 'k', 'v'))
    w = jnp.einsum('bqc,bkc->bqk', q, k) * (c ** -0.5)  # [B, H*W, H*W]
    w = jax.nn.softmax(w.astype(jnp.float32), axis=-1).astype(v.dtype)
    h = jnp.einsum('bqk,bkc->bqc', w, v).reshape(b, hh, ww, c)  # [B, H, W, C]
    return x + conv(c, 1, 'proj_out', self.dtype)(h)


class Downsample(nn.Module):
  """Zero pad right/bottom + 3x3 stride-2 VALID conv: [B, H, W, C] -> [B, H/2, W/2, C]."""
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return conv(x.shape[-1], 3, 'conv', self.dtype, strides=2, padding='VALID')(pad_right_bottom(x))


class Upsample(nn.Module):
  """Nearest x2 + 3x3 conv: [B, H, W, C] -> [B, 2H, 2W, C]."""
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)  # [B, 2H, 2W, C]
    return conv(x.shape[-1], 3, 'conv', self.dtype)(x)


class Level(nn.Module):
  """One resolution level (taming down[i] / up[i]): block_j (+ attn_j), then a resample."""
  out_channels: int
  num_blocks: int
  use_attn: bool
  resample: str  # 'downsample' | 'upsample' | 'none'
  dropout: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    for j in range(self.num_blocks):
      x = ResnetBlock(self.out_channels, self.dropout, self.dtype, name=f'block_{j}')(x, train)
      if self.use_attn:
        x = AttnBlock(self.dtype, name=f'attn_{j}')(x)
    if self.resample == 'downsample':
      x = Downsample(self.dtype, name='downsample')(x)
    elif self.resample == 'upsample':
      x = Upsample(self.dtype, name='upsample')(x)
    return x


class Mid(nn.Module):
  """block_1 -> attn_1 -> block_2 at the lowest resolution."""
  dropout: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    c = x.shape[-1]
    x = ResnetBlock(c, self.dropout, self.dtype, name='block_1')(x, train)
    x = AttnBlock(self.dtype, name='attn_1')(x)
    return ResnetBlock(c, self.dropout, self.dtype, name='block_2')(x, train)


class Encoder(nn.Module):
  """[B, S, S, 3] (already scaled) -> [B, h, w, z_channels]."""
  ch: int
  ch_mult: tuple[int, ...]
  num_res_blocks: int
  attn_resolutions: tuple[int, ...]
  resolution: int
  z_channels: int
  dropout: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    h = conv(self.ch, 3, 'conv_in', self.dtype)(x)
    res = self.resolution
    last = len(self.ch_mult) - 1
    for i, mult in enumerate(self.ch_mult):
      h = Level(self.ch * mult, self.num_res_blocks, res in self.attn_resolutions,
                'downsample' if i != last else 'none', self.dropout, self.dtype,
                name=f'down_{i}')(h, train)
      if i != last:
        res //= 2
    h = Mid(self.dropout, self.dtype, name='mid')(h, train)
    h = nn.swish(group_norm(h.shape[-1], 'norm_out', self.dtype)(h))
    return conv(self.z_channels, 3, 'conv_out', self.dtype)(h)


class Decoder(nn.Module):
  """[B, h, w, z_channels] -> [B, S, S, 3] in the [-1, 1] space (unclipped)."""
  ch: int
  ch_mult: tuple[int, ...]
  num_res_blocks: int
  attn_resolutions: tuple[int, ...]
  resolution: int
  dropout: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, z: jax.Array, train: bool) -> jax.Array:
    h = conv(self.ch * self.ch_mult[-1], 3, 'conv_in', self.dtype)(z)
    h = Mid(self.dropout, self.dtype, name='mid')(h, train)
    res = self.resolution // 2 ** (len(self.ch_mult) - 1)
    for i in reversed(range(len(self.ch_mult))):
      h = Level(self.ch * self.ch_mult[i], self.num_res_blocks + 1, res in self.attn_resolutions,
                'upsample' if i != 0 else 'none', self.dropout, self.dtype,
                name=f'up_{i}')(h, train)
      if i != 0:
        res *= 2
    h = nn.swish(group_norm(h.shape[-1], 'norm_out', self.dtype)(h))
    return conv(3, 3, 'conv_out', self.dtype)(h)


def nearest_code(z: jax.Array, codebook: jax.Array) -> jax.Array:
  """Index of the nearest code by squared L2: [..., D], [K, D] -> [...] int32."""
  z = z.astype(jnp.float32)
  codebook = codebook.astype(jnp.float32)
  d = (jnp.sum(z ** 2, axis=-1, keepdims=True) + jnp.sum(codebook ** 2, axis=-1)
       - 2.0 * jnp.einsum('...d,kd->...k', z, codebook))  # [..., K]
  return jnp.argmin(d, axis=-1).astype(jnp.int32)


class VectorQuantizer(nn.Module):
  """Nearest-code quantiser with a straight-through estimator (taming VectorQuantizer2, legacy)."""
  n_embed: int
  embed_dim: int
  beta: float

  def setup(self):
    # taming: embedding.weight.uniform_(-1 / K, 1 / K).
    init = nn.initializers.uniform(2.0 / self.n_embed)
    self.embedding = self.param(
        'embedding', nn.with_logical_partitioning(
            lambda rng, shape: init(rng, shape) - 1.0 / self.n_embed, ('codebook', None)),
        (self.n_embed, self.embed_dim))

  def __call__(self, z: jax.Array) -> dict[str, jax.Array]:
    """Quantises z.

    Args:
      z: [B, h, w, D] pre-quantisation vectors (quant_conv output).

    Returns:
      dict(quantized [B, h, w, D] with straight-through gradients to z, indices [B, h, w] int32,
      codebook_loss, commitment_loss, quant_loss (legacy: commitment + beta * codebook)).
    """
    z = z.astype(jnp.float32)
    indices = nearest_code(z, self.embedding)  # [B, h, w]
    z_q = self.embedding[indices]  # [B, h, w, D]
    commitment = jnp.mean((jax.lax.stop_gradient(z_q) - z) ** 2)
    codebook = jnp.mean((z_q - jax.lax.stop_gradient(z)) ** 2)
    return dict(quantized=z + jax.lax.stop_gradient(z_q - z), indices=indices,
                codebook_loss=codebook, commitment_loss=commitment,
                quant_loss=commitment + self.beta * codebook)

  def lookup(self, indices: jax.Array) -> jax.Array:
    """[...] int -> [..., D] code vectors."""
    return self.embedding[indices]


def scale_input(x01: jax.Array, scale: str) -> jax.Array:
  """'unit' keeps [0, 1]; 'signed' maps to [-1, 1] (2x - 1)."""
  if scale == 'unit':
    return x01
  if scale == 'signed':
    return 2.0 * x01 - 1.0
  raise ValueError(f"input scale must be 'unit' or 'signed', got {scale!r}")


class VQGAN(nn.Module):
  """taming's VQModel (encoder, quant_conv, quantize, post_quant_conv, decoder).

  Fields are exactly the keys of `config.tokenizer.model` (plus an optional compute `dtype` for the
  convolutions; parameters, norms, attention softmax and the quantiser stay float32).
  """
  ch: int
  ch_mult: tuple[int, ...]
  num_res_blocks: int
  attn_resolutions: tuple[int, ...]
  resolution: int
  z_channels: int
  embed_dim: int
  n_embed: int
  dropout: float = 0.0
  beta: float = 0.25
  feature_input_scale: str = 'unit'
  token_input_scale: str = 'signed'
  dtype: Any = jnp.float32

  def setup(self):
    ch_mult, attn = tuple(self.ch_mult), tuple(self.attn_resolutions)
    self.encoder = Encoder(self.ch, ch_mult, self.num_res_blocks, attn, self.resolution,
                           self.z_channels, self.dropout, self.dtype)
    self.quant_conv = conv(self.embed_dim, 1, 'quant_conv', self.dtype)
    self.quantize = VectorQuantizer(self.n_embed, self.embed_dim, self.beta)
    self.post_quant_conv = conv(self.z_channels, 1, 'post_quant_conv', self.dtype)
    self.decoder = Decoder(self.ch, ch_mult, self.num_res_blocks, attn, self.resolution,
                           self.dropout, self.dtype)

  @property
  def grid(self) -> int:
    """Token grid side h = w for `resolution`-sized inputs."""
    return self.resolution // 2 ** (len(self.ch_mult) - 1)

  def __call__(self, x01: jax.Array, train: bool = False) -> dict[str, jax.Array]:
    """Encode (token scaling), quantise, decode.

    Args:
      x01: [B, S, S, 3] float images in [0, 1].
      train: enables dropout (needs a 'dropout' rng when dropout > 0).

    Returns:
      dict(reconstruction [B, S, S, 3] in the [0, 1] scale (unclipped), z [B, h, w, D]
      pre-quantisation vectors, indices [B, h*w] int32, codebook_loss, commitment_loss,
      quant_loss).
    """
    z = self.quant_conv(self.encoder(scale_input(x01, self.token_input_scale), train))
    q = self.quantize(z)
    dec = self.decoder(self.post_quant_conv(q['quantized'].astype(self.dtype)), train)
    b = x01.shape[0]
    return dict(reconstruction=(dec.astype(jnp.float32) + 1.0) / 2.0, z=z.astype(jnp.float32),
                indices=q['indices'].reshape(b, -1),  # [B, h*w]
                codebook_loss=q['codebook_loss'], commitment_loss=q['commitment_loss'],
                quant_loss=q['quant_loss'])

  def encode_features(self, x01: jax.Array) -> jax.Array:
    """Continuous encoder output before quant_conv: [B, S, S, 3] in [0, 1] -> [B, h, w, Z]."""
    return self.encoder(scale_input(x01, self.feature_input_scale), False).astype(jnp.float32)

  def encode_tokens(self, x01: jax.Array) -> jax.Array:
    """Code indices: [B, S, S, 3] in [0, 1] -> [B, h*w] int32 (row-major over h, w)."""
    return self._codes(self.encoder(scale_input(x01, self.token_input_scale), False))

  def _codes(self, h: jax.Array) -> jax.Array:
    """Encoder output [B, h, w, Z] -> its nearest codes' indices [B, h*w] int32."""
    z = self.quant_conv(h)
    return nearest_code(z, self.quantize.embedding).reshape(h.shape[0], -1)  # [B, h*w]

  def encode_features_and_tokens(self, x01: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`encode_features` and `encode_tokens` from one encoder pass; only when both see the same
    input scale (otherwise they are two different passes, the original's quirk)."""
    if self.feature_input_scale != self.token_input_scale:
      raise ValueError('features and codes come from one encoder pass only when '
                       'feature_input_scale equals token_input_scale, not '
                       f'{self.feature_input_scale!r} and {self.token_input_scale!r}')
    h = self.encoder(scale_input(x01, self.token_input_scale), False)
    return h.astype(jnp.float32), self._codes(h)

  def decode_tokens(self, ids: jax.Array) -> jax.Array:
    """Images from code indices: [B, h*w] (square grid) -> [B, S, S, 3] clipped to [0, 1]."""
    b, n = ids.shape
    side = math.isqrt(n)
    if side * side != n:
      raise ValueError(f'decode_tokens needs a square token grid, got {n} tokens')
    q = self.quantize.lookup(ids).reshape(b, side, side, self.embed_dim)  # [B, h, w, D]
    dec = self.decoder(self.post_quant_conv(q.astype(self.dtype)), False)
    return jnp.clip((dec.astype(jnp.float32) + 1.0) / 2.0, 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class Frozen:
  """The frozen tokenizer as stages 1 and 2 call it (hashable: usable as a static jit argument).

  `params` are the VQGAN's 'params' collection; images are float [M, S, S, 3] in [0, 1].
  `chunk` > 0 encodes `chunk` images at a time (a `lax.map`; the last chunk zero-padded): the
  memory of one chunk's activations, the same values. Traced under a mesh whose 'data' axis
  divides the images (`jax.sharding.get_abstract_mesh`: the train step's, `jax.set_mesh`'s), a
  chunked encode runs on each device's own images (`jax.shard_map`): its chunk and row-band
  loops step over images, which would make the partitioner gather every image onto every
  device.
  """
  model: VQGAN
  chunk: int = 0

  def _encode(self, params: Any, images: jax.Array, method: str) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    data = 1 if mesh.empty or 'data' not in mesh.axis_names else mesh.shape['data']
    if self.chunk and data > 1 and images.shape[0] % data == 0:
      spec = PartitionSpec('data')
      return jax.shard_map(lambda p, x: self._encode_here(p, x, method), mesh=mesh,
                           in_specs=(PartitionSpec(), spec), out_specs=spec)(params, images)
    return self._encode_here(params, images, method)

  def _encode_here(self, params: Any, images: jax.Array, method: str) -> Any:
    m, c = images.shape[0], self.chunk
    if not c or m <= c:
      return self.model.apply({'params': params}, images, method=method)
    padded = jnp.pad(images, ((0, -m % c),) + ((0, 0),) * (images.ndim - 1))
    out = lax.map(lambda x: self.model.apply({'params': params}, x, method=method),
                  padded.reshape((-1, c) + images.shape[1:]))
    return jax.tree.map(lambda o: o.reshape((-1,) + o.shape[2:])[:m], out)

  @property
  def one_pass(self) -> bool:
    """True when features and codes see the same input scale, so that
    `encode_features_and_tokens` gets both from one encoder pass."""
    return self.model.feature_input_scale == self.model.token_input_scale

  def encode_features(self, params: Any, images: jax.Array) -> jax.Array:
    """-> continuous pre-quantisation features [M, h, w, C]."""
    return self._encode(params, images, 'encode_features')

  def encode_tokens(self, params: Any, images: jax.Array) -> jax.Array:
    """-> code indices int32 [M, h*w]."""
    return self._encode(params, images, 'encode_tokens')

  def encode_features_and_tokens(self, params: Any,
                                 images: jax.Array) -> tuple[jax.Array, jax.Array]:
    """-> (features [M, h, w, C], codes int32 [M, h*w]) from one encoder pass (`one_pass`
    only): XLA merges two equal passes of the float32 tokenizer by itself, but not the bfloat16
    one's, whose band loops it keeps apart."""
    return self._encode(params, images, 'encode_features_and_tokens')

  def decode_tokens(self, params: Any, ids: jax.Array) -> jax.Array:
    """[M, h*w] code ids -> images [M, S, S, 3] in [0, 1]."""
    return self.model.apply({'params': params}, ids, method='decode_tokens')


def frozen(model_config: Any, dtype: str = 'float32') -> Frozen:
  """The frozen tokenizer of `config.tokenizer.model` (lists from a JSON config become tuples)
  computing its convolutions in `dtype` ('float32' or 'bfloat16': `config.tokenizer.frozen_dtype`,
  which also encodes BFLOAT16_CHUNK images at a time); features and codes come out as float32
  and int32 either way."""
  items = model_config.to_dict() if hasattr(model_config, 'to_dict') else dict(model_config)
  items = {k: tuple(v) if isinstance(v, list) else v for k, v in items.items()}
  if dtype not in ('float32', 'bfloat16'):
    raise ValueError(f'the frozen tokenizer computes in float32 or bfloat16, not {dtype!r}')
  if dtype == 'float32':
    return Frozen(VQGAN(**items))
  return Frozen(VQGAN(**items, dtype=jnp.bfloat16), chunk=BFLOAT16_CHUNK)


def frozen_from_config(config: Any) -> Frozen:
  """The frozen tokenizer stages 1 and 2 and the caption command run: `config.tokenizer.model` in
  `config.tokenizer.frozen_dtype` (float32 for configs saved before that entry)."""
  return frozen(config.tokenizer.model, config.tokenizer.get('frozen_dtype', 'float32'))
