"""Attention kernels: softmax attention in one piece, in query chunks, or per head group.

Dimension legend: B batch, S key length, T query length, H heads, Dh head dim, C query chunk.
`layers.MultiHeadAttention` picks one (`query_chunk`, `head_group`); all give the same values.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from procap_jax import sharding
from procap_jax.models import accumulating


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
                          scale: float) -> jax.Array:
  """Softmax attention; [B, S, H, Dh] (queries [B, T, H, Dh]) -> [B, T, H, Dh].

  float32 inputs: `jax.nn.dot_product_attention` (its XLA implementation). Narrower inputs: the
  same computation (float32 scores and softmax, probabilities rounded to the inputs' dtype) with
  both products through `accumulating.accumulating_einsum`, so they run at the fast bfloat16 rate
  in the forward and backward passes (jax's version asks for a bfloat16 result in the second
  product and in the gradients its transposes derive).
  """
  if q.dtype == jnp.float32:
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
  logits = accumulating.accumulating_einsum('btnh,bsnh->bnts', q, k) * scale  # [B, H, T, S] float32
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # [B, H, T, S]
  return accumulating.accumulating_einsum('bnts,bsnh->btnh', probs, v).astype(v.dtype)


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
  XLA:CPU; `accumulating.accumulating_einsum`).

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
