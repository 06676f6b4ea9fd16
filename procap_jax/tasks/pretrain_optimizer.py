"""Stage 1's optimiser: the original's DeepSpeed WarmupLR (log or linear warmup, then constant;
an optional linear decay at the end) and Adam after a global-norm clip (checked against the
original's in tests/parity_stage1_test.py)."""

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax


def learning_rate(config: ml_collections.ConfigDict, total_steps: int = 0) -> optax.Schedule:
  """The original's DeepSpeed WarmupLR as train_stage1.py steps it: update n (0-based) runs at
  lr(k) with k = max(n - 1, 0), lr(k) = lo + (lr - lo) ln(k + 1) / ln(W) for k < W ('log'), or
  lo + (lr - lo) k / W ('linear'); then the constant lr. The scheduler's constructor already
  takes one step and the loop steps after every update, so updates 0 and 1 both run at lo
  (recorded from DeepSpeed 0.18.5: tests/parity_stage1_test.py).

  With `decay_steps` D > 0 (not the original's; docs/fidelity.md) the last D of `total_steps`
  updates decay the lr linearly to 0 (warmup-stable-decay): lr (total - n) / D for
  n >= total - D. On the synthetic default it lowers the val loss and raises the consistency
  accuracy (docs/fidelity.md).
  """
  t = config.pretrain.train
  lo, hi, steps = float(t.warmup_min), float(t.lr), int(t.warmup_steps)
  decay = int(t.decay_steps)
  if t.warmup not in ('log', 'linear'):
    raise ValueError(f"config.pretrain.train.warmup must be 'log' or 'linear', got {t.warmup!r}")
  if decay < 0 or (decay and decay > total_steps):
    raise ValueError(f'config.pretrain.train.decay_steps must be between 0 and the {total_steps} '
                     f'training steps, got {decay}')

  def schedule(count):
    n = jnp.asarray(count, jnp.float32)
    k = jnp.maximum(n - 1.0, 0.0)  # DeepSpeed's iteration counter at update n
    if steps <= 1:
      lr = jnp.full_like(n, hi)
    else:
      frac = jnp.log(k + 1.0) / np.log(steps) if t.warmup == 'log' else k / steps
      lr = jnp.where(k < steps, lo + (hi - lo) * frac, hi)
    if decay:
      lr = jnp.minimum(lr, hi * jnp.clip((total_steps - n) / decay, 0.0, 1.0))
    return lr

  return schedule


def make_optimizer(config: ml_collections.ConfigDict,
                   total_steps: int) -> optax.GradientTransformation:
  """Global-norm clip, then Adam (0.9, 0.999, 1e-8, no weight decay) on `learning_rate`."""
  return optax.chain(optax.clip_by_global_norm(config.pretrain.train.clip),
                     optax.adam(learning_rate(config, total_steps), b1=0.9, b2=0.999, eps=1e-8))
