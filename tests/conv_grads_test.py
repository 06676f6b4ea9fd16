"""The tap-product convolution gradients (procap_jax.models.conv_grads) against the library's, for
every convolution shape the tokenizer and its discriminator train: 3x3 'SAME', the downsample's
3x3 stride-2 'VALID', 1x1, a 3-channel conv_in, the discriminator's 4x4 stride-2 and stride-1
convolutions with one pixel of padding, inside a `lax.map` as the chunked train step runs them,
and both kernel-gradient forms (kernel rows, taps)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from procap_jax.models import banded_conv
from procap_jax.models import conv_grads
from procap_jax.models import vqgan_layers

SHAPES = [  # (x shape, kernel shape, strides, padding)
    ((2, 8, 8, 16), (3, 3, 16, 24), (1, 1), 'SAME'),
    ((2, 9, 9, 16), (3, 3, 16, 16), (2, 2), 'VALID'),  # downsample after its right/bottom pad
    ((2, 8, 8, 16), (1, 1, 16, 8), (1, 1), 'SAME'),
    ((2, 8, 8, 3), (3, 3, 3, 16), (1, 1), 'SAME'),
    ((2, 8, 8, 3), (4, 4, 3, 8), (2, 2), ((1, 1), (1, 1))),
    ((2, 7, 6, 8), (4, 4, 8, 4), (1, 1), ((1, 1), (1, 1))),
    ((1, 7, 9, 4), (3, 2, 4, 5), (2, 3), ((2, 0), (0, 1))),
]


def _library(x, kernel, strides, padding):
  return jax.lax.conv_general_dilated(x, kernel, strides, padding,
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def _grads(fn, x, kernel, weights):
  return jax.grad(lambda a, k: jnp.sum(fn(a, k) * weights), (0, 1))(x, kernel)


def _random(shape, key):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32)


@pytest.mark.parametrize('x_shape,k_shape,strides,padding', SHAPES)
@pytest.mark.parametrize('form', ['rows', 'taps'])
def test_gradients_match_library(x_shape, k_shape, strides, padding, form, monkeypatch):
  x, kernel = _random(x_shape, 0), _random(k_shape, 1)
  pads = conv_grads.explicit_pads(x_shape, k_shape, strides, padding)
  ref = _library(x, kernel, strides, padding)
  if form == 'taps':  # the kernel gradient one tap at a time, as beyond COLUMN_BYTES
    column = int(np.prod(ref.shape[:3])) * x_shape[3] * 4
    monkeypatch.setattr(conv_grads, 'COLUMN_BYTES', column * k_shape[1] - 1)
  got = conv_grads.conv(x, kernel, strides, pads)
  np.testing.assert_array_equal(got, ref)  # the forward is the library's
  weights = _random(ref.shape, 2)
  for g, r in zip(_grads(lambda a, k: conv_grads.conv(a, k, strides, pads), x, kernel, weights),
                  _grads(lambda a, k: _library(a, k, strides, padding), x, kernel, weights)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_gradients_match_library_inside_a_loop():
  x, kernel = _random((3, 2, 8, 8, 16), 0), _random((3, 3, 16, 16), 1)
  pads = ((1, 1), (1, 1))

  def looped(fn):
    return jax.jit(jax.grad(lambda a, k: jnp.sum(jax.lax.map(lambda xi: fn(xi, k) ** 2, a)),
                            (0, 1)))

  got = looped(lambda a, k: conv_grads.conv(a, k, (1, 1), pads))(x, kernel)
  ref = looped(lambda a, k: _library(a, k, (1, 1), 'SAME'))(x, kernel)
  for g, r in zip(got, ref):  # up to the summation order of sums over 2 x 64 pixels
    assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 1e-6
    np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-3)


def test_vqgan_convolutions_take_the_products_inside_loops_and_on_large_images(monkeypatch):
  """vqgan_layers.conv's float32 convolutions run conv_grads.conv (same values and gradients as the
  library's) inside `in_loop()` and from MIN_PIXELS output pixels on, and the library's
  otherwise; dilated ones always the library's."""
  x = _random((2, 8, 8, 8), 0)
  layer = vqgan_layers.conv(16, 4, 'c', jnp.float32, 2, 1)
  params = layer.init(jax.random.key(3), x)

  def jaxpr():
    return str(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(layer.apply(p, x) ** 2)))(params))

  assert 'custom_vjp_call' not in jaxpr()  # 4 x 4 output pixels
  with conv_grads.in_loop():
    assert 'custom_vjp_call' in jaxpr()
  assert 'custom_vjp_call' not in jaxpr()
  monkeypatch.setattr(conv_grads, 'MIN_PIXELS', 16)
  assert 'custom_vjp_call' in jaxpr()
  kernel = params['params']['kernel'].unbox()
  numbers = jax.lax.conv_dimension_numbers(x.shape, kernel.shape, conv_grads.NHWC)
  assert conv_grads.supported(x, kernel, ((1, 1), (1, 1)), None, None, numbers, 1, {})
  assert not conv_grads.supported(x, kernel, 'SAME', None, (2, 2), numbers, 1, {})
  assert not conv_grads.supported(x.astype(jnp.bfloat16), kernel, 'SAME', None, None, numbers, 1,
                                  {})
  dilated = nn.Conv(16, (3, 3), kernel_dilation=2,
                    conv_general_dilated=banded_conv.conv_general_dilated)
  p2 = dilated.init(jax.random.key(4), x)
  ref = nn.Conv(16, (3, 3), kernel_dilation=2).apply(p2, x)
  np.testing.assert_allclose(dilated.apply(p2, x), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('stride', [1, 2])
def test_banded_backward_products_match_library(stride):
  """The bfloat16 banded convolution's float32 backward, as products and as the library's."""
  x = _random((2, 9, 9, 32), 0).astype(jnp.bfloat16)
  kernel = (_random((3, 3, 32, 16), 1) / 16).astype(jnp.bfloat16)

  def grads(products):
    return jax.grad(lambda a, k: jnp.sum(
        banded_conv.banded_conv3x3(a, k, stride, products).astype(jnp.float32) ** 2),
        (0, 1))(x, kernel)

  for g, r in zip(grads(True), grads(False)):
    np.testing.assert_allclose(g.astype(jnp.float32), r.astype(jnp.float32), rtol=2e-2, atol=2e-2)
