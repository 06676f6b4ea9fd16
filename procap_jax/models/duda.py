"""DUDA, the Dual Dynamic Attention Model (Park, Darrell, Rohrbach, "Robust Change Captioning",
ICCV 2019): the CLEVR-Change paper's own change captioner, the field's baseline.

Dimension legend: B batch, S image side, h x w feature grid, N = h*w, C feature channels,
A attention hidden width, D speaker feature width, E word embedding width, H LSTM width,
L caption length, V vocab.

  before, after  [B, h, w, C]  features: the frozen tokenizer's, or a patch stem's from pixels
  X_d = X_a - X_b
  a_b = softmax_N(conv([X_b; X_d])), a_a = softmax_N(conv([X_a; X_d]))   (one shared conv stack)
  l_b = sum_N a_b X_b, l_a = sum_N a_a X_a, l_d = l_a - l_b               [B, C] each
  dynamic speaker, per word t:
    attention LSTM on [l_b; l_d; l_a; h_lang(t-1); E(w(t-1))] -> alpha(t) = softmax over the
    three features [B, 3]; l_dyn(t) = sum alpha(t) l;  language LSTM on [l_dyn(t); E(w(t-1))]
    -> logits of w(t)

Departures from the original, which reads ResNet-101 features of 224 px images: the attention
maps are a softmax over space (the original's sigmoid weights are not normalised); the speaker's
attention LSTM also sees the previous word; a patch stem trained from scratch can stand in
for the ResNet (`from_pixels`: dense layers over image patches).
"""

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from procap_jax import decoding
from procap_jax import token_ids


class PatchStem(nn.Module):
  """Features from pixels: images [B, S, S, 3] in [0, 1] -> non-overlapping patch x patch
  patches [B, S/patch, S/patch, patch*patch*3] -> dense layers with ReLU -> [B, h, w,
  channels[-1]], the same weights for before and after. (A strided conv stem's backward pass is
  several times slower on XLA:CPU; patches keep training within the CPU budget.)"""
  patch: int
  channels: Sequence[int]
  convs: int = 0

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    b, s, _, c = images.shape
    p, g = self.patch, images.shape[1] // self.patch
    x = (images - 0.5).reshape(b, g, p, g, p, c).transpose(0, 1, 3, 2, 4, 5)  # [B, g, g, p, p, 3]
    x = x.reshape(b, g, g, p * p * c)  # [B, h, w, p*p*3]
    for i, ch in enumerate(self.channels):
      x = nn.relu(nn.Dense(ch, name=f'dense_{i}')(x))
    for i in range(self.convs):
      x = nn.relu(nn.Conv(self.channels[-1], (3, 3), name=f'conv_{i}')(x))
    return x


def with_coordinates(grid: jax.Array) -> jax.Array:
  """[B, h, w, C] -> [B, h, w, C + 2]: each cell's x and y in [-1, 1) appended (the original's
  AddSpatialInfo), so attended features say where the change is."""
  b, h, w, _ = grid.shape
  ys, xs = jnp.meshgrid(jnp.arange(h) * 2.0 / h - 1.0, jnp.arange(w) * 2.0 / w - 1.0,
                        indexing='ij')
  coords = jnp.broadcast_to(jnp.stack([xs, ys], -1), (b, h, w, 2)).astype(grid.dtype)
  return jnp.concatenate([grid, coords], -1)


