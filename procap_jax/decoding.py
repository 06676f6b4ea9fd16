"""Greedy and beam-search caption decoding over a step function; pure jax, one jitted loop.

Dimensions: B batch, W beam width, L_max longest output ([BOS] + up to L_max - 1 tokens),
V vocab.

Both searches drive a `step_fn(cache, token, pos) -> (logits, cache)` closure: `token` [B'] int32
is the token at position `pos` (a scalar int32), `logits` [B', V] score the token at `pos + 1`,
and `cache` is any pytree whose leaves all have the batch axis first (B' = B for greedy, B * W for
beam search, beam-major inside each example). `models.decoder.CaptionDecoder.step` (through
`models.captioner.ProCapModel.decode_step`) is such a function with a KV cache.

Like the original (spec 5.7), [UNK] can never be emitted (its logit is set to -1e10). Unlike the
original, which always runs 24 full-buffer passes, the loops stop as soon as every sequence has
emitted [EOS]; tokens after a sequence's [EOS] are [PAD]. Detokenisation stops at the first [EOS],
so the captions are the same.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp

_NEG = -1e10
StepFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]


def _suppress(logits: jax.Array, unk_id: int | None) -> jax.Array:
  if unk_id is None:
    return logits
  return logits.at[:, unk_id].set(_NEG)


def greedy(step_fn: StepFn, cache: Any, batch_size: int, *, max_len: int = 24, bos_id: int = 4,
           eos_id: int = 5, unk_id: int | None = 6, pad_id: int = 0,
           return_logits: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Greedy decoding in one `lax.while_loop` with early exit.

  Args:
    step_fn: (cache, token [B], pos) -> (logits [B, V], cache).
    cache: the initial cache for B sequences.
    batch_size: B.
    max_len: L_max (the original's 24: [BOS] + up to 23 tokens).
    bos_id, eos_id, pad_id: special ids ([BOS]=4, [EOS]=5, [PAD]=0).
    unk_id: id whose logit is suppressed ([UNK]=6); None keeps every token.
    return_logits: also return the raw step logits.

  Returns:
    tokens [B, L_max] int32 starting with [BOS], [PAD] after [EOS]; with `return_logits`, also
    logits [B, L_max - 1, V] float32 (row t scores position t + 1; zero for steps not run).
  """
  tokens = jnp.full([batch_size, max_len], pad_id, jnp.int32).at[:, 0].set(bos_id)
  done = jnp.zeros([batch_size], bool)
  pos = jnp.zeros([], jnp.int32)
  vocab = jax.eval_shape(step_fn, cache, tokens[:, 0], pos)[0].shape[-1] if return_logits else 1
  all_logits = jnp.zeros([batch_size, max(max_len - 1, 1), vocab], jnp.float32)

  def cond(carry):
    pos, _, done, _, _ = carry
    return (pos < max_len - 1) & ~jnp.all(done)

  def body(carry):
    pos, tokens, done, cache, all_logits = carry
    token = jax.lax.dynamic_index_in_dim(tokens, pos, axis=1, keepdims=False)  # [B]
    logits, cache = step_fn(cache, token, pos)
    logits = logits.astype(jnp.float32)
    if return_logits:
      all_logits = jax.lax.dynamic_update_slice_in_dim(all_logits, logits[:, None], pos, 1)
    word = jnp.argmax(_suppress(logits, unk_id), axis=-1).astype(jnp.int32)  # [B]
    word = jnp.where(done, pad_id, word)
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, word[:, None], pos + 1, 1)
    return pos + 1, tokens, done | (word == eos_id), cache, all_logits

  _, tokens, _, _, all_logits = jax.lax.while_loop(
      cond, body, (pos, tokens, done, cache, all_logits))
  return (tokens, all_logits) if return_logits else tokens


def length_penalty(lengths: jax.Array, alpha: float) -> jax.Array:
  """GNMT length penalty ((5 + length) / 6)^alpha; alpha 0 = plain sum of log-probabilities."""
  return ((5.0 + lengths.astype(jnp.float32)) / 6.0) ** alpha


