"""Stage 2's loss: the caption decoder's label-smoothed KL (the original's `LabelSmoothingLoss`)
and the optional change head's cross-entropy, summed over a batch's rows and reduced.

Dimension legend: B pairs, L caption length, V vocab.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from procap_jax.data import vocab as vocab_lib


def teacher_forcing_labels(caption_in: jax.Array) -> jax.Array:
  """`vocab.decoder_labels` in jnp: [B, L] inputs -> [B, L] targets, -1 = ignored."""
  following = caption_in[:, 1:]
  labels = jnp.where(following != vocab_lib.PAD, following, vocab_lib.IGNORE)
  return jnp.pad(labels, ((0, 0), (0, 1)), constant_values=vocab_lib.IGNORE).astype(jnp.int32)


def label_smoothing_loss(logits: jax.Array, labels: jax.Array,
                         smoothing: float) -> tuple[jax.Array, jax.Array]:
  """The original `LabelSmoothingLoss` (spec 5.4): KL(q || softmax(logits)) SUMMED.

  q puts 1 - smoothing on the gold word and smoothing / (V - 1) on every other word.

  Args:
    logits: [B, L, V].
    labels: [B, L] int, -1 = ignored position.
    smoothing: e.g. 0.1.

  Returns:
    (summed KL over valid positions, number of valid positions), float32 scalars.
  """
  v = logits.shape[-1]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, L, V]
  valid = labels != vocab_lib.IGNORE
  gold = jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
  confidence, other = 1.0 - smoothing, smoothing / (v - 1)
  neg_entropy = jax.scipy.special.xlogy(confidence, confidence) + (
      (v - 1) * jax.scipy.special.xlogy(other, other))
  cross = confidence * gold + other * (jnp.sum(logp, axis=-1) - gold)  # [B, L]
  kl = jnp.where(valid, neg_entropy - cross, 0.0)
  return jnp.sum(kl), jnp.sum(valid).astype(jnp.float32)


def reduce(sums: dict, reduction: str, change_loss: float, words: jax.Array,
            pairs: jax.Array) -> jax.Array:
  """The loss of `sums` (of a batch, or of a micro-batch with the whole batch's `words` and
  `pairs` as denominators): the summed KL ('sum') or KL / words ('mean'), plus `change_loss`
  times the change head's summed cross-entropy ('sum') or that over `pairs` ('mean')."""
  if reduction not in ('sum', 'mean'):
    raise ValueError(f"config.caption.train.loss_reduction must be 'sum' or 'mean', got "
                     f'{reduction!r}')
  loss = sums['total'] if reduction == 'sum' else sums['total'] / words
  if change_loss:
    loss = loss + change_loss * (sums['change_ce'] if reduction == 'sum'
                                 else sums['change_ce'] / pairs)
  return loss


def metrics(sums: dict, pairs: jax.Array) -> dict:
  """The logged metrics of a batch's `sums` (`forward_sums` summed over its micro-batches):
  loss per word, summed KL, target words, word accuracy, and the change head's mean loss and
  accuracy over the `pairs` when it has them."""
  words = jnp.maximum(sums['count'], 1.0)
  out = {'loss_per_word': sums['total'] / words, 'loss_sum': sums['total'],
         'tokens': sums['count'], 'accuracy': sums['correct'] / words}
  if 'change_ce' in sums:
    out.update(change_loss=sums['change_ce'] / pairs, change_accuracy=sums['change_right'] / pairs)
  return out


def forward_sums(params: Any, model: nn.Module, rows: dict, rng: jax.Array,
                 t: ml_collections.ConfigDict) -> dict:
  """The captioner's training forward on `rows` (before, after, tokens, labels, change_type,
  valid): sums of the KL, the target words, the right words and, with `t.change_loss`, the
  change head's cross-entropy and right rows."""
  with_change = bool(t.change_loss)
  out = model.apply({'params': params}, rows['before'], rows['after'], rows['tokens'],
                    train=True, rngs={'dropout': rng},
                    **({'with_change': True} if with_change else {}))
  logits, change = out if with_change else (out, None)
  labels = rows['labels']
  total, count = label_smoothing_loss(logits, labels, t.label_smoothing)
  correct = jnp.sum((jnp.argmax(logits, -1) == labels) & (labels != vocab_lib.IGNORE))
  sums = dict(total=total, count=count, correct=correct.astype(jnp.float32))
  if with_change:
    sums['change_ce'], sums['change_right'], _ = change_type_loss(change, rows)
  return sums


def change_type_loss(change_logits: jax.Array,
                     batch: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The change head's cross-entropy against the batch's `change_type` ([B] ids of
  `pipeline.CHANGE_TYPES`), padding rows left out.

  Returns:
    (summed cross-entropy, rows whose argmax is right, valid rows (at least 1)), float32.
  """
  types = jnp.asarray(batch['change_type'], jnp.int32)  # [B]
  valid = jnp.asarray(batch['valid'], bool)  # [B]
  logp = jax.nn.log_softmax(change_logits.astype(jnp.float32), axis=-1)  # [B, types]
  ce = -jnp.take_along_axis(logp, types[:, None], axis=-1)[:, 0]  # [B]
  right = (jnp.argmax(logp, -1) == types) & valid
  rows = jnp.maximum(jnp.sum(valid).astype(jnp.float32), 1.0)
  return jnp.sum(jnp.where(valid, ce, 0.0)), jnp.sum(right).astype(jnp.float32), rows