class DualAttention(nn.Module):
  """The change detector: attention maps over the before and after grids from each with the
  difference, and the attended features.

  Returns (from `__call__(before [B, h, w, C], after [B, h, w, C])`):
    features [B, 3, C] (l_b, l_d, l_a), maps [B, 2, h, w] (a_b, a_a; each sums to 1 over h, w).
  """
  hidden: int
  dropout: float
  normalise: str = 'softmax'  # 'softmax' over the grid | 'sigmoid' per cell (the original)

  @nn.compact
  def __call__(self, before: jax.Array, after: jax.Array, train: bool = False):
    b, h, w, c = before.shape
    diff = after - before  # [B, h, w, C]
    both = jnp.concatenate([jnp.concatenate([before, diff], -1),
                            jnp.concatenate([after, diff], -1)], 0)  # [2B, h, w, 2C]
    # 1 x 1 convolutions as dense layers over the channels (the same map; XLA:CPU runs a 1 x 1
    # convolution's backward pass several times slower than the matmul's)
    x = nn.Dense(self.hidden, name='att_conv_0')(both)
    x = nn.relu(x)
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    x = nn.Dense(self.hidden, name='att_conv_1')(x)
    x = nn.relu(x)
    logits = nn.Dense(1, name='att_logits')(x).reshape(2, b, h * w)  # [2, B, N]
    if self.normalise == 'softmax':
      maps = jax.nn.softmax(logits, axis=-1)  # [2, B, N]
    else:
      maps = jax.nn.sigmoid(logits)  # [2, B, N]
    grids = jnp.stack([before, after]).reshape(2, b, h * w, c)  # [2, B, N, C]
    attended = jnp.einsum('kbn,kbnc->kbc', maps, grids)  # [2, B, C]
    l_b, l_a = attended[0], attended[1]
    features = jnp.stack([l_b, l_a - l_b, l_a], axis=1)  # [B, 3, C]
    return features, jnp.transpose(maps, (1, 0, 2)).reshape(b, 2, h, w)


class SpeakerStep(nn.Module):
  """One word of the dynamic speaker: (carry, word [B, E], features [B, 3, D]) -> (carry,
  (h_lang [B, H], alpha [B, 3])).

  carry = ((c_att, h_att), (c_lang, h_lang)), [B, H] each; `word` is the embedded previous word.
  """
  hidden: int

  @nn.compact
  def __call__(self, carry, word: jax.Array, features: jax.Array):
    att_state, lang_state = carry
    b = features.shape[0]
    u = jnp.concatenate([features.reshape(b, -1), lang_state[1], word], -1)  # [B, 3D + H + E]
    att_state, h_att = nn.OptimizedLSTMCell(self.hidden, name='att_lstm')(att_state, u)
    alpha = jax.nn.softmax(nn.Dense(3, name='att_weights')(h_att), axis=-1)  # [B, 3]
    dynamic = jnp.einsum('bk,bkd->bd', alpha, features)  # [B, D]
    x = jnp.concatenate([dynamic, word], -1)  # [B, D + E]
    lang_state, h_lang = nn.OptimizedLSTMCell(self.hidden, name='lang_lstm')(lang_state, x)
    return (att_state, lang_state), (h_lang, alpha)


