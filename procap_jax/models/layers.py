"""Shared small layers: QuickGELU, CLIP residual attention blocks, torch-style initialisers.

Dimension legend: B batch, S sequence length, D width, H heads, Dh head dim (D / H),
F MLP width (mlp_ratio * D), C input channels.

Parameter layout of `ResidualAttentionBlock` (one CLIP `visual.transformer.resblocks.{i}`):

  flax path                     shape      torch name (OpenAI CLIP)          conversion
  ln_1/{scale,bias}             [D]        ln_1.{weight,bias}                as is
  attn/in_proj/kernel           [D, 3D]    attn.in_proj_weight [3D, D]       transpose
  attn/in_proj/bias             [3D]       attn.in_proj_bias                 as is
  attn/out_proj/kernel          [D, D]     attn.out_proj.weight [D, D]       transpose
  attn/out_proj/bias            [D]        attn.out_proj.bias                as is
  ln_2/{scale,bias}             [D]        ln_2.{weight,bias}                as is
  mlp/c_fc/{kernel,bias}        [D, F]     mlp.c_fc.{weight [F, D],bias}     transpose kernel
  mlp/c_proj/{kernel,bias}      [F, D]     mlp.c_proj.{weight [D, F],bias}   transpose kernel

The fused in_proj columns are [q | k | v], each split into H contiguous chunks of Dh, exactly
torch.nn.MultiheadAttention's layout, so a transposed CLIP weight gives the same outputs.
"""

from typing import Any

import flax.linen as nn
import jax
from jax import ad_checkpoint
import jax.numpy as jnp

from procap_jax.models import accumulating
from procap_jax.models import attention

Dtype = Any
Initializer = Any

# checkpoint_name of MultiHeadAttention's output before out_proj: the encoder's checkpointed block
# scan keeps it, so its backward recomputes no attention forward outside the attention's own loop.
ATTENTION_OUTPUT = 'attention_output'
# checkpoint_name of the outputs of the block's dense products (in_proj, out_proj, c_fc): with
# the encoder's `scan_keep_dense` the block scan keeps them too, so its backward recomputes no
# product (c_proj's output is not needed by any backward).
DENSE_OUTPUT = 'dense_output'


def image_to_cells(image: jax.Array, side: int) -> jax.Array:
  """[B, h * side, w * side, C] -> [B, h, w, side * side * C]: each side x side cell's values,
  row-major, channels last (the layout of `tokenizer.model.feature_pixels`)."""
  b, hs, ws, c = image.shape
  h, w = hs // side, ws // side
  cells = image.reshape(b, h, side, w, side, c).transpose(0, 1, 3, 2, 4, 5)
  return cells.reshape(b, h, w, side * side * c)


def cells_to_image(cells: jax.Array, side: int) -> jax.Array:
  """The inverse of `image_to_cells`: [B, h, w, side * side * C] -> [B, h * side, w * side, C]."""
  b, h, w, n = cells.shape
  c = n // (side * side)
  image = cells.reshape(b, h, w, side, side, c).transpose(0, 1, 3, 2, 4, 5)
  return image.reshape(b, h * side, w * side, c)


def quick_gelu(x: jax.Array) -> jax.Array:
  """CLIP's QuickGELU: x * sigmoid(1.702 x)."""
  return x * jax.nn.sigmoid(1.702 * x)


def torch_kernel_init() -> Initializer:
  """torch.nn.Linear's default weight init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
  return nn.initializers.variance_scaling(1.0 / 3.0, 'fan_in', 'uniform')


def torch_bias_init(fan_in: int) -> Initializer:
  """torch.nn.Linear's default bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
  bound = 1.0 / max(1, fan_in) ** 0.5

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def layer_norm(eps: float = 1e-5, name: str | None = None) -> nn.LayerNorm:
  """LayerNorm (torch semantics: biased variance, eps inside the sqrt) with logical names."""
  return nn.LayerNorm(
      epsilon=eps, name=name,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)))


