"""The taming VQGAN's layers: convolutions, GroupNorm, ResNet and attention blocks, the
resolution levels and the Encoder / Decoder stacks (`vqgan.VQGAN` puts them together).

Dimensions: B batch, H/W rows/columns of a level, C channels. Layout NHWC, kernels HWIO with
logical axes `CONV_AXES`. The architecture and its GroupNorm group count: `vqgan`'s docstring.
"""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from procap_jax.models import banded_conv


CONV_AXES = (None, None, 'conv_in', 'conv_out')
# PyTorch's default Conv2d initialisation (kaiming_uniform with a = sqrt(5)).
_conv_init = nn.initializers.variance_scaling(1.0 / 3.0, 'fan_in', 'uniform')


def num_groups(channels: int) -> int:
  """GroupNorm group count: taming's 32 when it divides `channels`, else gcd(32, channels)."""
  return math.gcd(32, channels)


def conv(features: int, kernel: int, name: str, dtype: Any, strides: int = 1,
         padding: Any = 'SAME') -> nn.Conv:
  """A taming Conv2d: NHWC, HWIO kernel with logical axes (None, None, conv_in, conv_out);
  bfloat16 3x3 convolutions run in row bands (`banded_conv.conv_general_dilated`)."""
  return nn.Conv(features, (kernel, kernel), strides=strides, padding=padding, dtype=dtype,
                 conv_general_dilated=banded_conv.conv_general_dilated,
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
