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

import functools
import math
from typing import Any

import flax.linen as nn
import jax
from jax import ad_checkpoint
import jax.numpy as jnp
import numpy as np

from procap_jax import sharding

Dtype = Any
Initializer = Any

# checkpoint_name of MultiHeadAttention's output before out_proj: the encoder's checkpointed block
# scan keeps it, so its backward recomputes no attention forward outside the attention's own loop.
ATTENTION_OUTPUT = 'attention_output'
# checkpoint_name of the outputs of the block's dense products (in_proj, out_proj, c_fc): with
# the encoder's `scan_keep_dense` the block scan keeps them too, so its backward recomputes no
# product (c_proj's output is not needed by any backward).
DENSE_OUTPUT = 'dense_output'


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


def _dense_dims(lhs_ndim: int) -> tuple:
  """nn.Dense's dimension numbers: lhs [..., K] times rhs [K, N]."""
  return (((lhs_ndim - 1,), (0,)), ((), ()))


@jax.custom_vjp
def _accumulating_matmul(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """lhs [..., K] @ rhs [K, N] -> [..., N] in lhs's dtype, accumulated in float32."""
  return jax.lax.dot_general(lhs, rhs, _dense_dims(lhs.ndim),
                             preferred_element_type=jnp.float32).astype(lhs.dtype)


def _accumulating_matmul_fwd(lhs, rhs):
  return _accumulating_matmul(lhs, rhs), (lhs, rhs)


def _accumulating_matmul_bwd(residuals, g):
  lhs, rhs = residuals
  g = g.astype(lhs.dtype)  # [..., N]
  lead = tuple(range(lhs.ndim - 1))
  d_lhs = jax.lax.dot_general(g, rhs, (((g.ndim - 1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)  # [..., K]
  d_rhs = jax.lax.dot_general(lhs, g, ((lead, lead), ((), ())),
                              preferred_element_type=jnp.float32)  # [K, N]
  return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


_accumulating_matmul.defvjp(_accumulating_matmul_fwd, _accumulating_matmul_bwd)


def accumulating_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: tuple,
                             precision: Any = None,
                             preferred_element_type: Any = None) -> jax.Array:
  """nn.Dense's `dot_general` for low-precision matmuls: float32 accumulation in both passes.

  XLA:CPU multiplies bfloat16 operands fast only when the product is asked for in float32:
  a plain bfloat16 x bfloat16 -> bfloat16 dot (what nn.Dense and the transposes JAX derives for
  its backward pass emit) runs no faster than float32 (`docs/performance.md`, "bfloat16
  matmuls"). Here the forward product and both gradient products take bfloat16 operands and a
  float32 result, rounded to the operands' dtype afterwards: on an AVX-512 BF16 CPU about
  twice float32's matmul rate; the values are those of a float32-accumulated bfloat16 matmul.
  Only nn.Dense's contraction (last lhs axis with the first of a 2-D rhs) is handled; `precision`
  and `preferred_element_type` are accepted for nn.Dense's call signature and must be None.
  """
  if dimension_numbers != _dense_dims(lhs.ndim) or rhs.ndim != 2:
    raise ValueError(f'accumulating_dot_general handles nn.Dense contractions only, '
                     f'got {dimension_numbers} for rhs of rank {rhs.ndim}')
  if precision is not None or preferred_element_type is not None:
    raise ValueError('accumulating_dot_general takes no precision or preferred_element_type')
  return _accumulating_matmul(lhs, rhs)


def _einsum_transposes(spec: str) -> tuple[str, str]:
  """The einsum specs of the two gradients of `spec` ('ab,bc->ac': 'ac,bc->ab', 'ab,ac->bc')."""
  inputs, out = spec.split('->')
  a, b = inputs.split(',')
  for name, term, others in (('first', a, b + out), ('second', b, a + out)):
    if len(set(term)) != len(term) or not set(term) <= set(others):
      raise ValueError(f'einsum {spec!r}: every index of the {name} operand must appear once '
                       'in it and in the other operand or the output')
  return f'{out},{b}->{a}', f'{a},{out}->{b}'


def _batched_matmul(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """`spec`'s einsum as one [G, M, K] x [G, K, N] dot with a float32 result.

  Shared indices in the output are the batch G, shared ones absent from it the contraction K,
  the rest the free axes M (of `a`) and N (of `b`). XLA:CPU's bfloat16 x bfloat16 -> float32
  dot runs only in this canonical layout: some einsum operand orders fall back to a dot thunk
  that rejects those types at run time.
  """
  inputs, out = spec.split('->')
  sa, sb = inputs.split(',')
  batch = [c for c in sa if c in sb and c in out]
  contract = [c for c in sa if c in sb and c not in out]
  free_a = [c for c in sa if c not in sb]
  free_b = [c for c in sb if c not in sa]
  size = dict(zip(sa, a.shape)) | dict(zip(sb, b.shape))
  count = lambda axes: math.prod(size[c] for c in axes)
  lhs = jnp.transpose(a, [sa.index(c) for c in batch + free_a + contract])
  rhs = jnp.transpose(b, [sb.index(c) for c in batch + contract + free_b])
  lhs = lhs.reshape(count(batch), count(free_a), count(contract))  # [G, M, K]
  rhs = rhs.reshape(count(batch), count(contract), count(free_b))  # [G, K, N]
  y = jax.lax.dot_general(lhs, rhs, (((2,), (1,)), ((0,), (0,))),
                          preferred_element_type=jnp.float32)  # [G, M, N]
  order = batch + free_a + free_b
  y = y.reshape([size[c] for c in order])
  return jnp.transpose(y, [order.index(c) for c in out])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def accumulating_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """A two-operand einsum of low-precision operands with a float32 result, in both passes.

  The batched-matmul twin of `accumulating_dot_general` (attention products, tied output
  layers): the forward product is float32; the backward pass rounds the incoming gradient to
  `a`'s dtype and computes both gradients as float32 products of such operands, rounded to the
  operands' dtypes. No index may be summed within one operand alone.
  """
  _einsum_transposes(spec)
  return _batched_matmul(spec, a, b.astype(a.dtype))


def _accumulating_einsum_fwd(spec, a, b):
  return accumulating_einsum(spec, a, b), (a, b)


def _accumulating_einsum_bwd(spec, residuals, g):
  a, b = residuals
  spec_a, spec_b = _einsum_transposes(spec)
  g = g.astype(a.dtype)
  d_a = _batched_matmul(spec_a, g, b.astype(a.dtype))
  d_b = _batched_matmul(spec_b, a, g)
  return d_a.astype(a.dtype), d_b.astype(b.dtype)


accumulating_einsum.defvjp(_accumulating_einsum_fwd, _accumulating_einsum_bwd)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
                          scale: float) -> jax.Array:
  """Softmax attention; [B, S, H, Dh] (queries [B, T, H, Dh]) -> [B, T, H, Dh].

  float32 inputs: `jax.nn.dot_product_attention` (its XLA implementation). Narrower inputs: the
  same computation (float32 scores and softmax, probabilities rounded to the inputs' dtype) with
  both products through `accumulating_einsum`, so they run at the fast bfloat16 rate in the
  forward and backward passes (jax's version asks for a bfloat16 result in the second product
  and in the gradients its transposes derive).
  """
  if q.dtype == jnp.float32:
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
  logits = accumulating_einsum('btnh,bsnh->bnts', q, k) * scale  # [B, H, T, S] float32
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # [B, H, T, S]
  return accumulating_einsum('bnts,bsnh->btnh', probs, v).astype(v.dtype)


@jax.custom_vjp
def _accumulating_affine(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
  """x [..., K] @ kernel [K, N] + bias [N], all of x's dtype: nn.Dense's forward with
  `accumulating_dot_general` (product accumulated in float32, rounded, then the bias added)."""
  return _accumulating_matmul(x, kernel) + bias


def _accumulating_affine_fwd(x, kernel, bias):
  return _accumulating_affine(x, kernel, bias), (x, kernel)


def _accumulating_affine_bwd(residuals, g):
  x, kernel = residuals
  d_x, d_kernel = _accumulating_matmul_bwd((x, kernel), g)
  g = g.astype(x.dtype).reshape(-1, g.shape[-1])  # [M, N]
  ones = jnp.ones((1, g.shape[0]), x.dtype)
  d_bias = jax.lax.dot_general(ones, g, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)[0]  # [N]
  return d_x, d_kernel, d_bias.astype(x.dtype)


_accumulating_affine.defvjp(_accumulating_affine_fwd, _accumulating_affine_bwd)


class AccumulatingDense(nn.Dense):
  """nn.Dense for narrower than float32 computation, with the same parameters.

  The product is `accumulating_dot_general`'s; the bias gradient is computed as a product
  of a row of ones with the output gradient (float32 accumulation) instead of a sum over the
  rows, which XLA:CPU runs as a slow `reduce-window` (about 0.3 G elements/s). `dtype` must
  be set (the computation dtype); nn.Dense's `dot_general`, `dot_general_cls` and `precision`
  fields are not used.
  """

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    kernel = self.param('kernel', self.kernel_init, (jnp.shape(inputs)[-1], self.features),
                        self.param_dtype)
    if not self.use_bias:
      return _accumulating_matmul(inputs.astype(self.dtype), kernel.astype(self.dtype))
    bias = self.param('bias', self.bias_init, (self.features,), self.param_dtype)
    return _accumulating_affine(inputs.astype(self.dtype), kernel.astype(self.dtype),
                                bias.astype(self.dtype))


def dense_class(dtype: Dtype) -> type[nn.Dense]:
  """The Dense module for computation `dtype`: nn.Dense for float32 (unchanged graphs),
  `AccumulatingDense` (same parameters) for narrower float types."""
  if jnp.dtype(dtype) == jnp.dtype(jnp.float32):
    return nn.Dense
  return AccumulatingDense


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


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
                      chunk: int, scale: float) -> jax.Array:
  """Softmax attention computed for `chunk` queries at a time, each chunk rematerialised.

  Every query still attends to all S keys with an exact softmax (no online normalisation is
  needed because a chunk sees the whole key axis), so the result equals the unchunked one up to
  float rounding. Peak memory for the scores drops from [B, H, S, S] to [B, H, chunk, S]: the
  chunks run in a `lax.map` whose body is `jax.checkpoint`ed, so the backward pass recomputes
  each chunk's probabilities instead of keeping all of them.

  Args:
    q, k, v: [B, S, H, Dh].
    mask: bool broadcastable to [B, H, S, S] (True = may attend), or None.
    chunk: queries per chunk, > 0.
    scale: score scale (1/sqrt(Dh) in MultiHeadAttention).

  Returns:
    [B, S, H, Dh].
  """
  b, s, h, dh = q.shape
  n = -(-s // chunk)
  pad = n * chunk - s
  if mask is None:
    mask = jnp.ones((1, 1, s, s), bool)
  mask = jnp.broadcast_to(mask, jnp.broadcast_shapes(mask.shape, (1, 1, s, s)))  # [b|1, h|1, S, S]
  qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))  # [B, n*C, H, Dh]
  mp = jnp.pad(mask, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=True)  # [., ., n*C, S]
  q_chunks = jnp.moveaxis(qp.reshape(b, n, chunk, h, dh), 1, 0)  # [n, B, C, H, Dh]
  m_chunks = jnp.moveaxis(mp.reshape(*mp.shape[:2], n, chunk, s), 2, 0)  # [n, ., ., C, S]

  @jax.checkpoint
  def one(args):
    qc, mc = args  # [B, C, H, Dh], [., ., C, S]
    return dot_product_attention(qc, k, v, mc, scale)  # [B, C, H, Dh]

  out = jax.lax.map(one, (q_chunks, m_chunks))  # [n, B, C, H, Dh]
  return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, h, dh)[:, :s]  # [B, S, H, Dh]


def _pairs_dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
  """[G, ., .] x [G, ., .] products batched over axis 0, contracting `contract`, f32 result."""
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((0,), (0,))),
                             preferred_element_type=jnp.float32)