def dense_class(dtype: Dtype) -> type[nn.Dense]:
  """The Dense module for computation `dtype`: nn.Dense for float32 (unchanged graphs),
  `accumulating.AccumulatingDense` (same parameters) for narrower float types."""
  if jnp.dtype(dtype) == jnp.dtype(jnp.float32):
    return nn.Dense
  return accumulating.AccumulatingDense


def dense(features: int, names: tuple[str | None, str | None], *, dtype: Dtype = jnp.float32,
          kernel_init: Initializer | None = None, bias_init: Initializer | None = None,
          fan_in: int | None = None, name: str | None = None) -> nn.Dense:
  """nn.Dense with logical axis names; torch-default init unless inits are given.

  Args:
    features: output size.
    names: logical names of the kernel (input axis, output axis); the bias gets the second.
    dtype: computation dtype (parameters stay float32).
    kernel_init: kernel initialiser; default torch.nn.Linear's.
    bias_init: bias initialiser; default torch.nn.Linear's (needs `fan_in`), zeros without it.
    fan_in: input size, for the torch-default bias init.
    name: module name.
  """
  if kernel_init is None:
    kernel_init = torch_kernel_init()
  if bias_init is None:
    bias_init = torch_bias_init(fan_in) if fan_in else nn.initializers.zeros
  return dense_class(dtype)(
      features, dtype=dtype, param_dtype=jnp.float32, name=name,
      kernel_init=nn.with_logical_partitioning(kernel_init, names),
      bias_init=nn.with_logical_partitioning(bias_init, (names[1],)))


class LayerNormDense(nn.Module):
  """LayerNorm followed by a Dense: the original's `nn.Sequential(LayerNorm, Linear)`.

  torch `<name>.0.{weight,bias}` -> `norm/{scale,bias}`; `<name>.1.weight` [out, in] ->
  `dense/kernel` [in, out] (transpose); `<name>.1.bias` -> `dense/bias`.

  Attributes:
    features: output size.
    names: logical names of the dense kernel.
    dtype: computation dtype of the dense layer.
  """
  features: int
  names: tuple[str | None, str | None]
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """[..., C] -> [..., features]."""
    x = layer_norm(name='norm')(x)
    return dense(self.features, self.names, dtype=self.dtype, fan_in=x.shape[-1],
                 name='dense')(x)


