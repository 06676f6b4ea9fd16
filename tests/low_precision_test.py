"""Tests of the float32-accumulating bfloat16 products in models/layers.py.

Each product is compared with the same product computed in float32 from the same bfloat16
operands (what a float32-accumulated bfloat16 matmul should give), in the forward pass and in
both gradients; float32 models must keep JAX's own products.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from procap_jax.models import accumulating
from procap_jax.models import attention
from procap_jax.models import decoder
from procap_jax.models import layers

BF16 = jnp.bfloat16


def _bf16(key, shape):
  return jax.random.normal(key, shape).astype(BF16)


def _close(got, want, rtol):
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  scale = np.abs(want).max()
  assert scale > 0
  np.testing.assert_allclose(got, want, atol=rtol * scale, rtol=0)


def _close_norm(got, want, tol):
  """Relative error in norm: bfloat16 rounding through a few layers moves single entries more."""
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)


def test_accumulating_dot_general_matches_float32_product_and_gradients():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x, w = _bf16(k1, (3, 5, 16)), _bf16(k2, (16, 8))
  g = jax.random.normal(k3, (3, 5, 8))
  dims = (((2,), (0,)), ((), ()))

  def fast(x, w):
    return accumulating.accumulating_dot_general(x, w, dims).astype(jnp.float32)

  def ref(x, w):
    return jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), dims)

  y, vjp = jax.vjp(fast, x, w)
  y_ref, vjp_ref = jax.vjp(ref, x, w)
  assert accumulating.accumulating_dot_general(x, w, dims).dtype == BF16
  _close(y, y_ref, 1e-2)  # the result is rounded to bfloat16 once
  for got, want in zip(vjp(g), vjp_ref(g)):
    assert got.dtype == BF16
    _close(got, want, 2e-2)  # and the gradient products see a bfloat16 cotangent


def test_dense_class_is_flax_dense_for_float32_only():
  assert layers.dense_class(jnp.float32) is nn.Dense
  assert layers.dense_class(BF16) is accumulating.AccumulatingDense


@pytest.mark.parametrize('use_bias', [True, False])
def test_accumulating_dense_is_flax_dense_with_a_float32_accumulated_bias_gradient(use_bias):
  k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
  x = _bf16(k1, (3, 40, 16))
  g = jax.random.normal(k3, (3, 40, 8)).astype(BF16)
  kwargs = dict(features=8, use_bias=use_bias, dtype=BF16,
                dot_general=accumulating.accumulating_dot_general,
                bias_init=nn.initializers.normal(1.0))
  flax_dense, ours = nn.Dense(**kwargs), accumulating.AccumulatingDense(**kwargs)
  params = flax_dense.init(k2, x)
  assert jax.tree.map(jnp.shape, ours.init(k2, x)) == jax.tree.map(jnp.shape, params)
  y, vjp = jax.vjp(lambda p, x: ours.apply(p, x), params, x)
  y_ref, vjp_ref = jax.vjp(lambda p, x: flax_dense.apply(p, x), params, x)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  (d_params, d_x), (d_params_ref, d_x_ref) = vjp(g), vjp_ref(g)
  np.testing.assert_array_equal(np.asarray(d_x, np.float32), np.asarray(d_x_ref, np.float32))
  np.testing.assert_array_equal(d_params['params']['kernel'], d_params_ref['params']['kernel'])
  if use_bias:
    # The sum over the 120 rows, accumulated in float32 and rounded to bfloat16 once.
    want = np.asarray(g, np.float32).reshape(-1, 8).sum(0)
    np.testing.assert_allclose(d_params['params']['bias'], want, rtol=2 ** -8, atol=1e-6)


def test_accumulating_dot_general_rejects_other_contractions():
  x, w = jnp.ones((4, 3), BF16), jnp.ones((4, 5), BF16)
  with pytest.raises(ValueError, match='nn.Dense contractions'):
    accumulating.accumulating_dot_general(x, w, (((0,), (0,)), ((), ())))


@pytest.mark.parametrize('spec,a_shape,b_shape', [
    ('btnh,bsnh->bnts', (2, 5, 3, 4), (2, 7, 3, 4)),  # attention scores
    ('bnts,bsnh->btnh', (2, 3, 5, 7), (2, 7, 3, 4)),  # probabilities times values
    ('abh,hv->abv', (2, 5, 6), (6, 9)),  # tied output layer
])
def test_accumulating_einsum_matches_float32_einsum_and_gradients(spec, a_shape, b_shape):
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  a, b = _bf16(k1, a_shape), _bf16(k2, b_shape)
  y, vjp = jax.vjp(lambda a, b: accumulating.accumulating_einsum(spec, a, b), a, b)
  y_ref, vjp_ref = jax.vjp(
      lambda a, b: jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32)), a, b)
  assert y.dtype == jnp.float32
  _close(y, y_ref, 1e-5)  # float32 result of bfloat16 operands: exact up to summation order
  g = jax.random.normal(k3, y.shape)
  for got, want in zip(vjp(g), vjp_ref(g)):
    assert got.dtype == BF16
    _close(got, want, 2e-2)


def test_accumulating_einsum_rejects_an_index_summed_in_one_operand():
  with pytest.raises(ValueError, match='every index'):
    accumulating.accumulating_einsum('ij,jk->k', jnp.ones((2, 3), BF16), jnp.ones((3, 4), BF16))


@pytest.mark.parametrize('chunk,group', [(0, 0), (3, 0), (0, 2)])
def test_bfloat16_attention_tracks_float32_attention(chunk, group):
  k1, k2 = jax.random.split(jax.random.key(2))
  x = jax.random.normal(k1, (2, 7, 16))
  mask = jnp.tril(jnp.ones((7, 7), bool))[None, None]
  f32 = layers.MultiHeadAttention(16, 4, 0.2, 0.2, query_chunk=chunk, head_group=group)
  b16 = layers.MultiHeadAttention(16, 4, 0.2, 0.2, dtype=BF16, query_chunk=chunk,
                                  head_group=group)
  params = nn.meta.unbox(f32.init(k2, x, mask))

  def loss(model, params):
    return jnp.sum(model.apply(params, x, mask).astype(jnp.float32) ** 2)

  (l32, g32), (l16, g16) = (jax.value_and_grad(lambda p, m=m: loss(m, p))(params)
                            for m in (f32, b16))
  assert abs(float(l16) - float(l32)) < 0.02 * abs(float(l32))
  for got, want in zip(jax.tree.leaves(g16), jax.tree.leaves(g32)):
    _close_norm(got, want, 0.05)


def test_bfloat16_decoder_tracks_float32_decoder():
  model32 = decoder.CaptionDecoder(vocab_size=11, hidden=16, heads=4, ffn=24, layers=2,
                                   dropout=0.0, max_len=6)
  model16 = model32.clone(dtype=BF16)
  k1, k2 = jax.random.split(jax.random.key(3))
  tokens = jax.random.randint(k1, (2, 6), 0, 11)
  memory = jax.random.normal(k2, (2, 5, 16))
  params = nn.meta.unbox(model32.init(jax.random.key(4), tokens, memory))
  logits32 = model32.apply(params, tokens, memory)
  logits16 = model16.apply(params, tokens, memory)
  assert logits16.dtype == jnp.float32
  _close(logits16, logits32, 0.03)
  grads = [jax.grad(lambda p, m=m: jnp.sum(m.apply(p, tokens, memory) ** 2))(params)
           for m in (model32, model16)]
  # jax's own bfloat16 products gave the same errors here (up to 4 % in norm on one kernel)
  for got, want in zip(jax.tree.leaves(grads[1]), jax.tree.leaves(grads[0])):
    _close_norm(got, want, 0.06)


@pytest.mark.parametrize('shape', [(2, 5, 7), (1, 3, 64), (2, 4, 96), (3, 6, 1)])
def test_transposed_in_memory_is_a_transpose(shape):
  x = jax.random.normal(jax.random.key(0), shape).astype(BF16)
  np.testing.assert_array_equal(np.asarray(attention._transposed_in_memory(x), np.float32),
                                np.asarray(jnp.swapaxes(x, 1, 2), np.float32))


def _float32_products(compiled_text: str) -> list[str]:
  """The products of an optimised HLO module that read a float32 operand."""
  found = []
  for comp in re.split(r'\n(?=%?[\w.\-]+ \(.*\) -> .* \{)', compiled_text):
    for m in re.finditer(r'= \w+\[[\d,]*\]\{[\d,]*\} dot\((%[\w.\-]+), (%[\w.\-]+)\)', comp):
      for operand in m.groups():
        t = re.search(re.escape(operand) + r' = (\w+)\[', comp)
        if t and t.group(1) == 'f32':
          found.append(m.group(0))
  return found


def test_bfloat16_grouped_attention_gradient_multiplies_bfloat16_operands():
  # A product contracting an operand's middle axis makes XLA:CPU convert both operands to
  # float32 (half the bfloat16 rate); the attention's backward must avoid that form.
  q, k, v = (_bf16(key, (2, 48, 2, 16)) for key in jax.random.split(jax.random.key(3), 3))

  def loss(q, k, v):
    out = attention.grouped_attention(q, k, v, None, 2, 0.25)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
  assert text.count(' dot(') >= 6
  assert _float32_products(text) == []
