"""`probe_consistency --task change`: can a model tell a change pair from a no-change distractor?

Dimension legend: M clips, T frames, h x w tokenizer grid, C feature channels, D encoder width.

The question under caption matching's easiest part (a "nothing has changed" caption on a changed
clip, or the reverse), asked from the frames alone, with the answer told directly (label 1 =
change pair). Each probe trains on the first `n_train` clips with `probe_training.train_bce`:
  diff_mlp  the MLP (batch 8) on the spatial max and mean of |after - before| tokenizer
            features: a comparison made by hand, at the same positions.
  pixel_diff_mlp  the same on each token's pixel-patch statistics (mean/std/max/min RGB):
            how far the pixels themselves separate a change from the distractors' jitter.
  encoder   the run's ProcedureEncoder from scratch, frames only (an empty caption), its [REL]
            head (or [VID], `--head vid`) trained with BCE on the label (batch 8, `--lr` after
            a 100-step warmup); `--init stage1` starts it from the run's stage-1 checkpoint.
            `--head max` reads the frame tokens instead of a control token: a linear score of
            each LayerNormed last-layer frame token, the clip's logit its max over the tokens,
            so a change that one token detects is not averaged away.
            `--frame-difference none|before` overrides the run's encoder input switch
            (docs/fidelity.md), e.g. to measure what it buys on the same clips.

Records add to the common ones `chance`, the held-out share of the larger class (about 0.5), and
three threshold-free figures of the held-out logits: `held_out_auc` (ROC AUC, 0.5 = no
ranking), `logit_mean` and `logit_std`. Accuracy alone cannot tell a head that ranks the clips
but sits off its threshold (AUC > 0.5, |mean| > std) from one whose logits no longer depend on
the clip (AUC near 0.5, std near 0). The encoder's records also describe the hidden state its
head reads (the [REL] or [VID] row, or for `max` the top-scoring frame token): `read_mean_norm`,
the norm of its mean over the held-out clips, and `read_clip_std`, the root of its summed
variance across them. A clip-independent state has a large mean and a small spread.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from procap_jax.diagnostics import head_logits
from procap_jax.diagnostics import probe_training
from procap_jax.tasks import pretrain


def _fit_binary(name: str, apply, params, x, y, n_train: int, steps: int, every: int,
                lr: float, warmup: int = 0, read=None):
  """Yields records of `apply(params, x[i]) -> logits` trained with BCE on labels `y` [M] on
  the first `n_train` rows (batch 8, Adam, global-norm clip 1), scored on the rest: accuracy at
  logit 0, and (threshold-free) the ROC AUC and the mean and spread of the held-out logits.
  With `read(params, x) -> (logits [B], state [B, D])`, the logits and the hidden state the head
  reads from one forward, evaluation uses it and the records add `read_mean_norm`, the norm of
  that state's mean over the held-out clips, and `read_clip_std`, the root of its summed
  variance across them (how much of it depends on the clip at all)."""
  y = np.asarray(y, np.float32)
  schedule = optax.linear_schedule(lr * 1e-3, lr, warmup) if warmup else lr
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
  evaluate = jax.jit(read if read is not None else lambda p, xb: (apply(p, xb), None))
  held = y[n_train:] > 0.5
  chance = float(max(held.mean(), 1.0 - held.mean()))
  rows = lambda s, i: (y[i], x[i])
  for s, params in probe_training.train_bce(apply, params, tx, rows, n_train, steps, every):
    outs = [evaluate(params, x[j:j + 64]) for j in range(n_train, len(x), 64)]
    v = np.concatenate([np.asarray(o[0]) for o in outs])  # [M - n_train] logits
    record = {'probe': name, 'keep': 1.0, 'step': s, 'samples': 8 * s,
              'held_out_acc': float(np.mean((v > 0) == held)), 'chance': chance,
              'held_out_auc': head_logits.roc_auc(v, held), 'logit_mean': float(v.mean()),
              'logit_std': float(v.std())}
    if read is not None:
      h = np.concatenate([np.asarray(o[1]) for o in outs])  # [M - n_train, D]
      record['read_mean_norm'] = float(np.linalg.norm(h.mean(0)))
      record['read_clip_std'] = float(np.sqrt(np.sum(h.var(0))))
    yield record


def _pooled_difference(tokens: np.ndarray, n_train: int) -> np.ndarray:
  """Spatial max and mean of |after - before| per channel, standardised on the training rows:
  [M, T, h, w, C] -> [M, 2C]."""
  diff = np.abs(tokens[:, -1] - tokens[:, 0])  # [M, h, w, C]: after vs before, same position
  pooled = np.concatenate([diff.max((1, 2)), diff.mean((1, 2))], -1)  # [M, 2C]
  return probe_training.standardise(pooled, n_train)[0]


def probe_change(config, clean, change, n_train: int, steps: int, every: int, lr: float,
                 head: str = 'rel', init_params=None, pixels=None):
  """Yields records of the `--task change` probes (the module docstring); the encoder
  starts from `init_params` (e.g. the run's stage-1 parameters) when given, else from scratch.
  With `pixels` [M, T, h, w, 12] (`patch_statistics`), the difference MLP also runs on them."""
  inputs = [('change_diff_mlp', clean)]
  if pixels is not None:
    inputs.append(('change_pixel_diff_mlp', pixels))
  for name, tokens in inputs:
    pooled = _pooled_difference(tokens, n_train)
    mlp, apply_mlp = probe_training.mlp(pooled.shape[1])
    yield from _fit_binary(name, apply_mlp, mlp, pooled, change, n_train, steps, every, 1e-3)

  model = pretrain.build_model(config)
  if init_params is None:
    params = nn.meta.unbox(pretrain.init_params(model, config, jax.random.key(0), None))
  else:  # no scratch initialisation to throw away
    params = jax.tree.map(jnp.asarray, init_params)
  params = {'encoder': params}
  if head == 'max':  # a linear score per frame token, read out by its max over the tokens
    params['max_readout'] = {'w': jnp.zeros(model.width), 'b': jnp.zeros(())}
  t, n = clean.shape[1], clean.shape[2] * clean.shape[3]

  def forward(p, x):  # frames only: an empty caption, nothing masked
    empty = jnp.zeros((x.shape[0], model.text_len), jnp.int32)
    return model.apply({'params': p['encoder']}, empty, x, jnp.zeros((x.shape[0], t, n), bool),
                       use_rel=True)

  def token_scores(p, x):  # [B, T*N] scores and [B, T*N, D] LayerNormed frame hidden states
    h = forward(p, x)['frame_hidden']
    h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
    return h @ p['max_readout']['w'] + p['max_readout']['b'], h

  def apply_encoder(p, x):
    if head == 'max':
      return token_scores(p, x)[0].max(-1)  # [B]
    return forward(p, x)[f'{head}_logit']  # [B]

  def read(p, x):  # logits [B] and the hidden state the head reads [B, D], from one forward
    if head == 'max':
      scores, h = token_scores(p, x)
      return scores.max(-1), jnp.take_along_axis(h, scores.argmax(-1)[:, None, None], axis=1)[:, 0]
    out = forward(p, x)
    row = 0 if head == 'rel' else model.text_len + 2  # [REL] | [VID] (after the text and [ST1])
    return out[f'{head}_logit'], out['hidden'][:, row]

  yield from _fit_binary(f'change_encoder_{head}', apply_encoder, params, clean, change, n_train,
                         steps, every, lr, warmup=100, read=read)
