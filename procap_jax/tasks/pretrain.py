"""Stage 1, explicit procedure modeling: the `pretrain` Task (spec section 4).

Dimension legend: B batch, T frames, S image side, h x w token grid, N = h*w tokens per frame,
L caption length, D width, K codebook size, C tokenizer feature channels.

One step (the original's three transformer forwards, optionally fused into one of batch 3B):
  1. positive:  [REL] caption [ST1] [VID] + masked frame tokens -> L_msm logits, rel+, vid+
  2. rel-:      the same frame tokens with the control block swapped along the batch
  3. vid-:      corrupted clips (re-encoded by the frozen tokenizer), same mask and caption
With `binary_inputs='visible'` (not the original's) rel+, vid+, rel- and vid- come instead from
three forwards on unmasked frames (4 forwards, batch 4B fused); forward 1 only gives L_msm.
Losses:
  L_msm   = CE over the codebook on masked positions, token-level mean over the batch
  L_align = sum_i m_i [BCE(rel+_i, 1) + BCE(rel-_i, 0)] / max(1, sum_i m_i)
  L_csy   = [sum_i BCE(vid+_i, 1) + sum_i BCE(vid-_i, 0)] / max(1, sum_i m_i)   ('code')
            sum_i m_i [BCE(vid+_i, 1) + BCE(vid-_i, 0)] / max(1, sum_i m_i)   ('mean')
  L       = w_msm L_msm + w_align L_align + w_csy L_csy   (7 / 0.5 / 0.5)
with m_i = 0 for fully masked samples (and padding rows, valid=False).

The frozen tokenizer is reached through a small adapter object (`encode_features`,
`encode_tokens`), so tests can inject a fake one with `make_task(tokenizer_factory=...)`.
"""

from typing import Any, Callable, Iterable, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from procap_jax import checkpointing
from procap_jax import config_lib
from procap_jax import sharding
from procap_jax import train
from procap_jax.convert import init as convert_init
from procap_jax.data import pipeline
from procap_jax.models import procedure_encoder
from procap_jax.models import vqgan
from procap_jax.data import feature_cache
from procap_jax.tasks import corruptions
from procap_jax.models import encodings
from procap_jax.tasks import masking
from procap_jax.tasks import pretrain_optimizer

BINARY_INPUTS = ('masked', 'visible')  # what the match and consistency heads judge
RANK_TIE_RTOL, RANK_TIE_ATOL = 1e-5, 1e-6  # ties of the rank accuracies, to rounding
SUM_KEYS = ('msm_ce', 'msm_correct', 'msm_count', 'align_sum', 'included', 'match_correct',
            'match_pair_correct', 'match_rank_correct', 'csy_sum_all', 'csy_sum_included',
            'csy_correct', 'csy_pair_correct', 'csy_rank_correct')


class Tokenizer(Protocol):
  """The frozen tokenizer as seen by stage 1 (images float [M, S, S, 3] in [0, 1])."""

  def encode_features(self, params: Any, images: jax.Array) -> jax.Array:
    """-> continuous features [M, h, w, C]."""

  def encode_tokens(self, params: Any, images: jax.Array) -> jax.Array:
    """-> code indices int32 [M, h*w]."""


VQGANTokenizer = vqgan.Frozen


def vqgan_tokenizer(config: ml_collections.ConfigDict) -> vqgan.Frozen:
  """The real tokenizer: the frozen VQGAN(**config.tokenizer.model) in
  config.tokenizer.frozen_dtype."""
  return vqgan.frozen_from_config(config)


# ----------------------------------------------------------------------------- model and state


def build_model(config: ml_collections.ConfigDict) -> procedure_encoder.ProcedureEncoder:
  """ProcedureEncoder(**config.pretrain.model) computing in config.compute_dtype."""
  kwargs = config_lib.encoder_kwargs(config)
  if kwargs['text_vocab_size'] <= 0:
    raise ValueError('config.pretrain.model.text_vocab_size must be set (the caption '
                     'vocabulary size) before the encoder is built')
  return procedure_encoder.ProcedureEncoder(**kwargs, dtype=jnp.dtype(config.compute_dtype))