def beam_search(step_fn: StepFn, cache: Any, batch_size: int, *, beam_size: int,
                max_len: int = 24, bos_id: int = 4, eos_id: int = 5, unk_id: int | None = 6,
                pad_id: int = 0, alpha: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """Beam search in one `lax.while_loop` with early exit.

  Length handling: a beam that has emitted [EOS] stays in the beam with a frozen score (its only
  continuation is [PAD] at log-probability 0), so finished and unfinished hypotheses compete on
  their summed log-probability while searching. The search stops when every beam of every
  example is finished (continuing would change nothing) or at L_max. The winner of each example
  is the beam with the highest score / length_penalty(length, alpha), where length counts the
  generated tokens including [EOS]; alpha = 0 (default) ranks by the plain sum, which favours
  short captions; alpha > 0 favours longer ones.

  Args:
    step_fn: (cache, token [B*W], pos) -> (logits [B*W, V], cache).
    cache: the initial cache for B sequences (repeated W times here).
    batch_size: B.
    beam_size: W (must be below V - 1).
    max_len, bos_id, eos_id, unk_id, pad_id: as `greedy`.
    alpha: length-penalty exponent for the final choice.

  Returns:
    tokens [B, L_max] int32 (best beam; [BOS] first, [PAD] after [EOS]) and its summed
    log-probability [B] float32.
  """
  b, w = batch_size, beam_size
  cache = jax.tree.map(lambda x: jnp.repeat(x, w, axis=0), cache)  # [B*W, ...]
  tokens = jnp.full([b, w, max_len], pad_id, jnp.int32).at[:, :, 0].set(bos_id)
  # Only beam 0 is live at the start, so the first expansion has no duplicates.
  scores = jnp.full([b, w], _NEG, jnp.float32).at[:, 0].set(0.0)
  finished = jnp.zeros([b, w], bool)
  pos = jnp.zeros([], jnp.int32)

  def cond(carry):
    pos, _, _, finished, _ = carry
    return (pos < max_len - 1) & ~jnp.all(finished)

  def body(carry):
    pos, tokens, scores, finished, cache = carry
    token = jax.lax.dynamic_index_in_dim(tokens, pos, axis=2, keepdims=False)  # [B, W]
    logits, cache = step_fn(cache, token.reshape(b * w), pos)
    logp = jax.nn.log_softmax(_suppress(logits.astype(jnp.float32), unk_id), axis=-1)
    v = logp.shape[-1]
    logp = logp.reshape(b, w, v)  # [B, W, V]
    pad_only = jnp.full([v], _NEG, jnp.float32).at[pad_id].set(0.0)
    logp = jnp.where(finished[..., None], pad_only, logp)
    candidates = (scores[..., None] + logp).reshape(b, w * v)  # [B, W*V]
    scores, flat = jax.lax.top_k(candidates, w)  # [B, W]
    parent, word = flat // v, (flat % v).astype(jnp.int32)
    tokens = jnp.take_along_axis(tokens, parent[..., None], axis=1)  # [B, W, L_max]
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, word[..., None], pos + 1, 2)
    finished = jnp.take_along_axis(finished, parent, axis=1) | (word == eos_id)
    rows = (jnp.arange(b)[:, None] * w + parent).reshape(b * w)  # [B*W]
    cache = jax.tree.map(lambda x: jnp.take(x, rows, axis=0), cache)
    return pos + 1, tokens, scores, finished, cache

  _, tokens, scores, _, _ = jax.lax.while_loop(
      cond, body, (pos, tokens, scores, finished, cache))
  lengths = jnp.sum(tokens[:, :, 1:] != pad_id, axis=-1)  # [B, W]
  best = jnp.argmax(scores / length_penalty(lengths, alpha), axis=-1)  # [B]
  best_tokens = jnp.take_along_axis(tokens, best[:, None, None], axis=1)[:, 0]  # [B, L_max]
  best_scores = jnp.take_along_axis(scores, best[:, None], axis=1)[:, 0]  # [B]
  return best_tokens, best_scores


def search(step_fn: StepFn, cache: Any, batch_size: int, *, method: str, beam_size: int,
           alpha: float, max_len: int, bos_id: int, eos_id: int, unk_id: int | None,
           pad_id: int) -> jax.Array:
  """Caption ids [B, max_len] by `method` ('greedy' | 'beam': the best beam); the one dispatch
  every captioner's `generate` uses."""
  ids = dict(max_len=max_len, bos_id=bos_id, eos_id=eos_id, unk_id=unk_id, pad_id=pad_id)
  if method == 'greedy':
    return greedy(step_fn, cache, batch_size, **ids)
  if method == 'beam':
    return beam_search(step_fn, cache, batch_size, beam_size=beam_size, alpha=alpha, **ids)[0]
  raise ValueError(f"decoding method must be 'greedy' or 'beam', got {method!r}")
