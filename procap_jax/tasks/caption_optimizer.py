"""Stage 2's optimiser: the original's BertAdam and warmup_linear as optax, per parameter group
(spec 5.5; the parameter groups and decay rule checked against the original's in
tests/parity_stage2_test.py)."""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from procap_jax import config_lib

# Stage-1 heads the original freezes in stage 2 (its `skip_params`), and image_emb.
FROZEN_ENCODER_MODULES = ('to_logits', 'to_logits_rel', 'to_logits_vid', 'image_emb')


def warmup_linear(peak: float, total_steps: int, warmup_frac: float) -> optax.Schedule:
  """The original `warmup_linear` (spec 5.5): x = step / total; x / w for x < w, then
  (1 - x) / (1 - w), floored at 0; times `peak`. The first update (step 0) has lr 0."""

  def schedule(count):
    x = jnp.asarray(count, jnp.float32) / total_steps
    decay = (1.0 - x) / (1.0 - warmup_frac)
    mult = jnp.where(x < warmup_frac, x / warmup_frac, decay) if warmup_frac > 0 else decay
    return peak * jnp.maximum(mult, 0.0)

  return schedule


class BertAdamState(NamedTuple):
  count: jax.Array
  mu: Any
  nu: Any


def _path_names(path) -> list[str]:
  return [str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path]


def _decayed(names: list[str]) -> bool:
  """The original's rule on its torch names: decay unless the name contains 'bias'. Our paths
  hold 'bias' exactly where its names do, except the decoder LayerNorms' bias, which densecap's
  LayerNorm calls `beta`: decayed (tests/parity_stage2_test.py checks every parameter)."""
  if names[0] == 'decoder' and names[-1] == 'bias' and names[-2].startswith('norm_'):
    return True
  return 'bias' not in '/'.join(names)


def decay_mask(params: Any) -> Any:
  """True where weight decay applies: the original's effective rule (`_decayed`): LayerNorm
  scales, image_mask, embeddings and the decoder LayerNorms' biases are decayed."""
  return jax.tree_util.tree_map_with_path(lambda path, _: _decayed(_path_names(path)), params)


def bert_adam(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
              eps: float = 1e-6, weight_decay: float = 0.01,
              mask: Callable[[Any], Any] | None = decay_mask) -> optax.GradientTransformation:
  """The original BertAdam (spec 5.5) as an optax transformation.

  m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2 (NO bias correction);
  update = -lr_t * (m / (sqrt(v) + eps) + wd * p [where mask(p)]), lr_t = schedule(step) with
  step counted from 0. (Its per-tensor clip to norm 1 is a no-op after the global clip.)
  """

  def init_fn(params):
    return BertAdamState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(jnp.zeros_like, params),
                         nu=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError('bert_adam needs the params (decoupled weight decay)')
    mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.nu, updates)
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    decays = mask(params) if mask is not None else jax.tree.map(lambda _: True, params)

    def one(m, v, p, decay):
      step = m / (jnp.sqrt(v) + eps)
      if decay and weight_decay:
        step = step + weight_decay * p
      return (-lr * step).astype(p.dtype)

    new = jax.tree.map(one, mu, nu, params, decays)
    return new, BertAdamState(count=state.count + 1, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def param_labels(params: Any) -> Any:
  """'frozen' (stage-1 heads), 'encoder' (rest of the encoder) or 'decoder' (MLP + decoder)."""

  def label(path, _):
    names = _path_names(path)
    if names[0] != 'encoder':
      return 'decoder'
    return 'frozen' if any(n in FROZEN_ENCODER_MODULES for n in names[1:]) else 'encoder'

  return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(config: ml_collections.ConfigDict,
                   total_steps: int) -> optax.GradientTransformation:
  """Global-norm clip, then BertAdam per group: encoder at lr_encoder, memory MLP and decoder
  at lr, the stage-1 heads frozen. t_total = total_steps * t_total_factor.

  DUDA (`caption.model.kind='duda'`): global-norm clip, then Adam (bias-corrected, decoupled
  decay `weight_decay`) at `lr` on the same warmup_linear schedule."""
  t = config.caption.train
  t_total = max(1, int(round(total_steps * t.t_total_factor)))
  if config_lib.caption_kind(config) == 'duda':
    return optax.chain(optax.clip_by_global_norm(t.clip), optax.adamw(
        warmup_linear(t.lr, t_total, t.warmup_frac), weight_decay=t.weight_decay))

  def group(lr):
    return bert_adam(warmup_linear(lr, t_total, t.warmup_frac), weight_decay=t.weight_decay)

  return optax.chain(
      optax.clip_by_global_norm(t.clip),
      optax.multi_transform({'encoder': group(t.lr_encoder), 'decoder': group(t.lr),
                             'frozen': optax.set_to_zero()}, param_labels))