class Duda(nn.Module):
  """The DUDA captioner. Inputs are images [B, S, S, 3] in [0, 1] when `from_pixels` (the conv
  stem makes the grid), else feature grids [B, h, w, C]."""
  vocab_size: int
  from_pixels: bool
  stem_patch: int = 4
  stem_channels: Sequence[int] = (64, 64)
  stem_convs: int = 0
  coords: bool = False
  attention_hidden: int = 128
  attention_norm: str = 'softmax'
  feature_dim: int = 256
  embed: int = 128
  hidden: int = 256
  dropout: float = 0.1

  def setup(self):
    if self.from_pixels:
      self.stem = PatchStem(self.stem_patch, tuple(self.stem_channels), self.stem_convs)
    self.attention = DualAttention(self.attention_hidden, self.dropout, self.attention_norm)
    self.project = nn.Dense(self.feature_dim)
    self.word_embed = nn.Embed(self.vocab_size, self.embed)
    self.speaker = nn.scan(SpeakerStep, variable_broadcast='params',
                           split_rngs={'params': False},
                           in_axes=(1, nn.broadcast), out_axes=1)(self.hidden)
    self.to_logits = nn.Dense(self.vocab_size)
    self.drop = nn.Dropout(self.dropout)

  def encode(self, before: jax.Array, after: jax.Array, train: bool = False):
    """(speaker features [B, 3, D], attention maps [B, 2, h, w])."""
    if self.from_pixels:
      grids = self.stem(jnp.concatenate([before, after], 0))  # [2B, h, w, C]
      before, after = jnp.split(grids, 2, axis=0)
    if self.coords:
      before, after = with_coordinates(before), with_coordinates(after)
    features, maps = self.attention(before, after, train)
    features = nn.relu(self.project(features))  # [B, 3, D]
    return features, maps

  def initial_carry(self, batch: int):
    zeros = jnp.zeros([batch, self.hidden], jnp.float32)
    return ((zeros, zeros), (zeros, zeros))

  def speak(self, carry, features: jax.Array, tokens: jax.Array, train: bool = False):
    """(carry, logits [B, L, V], alpha [B, L, 3]) for the words `tokens` [B, L] fed in."""
    words = self.drop(self.word_embed(tokens), deterministic=not train)  # [B, L, E]
    carry, (h_lang, alpha) = self.speaker(carry, words, features)  # [B, L, H], [B, L, 3]
    logits = self.to_logits(self.drop(h_lang, deterministic=not train))  # [B, L, V]
    return carry, logits, alpha

  def __call__(self, before: jax.Array, after: jax.Array, tokens: jax.Array,
               train: bool = False) -> jax.Array:
    """Teacher-forced logits [B, L, V]: position t scores token t + 1 of `tokens` [B, L]."""
    features, _ = self.encode(before, after, train)
    _, logits, _ = self.speak(self.initial_carry(tokens.shape[0]), features, tokens, train)
    return logits

  def word_weights(self, before: jax.Array, after: jax.Array, tokens: jax.Array) -> jax.Array:
    """The speaker's weights of (l_b, l_d, l_a) per position [B, L, 3] (inference mode)."""
    features, _ = self.encode(before, after)
    return self.speak(self.initial_carry(tokens.shape[0]), features, tokens)[2]

  def attention_maps(self, before: jax.Array, after: jax.Array) -> jax.Array:
    """a_b and a_a [B, 2, h, w] (inference mode)."""
    return self.encode(before, after)[1]

  def init_cache(self, before: jax.Array, after: jax.Array) -> dict:
    """The greedy/beam decoding cache: the features and the zero LSTM states, batch first."""
    features, _ = self.encode(before, after)
    return {'features': features, 'carry': self.initial_carry(features.shape[0])}

  def decode_step(self, cache: dict, token: jax.Array, pos: jax.Array):
    """`decoding.StepFn`: (cache, token [B], pos) -> (logits [B, V], cache)."""
    del pos
    carry, logits, _ = self.speak(cache['carry'], cache['features'], token[:, None])
    return logits[:, 0], dict(cache, carry=carry)


def from_config(config: ml_collections.ConfigDict) -> Duda:
  """`Duda` from `config.caption.model.duda`, its dropout and vocabulary size."""
  d = config.caption.model.duda
  return Duda(vocab_size=int(config.caption.model.vocab_size),
              from_pixels=d.input == 'pixels', stem_patch=int(d.stem_patch),
              stem_channels=tuple(d.stem_channels), stem_convs=int(d.stem_convs),
              coords=bool(d.coords), attention_hidden=int(d.attention_hidden),
              attention_norm=str(d.attention_norm),
              feature_dim=int(d.feature_dim), embed=int(d.embed), hidden=int(d.hidden),
              dropout=float(config.caption.model.dropout))


def generate(model: Duda, params: Any, before: jax.Array, after: jax.Array, *,
             method: str = 'greedy', beam_size: int = 3, alpha: float = 0.0,
             max_len: int = 24, encode_rows: int = 0) -> jax.Array:
  """Caption ids [B, max_len] ([BOS] first, [PAD] after [EOS]); the same searches as ProCap's
  (`procap_jax.decoding`). `encode_rows` is ProCap's encoder schedule; DUDA ignores it."""
  del encode_rows
  variables = {'params': params}
  cache = model.apply(variables, before, after, method='init_cache')

  def step(cache, token, pos):
    return model.apply(variables, cache, token, pos, method='decode_step')

  return decoding.search(step, cache, before.shape[0], method=method, beam_size=beam_size,
                         alpha=alpha, max_len=max_len, **token_ids.DECODING_IDS)
