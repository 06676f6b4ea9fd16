"""Caption decoder: the post-LN masked transformer of densecap/MART used by ProCap stage 2.

Dimensions: B batch, L caption length, L_max cache length, M memory length, H decoder width,
V vocab, F feed-forward width, N_h heads, D_h = H / N_h head width.

The original (spec 5.3) keeps legacy quirks; each one sits behind a switch whose default is the
original's behaviour (docs/fidelity.md):
  attention_scale 'd_model'      scores / sqrt(H) instead of / sqrt(D_h)
  qkv_bias False                 q, k, v, o projections without bias
  layernorm 'unbiased_std'       gamma * (x - mean) / (std_unbiased + 1e-6) + beta
The token embedding is tied to the output layer (emb = out.kernel^T * sqrt(H)); positions are
sinusoidal; there is no key-padding mask (padded targets are only excluded by the loss).

Incremental decoding uses an explicit cache pytree (`init_cache` / `step`): per layer the self-
attention keys/values written so far and the cross-attention keys/values of the memory, which
are computed once.
"""

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from procap_jax.models import accumulating
from procap_jax.models import layers

_NEG = -1e10  # the original subtracts 1e10 on masked (future) positions


def torch_kernel_init(names: tuple[str, str]):
  """torch.nn.Linear's default weight init U(+-1/sqrt(fan_in)), boxed with logical names."""
  return nn.with_logical_partitioning(
      nn.initializers.variance_scaling(1.0 / 3.0, 'fan_in', 'uniform'), names)


def torch_bias_init(fan_in: int, names: tuple[str]):
  """torch.nn.Linear's default bias init U(+-1/sqrt(fan_in)), boxed with logical names."""
  bound = 1.0 / math.sqrt(fan_in)

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return nn.with_logical_partitioning(init, names)


def sinusoid_table(length: int, width: int) -> np.ndarray:
  """Sinusoidal positions [length, width]: sin on even channels, cos on odd, base 10000.

  Channel c of position p is sin(p / 10000^(c / width)) for even c and
  cos(p / 10000^((c - 1) / width)) for odd c, as the original's `positional_encodings_like`.
  """
  pos = np.arange(length, dtype=np.float64)[:, None]  # [L, 1]
  even = np.arange(0, width, 2, dtype=np.float64)  # [ceil(H/2)]
  angle = pos / np.power(10000.0, even / width)[None, :]  # [L, ceil(H/2)]
  table = np.zeros([length, width], np.float64)
  table[:, 0::2] = np.sin(angle)
  table[:, 1::2] = np.cos(angle[:, :width // 2])
  return table.astype(np.float32)


class DecoderLayerNorm(nn.Module):
  """LayerNorm over the last axis; 'unbiased_std' is the original's, 'standard' is torch's.

  Attributes:
    variant: 'unbiased_std': gamma * (x - mean) / (std_unbiased + eps) + beta, eps 1e-6 outside
      the square root (original); 'standard': gamma * (x - mean) / sqrt(var + eps) + beta,
      eps 1e-5 (torch.nn.LayerNorm).
  """
  variant: str = 'unbiased_std'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    width = x.shape[-1]
    scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
                       (width,))
    bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)),
                      (width,))
    x = x.astype(jnp.float32)
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    if self.variant == 'unbiased_std':
      std = jnp.sqrt(jnp.sum(centred * centred, axis=-1, keepdims=True) / (width - 1))
      normed = centred / (std + 1e-6)
    elif self.variant == 'standard':
      normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + 1e-5)
    else:
      raise ValueError(f'unknown layernorm variant {self.variant!r}')
    return normed * scale + bias


