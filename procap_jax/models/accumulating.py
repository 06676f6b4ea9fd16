"""Products that accumulate in float32 for narrower inputs, forward and backward: `nn.Dense`'s
dot_general, einsum and the dense layer with its bias (`AccumulatingDense`).

Dimension legend: B batch, S sequence length, K contracted width, N output width.
On XLA:CPU a bfloat16 product accumulates in bfloat16 unless asked; these ask for float32
accumulation and round once (docs/performance.md on low precision).
"""

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


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
