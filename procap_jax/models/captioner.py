"""Stage-2 model: procedure encoder + procedure queries + memory MLP + caption decoder.

Dimensions: B batch, k imagined frames (procedure-query frames), T = k + 2 frame slots,
h x w tokenizer grid, N = h * w tokens per frame, C tokenizer feature width, D encoder width,
M = T * N memory length, H decoder width, L caption length, V vocab, K codebook size.

Frame slots given to the stage-1 encoder (spec 5.2):
  [before features (N), k x N procedure queries, after features (N)]
The procedure queries are the encoder's learned [MASK] vector (`image_mask`), i.e. the middle k
frames are passed as fully masked (`frame_mask` True); they differ only by their axial (t, h, w)
position embeddings. The decoder memory is the encoder output at ALL T x N frame slots through
`memory_mlp` = Dense(D, D) -> ReLU -> Dense(D, H) -> LayerNorm(H), without any padding mask.
With `memory_frames='ends'` (not the original's) the decoder reads only the before and after
slots of that output (M = 2N); the queries still take part in the encoder's attention.

With `use_queries=False` (static baseline / "w/o queries" ablation) only the before and after
slots exist (T = 2, M = 2N): the encoder is built with 2 frame rows, and a stage-1 checkpoint
fills them with its rows 0 and k + 1, so before and after keep their stage-1 frame positions
(`tasks.caption.restore_pretrained_encoder`, docs/fidelity.md).
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from procap_jax import config_lib
from procap_jax import decoding
from procap_jax import sharding
from procap_jax import token_ids
from procap_jax.models import decoder as decoder_lib
from procap_jax.models import layers
from procap_jax.models import procedure_encoder


# The change head's classes: len(pipeline.CHANGE_TYPES) (none, color, material, add, drop, move,
# other; tests/caption_task_test.py checks they agree), without importing the data pipeline here.
NUM_CHANGE_TYPES = 7


class MemoryMLP(nn.Module):
  """Dense(D, D) -> ReLU -> Dense(D, H) -> LayerNorm(H) (torch LayerNorm, eps 1e-5)."""
  hidden: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x [B, M, D] -> [B, M, H] float32."""
    width = x.shape[-1]
    dense_cls = layers.dense_class(self.dtype)
    x = dense_cls(width, dtype=self.dtype, name='dense_0',
                  kernel_init=decoder_lib.torch_kernel_init(('embed', 'mlp')),
                  bias_init=decoder_lib.torch_bias_init(width, ('mlp',)))(x)
    x = nn.relu(x)
    x = dense_cls(self.hidden, dtype=self.dtype, name='dense_1',
                  kernel_init=decoder_lib.torch_kernel_init(('mlp', 'embed')),
                  bias_init=decoder_lib.torch_bias_init(width, ('embed',)))(x)
    return decoder_lib.DecoderLayerNorm('standard', name='norm')(x)


