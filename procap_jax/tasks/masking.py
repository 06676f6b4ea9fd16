"""Stage-1 mask strategies for masked token reconstruction (pure jax, one strategy per sample).

Dimension legend: B batch, T frames, h x w token grid, N = h*w tokens per frame.

Strategies (index: name), drawn per sample with `strategy_probs` (the original's
`--msm_strategy_prob` 7,1,1,1 plus our optional stage-2 pattern, spec 4.3):
  0 random   keep each token with probability p_keep ~ U(keep_prob_range), mask the rest
  1 all      mask every token of every frame
  2 in_box   one RandomErasing rectangle, masked at the same place in every frame
  3 out_box  everything except such a rectangle
  4 stage2   first and last frame visible, intermediate frames fully masked (the stage-2 input)
The mask always spans all T frames (before and after included), as the original.
"""

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from procap_jax import config_lib

STRATEGIES = ('random', 'all', 'in_box', 'out_box', 'stage2')


class Masks(NamedTuple):
  mask: jax.Array          # bool [B, T, N], True = masked (input replaced by image_mask)
  fully_masked: jax.Array  # bool [B], every token masked (excluded from L_align)
  strategy: jax.Array      # int32 [B], index into STRATEGIES


def random_box(rng: jax.Array, grid: tuple[int, int], scale: Sequence[float],
               ratio: Sequence[float], tries: int = 10) -> jax.Array:
  """One torchvision RandomErasing(p=1) rectangle on an h x w grid, vectorised.

  torchvision tries up to `tries` times: area = h*w*U(scale), aspect = exp(U(log ratio)),
  bh = round(sqrt(area*aspect)), bw = round(sqrt(area/aspect)); a try fits when bh < h and
  bw < w, then the top-left corner is uniform over the valid positions. If no try fits nothing
  is erased. Here all tries are drawn at once and the first fitting one is used, which has the
  same distribution.

  Args:
    rng: PRNG key.
    grid: (h, w).
    scale: (min, max) fraction of the grid area.
    ratio: (min, max) aspect ratio bh / bw, sampled log-uniformly.
    tries: number of candidate rectangles.

  Returns:
    bool [h, w], True inside the rectangle (all False when no candidate fits).
  """
  h, w = grid
  k_area, k_ratio, k_i, k_j = jax.random.split(rng, 4)
  area = h * w * jax.random.uniform(k_area, (tries,), minval=scale[0], maxval=scale[1])
  log_r = jax.random.uniform(k_ratio, (tries,), minval=jnp.log(ratio[0]),
                             maxval=jnp.log(ratio[1]))
  aspect = jnp.exp(log_r)
  bh = jnp.round(jnp.sqrt(area * aspect)).astype(jnp.int32)  # [tries], half to even as Python
  bw = jnp.round(jnp.sqrt(area / aspect)).astype(jnp.int32)  # [tries]
  fits = (bh < h) & (bw < w)
  first = jnp.argmax(fits)
  bh, bw = bh[first], bw[first]
  # torch.randint(0, h - bh + 1): uniform integer top-left corner.
  i = jnp.floor(jax.random.uniform(k_i) * (h - bh + 1)).astype(jnp.int32)
  j = jnp.floor(jax.random.uniform(k_j) * (w - bw + 1)).astype(jnp.int32)
  rows = jnp.arange(h)[:, None]
  cols = jnp.arange(w)[None, :]
  inside = (rows >= i) & (rows < i + bh) & (cols >= j) & (cols < j + bw)  # [h, w]
  return inside & fits.any()


def sample_masks(rng: jax.Array, batch_size: int, num_frames: int, grid: tuple[int, int], *,
                 strategy_probs: Sequence[float], keep_prob_range: Sequence[float] = (0.2, 0.2),
                 box_scale: Sequence[float] = (0.2, 0.8), box_ratio: Sequence[float] = (0.5, 2.0),
                 tries: int = 10) -> Masks:
  """Draws one mask per sample over all T frames.

  Args:
    rng: PRNG key.
    batch_size: B.
    num_frames: T.
    grid: (h, w) tokens per frame side.
    strategy_probs: 4 or 5 non-negative weights for STRATEGIES (normalised here).
    keep_prob_range: (lo, hi) of the per-sample keep probability of strategy 'random'.
    box_scale: RandomErasing area range (fraction of h*w).
    box_ratio: RandomErasing aspect ratio range.
    tries: RandomErasing attempts.

  Returns:
    Masks(mask bool [B, T, N], fully_masked bool [B], strategy int32 [B]).
  """
  probs = jnp.asarray(tuple(strategy_probs) + (0.0,) * (len(STRATEGIES) - len(strategy_probs)),
                      jnp.float32)
  if probs.shape[0] != len(STRATEGIES):
    raise ValueError(f'strategy_probs has {len(strategy_probs)} entries; at most '
                     f'{len(STRATEGIES)} ({", ".join(STRATEGIES)})')
  h, w = grid
  n = h * w
  k_strategy, k_keep, k_bern, k_box = jax.random.split(rng, 4)
  strategy = jax.random.choice(k_strategy, len(STRATEGIES), (batch_size,),
                               p=probs / probs.sum()).astype(jnp.int32)

  keep = jax.random.uniform(k_keep, (batch_size, 1, 1), minval=keep_prob_range[0],
                            maxval=keep_prob_range[1])
  random_mask = jax.random.uniform(k_bern, (batch_size, num_frames, n)) >= keep  # [B, T, N]
  box = jax.vmap(lambda k: random_box(k, grid, box_scale, box_ratio, tries))(
      jax.random.split(k_box, batch_size))  # [B, h, w]
  box = jnp.broadcast_to(box.reshape(batch_size, 1, n), (batch_size, num_frames, n))  # [B, T, N]
  middle = (jnp.arange(num_frames) > 0) & (jnp.arange(num_frames) < num_frames - 1)  # [T]
  stage2 = jnp.broadcast_to(middle[None, :, None], (batch_size, num_frames, n))  # [B, T, N]
  candidates = jnp.stack([random_mask, jnp.ones_like(random_mask), box, ~box, stage2])
  mask = jnp.take_along_axis(candidates, strategy[None, :, None, None], axis=0)[0]  # [B, T, N]
  return Masks(mask=mask, fully_masked=mask.all(axis=(1, 2)), strategy=strategy)


def sample_masks_from_config(rng: jax.Array, batch_size: int, config) -> Masks:
  """`sample_masks` with `config.pretrain.masking` and the encoder's T and grid."""
  m = config.pretrain.masking
  model = config.pretrain.model
  return sample_masks(rng, batch_size, config_lib.frame_slots(config), tuple(model.grid),
                      strategy_probs=tuple(m.strategy_probs),
                      keep_prob_range=tuple(m.keep_prob_range), box_scale=tuple(m.box_scale),
                      box_ratio=tuple(m.box_ratio))