class Attention(nn.Module):
  """Multi-head attention with the original's quirks behind switches.

  Attributes:
    hidden: H.
    heads: N_h; heads are consecutive chunks of D_h = H / N_h channels.
    scale: 'd_model' (scores / sqrt(H), original) or 'head_dim' (scores / sqrt(D_h)).
    use_bias: bias on the q, k, v, o projections (original: False).
    dropout: dropout rate on the attention weights.
    dtype: computation dtype of the projections (softmax in float32).
  """
  hidden: int
  heads: int
  scale: str = 'd_model'
  use_bias: bool = False
  dropout: float = 0.1
  dtype: Any = jnp.float32

  def setup(self):
    if self.hidden % self.heads:
      raise ValueError(f'decoder width {self.hidden} is not divisible by {self.heads} heads')
    dense_cls = layers.dense_class(self.dtype)
    dense = functools.partial(
        dense_cls, self.hidden, use_bias=self.use_bias, dtype=self.dtype,
        bias_init=torch_bias_init(self.hidden, ('heads',)),
        kernel_init=torch_kernel_init(('embed', 'heads')))
    self.query = dense()
    self.key = dense()
    self.value = dense()
    self.out = dense_cls(self.hidden, use_bias=self.use_bias, dtype=self.dtype,
                         kernel_init=torch_kernel_init(('heads', 'embed')),
                         bias_init=torch_bias_init(self.hidden, ('embed',)))
    self.weights_dropout = nn.Dropout(self.dropout)

  def _split(self, x: jax.Array) -> jax.Array:
    b, n, _ = x.shape
    return x.reshape(b, n, self.heads, self.hidden // self.heads)  # [B, n, N_h, D_h]

  def project_kv(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values [B, S, N_h, D_h] of `x` [B, S, H]."""
    return self._split(self.key(x)), self._split(self.value(x))

  def attend(self, x: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
             deterministic: bool) -> jax.Array:
    """Attention of queries from `x` [B, Lq, H] over k, v [B, S, N_h, D_h].

    Args:
      mask: bool, broadcastable to [B, N_h, Lq, S], True = may attend; None = everything.
      deterministic: no dropout on the attention weights.

    Returns:
      [B, Lq, H].
    """
    if self.scale not in ('d_model', 'head_dim'):
      raise ValueError(f'unknown attention_scale {self.scale!r}')
    width = self.hidden if self.scale == 'd_model' else self.hidden // self.heads
    q = self._split(self.query(x))  # [B, Lq, N_h, D_h]
    if q.dtype == jnp.float32:
      scores = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32)
    else:
      scores = accumulating.accumulating_einsum('bqhd,bkhd->bhqk', q, k)  # [B, N_h, Lq, S] float32
    if mask is not None:
      scores = jnp.where(mask, scores, _NEG)
    weights = jax.nn.softmax(scores / math.sqrt(width), axis=-1)  # [B, N_h, Lq, S]
    # kept only when 'intermediates' is mutable (diagnostics/memory_attention.py reads them)
    self.sow('intermediates', 'attention_weights', weights)
    weights = self.weights_dropout(weights, deterministic=deterministic)
    if v.dtype == jnp.float32:
      out = jnp.einsum('bhqk,bkhd->bqhd', weights, v)  # [B, Lq, N_h, D_h]
    else:
      out = accumulating.accumulating_einsum('bhqk,bkhd->bqhd', weights.astype(v.dtype),
                                       v).astype(v.dtype)
    b, lq = out.shape[:2]
    return self.out(out.reshape(b, lq, self.hidden))  # [B, Lq, H]

  def __call__(self, x: jax.Array, kv_input: jax.Array, mask: jax.Array | None,
               deterministic: bool) -> jax.Array:
    k, v = self.project_kv(kv_input)
    return self.attend(x, k, v, mask, deterministic)


class DecoderLayer(nn.Module):
  """x = LN(x + Drop(SelfAttn_causal(x))); x = LN(x + Drop(CrossAttn(x, mem)));
  x = LN(x + Drop(FFN_relu(x))) (post-LN, as the original)."""
  hidden: int
  heads: int
  ffn: int
  dropout: float
  attention_scale: str
  qkv_bias: bool
  layernorm: str
  dtype: Any = jnp.float32

  def setup(self):
    attn = functools.partial(Attention, self.hidden, self.heads, self.attention_scale,
                             self.qkv_bias, self.dropout, self.dtype)
    self.self_attn = attn()
    self.cross_attn = attn()
    self.norm_self = DecoderLayerNorm(self.layernorm)
    self.norm_cross = DecoderLayerNorm(self.layernorm)
    self.norm_ffn = DecoderLayerNorm(self.layernorm)
    dense_cls = layers.dense_class(self.dtype)
    self.ffn_in = dense_cls(self.ffn, dtype=self.dtype,
                            kernel_init=torch_kernel_init(('embed', 'mlp')),
                            bias_init=torch_bias_init(self.hidden, ('mlp',)))
    self.ffn_out = dense_cls(self.hidden, dtype=self.dtype,
                             kernel_init=torch_kernel_init(('mlp', 'embed')),
                             bias_init=torch_bias_init(self.ffn, ('embed',)))
    self.residual_dropout = nn.Dropout(self.dropout)

  def _tail(self, x: jax.Array, mem_k: jax.Array, mem_v: jax.Array,
            deterministic: bool) -> jax.Array:
    """Cross-attention and FFN blocks on x [B, L, H]."""
    drop = functools.partial(self.residual_dropout, deterministic=deterministic)
    x = self.norm_cross(x + drop(self.cross_attn.attend(x, mem_k, mem_v, None, deterministic)))
    h = self.ffn_out(nn.relu(self.ffn_in(x)))
    return self.norm_ffn(x + drop(h))

  def __call__(self, x: jax.Array, memory: jax.Array, deterministic: bool) -> jax.Array:
    """x [B, L, H], memory [B, M, H] -> [B, L, H] (full causal pass)."""
    length = x.shape[1]
    causal = jnp.tril(jnp.ones([length, length], bool))  # [L, L]
    att = self.self_attn(x, x, causal[None, None], deterministic)
    x = self.norm_self(x + self.residual_dropout(att, deterministic=deterministic))
    mem_k, mem_v = self.cross_attn.project_kv(memory)
    return self._tail(x, mem_k, mem_v, deterministic)

  def init_cache(self, memory: jax.Array, max_len: int) -> dict:
    """Empty self-attention cache [B, L_max, N_h, D_h] and the memory's keys/values."""
    mem_k, mem_v = self.cross_attn.project_kv(memory)
    b, d_h = memory.shape[0], self.hidden // self.heads
    zeros = jnp.zeros([b, max_len, self.heads, d_h], mem_k.dtype)
    return {'k': zeros, 'v': zeros, 'mem_k': mem_k, 'mem_v': mem_v}

  def step(self, x: jax.Array, cache: dict, pos: jax.Array) -> tuple[jax.Array, dict]:
    """One position: x [B, 1, H] at `pos` -> ([B, 1, H], cache with this position written)."""
    k_new, v_new = self.self_attn.project_kv(x)  # [B, 1, N_h, D_h]
    k = jax.lax.dynamic_update_slice_in_dim(cache['k'], k_new.astype(cache['k'].dtype), pos, 1)
    v = jax.lax.dynamic_update_slice_in_dim(cache['v'], v_new.astype(cache['v'].dtype), pos, 1)
    visible = jnp.arange(k.shape[1]) <= pos  # [L_max]
    att = self.self_attn.attend(x, k, v, visible[None, None, None], True)
    x = self.norm_self(x + att)
    x = self._tail(x, cache['mem_k'], cache['mem_v'], True)
    return x, dict(cache, k=k, v=v)


class TiedOutput(nn.Module):
  """Output layer Dense(H -> V) with bias whose kernel is also the token embedding.

  Parameters: kernel [H, V], bias [V]. embed(ids) = kernel^T[ids] * sqrt(H).
  """
  vocab_size: int
  hidden: int
  dtype: Any = jnp.float32

  def setup(self):
    self.kernel = self.param('kernel', torch_kernel_init(('embed', 'vocab')),
                             (self.hidden, self.vocab_size))
    self.bias = self.param('bias', torch_bias_init(self.hidden, ('vocab',)), (self.vocab_size,))

  def embed(self, ids: jax.Array) -> jax.Array:
    """ids [...] int -> [..., H]."""
    return jnp.take(self.kernel.T, ids, axis=0) * math.sqrt(self.hidden)

  def __call__(self, h: jax.Array) -> jax.Array:
    """h [..., H] -> logits [..., V] in float32."""
    if jnp.dtype(self.dtype) == jnp.float32:
      logits = jnp.dot(h.astype(self.dtype), self.kernel.astype(self.dtype),
                       preferred_element_type=jnp.float32)
    else:
      lead = 'abcdefg'[:h.ndim - 1]
      logits = accumulating.accumulating_einsum(f'{lead}h,hv->{lead}v', h.astype(self.dtype),
                                          self.kernel.astype(self.dtype))
    return logits + self.bias


class CaptionDecoder(nn.Module):
  """The stage-2 caption decoder (spec 5.3).

  Attributes:
    vocab_size: V.
    hidden: H (original 512).
    heads: N_h (original 8).
    ffn: F (original 2048).
    layers: number of decoder layers (original 2 CLEVR/Edit, 3 Spot).
    dropout: rate on embeddings, residual branches and attention weights (original 0.1).
    max_len: L_max, the longest caption (positions table and cache length).
    attention_scale: 'd_model' (original) | 'head_dim'.
    qkv_bias: bias on attention projections (original False).
    layernorm: 'unbiased_std' (original) | 'standard'.
    dtype: computation dtype (parameters stay float32).
  """
  vocab_size: int
  hidden: int = 512
  heads: int = 8
  ffn: int = 2048
  layers: int = 2
  dropout: float = 0.1
  max_len: int = 24
  attention_scale: str = 'd_model'
  qkv_bias: bool = False
  layernorm: str = 'unbiased_std'
  dtype: Any = jnp.float32

  def setup(self):
    self.output = TiedOutput(self.vocab_size, self.hidden, self.dtype)
    self.blocks = [
        DecoderLayer(self.hidden, self.heads, self.ffn, self.dropout, self.attention_scale,
                     self.qkv_bias, self.layernorm, self.dtype) for _ in range(self.layers)]
    self.embed_dropout = nn.Dropout(self.dropout)

  def _positions(self) -> jax.Array:
    return jnp.asarray(sinusoid_table(self.max_len, self.hidden))  # [L_max, H]

  def __call__(self, tokens: jax.Array, memory: jax.Array, train: bool = False) -> jax.Array:
    """Teacher-forced logits.

    Args:
      tokens: [B, L] int token ids, L <= max_len.
      memory: [B, M, H] (every layer attends to the same memory; no padding mask).
      train: dropout on (needs the 'dropout' rng).

    Returns:
      logits [B, L, V] float32.
    """
    length = tokens.shape[1]
    if length > self.max_len:
      raise ValueError(f'caption length {length} exceeds the decoder max_len {self.max_len}')
    x = self.output.embed(tokens) + self._positions()[None, :length]  # [B, L, H]
    x = self.embed_dropout(x, deterministic=not train)
    for block in self.blocks:
      x = block(x, memory, not train)
    return self.output(x)

  def init_cache(self, memory: jax.Array) -> dict:
    """The incremental-decoding cache for `memory` [B, M, H] (batch axis first in every leaf)."""
    return {f'layer_{i}': block.init_cache(memory, self.max_len)
            for i, block in enumerate(self.blocks)}

  def step(self, cache: dict, token: jax.Array, pos: jax.Array) -> tuple[jax.Array, dict]:
    """Logits [B, V] of the next token after `token` [B] at position `pos` (scalar int).

    Equals `__call__(tokens, memory)[:, pos]` for the tokens fed so far (deterministic mode).
    """
    pos = jnp.asarray(pos, jnp.int32)
    pe = jax.lax.dynamic_index_in_dim(self._positions(), pos, 0, keepdims=True)  # [1, H]
    x = self.output.embed(token[:, None]) + pe[None]  # [B, 1, H]
    new_cache = {}
    for i, block in enumerate(self.blocks):
      x, new_cache[f'layer_{i}'] = block.step(x, cache[f'layer_{i}'], pos)
    return self.output(x[:, 0]), new_cache