class ProCapModel(nn.Module):
  """Stage-2 captioner: ProCap's flax module (the inference API around a trained run is
  `procap_jax.caption.Captioner`).

  Attributes:
    encoder: the stage-1 `ProcedureEncoder` (same parameter tree as stage 1, so the stage-1
      checkpoint's params slot into `params['encoder']`); any module with its call signature
      `(text, frame_features [B, T, h, w, C], frame_mask [B, T, N], *, use_rel, stage2_mask,
      text_slot) -> dict(frame_hidden [B, T*N, D], frame_logits [B, T*N, K], ...)`.
    decoder: the `CaptionDecoder`.
    num_queries: k, the number of procedure-query frames.
    use_queries: False -> only the before and after slots (T = 2).
    text_slot: stage-2 text slots of the encoder ('code' | 'padding' | 'none', spec 8.1).
    stage2_mask: encoder attention mask in stage 2 ('code' | 'aligned', spec 8.2).
    change_head: 0 (the original) | W > 0: an auxiliary head that names the change type from
      the memory (`change_logits`; not the original's, docs/fidelity.md), trained with weight
      `caption.train.change_loss`; the captions still come from the decoder alone.
    num_change_types: the head's classes (`pipeline.CHANGE_TYPES`).
    memory_frames: 'all' (the original: the memory is every frame slot's output) | 'ends'
      (only the before and after slots': M = 2N).
    dtype: computation dtype of the memory MLP.
  """
  encoder: nn.Module
  decoder: nn.Module
  num_queries: int = 2
  use_queries: bool = True
  text_slot: str = 'code'
  stage2_mask: str = 'code'
  change_head: int = 0
  num_change_types: int = NUM_CHANGE_TYPES
  memory_frames: str = 'all'
  dtype: Any = jnp.float32

  def setup(self):
    self.memory_mlp = MemoryMLP(self.decoder.hidden, self.dtype)
    if self.change_head:
      self.change_hidden = nn.Dense(
          self.change_head, kernel_init=decoder_lib.torch_kernel_init(('embed', 'mlp')),
          bias_init=decoder_lib.torch_bias_init(self.decoder.hidden, ('mlp',)))
      self.change_out = nn.Dense(
          self.num_change_types, kernel_init=decoder_lib.torch_kernel_init(('mlp', None)),
          bias_init=decoder_lib.torch_bias_init(self.change_head, (None,)))

  def frame_slots(self, before_feats: jax.Array,
                  after_feats: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Frame inputs [B, T, h, w, C] and frame mask [B, T, N] (True = procedure query)."""
    b, gh, gw, c = before_feats.shape
    k = self.num_queries if self.use_queries else 0
    middle = jnp.zeros([b, k, gh, gw, c], before_feats.dtype)  # replaced by the queries
    frames = jnp.concatenate([before_feats[:, None], middle, after_feats[:, None]], 1)
    mask = jnp.zeros([b, k + 2, gh * gw], bool).at[:, 1:k + 1].set(True)  # [B, T, N]
    return frames, mask

  def _encoder_outputs(self, before_feats: jax.Array, after_feats: jax.Array) -> dict:
    frames, mask = self.frame_slots(before_feats, after_feats)
    last = frames.shape[1] - 1  # the queries between before and after are masked whole
    return self.encoder(None, frames, mask, use_rel=False, stage2_mask=self.stage2_mask,
                        text_slot=self.text_slot, visible_frames=(0, last))

  def encode(self, before_feats: jax.Array, after_feats: jax.Array) -> jax.Array:
    """Decoder memory.

    Args:
      before_feats, after_feats: tokenizer features [B, h, w, C].

    Returns:
      memory [B, M, H], M = T * N (`memory_frames='ends'`: M = 2N).
    """
    hidden = self._encoder_outputs(before_feats, after_feats)['frame_hidden']  # [B, T * N, D]
    if self.memory_frames == 'ends':
      n = before_feats.shape[1] * before_feats.shape[2]
      hidden = jnp.concatenate([hidden[:, :n], hidden[:, -n:]], axis=1)
    return self.memory_mlp(hidden)

  def decode_logits(self, memory: jax.Array, tokens: jax.Array,
                    train: bool = False) -> jax.Array:
    """Teacher-forced logits [B, L, V] of `tokens` [B, L] given `memory` [B, M, H]."""
    return self.decoder(tokens, memory, train)

  def change_logits(self, memory: jax.Array) -> jax.Array:
    """The auxiliary change head (`change_head` > 0): memory [B, M, H] -> Dense(W) -> ReLU ->
    max over the M slots (a change sits in a few of them) -> Dense(types): logits [B, types]
    (float32)."""
    pooled = jnp.max(nn.relu(self.change_hidden(memory.astype(jnp.float32))), axis=1)  # [B, W]
    return self.change_out(pooled)

  def __call__(self, before_feats: jax.Array, after_feats: jax.Array, tokens: jax.Array,
               train: bool = False, with_change: bool = False):
    """Logits [B, L, V] of `tokens` [B, L] for the pairs' features [B, h, w, C]; with
    `with_change` also the change head's logits [B, types] (a pair)."""
    memory = self.encode(before_feats, after_feats)
    logits = self.decode_logits(memory, tokens, train)
    if with_change or (self.change_head and self.is_initializing()):
      change = self.change_logits(memory)
      if with_change:
        return logits, change
    return logits

  def init_cache(self, memory: jax.Array) -> dict:
    """The decoder's incremental-decoding cache for `memory` [B, M, H]."""
    return self.decoder.init_cache(memory)

  def decode_step(self, cache: dict, token: jax.Array,
                  pos: jax.Array) -> tuple[jax.Array, dict]:
    """(cache, token [B], pos) -> (logits [B, V], cache): the step function of `decoding`."""
    return self.decoder.step(cache, token, pos)

  def imagine(self, before_feats: jax.Array, after_feats: jax.Array) -> jax.Array:
    """Code ids [B, k, N] of the imagined intermediate frames.

    The procedure-query outputs through the (frozen) stage-1 token head `to_logits`, argmax;
    decode them with the tokenizer's `decode_tokens` to see the imagined frames.
    """
    if not self.use_queries:
      raise ValueError('imagine() needs procedure queries (config.caption.model.use_queries)')
    out = self._encoder_outputs(before_feats, after_feats)
    logits = out['frame_logits']  # [B, T*N, K]
    b, n = before_feats.shape[0], before_feats.shape[1] * before_feats.shape[2]
    logits = logits.reshape(b, self.num_queries + 2, n, logits.shape[-1])  # [B, T, N, K]
    return jnp.argmax(logits[:, 1:-1], axis=-1).astype(jnp.int32)  # [B, k, N]


def from_config(config: Any) -> ProCapModel:
  """The ProCapModel of `config.caption.model` around the stage-1 encoder
  (`config_lib.encoder_kwargs`: k = data.num_keyframes query frames), computing in
  `config.compute_dtype`. Without procedure queries the encoder has T = 2 frame slots. Used by
  training (`tasks.caption.build_model`) and inference (`procap_jax.caption`) alike."""
  m = config.caption.model
  enc = config_lib.encoder_kwargs(config)
  k = enc['num_frames'] - 2
  if not m.use_queries:
    enc['num_frames'] = 2
  dtype = jnp.dtype(config.compute_dtype)
  encoder = procedure_encoder.ProcedureEncoder(**enc, dtype=dtype)
  decoder = decoder_lib.CaptionDecoder(
      vocab_size=m.vocab_size, hidden=m.hidden, heads=m.heads, ffn=m.ffn, layers=m.layers,
      dropout=m.dropout, max_len=m.max_len, attention_scale=m.attention_scale,
      qkv_bias=m.qkv_bias, layernorm=m.layernorm, dtype=dtype)
  return ProCapModel(encoder=encoder, decoder=decoder, num_queries=k, use_queries=m.use_queries,
                     text_slot=m.text_slot, stage2_mask=m.stage2_mask,
                     change_head=int(m.change_head), num_change_types=NUM_CHANGE_TYPES,
                     memory_frames=m.memory_frames, dtype=dtype)


def generate(model: ProCapModel, params: Any, before_feats: jax.Array, after_feats: jax.Array, *,
             method: str = 'greedy', beam_size: int = 3, alpha: float = 0.0,
             max_len: int = 24, encode_rows: int = 0) -> jax.Array:
  """Caption ids [B, max_len] ([BOS] first, [PAD] after [EOS]) for features [B, h, w, C].

  The encoder runs once (`encode_rows` > 0: on that many pairs at a time, see `encode_memory`);
  the decoder then runs one position at a time on its KV cache inside a single
  `lax.while_loop` (`decoding.greedy` or `decoding.beam_search`). Jit the caller.
  """
  variables = {'params': params}
  memory = encode_memory(model, params, before_feats, after_feats, encode_rows)  # [B, M, H]
  cache = model.apply(variables, memory, method='init_cache')

  def step(cache, token, pos):
    return model.apply(variables, cache, token, pos, method='decode_step')

  return decoding.search(step, cache, before_feats.shape[0], method=method, beam_size=beam_size,
                         alpha=alpha, max_len=max_len, **token_ids.DECODING_IDS)


def encode_memory(model: ProCapModel, params: Any, before_feats: jax.Array,
                  after_feats: jax.Array, rows: int = 0) -> jax.Array:
  """The decoder memory [B, M, H] of `ProCapModel.encode`, `rows` pairs at a time (0: all).

  The same values (each pair's encoding depends on that pair alone); only the schedule
  changes: the encoder's activations for a few pairs stay in cache, which XLA:CPU runs faster
  than the whole batch at once (docs/performance.md, section "Inference"). With C = ceil(B /
  rows) calls, call j takes pairs j, j + C, j + 2C, ... (as training's micro-batches do), so
  on a data-parallel mesh a call spreads over the devices when `rows` is a multiple of the
  data axis. A batch that `rows` does not divide is padded with copies of its last pair, whose
  outputs are dropped.
  """
  b = before_feats.shape[0]
  if rows <= 0 or rows >= b:
    return model.apply({'params': params}, before_feats, after_feats, method='encode')
  calls = -(-b // rows)

  def split(x):  # [B, ...] -> [calls, rows, ...]; call j holds pairs j, j + calls, ...
    x = jnp.concatenate([x, jnp.repeat(x[-1:], calls * rows - b, axis=0)])
    return sharding.interleaved_rows(x, calls)

  memory = jax.lax.map(
      lambda f: model.apply({'params': params}, f[0], f[1], method='encode'),
      (split(before_feats), split(after_feats)))  # [calls, rows, M, H]
  return sharding.rows_in_order(memory)[:b]