def _transposed_in_memory(x: jax.Array) -> jax.Array:
  """[G, M, K] -> [G, K, M], written out as a transposed copy.

  XLA:CPU multiplies bfloat16 operands into a float32 result natively only when each operand's
  contracted axis is where a row-major matmul wants it; a product contracting the lhs's middle
  axis gets both operands converted to float32 and runs at the float32 rate. A plain transpose
  in front of the product does not help (XLA folds it into the product's dimension numbers);
  written through a split of the last axis it stays a copy, which the product then reads in
  the native form. Same values.
  """
  g, m, k = x.shape
  split = next((c for c in (64, 32, 16, 8, 4, 2) if k % c == 0 and c < k), 1)
  x = x.reshape(g, m, k // split, split)
  return jnp.transpose(x, (0, 2, 3, 1)).reshape(g, k, m)


def _pairs_dot_first(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [G, T, S] and b [G, T, N] contracted over T -> [G, S, N] float32.

  For narrower than float32 operands `a` is transposed in memory first
  (`_transposed_in_memory`): about 1.35 times as fast a paper-size attention gradient in
  bfloat16 on XLA:CPU. float32 operands keep the plain product (unchanged float32 programs).
  """
  if a.dtype == jnp.float32:
    return _pairs_dot(a, b, (1, 1))
  return _pairs_dot(_transposed_in_memory(a), b, (2, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _pairs_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
                     scale: float) -> jax.Array:
  """Softmax attention of G independent (batch, head) pairs: q [G, T, Dh], k and v [G, S, Dh],
  mask bool [G | 1, T, S] or None -> [G, T, Dh] in v's dtype (products accumulated in f32)."""
  return _pairs_attention_fwd(q, k, v, mask, scale)[0]


def _pairs_attention_fwd(q, k, v, mask, scale):
  logits = _pairs_dot(q, k, (2, 2)) * scale  # [G, T, S] float32
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # [G, T, S]
  out = _pairs_dot(probs, v, (2, 1))  # [G, T, Dh] float32
  return out.astype(v.dtype), (q, k, v, mask, probs, out)


def _pairs_attention_bwd(scale, residuals, g):
  q, k, v, mask, probs, out = residuals
  g = g.astype(v.dtype)  # [G, T, Dh]
  d_v = _pairs_dot_first(probs, g)  # [G, S, Dh]
  d_probs = _pairs_dot(g, v, (2, 2))  # [G, T, S]
  # sum_s d_probs * probs = sum_h g * out: the softmax backward's row term from [G, T, Dh].
  row = jnp.sum(g.astype(jnp.float32) * out, axis=-1, keepdims=True)  # [G, T, 1]
  d_logits = (probs.astype(jnp.float32) * (d_probs - row) * scale).astype(q.dtype)  # [G, T, S]
  d_q = _pairs_dot(d_logits, k, (2, 1))  # [G, T, Dh]
  d_k = _pairs_dot_first(d_logits, q)  # [G, S, Dh]
  d_mask = None if mask is None else np.zeros(mask.shape, jax.dtypes.float0)
  return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_mask


_pairs_attention.defvjp(_pairs_attention_fwd, _pairs_attention_bwd)


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
                      group: int, scale: float) -> jax.Array:
  """Softmax attention computed for `group` (batch, head) pairs at a time, each step
  rematerialised.

  The same values as `dot_product_attention`, arranged for a CPU's caches: one loop step
  handles `group` [T, S] score matrices (2.6 MB each in float32 at T = S = 811), which stay in
  cache from the scores product through the softmax to the value product, where the whole
  [B, H, T, S] block makes every one of those passes through memory. Each step is
  `jax.checkpoint`ed, so the backward pass recomputes one step's probabilities at a time; the
  softmax's backward is written out (custom VJP) so it reuses the probabilities instead of
  exponentiating again, and every product asks for a float32 result (the fast bfloat16 form on
  XLA:CPU; `accumulating_einsum`).

  Step j takes pairs j, j + steps, j + 2 steps, ... of the (batch, head) pairs in batch-major
  order, as training's micro-batches take rows: on a data-parallel mesh, with `group` a
  multiple of the data axis, every step takes its pairs evenly from all devices and each device
  computes its own rows' attention. (Consecutive pairs per step would put the loop over the
  sharded axis, and the partitioner would gather the whole batch's queries, keys and values onto
  every device, each of which would then compute all of it.)

  Args:
    q: [B, T, H, Dh] queries.
    k, v: [B, S, H, Dh].
    mask: bool broadcastable to [B, H, T, S] (True = may attend), or None.
    group: pairs per step, > 0; the largest divisor of B * H not above it is used.
    scale: score scale.

  Returns:
    [B, T, H, Dh] in v's dtype.
  """
  if group < 1:
    raise ValueError(f'attention group must be a positive number of (batch, head) pairs, '
                     f'got {group}')
  b, t, h, dh = q.shape
  s = k.shape[1]
  pairs = b * h
  group = max(d for d in range(1, min(group, pairs) + 1) if pairs % d == 0)
  steps = pairs // group

  def by_pair(x):  # [B, L, H, Dh] -> [steps, group, L, Dh]; step j: pairs j, j + steps, ...
    pairs_first = jnp.transpose(x, (0, 2, 1, 3)).reshape(pairs, x.shape[1], dh)
    return sharding.interleaved_rows(pairs_first, steps)

  if mask is not None:
    mask = jnp.asarray(mask)
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # [b|1, h|1, t|1, s|1]
    mask = jnp.broadcast_to(mask, mask.shape[:2] + (t, s))  # [b|1, h|1, T, S]
  shared = mask is None or mask.shape[:2] == (1, 1)

  @jax.checkpoint
  def one(args):
    qg, kg, vg, first = args  # [group, T|S, Dh] x 3, the step's first pair (its index j)
    if shared:
      mg = None if mask is None else mask[0]  # [1, T, S]
    else:
      idx = first + steps * jnp.arange(group)  # [group] pair indices
      mg = mask[idx // h if mask.shape[0] > 1 else 0, idx % h if mask.shape[1] > 1 else 0]
      mg = mg.reshape(-1, t, s)  # [group | 1, T, S]
    return _pairs_attention(qg, kg, vg, mg, scale)  # [group, T, Dh]

  firsts = jnp.arange(steps)
  out = jax.lax.map(one, (by_pair(q), by_pair(k), by_pair(v), firsts))  # [steps, group, T, Dh]
  out = sharding.rows_in_order(out)  # [B * H, T, Dh] in pair order
  return jnp.transpose(out.reshape(b, h, t, dh), (0, 2, 1, 3))  # [B, T, H, Dh]


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
      of C (`chunked_attention`), so only a [B, H, C, S] block of scores exists at a time, in
      the forward and, recomputed, in the backward pass. Same values and parameters.
    head_group: 0 = as `query_chunk` says; G > 0 = attention for G (batch, head) pairs at a
      time (`grouped_attention`): the score matrices stay in cache, 1.4 to 2.5 times as fast
      on a CPU as either form above, with a [G, S, S] block of scores alive at a time. Takes
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
      out = grouped_attention(q, k, v, mask, self.head_group, dh ** -0.5)  # [B, S, H, Dh]
    elif self.query_chunk and s > self.query_chunk:
      out = chunked_attention(q, k, v, mask, self.query_chunk, dh ** -0.5)  # [B, S, H, Dh]
    else:
      out = dot_product_attention(q, k, v, mask, dh ** -0.5)  # [B, S, H, Dh]
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