def init_params(model: procedure_encoder.ProcedureEncoder, config: ml_collections.ConfigDict,
                rng: jax.Array, batch: dict) -> Any:
  """Boxed (logically partitioned) parameters, initialised on a batch of one."""
  del config, batch
  h, w = model.grid
  text = jnp.zeros((1, model.text_len), jnp.int32)
  features = jnp.zeros((1, model.num_frames, h, w, model.feature_dim), jnp.float32)
  mask = jnp.zeros((1, model.num_frames, h * w), bool)
  return model.init(rng, text, features, mask, use_rel=True)['params']


def load_constants(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """The frozen tokenizer parameters of the finished tokenizer stage."""
  del config
  return {'tokenizer': checkpointing.load_stage_variables(workdir, 'tokenizer', which='best')[
      'params']}


# ----------------------------------------------------------------------------- losses


def swap_batch(x: jax.Array) -> jax.Array:
  """The original's control-block swap: even B exchanges the halves (sample i gets sample
  i + B/2 mod B); odd B uses the fixed non-identity rotation i -> i + 1 mod B."""
  b = x.shape[0]
  if b < 2:
    raise ValueError('the caption-alignment negatives need a batch of at least 2')
  return jnp.roll(x, b // 2 if b % 2 == 0 else -1, axis=0)


def batch_statistics(params: Any, tokenizer_params: Any, batch: dict, rng: jax.Array,
                     config: ml_collections.ConfigDict, model: nn.Module,
                     tokenizer: Tokenizer) -> dict:
  """Sums over the batch from which every loss and accuracy follows (`losses_from_sums`).

  Sums (not means) so evaluation can pool batches exactly. Padding rows (valid=False)
  contribute nothing.

  Args:
    params: encoder parameters.
    tokenizer_params: frozen tokenizer parameters.
    batch: the batch contract; uses keyframes [B, T, S, S, 3] uint8, encoder_text [B, L],
      valid [B], and the feature cache's keyframe_features and keyframe_codes when present.
    rng: PRNG key (masks and corruptions).
    config: the run config (config.pretrain).
    model: the ProcedureEncoder.
    tokenizer: see `Tokenizer`.

  Returns:
    dict of float32 scalars keyed by SUM_KEYS.
  """
  out = batch_logits(params, tokenizer_params, batch, rng, config, model, tokenizer)
  return statistics_from_logits(out['frame_logits'], out['codes'], out['token_mask'],
                                out['fully_masked'], jnp.asarray(batch['valid'], bool),
                                out['rel_pos'], out['rel_neg'], out['vid_pos'], out['vid_neg'])


def batch_logits(params: Any, tokenizer_params: Any, batch: dict, rng: jax.Array,
                 config: ml_collections.ConfigDict, model: nn.Module,
                 tokenizer: Tokenizer) -> dict:
  """The stage-1 forwards of a batch (arguments as `batch_statistics`, which sums these).

  Draws the masks and corruptions from `rng`, encodes the clean and corrupted clips with the
  frozen tokenizer (the clean ones read from the feature cache when the batch carries it) and
  runs `forward_logits` on them.

  Returns:
    dict with frame_logits [B, T*N, K] of the reconstruction forward, codes int32 [B, T*N]
    (its targets), token_mask bool [B, T*N] (True = masked), fully_masked bool [B], the head
    logits rel_pos, rel_neg (own and swapped caption), vid_pos, vid_neg (clean and corrupted
    clip), each [B], and corruption int32 [B] (index into `corruptions.KINDS`).
  """
  x = forward_inputs(tokenizer_params, batch, rng, config, tokenizer)
  out = forward_logits(params, config, model, x['text'], x['features'], x['features_neg'],
                       x['mask'], x['fully_masked'])
  return dict(out, codes=x['codes'], corruption=x['corruption'])


def forward_inputs(tokenizer_params: Any, batch: dict, rng: jax.Array,
                   config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> dict:
  """What the stage-1 forwards of a batch take, none of it depending on the encoder: the masks
  and corruptions drawn from `rng` and the frozen tokenizer's encodings (arguments as
  `batch_statistics`).

  Returns:
    dict with text int32 [B, L], features and features_neg [B, T, h, w, C] (clean and
    corrupted clips), mask bool [B, T, N], fully_masked bool [B], codes int32 [B, T*N] and
    corruption int32 [B].
  """
  frames = encodings.images01(batch['keyframes'])  # [B, T, S, S, 3]
  text = jnp.asarray(batch['encoder_text'], jnp.int32)  # [B, L]
  b = frames.shape[0]
  k_mask, k_corrupt = jax.random.split(rng)

  # [B, T, h, w, C], [B, T, N]
  features, codes = encodings.clip_encodings(tokenizer, tokenizer_params, batch, frames)
  codes = codes.reshape(b, -1)  # [B, T*N]
  masks = masking.sample_masks_from_config(k_mask, b, config)
  # The corrupted clips' features: 'replace' and 'shuffle' only move frames, so their features
  # are gathered; 'colour' and 'affine' change one frame, the only one encoded (1 frame per
  # sample instead of T; the same values as encoding the whole corrupted clip). The cache
  # cannot hold it: the change is drawn every step.
  features_neg, kind = corruptions.corrupt_encoded_from_config(
      k_corrupt, frames, features,
      lambda images: jax.lax.stop_gradient(tokenizer.encode_features(tokenizer_params, images)),
      config)
  return dict(text=text, features=features, features_neg=features_neg, mask=masks.mask,
              fully_masked=masks.fully_masked, codes=codes, corruption=kind)


def forward_logits(params: Any, config: ml_collections.ConfigDict, model: nn.Module,
                   text: jax.Array, features: jax.Array, features_neg: jax.Array,
                   mask: jax.Array, fully_masked: jax.Array,
                   text_swapped: jax.Array | None = None) -> dict:
  """The stage-1 forwards on explicit inputs (what `batch_logits` samples and encodes).

  Args:
    params: encoder parameters.
    config: the run config (config.pretrain.binary_inputs, fused_forwards).
    model: the ProcedureEncoder.
    text: int32 [B, L] caption ids (0 = padding).
    features: [B, T, h, w, C] tokenizer features of the clips.
    features_neg: [B, T, h, w, C] features of the corrupted clips.
    mask: bool [B, T, N], True = masked.
    fully_masked: bool [B], samples excluded from the binary losses' divisor.
    text_swapped: int32 [B, L], the alignment negatives' captions; None = `swap_batch(text)`
      (a micro-batch passes its rows of the whole batch's swap).

  Returns:
    dict with frame_logits [B, T*N, K], token_mask bool [B, T*N], fully_masked bool [B] (all
    False with binary_inputs='visible'), rel_pos, rel_neg, vid_pos, vid_neg [B].
  """
  b = text.shape[0]
  if text_swapped is None:
    text_swapped = swap_batch(text)
  inputs = config.pretrain.binary_inputs
  if inputs not in BINARY_INPUTS:
    raise ValueError(f'config.pretrain.binary_inputs must be one of {BINARY_INPUTS}, '
                     f'got {inputs!r}')
  # Forwards as (text, features, mask): the original takes the match and consistency positives
  # from the masked reconstruction forward and gives the negatives the same mask ('masked');
  # 'visible' judges all three on unmasked frames, in a separate positive forward.
  clear = jnp.zeros_like(mask)
  if inputs == 'masked':
    forwards = [(text, features, mask), (text_swapped, features, mask),
                (text, features_neg, mask)]
  else:
    forwards = [(text, features, mask), (text, features, clear), (text_swapped, features, clear),
                (text, features_neg, clear)]
  fully_masked = binary_fully_masked(config, fully_masked)
  if config.pretrain.fused_forwards:
    out = model.apply({'params': params}, *(jnp.concatenate(x) for x in zip(*forwards)),
                      use_rel=True)
    outs = [jax.tree.map(lambda x, i=i: x[i * b:(i + 1) * b], out) for i in range(len(forwards))]
  else:
    outs = [model.apply({'params': params}, *f, use_rel=True) for f in forwards]
  pos, neg_rel, neg_vid = outs[-3:]
  return dict(frame_logits=outs[0]['frame_logits'], token_mask=mask.reshape(b, -1),
              fully_masked=fully_masked, rel_pos=pos['rel_logit'], rel_neg=neg_rel['rel_logit'],
              vid_pos=pos['vid_logit'], vid_neg=neg_vid['vid_logit'])


def binary_fully_masked(config: Any, fully_masked: jax.Array) -> jax.Array:
  """bool [B]: the samples the binary losses leave out of their divisor. With
  binary_inputs='masked' those whose frames the masking hid entirely (`fully_masked`); with
  'visible' none, since no binary decision sees a masked frame."""
  if config.pretrain.binary_inputs == 'visible':
    return jnp.zeros_like(fully_masked)
  return fully_masked


def statistics_from_logits(frame_logits: jax.Array, codes: jax.Array, token_mask: jax.Array,
                           fully_masked: jax.Array, valid: jax.Array, rel_pos: jax.Array,
                           rel_neg: jax.Array, vid_pos: jax.Array, vid_neg: jax.Array) -> dict:
  """The SUM_KEYS sums from the heads' outputs.

  Args:
    frame_logits: [B, T*N, K] masked-token logits of the positive forward.
    codes: int [B, T*N] target codes.
    token_mask: bool [B, T*N], True = masked (a prediction target).
    fully_masked: bool [B].
    valid: bool [B]; False rows contribute nothing.
    rel_pos, rel_neg: [B] [REL] logits of the matched and swapped captions.
    vid_pos, vid_neg: [B] [VID] logits of the clean and corrupted clips.
  """
  token_mask = (token_mask & valid[:, None]).astype(jnp.float32)  # [B, T*N]
  ce = optax.softmax_cross_entropy_with_integer_labels(frame_logits, codes)  # [B, T*N]
  correct = (jnp.argmax(frame_logits, -1) == codes).astype(jnp.float32)  # [B, T*N]
  included = (valid & ~fully_masked).astype(jnp.float32)  # [B]
  validf = valid.astype(jnp.float32)
  bce = optax.sigmoid_binary_cross_entropy
  align = bce(rel_pos, jnp.ones_like(rel_pos)) + bce(rel_neg, jnp.zeros_like(rel_neg))  # [B]
  csy = bce(vid_pos, jnp.ones_like(vid_pos)) + bce(vid_neg, jnp.zeros_like(vid_neg))  # [B]
  # Per decision (positive and negative counted separately; chance 0.5) and per pair (both
  # right; chance 0.25).
  match = (rel_pos > 0).astype(jnp.float32) + (rel_neg < 0).astype(jnp.float32)  # [B] 0..2
  match_pair = ((rel_pos > 0) & (rel_neg < 0)).astype(jnp.float32)  # [B]
  consistent = (vid_pos > 0).astype(jnp.float32) + (vid_neg < 0).astype(jnp.float32)  # [B]
  consistent_pair = ((vid_pos > 0) & (vid_neg < 0)).astype(jnp.float32)  # [B]
  # Rank sums are threshold-free (chance 0.5): a head can rank right, all logits one side of 0.
  return dict(
      msm_ce=jnp.sum(ce * token_mask), msm_correct=jnp.sum(correct * token_mask),
      msm_count=jnp.sum(token_mask), align_sum=jnp.sum(align * included),
      included=jnp.sum(included), match_correct=jnp.sum(match * included),
      match_pair_correct=jnp.sum(match_pair * included),
      match_rank_correct=jnp.sum(rank_credit(rel_pos, rel_neg) * included),
      csy_sum_all=jnp.sum(csy * validf), csy_sum_included=jnp.sum(csy * included),
      csy_correct=jnp.sum(consistent * included),
      csy_pair_correct=jnp.sum(consistent_pair * included),
      csy_rank_correct=jnp.sum(rank_credit(vid_pos, vid_neg) * included))


def rank_credit(pos: jax.Array, neg: jax.Array) -> jax.Array:
  """Per sample: 1 if the positive scores above its own negative, 0 below, 0.5 for a tie within
  rounding (RANK_TIE_*: equal logits can come out an ulp apart by the CPU's kernels)."""
  return jnp.where(jnp.isclose(pos, neg, rtol=RANK_TIE_RTOL, atol=RANK_TIE_ATOL), 0.5,
                   (pos > neg).astype(jnp.float32))


def losses_from_sums(sums: dict, config: ml_collections.ConfigDict) -> dict:
  """Losses, total and accuracies from `batch_statistics` sums (jnp or numpy scalars).

  Accuracies over the included (not fully masked, valid) samples: masked-token top-1
  (`msm_acc`); match and consistency as binary classifiers, each positive and each negative one
  decision (`match_acc`, `csy_acc`: chance 0.5); and per pair, both decisions right
  (`match_pair_acc`: rel+ > 0 and rel- < 0, `csy_pair_acc` likewise; chance 0.25); and
  threshold-free, the positive above its own negative (`match_rank_acc`: rel+ > rel-,
  `csy_rank_acc`: vid+ > vid-; ties, to rounding, count half; chance 0.5).
  """
  norm = config.pretrain.csy_normalisation
  if norm not in ('code', 'mean'):
    raise ValueError(f"config.pretrain.csy_normalisation must be 'code' or 'mean', got {norm!r}")
  tokens = jnp.maximum(1.0, sums['msm_count'])
  included = jnp.maximum(1.0, sums['included'])
  csy_sum = sums['csy_sum_all'] if norm == 'code' else sums['csy_sum_included']
  out = dict(loss_msm=sums['msm_ce'] / tokens, loss_align=sums['align_sum'] / included,
             loss_csy=csy_sum / included, msm_acc=sums['msm_correct'] / tokens,
             match_acc=sums['match_correct'] / (2.0 * included),
             csy_acc=sums['csy_correct'] / (2.0 * included),
             # before the pair figures: the console's val line shows the first eight metrics
             match_rank_acc=sums['match_rank_correct'] / included,
             csy_rank_acc=sums['csy_rank_correct'] / included,
             match_pair_acc=sums['match_pair_correct'] / included,
             csy_pair_acc=sums['csy_pair_correct'] / included)
  w = config.pretrain.loss_weights
  out['loss'] = w.msm * out['loss_msm'] + w.align * out['loss_align'] + w.csy * out['loss_csy']
  return out


def micro_batched_value_and_grad(params: Any, tokenizer_params: Any, batch: dict,
                                 rng: jax.Array, config: ml_collections.ConfigDict,
                                 model: nn.Module, tokenizer: Tokenizer,
                                 micro_batches: int) -> tuple[tuple[jax.Array, dict], Any]:
  """The loss, its metrics and gradients of a batch, the encoder run `micro_batches` rows at a
  time (gradient accumulation in a `lax.scan`): the same values as one pass over the batch.

  Everything that couples rows is drawn for the whole batch first (masks, corruptions, the
  swapped captions of the alignment negatives, the frozen encodings), and the losses'
  divisors (masked tokens, included samples) are the whole batch's, so the micro-batches'
  losses add up to the batch's loss and their gradients to its gradient. Micro-batch j takes
  rows j, j + M, j + 2M, ... (M = micro_batches), which keeps a batch sharded over devices
  evenly spread over the micro-batches.

  Args:
    params, tokenizer_params, batch, rng, config, model, tokenizer: as `batch_statistics`.
    micro_batches: M, dividing the batch size.

  Returns:
    ((loss, metrics as `losses_from_sums`), gradients like `params`).
  """
  x = forward_inputs(tokenizer_params, batch, rng, config, tokenizer)
  valid = jnp.asarray(batch['valid'], bool)  # [B]
  b, m = valid.shape[0], micro_batches
  fully_masked = binary_fully_masked(config, x['fully_masked'])
  # The whole batch's divisors (what losses_from_sums would read from the summed statistics).
  divisors = dict(msm_count=jnp.sum(x['mask'].reshape(b, -1) & valid[:, None]).astype(jnp.float32),
                  included=jnp.sum(valid & ~fully_masked).astype(jnp.float32))
  rows = dict(text=x['text'], text_swapped=swap_batch(x['text']), features=x['features'],
              features_neg=x['features_neg'], mask=x['mask'], fully_masked=x['fully_masked'],
              codes=x['codes'], valid=valid)
  rows = train.micro_batch_rows(rows, m)

  def micro_loss(p, r):
    out = forward_logits(p, config, model, r['text'], r['features'], r['features_neg'],
                         r['mask'], r['fully_masked'], text_swapped=r['text_swapped'])
    sums = statistics_from_logits(out['frame_logits'], r['codes'], out['token_mask'],
                                  out['fully_masked'], r['valid'], out['rel_pos'],
                                  out['rel_neg'], out['vid_pos'], out['vid_neg'])
    return losses_from_sums(dict(sums, **divisors), config)['loss'], sums

  grads, sums = train.accumulate_gradients(
      micro_loss, params, rows, {key: jnp.zeros((), jnp.float32) for key in SUM_KEYS})
  metrics = losses_from_sums(sums, config)
  return (metrics['loss'], metrics), grads


# The optimiser lives in pretrain_optimizer.py; its two names stay reachable from here.
learning_rate = pretrain_optimizer.learning_rate
make_optimizer = pretrain_optimizer.make_optimizer


# ----------------------------------------------------------------------------- task


_statistics_jit = jax.jit(batch_statistics, static_argnames=('config', 'model', 'tokenizer'))
_EVAL_KEYS = ('keyframes', 'encoder_text', 'valid') + feature_cache.KEYS  # the last if present


def evaluate_batches(params: Any, tokenizer_params: Any, config: ml_collections.ConfigDict,
                     model: nn.Module, tokenizer: Tokenizer, batches: Iterable[dict]) -> dict:
  """Pools `batch_statistics` over `batches` with a fixed key per batch index -> floats."""
  frozen = ml_collections.FrozenConfigDict(config)
  totals = {k: 0.0 for k in SUM_KEYS}
  for i, batch in enumerate(batches):
    rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), i)
    inputs = sharding.place_eval_batch({k: batch[k] for k in _EVAL_KEYS if k in batch}, config)
    with sharding.eval_context(config):
      sums = _statistics_jit(params, tokenizer_params, inputs, rng,
                             config=frozen, model=model, tokenizer=tokenizer)
    for k, v in jax.device_get(sums).items():
      totals[k] += float(v)
  return {k: float(v) for k, v in losses_from_sums(
      {k: np.float64(v) for k, v in totals.items()}, config).items()}


def eval_batches(config: ml_collections.ConfigDict, split: str, workdir: str,
                 num_batches: int, cache: feature_cache.FeatureCache | None = None
                 ) -> Iterable[dict]:
  """Stage-1 evaluation batches of `split` (`num_batches` 0 = all) in the fixed shuffled order,
  so a no-change clip's swapped caption is not always another no-change caption; with `cache`
  they carry its encodings."""
  return pipeline.make_eval_iterator(config, split, workdir, int(config.pretrain.train.batch_size),
                                     num_batches=num_batches, shuffled=True, cache=cache)


def make_task(tokenizer_factory: Callable[[ml_collections.ConfigDict], Tokenizer] = vqgan_tokenizer
              ) -> train.Task:
  """The pretrain Task, with the frozen tokenizer built by `tokenizer_factory(config)`."""

  def loss_fn(params, model_state, constants, batch, rng, config, model):
    sums = batch_statistics(params, constants['tokenizer'], batch, rng, config, model,
                            tokenizer_factory(config))
    metrics = losses_from_sums(sums, config)
    return metrics['loss'], (metrics, model_state)

  value_and_grad = train.micro_batched(
      'pretrain', loss_fn, lambda params, constants, batch, rng, config, model, m:
      micro_batched_value_and_grad(params, constants['tokenizer'], batch, rng, config, model,
                                   tokenizer_factory(config), m))

  def evaluate(state, constants, config, model, split, workdir, *, batches=None):
    if batches is None:
      cache = feature_cache.load(config, workdir, constants['tokenizer'])
      batches = eval_batches(config, split, workdir, config.pretrain.train.eval_batches, cache)
    return evaluate_batches(nn.meta.unbox(state.params), constants['tokenizer'], config, model,
                            tokenizer_factory(config), batches)

  return train.Task(name='pretrain', build_model=build_model, init_params=init_params,
                    loss_fn=loss_fn, value_and_grad=value_and_grad,
                    make_optimizer=pretrain_optimizer.make_optimizer, evaluate=evaluate,
                    load_constants=load_constants, feature_cache=tokenizer_factory,
                    restore_init=lambda params, config, workdir: convert_init.restore(
                        'pretrain', params, config))


TASK = make_task()