class MultiHeadAttention(nn.Module):
  """torch.nn.MultiheadAttention (fused q/k/v in_proj with bias, out_proj with bias).

  Scores are scaled by 1/sqrt(Dh); no dropout.

  Attributes:
    width: D.
    heads: H; must divide D.
    in_std: std of the normal in_proj init (from-scratch runs).
    out_std: std of the normal out_proj init.
    dtype: computation dtype.
    query_chunk: 0 = one softmax over the full [S, S] score matrix; C > 0 = queries in chunks
      of C (`attention.chunked_attention`), so only a [B, H, C, S] block of scores exists at a
      time, in the forward and, recomputed, in the backward pass. Same values and parameters.
    head_group: 0 = as `query_chunk` says; G > 0 = attention for G (batch, head) pairs at a
      time (`attention.grouped_attention`): the score matrices stay in cache, 1.4 to 2.5 times as
      fast on a CPU as either form above, with a [G, S, S] block of scores alive at a time. Takes
      precedence over `query_chunk`. Same values and parameters.
  """
  width: int
  heads: int
  in_std: float
  out_std: float
  dtype: Dtype = jnp.float32
  query_chunk: int = 0
  head_group: int = 0

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Self-attention.

    Args:
      x: [B, S, D].
      mask: bool, broadcastable to [B, H, S, S]; True where a query (row) may attend to a
        key (column). None = full attention.

    Returns:
      [B, S, D].
    """
    b, s, d = x.shape
    if d != self.width or d % self.heads:
      raise ValueError(f'width {d} (expected {self.width}) must be divisible by {self.heads} heads')
    dh = d // self.heads
    qkv = dense(3 * d, ('embed', 'heads'), dtype=self.dtype,
                kernel_init=nn.initializers.normal(self.in_std),
                bias_init=nn.initializers.zeros, name='in_proj')(x)  # [B, S, 3D]
    qkv = ad_checkpoint.checkpoint_name(qkv, DENSE_OUTPUT)
    q, k, v = jnp.split(qkv, 3, axis=-1)  # 3 x [B, S, D]
    q = q.reshape(b, s, self.heads, dh)  # [B, S, H, Dh]
    k = k.reshape(b, s, self.heads, dh)  # [B, S, H, Dh]
    v = v.reshape(b, s, self.heads, dh)  # [B, S, H, Dh]
    if self.head_group:
      out = attention.grouped_attention(q, k, v, mask, self.head_group, dh ** -0.5)  # [B, S, H, Dh]
    elif self.query_chunk and s > self.query_chunk:
      out = attention.chunked_attention(q, k, v, mask, self.query_chunk,
                                        dh ** -0.5)  # [B, S, H, Dh]
    else:
      out = attention.dot_product_attention(q, k, v, mask, dh ** -0.5)  # [B, S, H, Dh]
    out = out.reshape(b, s, d)  # [B, S, D]
    out = ad_checkpoint.checkpoint_name(out, ATTENTION_OUTPUT)
    out = dense(d, ('heads', 'embed'), dtype=self.dtype,
                kernel_init=nn.initializers.normal(self.out_std),
                bias_init=nn.initializers.zeros, name='out_proj')(out)  # [B, S, D]
    return ad_checkpoint.checkpoint_name(out, DENSE_OUTPUT)


class Mlp(nn.Module):
  """CLIP MLP: c_fc (D -> F), QuickGELU, c_proj (F -> D)."""
  width: int
  hidden: int
  fc_std: float
  proj_std: float
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """[B, S, D] -> [B, S, D]."""
    h = dense(self.hidden, ('embed', 'mlp'), dtype=self.dtype,
              kernel_init=nn.initializers.normal(self.fc_std),
              bias_init=nn.initializers.zeros, name='c_fc')(x)  # [B, S, F]
    h = ad_checkpoint.checkpoint_name(h, DENSE_OUTPUT)
    h = quick_gelu(h)
    return dense(self.width, ('mlp', 'embed'), dtype=self.dtype,
                 kernel_init=nn.initializers.normal(self.proj_std),
                 bias_init=nn.initializers.zeros, name='c_proj')(h)  # [B, S, D]


class ResidualAttentionBlock(nn.Module):
  """CLIP `ResidualAttentionBlock`: pre-LN (eps 1e-5) attention and QuickGELU MLP, no dropout.

  x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)). The residual stream keeps the input dtype
  (float32), while matmuls run in `dtype`.

  From-scratch initialisation follows CLIP's `initialize_parameters` for its transformer
  (the original loads pretrained CLIP weights instead): in_proj N(0, D^-1/2), out_proj and
  c_proj N(0, D^-1/2 (2 depth)^-1/2), c_fc N(0, (2D)^-1/2), zero biases.

  Attributes:
    width: D.
    heads: H.
    mlp_ratio: F / D.
    depth: number of blocks in the stack (only scales the init).
    dtype: computation dtype.
    query_chunk: attention query chunk (MultiHeadAttention.query_chunk; 0 = unchunked).
    head_group: attention (batch, head) pairs per step (MultiHeadAttention.head_group; 0 = off).
  """
  width: int
  heads: int
  mlp_ratio: int = 4
  depth: int = 1
  dtype: Dtype = jnp.float32
  query_chunk: int = 0
  head_group: int = 0

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """[B, S, D] (mask as in MultiHeadAttention) -> [B, S, D]."""
    attn_std = self.width ** -0.5
    proj_std = attn_std * (2 * self.depth) ** -0.5
    fc_std = (2 * self.width) ** -0.5
    h = MultiHeadAttention(self.width, self.heads, in_std=attn_std, out_std=proj_std,
                           dtype=self.dtype, query_chunk=self.query_chunk,
                           head_group=self.head_group,
                           name='attn')(layer_norm(name='ln_1')(x), mask)
    x = x + h.astype(x.dtype)
    h = Mlp(self.width, self.mlp_ratio * self.width, fc_std=fc_std, proj_std=proj_std,
            dtype=self.dtype, name='mlp')(layer_norm(name='ln_2')(x))
    return x + h.astype(x.dtype)
