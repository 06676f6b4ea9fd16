"""Tests for models/vqgan.py: shapes, the paper configuration's parameter tree, the quantiser, the
straight-through gradient, the asymmetric downsample padding, the input-scaling switches, and the
bfloat16 convolutions in row bands with the chunked frozen encode."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import synthetic
from procap_jax import config_migrate
from procap_jax import sharding
from procap_jax.models import banded_conv
from procap_jax.models import vqgan
from procap_jax.models import vqgan_layers

import jaxpr_counts  # tests/ is on the path (pytest's default import mode)
import margins

TINY = dict(ch=8, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(8,), resolution=16,
            z_channels=8, embed_dim=4, n_embed=7, dropout=0.0, beta=0.25,
            feature_input_scale='unit', token_input_scale='signed')


def _images(b: int, s: int, seed: int = 0) -> jax.Array:
  return jax.random.uniform(jax.random.key(seed), (b, s, s, 3))


def _variables(model: vqgan.VQGAN, side: int, seed: int = 0) -> dict:
  """Random parameters with the model's tree, filled with numpy (eager flax init is slow on the
  shared CPU): kernels and codes ~ N(0, 1 / fan_in), norm scales 1, biases 0."""
  rng = np.random.default_rng(seed)
  abstract = jax.eval_shape(model.init, jax.random.key(0),
                            jax.ShapeDtypeStruct((1, side, side, 3), jnp.float32))

  def fill(path, leaf):
    name = path[-1].key
    if name == 'scale':
      return jnp.ones(leaf.shape)
    if name == 'bias':
      return jnp.zeros(leaf.shape)
    fan_in = int(np.prod(leaf.shape[:-1])) if name == 'kernel' else leaf.shape[-1]
    return jnp.asarray(rng.normal(size=leaf.shape) / np.sqrt(fan_in), jnp.float32)

  return {'params': jax.tree_util.tree_map_with_path(fill, nn.meta.unbox(abstract['params']))}


def _param_shapes(params) -> dict[str, tuple]:
  flat = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params))
  return {'/'.join(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def test_codebook_init_is_taming_uniform():
  q = vqgan.VectorQuantizer(n_embed=7, embed_dim=4, beta=0.25)
  params = q.init(jax.random.key(0), jnp.zeros((1, 1, 1, 4)))['params']
  codebook = nn.meta.unbox(params)['embedding']
  assert codebook.shape == (7, 4) and codebook.dtype == jnp.float32
  assert float(jnp.abs(codebook).max()) <= 1.0 / 7  # uniform(-1/K, 1/K)
  assert float(codebook.min()) < 0.0 < float(codebook.max())


def test_tiny_preset_runs_with_contract_shapes():
  config = synthetic.get_config('tiny')
  model = vqgan.VQGAN(**config.tokenizer.model)
  s, grid = config.tokenizer.model.resolution, model.grid
  x = _images(3, s)
  variables = _variables(model, s)
  out = model.apply(variables, x)
  assert out['reconstruction'].shape == (3, s, s, 3)
  assert out['indices'].shape == (3, grid * grid) and out['indices'].dtype == jnp.int32
  assert out['z'].shape == (3, grid, grid, config.tokenizer.model.embed_dim)
  assert np.isfinite(float(out['codebook_loss'])) and np.isfinite(float(out['commitment_loss']))
  feats = model.apply(variables, x, method='encode_features')
  assert feats.shape == (3, grid, grid, config.tokenizer.model.z_channels)
  tokens = model.apply(variables, x, method='encode_tokens')
  np.testing.assert_array_equal(tokens, out['indices'])
  images = model.apply(variables, tokens, method='decode_tokens')
  assert images.shape == (3, s, s, 3)
  assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0


def test_default_preset_shapes():
  config = synthetic.get_config('default')
  model = vqgan.VQGAN(**config.tokenizer.model)
  s = config.tokenizer.model.resolution
  x = jax.ShapeDtypeStruct((5, s, s, 3), jnp.float32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  out = jax.eval_shape(model.apply, variables, x)
  grid = config.pretrain.model.grid
  assert out['indices'].shape == (5, grid[0] * grid[1])
  feats = jax.eval_shape(lambda v, x: model.apply(v, x, method='encode_features'), variables, x)
  assert feats.shape == (5,) + tuple(grid) + (config.pretrain.model.feature_dim,)
  assert config.tokenizer.model.n_embed == config.pretrain.model.codebook_size


def test_paper_configuration_matches_taming_layout():
  model = vqgan.VQGAN(**vqgan.paper_config())
  x = jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  out = jax.eval_shape(model.apply, variables, x)
  assert out['indices'].shape == (2, 196)
  assert out['reconstruction'].shape == (2, 224, 224, 3)
  feats = jax.eval_shape(lambda v, x: model.apply(v, x, method='encode_features'), variables, x)
  assert feats.shape == (2, 14, 14, 256)
  shapes = _param_shapes(variables['params'])
  expected = {
      'encoder/conv_in/kernel': (3, 3, 3, 128),
      'encoder/down_0/block_0/norm1/scale': (128,),
      'encoder/down_0/downsample/conv/kernel': (3, 3, 128, 128),
      'encoder/down_2/block_0/nin_shortcut/kernel': (1, 1, 128, 256),
      'encoder/down_4/block_1/conv2/kernel': (3, 3, 512, 512),
      'encoder/mid/attn_1/q/kernel': (1, 1, 512, 512),
      'encoder/mid/attn_1/proj_out/bias': (512,),
      'encoder/conv_out/kernel': (3, 3, 512, 256),
      'quant_conv/kernel': (1, 1, 256, 256),
      'quantize/embedding': (1024, 256),
      'post_quant_conv/kernel': (1, 1, 256, 256),
      'decoder/conv_in/kernel': (3, 3, 256, 512),
      'decoder/up_4/block_2/conv1/kernel': (3, 3, 512, 512),
      'decoder/up_1/upsample/conv/kernel': (3, 3, 128, 128),
      'decoder/up_0/block_0/conv1/kernel': (3, 3, 128, 128),
      'decoder/norm_out/scale': (128,),
      'decoder/conv_out/kernel': (3, 3, 128, 3),
  }
  for name, shape in expected.items():
    assert shapes[name] == shape, name
  # Levels run 224-112-56-28-14: attn_resolutions=(16,) never fires, only the mid blocks attend.
  assert not [k for k in shapes if '/attn_' in k and '/mid/' not in k]
  assert not [k for k in shapes if 'down_4/downsample' in k or 'up_0/upsample' in k]
  assert not [k for k in shapes if 'down_0/block_0/nin_shortcut' in k]
  # The count equals taming's VQModel (encoder, decoder, quantize, quant convs) at this config.
  assert sum(int(np.prod(s)) for s in shapes.values()) == 66_883_459


def test_logical_axis_names():
  model = vqgan.VQGAN(**TINY)
  params = jax.eval_shape(model.init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 16, 16, 3), jnp.float32))['params']
  assert params['encoder']['conv_in']['kernel'].names == (None, None, 'conv_in', 'conv_out')
  assert params['quant_conv']['kernel'].names == (None, None, 'conv_in', 'conv_out')
  assert params['quantize']['embedding'].names == ('codebook', None)
  assert params['encoder']['norm_out']['scale'].names == ('norm',)
  assert params['decoder']['mid']['attn_1']['norm']['bias'].names == ('norm',)


def test_attention_at_listed_resolutions_only():
  abstract = jax.eval_shape(vqgan.VQGAN(**TINY).init, jax.random.key(0),
                            jax.ShapeDtypeStruct((1, 16, 16, 3), jnp.float32))
  shapes = _param_shapes(abstract['params'])
  # resolution 16, ch_mult (1, 2): level 0 at 16 px, level 1 at 8 px (in attn_resolutions).
  assert 'encoder/down_1/attn_0/q/kernel' in shapes
  assert not [k for k in shapes if k.startswith('encoder/down_0/attn')]
  assert {'decoder/up_1/attn_0/v/kernel', 'decoder/up_1/attn_1/v/kernel'} <= set(shapes)
  assert not [k for k in shapes if k.startswith('decoder/up_0/attn')]


@pytest.mark.parametrize('channels, groups', [(8, 8), (16, 16), (32, 32), (48, 16), (128, 32),
                                              (512, 32)])
def test_group_count(channels, groups):
  assert vqgan_layers.num_groups(channels) == groups


def test_nearest_code_on_hand_made_codebook():
  codebook = jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [-3.0, -3.0]])
  z = jnp.array([[0.1, -0.2], [0.9, 0.4], [0.2, 1.2], [-1.0, -2.5], [0.6, 0.0]])
  np.testing.assert_array_equal(vqgan.nearest_code(z, codebook), [0, 1, 2, 3, 1])

  q = vqgan.VectorQuantizer(n_embed=4, embed_dim=2, beta=0.25)
  out = q.apply({'params': {'embedding': codebook}}, z.reshape(1, 1, 5, 2))
  np.testing.assert_array_equal(out['indices'].reshape(-1), [0, 1, 2, 3, 1])
  np.testing.assert_allclose(out['quantized'].reshape(5, 2), codebook[jnp.array([0, 1, 2, 3, 1])],
                             atol=1e-6)
  mse = np.mean((np.asarray(codebook)[[0, 1, 2, 3, 1]] - np.asarray(z)) ** 2)
  np.testing.assert_allclose(out['commitment_loss'], mse, rtol=1e-6)
  np.testing.assert_allclose(out['codebook_loss'], mse, rtol=1e-6)
  np.testing.assert_allclose(out['quant_loss'], 1.25 * mse, rtol=1e-6)  # legacy weighting


def test_straight_through_gradient_is_identity():
  codebook = jax.random.normal(jax.random.key(1), (5, 3))
  q = vqgan.VectorQuantizer(n_embed=5, embed_dim=3, beta=0.25)
  z = jax.random.normal(jax.random.key(2), (1, 2, 2, 3))
  jac = jax.jacobian(lambda z: q.apply({'params': {'embedding': codebook}}, z)['quantized'])(z)
  np.testing.assert_allclose(jac.reshape(12, 12), np.eye(12), atol=1e-6)
  # The legacy losses route gradients: commitment to z only, codebook loss to the codes only.
  grads = jax.grad(lambda cb, z: q.apply({'params': {'embedding': cb}}, z)['commitment_loss'],
                   argnums=(0, 1))(codebook, z)
  assert float(jnp.abs(grads[0]).max()) == 0.0 and float(jnp.abs(grads[1]).max()) > 0.0
  grads = jax.grad(lambda cb, z: q.apply({'params': {'embedding': cb}}, z)['codebook_loss'],
                   argnums=(0, 1))(codebook, z)
  assert float(jnp.abs(grads[0]).max()) > 0.0 and float(jnp.abs(grads[1]).max()) == 0.0


def test_downsample_asymmetric_padding_by_hand():
  x = jnp.arange(16, dtype=jnp.float32).reshape(1, 4, 4, 1)  # x[i, j] = 4 i + j
  kernel = jnp.zeros((3, 3, 1, 1)).at[0, 0].set(1.0).at[2, 2].set(2.0)
  params = {'conv': {'kernel': kernel, 'bias': jnp.zeros((1,))}}
  y = vqgan_layers.Downsample().apply({'params': params}, x)
  # Zero pad only right/bottom to 5x5, VALID stride 2: out[p, q] = x[2p, 2q] + 2 xpad[2p+2, 2q+2].
  # out[0,0] = 0 + 2*10, out[0,1] = 2 + 2*pad, out[1,0] = 8 + 2*pad, out[1,1] = 10 + 2*pad.
  np.testing.assert_allclose(y[0, :, :, 0], [[20.0, 2.0], [8.0, 10.0]])
  # A symmetric pad of one would give a different top-left value (x[1,1] term: 2*5 = 10).
  assert float(y[0, 0, 0, 0]) != 10.0


def test_upsample_is_nearest_then_conv():
  x = jnp.arange(4, dtype=jnp.float32).reshape(1, 2, 2, 1)
  identity = jnp.zeros((3, 3, 1, 1)).at[1, 1].set(1.0)
  y = vqgan_layers.Upsample().apply(
      {'params': {'conv': {'kernel': identity, 'bias': jnp.zeros(1)}}}, x)
  np.testing.assert_allclose(y[0, :, :, 0], [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3],
                                             [2, 2, 3, 3]])


def test_input_scaling_switches():
  x = _images(2, 16, seed=3)
  unit = vqgan.VQGAN(**TINY)
  variables = _variables(unit, 16)
  signed = vqgan.VQGAN(**dict(TINY, feature_input_scale='signed'))
  f_unit = unit.apply(variables, x, method='encode_features')
  f_signed = signed.apply(variables, x, method='encode_features')
  np.testing.assert_allclose(f_signed, unit.apply(variables, 2 * x - 1, method='encode_features'),
                             atol=1e-5)
  assert float(jnp.abs(f_unit - f_signed).max()) > 1e-3
  # Tokens: 'signed' (default) encodes 2x - 1, i.e. 'unit' tokens of 2x - 1.
  unit_tokens = vqgan.VQGAN(**dict(TINY, token_input_scale='unit'))
  np.testing.assert_array_equal(unit.apply(variables, x, method='encode_tokens'),
                                unit_tokens.apply(variables, 2 * x - 1, method='encode_tokens'))
  with pytest.raises(ValueError, match='input scale'):
    vqgan.VQGAN(**dict(TINY, feature_input_scale='half')).apply(variables, x,
                                                                 method='encode_features')


def test_feature_pixels_appends_each_cells_pooled_pixels():
  # TINY: 16 px, a 8 x 8 grid of 2 x 2 px cells; P = 1 pools each cell to its mean colour.
  x = _images(2, 16, seed=4)
  plain = vqgan.VQGAN(**TINY)
  variables = _variables(plain, 16)
  with_pixels = vqgan.VQGAN(**dict(TINY, feature_pixels=1))
  f = with_pixels.apply(variables, x, method='encode_features')
  assert f.shape == (2, 8, 8, TINY['z_channels'] + 3)
  np.testing.assert_array_equal(f[..., :-3], plain.apply(variables, x, method='encode_features'))
  cell = x[1, 4:6, 6:8].mean((0, 1))  # row 2, column 3 of the grid
  np.testing.assert_allclose(f[1, 2, 3, -3:], 2 * cell - 1, atol=1e-6)
  # P = 2 keeps every pixel of a 2 x 2 cell, row-major then channel.
  f2 = vqgan.VQGAN(**dict(TINY, feature_pixels=2)).apply(variables, x, method='encode_features')
  np.testing.assert_allclose(f2[0, 5, 1, -12:], (2 * x[0, 10:12, 2:4] - 1).reshape(-1),
                             atol=1e-6)
  # The one-pass encode (same input scales) appends the same pixels; the codes do not change.
  one = vqgan.VQGAN(**dict(TINY, feature_input_scale='signed', feature_pixels=1))
  feats, codes = one.apply(variables, x, method='encode_features_and_tokens')
  np.testing.assert_array_equal(feats[..., -3:], f[..., -3:])
  np.testing.assert_array_equal(codes, plain.apply(variables, x, method='encode_tokens'))
  with pytest.raises(ValueError, match='must divide'):
    vqgan.VQGAN(**dict(TINY, feature_pixels=3)).apply(variables, x, method='encode_features')


def test_bfloat16_compute_dtype_runs():
  x = _images(2, 16)
  model = vqgan.VQGAN(**TINY)
  model16 = vqgan.VQGAN(**TINY, dtype=jnp.bfloat16)
  variables = _variables(model, 16)
  out16 = model16.apply(variables, x)
  assert out16['reconstruction'].dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(out16['reconstruction'])))
  # Continuous features agree to bf16 precision (codes may flip near ties, so compare features).
  f32 = model.apply(variables, x, method='encode_features')
  f16 = model16.apply(variables, x, method='encode_features')
  assert f16.dtype == jnp.float32
  assert float(jnp.abs(f16 - f32).max()) < 0.05 * float(jnp.abs(f32).max())


def test_decode_tokens_rejects_non_square_grid():
  model = vqgan.VQGAN(**TINY)
  variables = _variables(model, 16)
  with pytest.raises(ValueError, match='square'):
    model.apply(variables, jnp.zeros((1, 15), jnp.int32), method='decode_tokens')


# Channels enough for the bfloat16 row-band convolutions (3x3 with >= 32 input channels).
WIDE = dict(TINY, ch=32, embed_dim=8)


def _library_conv(x, kernel, strides=(1, 1), padding='SAME'):
  return jax.lax.conv_general_dilated(x, kernel, strides, padding,
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


@pytest.mark.parametrize('stride', [1, 2])
@pytest.mark.parametrize('shape,out', [((2, 12, 10, 32), 16), ((1, 7, 5, 40), 8),
                                       ((1, 13, 9, 32), 8)])
def test_banded_conv3x3_matches_library_convolution(shape, out, stride):
  # stride 2 is 'VALID' (the downsample after its right/bottom pad): odd and even sides.
  x = jax.random.normal(jax.random.key(0), shape)
  kernel = jax.random.normal(jax.random.key(1), (3, 3, shape[-1], out)) / 10
  padding = 'SAME' if stride == 1 else 'VALID'
  ref = _library_conv(x, kernel, (stride, stride), padding)
  scale = float(jnp.abs(ref).max())
  height = ref.shape[1]
  for rows in [r for r in range(1, height + 1) if height % r == 0]:
    got = banded_conv._band_product(x, kernel, rows, stride)
    assert got.shape == ref.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, atol=1e-5 * scale, rtol=0)
  loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))  # noqa: E731
  grads = jax.grad(loss(lambda a, b: banded_conv.banded_conv3x3(a, b, stride)), (0, 1))(x, kernel)
  ref_grads = jax.grad(loss(lambda a, b: _library_conv(a, b, (stride, stride), padding)),
                       (0, 1))(x, kernel)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=1e-5 * float(jnp.abs(r).max()), rtol=0)


def test_winograd_product_matches_library_convolution():
  x = jax.random.normal(jax.random.key(0), (2, 12, 10, 32))
  kernel = jax.random.normal(jax.random.key(1), (3, 3, 32, 16)) / 10
  ref = _library_conv(x, kernel)
  scale = float(jnp.abs(ref).max())
  for rows in (2, 4, 6, 12):
    got = banded_conv._winograd_product(x, kernel, rows)
    assert got.shape == ref.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, atol=1e-5 * scale, rtol=0)


def test_banded_conv3x3_takes_winograd_on_wide_images(monkeypatch):
  x = jax.random.normal(jax.random.key(0), (1, 8, 8, 32))
  kernel = jax.random.normal(jax.random.key(1), (3, 3, 32, 16)) / 10
  xb, kb = x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16)
  ref = _library_conv(xb.astype(jnp.float32), kb.astype(jnp.float32))
  plain = banded_conv.banded_conv3x3(xb, kb)  # 8 px: below WINOGRAD_MIN_SIDE
  monkeypatch.setattr(banded_conv, 'WINOGRAD_MIN_SIDE', 8)
  wino = banded_conv.banded_conv3x3(xb, kb)
  assert wino.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      wino, banded_conv._winograd_product(
          xb, kb, banded_conv.winograd_rows(8, 8, 32, 2)).astype(jnp.bfloat16))
  def rel(a):
    return float(jnp.linalg.norm(a.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))

  # bf16 rounding of the transformed tiles: a few times the plain bands' error, still small.
  assert rel(plain) < 0.005 and rel(wino) < 0.01 and not np.array_equal(wino, plain)
  # odd sides keep the plain bands; the backward is the library's either way
  odd = x[:, :7, :7].astype(jnp.bfloat16)
  np.testing.assert_array_equal(banded_conv.banded_conv3x3(odd, kb),
                                banded_conv._band_product(odd, kb, 7).astype(jnp.bfloat16))
  loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b).astype(jnp.float32)))  # noqa: E731
  grads = jax.grad(loss(banded_conv.banded_conv3x3), (0, 1))(xb, kb)
  ref_grads = jax.grad(loss(_library_conv), (0, 1))(xb.astype(jnp.float32), kb.astype(jnp.float32))
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g.astype(jnp.float32), r, atol=0.02 * float(jnp.abs(r).max()))


def test_winograd_rows_is_the_largest_even_divisor_within_the_budget():
  assert banded_conv.winograd_rows(224, 224, 128, 2) == 16  # 4 x 16 x 224 x 128 x 2 bytes <= 4 MiB
  assert banded_conv.winograd_rows(112, 112, 128, 2) == 28
  assert banded_conv.winograd_rows(10, 10, 2**20, 4) == 2  # nothing fits: two rows at a time


def test_band_rows_is_the_largest_divisor_within_the_budget():
  assert banded_conv.band_rows(224, 224, 128, 2) == 8  # (8 + 2) x 224 x 384 x 2 bytes <= 2 MiB
  assert banded_conv.band_rows(14, 14, 512, 2) == 14
  assert banded_conv.band_rows(13, 13, 512, 2, budget=1) == 1  # nothing fits: one row at a time
  assert banded_conv.band_rows(12, 10, 32, 4, budget=(6 + 2) * 10 * 96 * 4) == 6


def test_conv_general_dilated_routes_by_dtype_and_shape():
  x = jax.random.normal(jax.random.key(0), (1, 8, 8, 32))
  k3 = jax.random.normal(jax.random.key(1), (3, 3, 32, 16)) / 10
  dims = jax.lax.conv_dimension_numbers(x.shape, k3.shape, ('NHWC', 'HWIO', 'NHWC'))

  def ours(a, k, strides=(1, 1), padding='SAME'):
    return banded_conv.conv_general_dilated(a, k, strides, padding, dimension_numbers=dims)

  # float32: the library convolution itself, bit for bit.
  np.testing.assert_array_equal(ours(x, k3), _library_conv(x, k3))
  xb, kb = x.astype(jnp.bfloat16), k3.astype(jnp.bfloat16)
  # bfloat16 3x3 stride 1: the row bands (float32 sums of the bf16 operands, result bf16).
  banded = ours(xb, kb)
  assert banded.dtype == jnp.bfloat16
  np.testing.assert_array_equal(banded, banded_conv.banded_conv3x3(xb, kb))
  # bfloat16 3x3 stride 2 'VALID' (the downsample): the row bands too.
  down = ours(xb, kb, (2, 2), 'VALID')
  assert down.dtype == jnp.bfloat16 and down.shape == (1, 3, 3, 16)
  np.testing.assert_array_equal(down, banded_conv.banded_conv3x3(xb, kb, 2))
  # other bfloat16 convolutions (here stride 2 'SAME', and a 1x1): the library's float32 form.
  strided = ours(xb, kb, (2, 2), 'SAME')
  assert strided.dtype == jnp.bfloat16
  np.testing.assert_array_equal(strided, _library_conv(xb.astype(jnp.float32),
                                                       kb.astype(jnp.float32), (2, 2),
                                                       'SAME').astype(jnp.bfloat16))
  k1 = kb[1:2, 1:2]
  np.testing.assert_array_equal(ours(xb, k1), _library_conv(xb.astype(jnp.float32),
                                                           k1.astype(jnp.float32)
                                                           ).astype(jnp.bfloat16))


def test_group_norm_statistics_in_one_pass_only_for_bfloat16():
  # float32 models keep flax's two-pass variance (the original's values); bf16 ones read x once.
  x = 10 + jax.random.normal(jax.random.key(0), (2, 8, 8, 32))
  ref = (x - x.mean((1, 2), keepdims=True)) / jnp.sqrt(x.var((1, 2), keepdims=True) + 1e-6)
  for dtype, one_pass in ((jnp.float32, False), (jnp.bfloat16, True)):
    norm = vqgan_layers.group_norm(32, 'n', dtype)  # 32 groups of one channel
    assert isinstance(norm, vqgan_layers.ChannelSumsGroupNorm) == one_pass
    assert one_pass or not norm.use_fast_variance
    got = norm.apply(norm.init(jax.random.key(1), x), x)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def _boxed(a) -> bool:
  return isinstance(a, nn.Partitioned)


@pytest.mark.parametrize('shape', [(2, 6, 10, 64), (3, 7, 96)])
def test_channel_sums_group_norm_is_flax_one_pass_group_norm(shape):
  """Same parameters (names, shapes, logical axes) and values as flax's GroupNorm with one-pass
  statistics, groups of several channels, for 4-d and 3-d inputs and bf16 or float32 x."""
  x = 3 + 2 * jax.random.normal(jax.random.key(0), shape)
  ours = vqgan_layers.ChannelSumsGroupNorm(vqgan_layers.num_groups(shape[-1]))
  flax_norm = nn.GroupNorm(num_groups=vqgan_layers.num_groups(shape[-1]), epsilon=1e-6,
                           use_fast_variance=True, dtype=jnp.float32,
                           scale_init=nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
                           bias_init=nn.with_logical_partitioning(nn.initializers.zeros,
                                                                  ('norm',)))
  v_ours = ours.init(jax.random.key(1), x)
  v_flax = flax_norm.init(jax.random.key(1), x)
  assert jax.tree.map(lambda a: (a.value.shape, a.names), v_ours, is_leaf=_boxed) == \
      jax.tree.map(lambda a: (a.value.shape, a.names), v_flax, is_leaf=_boxed)
  params = {'params': {'scale': 0.5 + jnp.arange(shape[-1]) / shape[-1],
                       'bias': jnp.linspace(-1, 1, shape[-1])}}
  for dtype in (jnp.float32, jnp.bfloat16):
    xd = x.astype(dtype)
    np.testing.assert_allclose(ours.apply(params, xd), flax_norm.apply(params, xd),
                               atol=2e-5, rtol=1e-5)


def test_bfloat16_frozen_tokenizer_tracks_float32():
  x = _images(2, 16)
  variables = _variables(vqgan.VQGAN(**WIDE), 16)
  f32, b16 = vqgan.frozen(WIDE), vqgan.frozen(WIDE, 'bfloat16')
  assert b16.model.dtype == jnp.bfloat16 and f32.model.dtype == jnp.float32
  ref = f32.encode_features(variables['params'], x)
  got = b16.encode_features(variables['params'], x)
  assert got.dtype == jnp.float32
  assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 0.03
  codes = b16.encode_tokens(variables['params'], x)
  assert codes.dtype == jnp.int32 and codes.shape == (2, 64)
  # Training in bfloat16 differentiates through the bands (float32 library backward); the
  # features' gradient, since a code flipped by rounding changes the quantised path.
  def loss(model):
    return lambda p: jnp.mean(jnp.sin(model.apply({'params': p}, x, method='encode_features')))

  g16 = jax.grad(loss(vqgan.VQGAN(**WIDE, dtype=jnp.bfloat16)))(variables['params'])
  g32 = jax.grad(loss(vqgan.VQGAN(**WIDE)))(variables['params'])
  a, b = (jnp.concatenate([v.ravel() for v in jax.tree_util.tree_leaves(g)]) for g in (g16, g32))
  assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.03


def test_frozen_from_config_reads_the_frozen_dtype():
  config = synthetic.get_config('tiny')
  assert vqgan.frozen_from_config(config).model.dtype == jnp.float32
  config.tokenizer.frozen_dtype = 'bfloat16'
  assert vqgan.frozen_from_config(config).model.dtype == jnp.bfloat16
  del config.tokenizer['frozen_dtype']  # a config saved before the entry existed, migrated
  assert vqgan.frozen_from_config(config_migrate.migrate(config)).model.dtype == jnp.float32


def test_frozen_chunks_give_the_unchunked_values():
  x = _images(5, 16)
  variables = _variables(vqgan.VQGAN(**WIDE), 16)
  whole = vqgan.frozen(WIDE)
  chunked = vqgan.Frozen(whole.model, chunk=2)  # 3 chunks, the last one padded
  # Two programs: float32 error of 16 ulps x sqrt(the encoder's longest sum, a 3x3 conv over 64
  # channels) of the features' scale (tests/margins.py); codes equal where the nearest code
  # wins by more than that error can move the distances (checked: all 320 here).
  rel = margins.sum_tolerance(1.0, 9 * 64, ulps=16)
  clear = margins.clear_codes(whole.model, variables['params'], x, rel)
  assert clear.mean() > 0.9, clear.mean()
  for method in ('encode_features', 'encode_tokens'):
    want = getattr(whole, method)(variables['params'], x)
    got = getattr(chunked, method)(variables['params'], x)
    assert got.shape == want.shape and got.dtype == want.dtype
    if method == 'encode_features':
      np.testing.assert_allclose(got, want, atol=rel * float(jnp.abs(want).max()), rtol=0)
    else:
      np.testing.assert_array_equal(np.asarray(got)[clear], np.asarray(want)[clear])
  assert vqgan.frozen(WIDE, 'bfloat16').chunk == vqgan.BFLOAT16_CHUNK
  assert vqgan.frozen(WIDE).chunk == 0  # float32 programs as before
  with pytest.raises(ValueError, match='float32 or bfloat16'):
    vqgan.frozen(WIDE, 'float16')


def test_chunked_encode_runs_on_each_devices_own_images():
  """Under a mesh in context (as the train step and evaluation trace), the bf16 encode's chunk
  and band loops, which step over images, must not gather every image onto every device."""
  mesh = sharding.make_mesh(data=4, model=2)
  x = _images(8, 16)
  params = _variables(vqgan.VQGAN(**WIDE), 16)['params']
  frozen = vqgan.Frozen(vqgan.VQGAN(**WIDE, dtype=jnp.bfloat16), chunk=2)
  # Each device's program is one device's encode of its 2 images (the chunk loop, which rounds
  # bf16 differently from a single call, does not run for 2 images).
  want = {m: jnp.concatenate([jax.jit(getattr(frozen, m))(params, x[i:i + 2])
                              for i in range(0, 8, 2)])
          for m in ('encode_features', 'encode_tokens')}
  x_mesh = jax.device_put(x, sharding.batch_sharding(mesh, x.ndim))
  params_mesh = jax.device_put(params, sharding.replicated(mesh))

  def traced_under(method):
    def f(p, images):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return getattr(frozen, method)(p, images)
    return jax.jit(f)

  for method, ref in want.items():
    fn = traced_under(method)
    hlo = fn.lower(params_mesh, x_mesh).compile().as_text()
    assert 'all-gather' not in hlo and 'all-to-all' not in hlo
    got = fn(params_mesh, x_mesh)
    assert got.sharding.spec[0] == 'data'
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  # Images the data axis does not divide: the loops as without a mesh, same values.
  with jax.set_mesh(mesh):
    odd = jax.jit(frozen.encode_features)(params_mesh, x[:6])
  np.testing.assert_array_equal(np.asarray(odd),
                                np.asarray(jax.jit(frozen.encode_features)(params, x[:6])))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_features_and_codes_from_one_encoder_pass(dtype):
  """With one input scale for both, `encode_features_and_tokens` gives `encode_features` and
  `encode_tokens` from one pass: half the encoder's products (XLA does not merge the bfloat16
  encoder's two band-loop passes by itself), the same features, and the same codes up to the
  bfloat16 rounding of the encoder's output, which XLA may skip in the codes-only program."""
  x = _images(5, 16, seed=4)
  params = _variables(vqgan.VQGAN(**WIDE), 16)['params']
  one_scale = dict(WIDE, feature_input_scale='signed')
  frozen = vqgan.Frozen(vqgan.frozen(one_scale, dtype).model, chunk=2)  # 3 chunks, one padded
  assert frozen.one_pass and not vqgan.frozen(WIDE, dtype).one_pass
  features, codes = jax.jit(frozen.encode_features_and_tokens)(params, x)
  want_features = jax.jit(frozen.encode_features)(params, x)
  want_codes = jax.jit(frozen.encode_tokens)(params, x)
  assert features.dtype == jnp.float32 and codes.dtype == jnp.int32
  assert features.shape == want_features.shape and codes.shape == want_codes.shape == (5, 64)
  np.testing.assert_array_equal(np.asarray(features), np.asarray(want_features))
  if dtype == 'float32':  # two programs: codes equal where they win by a margin (as above)
    clear = margins.clear_codes(frozen.model, params, x, margins.sum_tolerance(1.0, 9 * 64, 16))
    assert clear.mean() > 0.9, clear.mean()  # all 320 here
    np.testing.assert_array_equal(np.asarray(codes)[clear], np.asarray(want_codes)[clear])
  else:
    assert float(jnp.mean(codes == want_codes)) > 0.95

  def products(f):
    return jaxpr_counts.count_equations(jax.make_jaxpr(f)(params, x).jaxpr,
                                        ('conv_general_dilated', 'dot_general'))

  one = products(frozen.encode_features_and_tokens)
  two = products(frozen.encode_features) + products(frozen.encode_tokens)
  tokens_only = products(frozen.encode_tokens)
  assert one == tokens_only and two > 1.9 * one, (one, two)
  with pytest.raises(ValueError, match='one encoder pass only when'):
    vqgan.frozen(WIDE, dtype).encode_features_and_tokens(params, x)


def test_one_pass_encode_runs_on_each_devices_own_images():
  """The one-pass encode's two outputs under a data mesh: each device encodes its own images."""
  mesh = sharding.make_mesh(data=4, model=2)
  x = _images(8, 16)
  params = _variables(vqgan.VQGAN(**WIDE), 16)['params']
  frozen = vqgan.Frozen(vqgan.VQGAN(**dict(WIDE, feature_input_scale='signed'),
                                    dtype=jnp.bfloat16), chunk=2)
  want = [jnp.concatenate(parts) for parts in zip(*[
      jax.jit(frozen.encode_features_and_tokens)(params, x[i:i + 2]) for i in range(0, 8, 2)])]

  def f(p, images):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return frozen.encode_features_and_tokens(p, images)

  fn = jax.jit(f)
  x_mesh = jax.device_put(x, sharding.batch_sharding(mesh, x.ndim))
  params_mesh = jax.device_put(params, sharding.replicated(mesh))
  hlo = fn.lower(params_mesh, x_mesh).compile().as_text()
  assert 'all-gather' not in hlo and 'all-to-all' not in hlo
  for got, ref in zip(fn(params_mesh, x_mesh), want):
    assert got.sharding.spec[0] == 'data'
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
