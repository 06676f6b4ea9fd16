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

`feature_pixels` (not the original's; a synthetic-benchmark switch, docs/fidelity.md): P > 0
appends each token cell's pixels, average-pooled to P x P and mapped to [-1, 1], to the features
(`encode_features` then gives Z + 3 P^2 channels): a linear pixel stem beside the tokenizer's
features, for a from-scratch tokenizer whose codes keep an object's shape but not its colour.

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
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from procap_jax.models import layers
from procap_jax.models import vqgan_layers

# Images per encode call of the bfloat16 frozen tokenizer: the band loops' float32 results and
# padded copies of 64 images at 224 px took paper-size inference from 8 to 15.6 GiB; 8 images at
# a time bound them and were faster per image (docs/performance.md, same section).
BFLOAT16_CHUNK = 8


def paper_config() -> dict[str, Any]:
  """The original's tokenizer (vqgan.1024.224.config.yml, resolution overwritten to 224)."""
  return dict(ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, attn_resolutions=(16,),
              resolution=224, z_channels=256, embed_dim=256, n_embed=1024, dropout=0.0,
              beta=0.25, feature_input_scale='unit', token_input_scale='signed')


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
  feature_pixels: int = 0
  dtype: Any = jnp.float32

  def setup(self):
    ch_mult, attn = tuple(self.ch_mult), tuple(self.attn_resolutions)
    self.encoder = vqgan_layers.Encoder(self.ch, ch_mult, self.num_res_blocks, attn,
                                        self.resolution, self.z_channels, self.dropout, self.dtype)
    self.quant_conv = vqgan_layers.conv(self.embed_dim, 1, 'quant_conv', self.dtype)
    self.quantize = VectorQuantizer(self.n_embed, self.embed_dim, self.beta)
    self.post_quant_conv = vqgan_layers.conv(self.z_channels, 1, 'post_quant_conv', self.dtype)
    self.decoder = vqgan_layers.Decoder(self.ch, ch_mult, self.num_res_blocks, attn,
                                        self.resolution, self.dropout, self.dtype)

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
    h = self.encoder(scale_input(x01, self.feature_input_scale), False).astype(jnp.float32)
    return self._with_pixels(h, x01)

  def _with_pixels(self, h: jax.Array, x01: jax.Array) -> jax.Array:
    """Features h [B, h, w, Z] with each cell's pooled pixels appended ([B, h, w, Z + 3 P^2])
    when `feature_pixels` P > 0; h unchanged otherwise."""
    p = self.feature_pixels
    if not p:
      return h
    cell = x01.shape[1] // h.shape[1]  # token cell side in pixels
    if cell % p:
      raise ValueError(f'feature_pixels {p} must divide the token cell side {cell}')
    pooled = nn.avg_pool(x01.astype(jnp.float32), (cell // p,) * 2, (cell // p,) * 2)
    return jnp.concatenate([h, 2.0 * layers.image_to_cells(pooled, p) - 1.0], -1)

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
    return self._with_pixels(h.astype(jnp.float32), x01), self._codes(h)

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
  `config.tokenizer.frozen_dtype`."""
  return frozen(config.tokenizer.model, config.tokenizer.frozen_dtype)
