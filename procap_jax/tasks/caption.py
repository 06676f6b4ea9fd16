"""Stage 2, implicit procedure captioning: the `caption` Task (spec sections 5-7).

Dimension legend: B batch, S image side, h x w tokenizer grid, C feature channels, k procedure-
query frames, N = h*w tokens per frame, L caption length, V vocab, M memory length, H decoder
width.

One step: before/after images -> frozen tokenizer features [B, h, w, C] -> captioner (encoder
with procedure queries, memory MLP, decoder) -> teacher-forced logits [B, L, V] ->
label-smoothed KL summed over the valid target positions (the original's `LabelSmoothingLoss`).
Optimiser: the original's BertAdam (no bias correction, decoupled decay except on 'bias'
parameters) with the warmup_linear schedule, the encoder at `lr_encoder`, the memory MLP and
decoder at `lr`, the stage-1 heads frozen, global-norm clipping. docs/fidelity.md lists every
departure from the original and its switch.

The frozen tokenizer is reached through a small adapter (`encode_features`, `decode_tokens`), so
tests inject a fake one with `make_task(tokenizer_factory=...)`.

`config.caption.model.kind='duda'` trains the field's baseline instead (`models/duda.py`) in the
same pipeline (data, selection on val, test evaluation, results, report): on the tokenizer's
features, or on the pixels through its own patch stem (`caption.model.duda.input`), with Adam.
"""

import functools
import os
from typing import Any, Callable

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from procap_jax import checkpointing
from procap_jax import config_lib
from procap_jax import errors
from procap_jax import evaluation
from procap_jax import semantic_scores
from procap_jax import sharding
from procap_jax import train
from procap_jax.convert import init as convert_init
from procap_jax.data import feature_cache
from procap_jax.data import pipeline
from procap_jax.data import vocab as vocab_lib
from procap_jax.models import captioner as captioner_lib
from procap_jax.models import duda as duda_lib
from procap_jax.models import vqgan
from procap_jax.tasks import caption_loss
from procap_jax.tasks import caption_optimizer
from procap_jax.models import encodings

# Stage-1 heads that stay frozen in stage 2 (the original's `skip_params`, spec 5.1).
# The axial frame-position table of the encoder ([T, 1, 1, D]); see `restore_pretrained_encoder`.
_FRAME_POSITIONS = ('target_pos_emb', 'weights_0')


FrozenTokenizer = vqgan.Frozen


def vqgan_tokenizer(config: ml_collections.ConfigDict) -> vqgan.Frozen:
  """The real tokenizer: the frozen VQGAN(**config.tokenizer.model) in
  config.tokenizer.frozen_dtype."""
  return vqgan.frozen_from_config(config)


# ----------------------------------------------------------------------------- model and params


def build_model(config: ml_collections.ConfigDict) -> nn.Module:
  """The ProCapModel of `config.caption.model` around `ProcedureEncoder(**config.pretrain.model)`,
  or DUDA (`caption.model.kind='duda'`).

  Without procedure queries the encoder has T = 2 frame slots (before, after).
  """
  m = config.caption.model
  if m.vocab_size <= 0:
    raise ValueError('config.caption.model.vocab_size must be set (the caption vocabulary size) '
                     'before the captioner is built')
  if config_lib.caption_kind(config) == 'duda':
    return duda_lib.from_config(config)
  return captioner_lib.from_config(config)


def pair_inputs(model: nn.Module, tokenizer: FrozenTokenizer, tokenizer_params: Any,
                batch: dict) -> tuple[jax.Array, jax.Array]:
  """The captioner's before/after inputs: frozen features [B, h, w, C] each
  (`encodings.pair_features`), or for DUDA on pixels the images [B, S, S, 3] in [0, 1] (a
  `share_before` batch's halved `before` repeated to rows 2i and 2i + 1)."""
  if not (isinstance(model, duda_lib.Duda) and model.from_pixels):
    return encodings.pair_features(tokenizer, tokenizer_params, batch)
  before, after = jnp.asarray(batch['before']), jnp.asarray(batch['after'])
  if before.shape[0] != after.shape[0]:
    before = jnp.repeat(before, 2, axis=0)
  return encodings.images01(before), encodings.images01(after)


def init_params(model: captioner_lib.ProCapModel, config: ml_collections.ConfigDict,
                rng: jax.Array, batch: dict, workdir: str | None = None) -> Any:
  """Boxed parameters; the encoder from the stage-1 checkpoint when `init_from_pretrain`.

  Args:
    model: the ProCapModel (or DUDA).
    config: the resolved config.
    rng: init rng.
    batch: a batch of the contract (only `caption_in`'s length is used).
    workdir: the run's workdir (needed to find the stage-1 checkpoint).
  """
  gh, gw = config.pretrain.model.grid
  feats = jnp.zeros([1, gh, gw, config.pretrain.model.feature_dim], jnp.float32)
  if isinstance(model, duda_lib.Duda) and model.from_pixels:
    feats = jnp.zeros([1, config.data.image_size, config.data.image_size, 3], jnp.float32)
  tokens = jnp.asarray(batch['caption_in'][:1], jnp.int32)
  params = model.init(rng, feats, feats, tokens)['params']
  if config_lib.caption_kind(config) == 'duda':
    return params
  if config.caption.init_from_pretrain and workdir is not None:
    params = restore_pretrained_encoder(params, workdir)
  return params


def restore_init(params: Any, config: ml_collections.ConfigDict, workdir: str) -> Any:
  """The trainer's hook after a fresh init: the whole captioner from `caption.init_from` (a
  released ProCap stage-2 checkpoint) when set, else the stage-1 encoder when
  `init_from_pretrain`."""
  if config_lib.caption_kind(config) == 'duda':
    return params
  if config.caption.init_from:
    return convert_init.restore('caption', params, config)
  if not config.caption.init_from_pretrain:
    return params
  return restore_pretrained_encoder(params, workdir)


def restore_pretrained_encoder(params: Any, workdir: str) -> Any:
  """Replaces `params['encoder']` (boxed or not) by the stage-1 checkpoint's parameters.

  Every leaf must exist in the checkpoint with the same shape, except the frame-position table:
  an encoder with 2 frame slots (no procedure queries) takes the checkpoint's first and LAST
  frame rows, so before/after keep the positions they had in stage 1.

  Raises:
    UserError: no stage-1 checkpoint, or one trained with another encoder config.
  """
  try:
    stage1 = checkpointing.load_stage_variables(workdir, 'pretrain')['params']
  except errors.UserError:
    raise errors.UserError(
        f'stage 2 starts from the stage-1 encoder, but {os.path.join(workdir, "pretrain")} has no '
        'checkpoint; run the pretrain stage first (or set config.caption.init_from_pretrain=False)'
    ) from None
  ours = flax.traverse_util.flatten_dict(dict(params['encoder']))
  theirs = flax.traverse_util.flatten_dict(dict(stage1))
  problems = [f'{"/".join(p)} missing' for p in ours if p not in theirs]
  problems += [f'{"/".join(p)} unexpected' for p in theirs if p not in ours]
  restored = {}
  for path, leaf in ours.items():
    if path not in theirs:
      continue
    value = np.asarray(theirs[path])
    shape = tuple(nn.meta.unbox(leaf).shape)
    if path == _FRAME_POSITIONS and shape[0] == 2 and value.shape[0] > 2:
      value = value[[0, -1]]  # [2, 1, 1, D]: the before and after rows
    if value.shape != shape:
      problems.append(f'{"/".join(path)} has shape {value.shape}, expected {shape}')
      continue
    value = jnp.asarray(value, nn.meta.unbox(leaf).dtype)
    restored[path] = leaf.replace_boxed(value) if isinstance(leaf, nn.meta.AxisMetadata) else value
  if problems:
    raise errors.UserError(
        'the stage-1 checkpoint does not fit this encoder (' + '; '.join(problems[:4])
        + (' ...' if len(problems) > 4 else '') + '); rerun the pretrain stage with this '
        'config.pretrain.model or use its workdir')
  params = dict(params)
  params['encoder'] = flax.traverse_util.unflatten_dict(restored)
  return params


def load_constants(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """The frozen tokenizer parameters of the finished tokenizer stage ({} for DUDA on pixels,
  which reads no tokenizer)."""
  if not config_lib.reads_tokenizer(config):
    return {'tokenizer': {}}
  return {'tokenizer': checkpointing.load_stage_variables(workdir, 'tokenizer')['params']}


# ----------------------------------------------------------------------------- loss


def _batch_labels(batch: dict) -> jax.Array:
  """Teacher-forcing targets [B, L] of the batch's captions, all ignored on padding rows."""
  labels = caption_loss.teacher_forcing_labels(jnp.asarray(batch['caption_in'], jnp.int32))
  return jnp.where(jnp.asarray(batch['valid'])[:, None], labels, vocab_lib.IGNORE)


def _rows(model: nn.Module, tokenizer: FrozenTokenizer, tokenizer_params: Any,
          batch: dict) -> tuple[dict, jax.Array, jax.Array]:
  """(the forward's rows, the batch's target words, its valid pairs), both counts >= 1."""
  before, after = pair_inputs(model, tokenizer, tokenizer_params, batch)
  rows = dict(before=before, after=after, tokens=jnp.asarray(batch['caption_in'], jnp.int32),
              labels=_batch_labels(batch), change_type=jnp.asarray(batch['change_type'],
                                                                   jnp.int32),
              valid=jnp.asarray(batch['valid'], bool))
  words = jnp.maximum(jnp.sum(rows['labels'] != vocab_lib.IGNORE).astype(jnp.float32), 1.0)
  pairs = jnp.maximum(jnp.sum(rows['valid']).astype(jnp.float32), 1.0)
  return rows, words, pairs


def batch_loss(params: Any, tokenizer_params: Any, batch: dict, rng: jax.Array,
               config: ml_collections.ConfigDict, model: nn.Module,
               tokenizer: FrozenTokenizer) -> tuple[jax.Array, dict]:
  """(loss, metrics) of a training batch; loss is the summed KL ('sum') or per word ('mean'),
  plus `caption.train.change_loss` times the change head's loss.

  The before/after features come from the feature cache when the batch carries it."""
  t = config.caption.train
  rows, words, pairs = _rows(model, tokenizer, tokenizer_params, batch)
  sums = caption_loss.forward_sums(params, model, rows, rng, t)
  loss = caption_loss.reduce(sums, t.loss_reduction, t.change_loss, words, pairs)
  return loss, caption_loss.metrics(sums, pairs)


def micro_batched_value_and_grad(params: Any, tokenizer_params: Any, batch: dict,
                                 rng: jax.Array, config: ml_collections.ConfigDict,
                                 model: nn.Module, tokenizer: FrozenTokenizer,
                                 micro_batches: int) -> tuple[tuple[jax.Array, dict], Any]:
  """`batch_loss` and its gradients with the captioner run `micro_batches` rows at a time
  (gradient accumulation in a `lax.scan`).

  The frozen features are computed for the whole batch first; 'mean' divides by the whole
  batch's word (and pair) count. So the loss, metrics and gradients are the batch's, except that
  dropout draws its masks per micro-batch (`jax.random.fold_in(rng, j)`): other masks from the
  same distribution. Micro-batch j takes rows j, j + M, j + 2M, ... (M = micro_batches).

  Returns:
    ((loss, metrics as `batch_loss`), gradients like `params`).
  """
  t = config.caption.train
  rows, words, pairs = _rows(model, tokenizer, tokenizer_params, batch)
  rows = dict(train.micro_batch_rows(rows, micro_batches),
              key=jnp.arange(micro_batches, dtype=jnp.int32))

  def micro_loss(p, r):
    sums = caption_loss.forward_sums(p, model, r, jax.random.fold_in(rng, r['key']), t)
    return caption_loss.reduce(sums, t.loss_reduction, t.change_loss, words, pairs), sums

  names = ('total', 'count', 'correct') + (('change_ce', 'change_right') if t.change_loss else ())
  zeros = {k: jnp.zeros((), jnp.float32) for k in names}
  grads, sums = train.accumulate_gradients(micro_loss, params, rows, zeros)
  return (caption_loss.reduce(sums, t.loss_reduction, t.change_loss, words, pairs),
          caption_loss.metrics(sums, pairs)), grads


def _features(tokenizer: FrozenTokenizer, tokenizer_params: Any, before: jax.Array,
              after: jax.Array) -> tuple[jax.Array, jax.Array]:
  """uint8 images [B, S, S, 3] -> frozen features [B, h, w, C] each (one tokenizer call)."""
  return encodings.pair_features(tokenizer, tokenizer_params, {'before': before, 'after': after})


# ----------------------------------------------------------------------------- decoding


@functools.partial(jax.jit, static_argnames=('model', 'tokenizer', 'method', 'beam_size',
                                             'alpha', 'max_len', 'encode_rows'))
def _generate(params, tokenizer_params, pair, *, model, tokenizer, **settings):
  feats_b, feats_a = pair_inputs(model, tokenizer, tokenizer_params, pair)
  if isinstance(model, duda_lib.Duda):
    return duda_lib.generate(model, params, feats_b, feats_a, **settings)  # [B, L]
  return captioner_lib.generate(model, params, feats_b, feats_a, **settings)  # [B, L]


@functools.partial(jax.jit, static_argnames=('model', 'tokenizer'))
def _imagine(params, tokenizer_params, before, after, *, model, tokenizer) -> jax.Array:
  feats_b, feats_a = _features(tokenizer, tokenizer_params, before, after)
  codes = model.apply({'params': params}, feats_b, feats_a, method='imagine')  # [B, k, N]
  b, k, n = codes.shape
  images = tokenizer.decode_tokens(tokenizer_params, codes.reshape(b * k, n))  # [B*k, S, S, 3]
  return images.reshape((b, k) + images.shape[1:])  # [B, k, S, S, 3]


def generate(params: Any, constants: dict, config: ml_collections.ConfigDict, model: nn.Module,
             before: np.ndarray, after: np.ndarray,
             tokenizer: FrozenTokenizer | None = None,
             keyframe_features: np.ndarray | None = None) -> np.ndarray:
  """Caption token ids [B, L] (greedy or beam per config.caption.decoding) for uint8 pairs.

  `keyframe_features` [B, T, h, w, C] (the feature cache's batch key) replaces encoding the
  images: keyframes 0 and T-1 are the before and after images. When rows 2i and 2i + 1 have
  the same before image for every i (a CLEVR split in record order: each scene's change pair,
  then its distractor), each before image is encoded once (`encodings.share_before`)."""
  pair = ({'before': before, 'after': after} if keyframe_features is None
          else {encodings.CACHED: keyframe_features})
  pair = sharding.place_eval_batch(encodings.share_before(pair), config)
  with sharding.eval_context(config):
    return np.asarray(_generate(
        nn.meta.unbox(params), constants['tokenizer'], pair, model=model,
        tokenizer=tokenizer or vqgan_tokenizer(config), **config_lib.decoding_settings(config)))


def imagine_frames(params: Any, constants: dict, config: ml_collections.ConfigDict,
                   model: nn.Module, before: np.ndarray, after: np.ndarray,
                   tokenizer: FrozenTokenizer | None = None) -> np.ndarray:
  """The k imagined intermediate frames [B, k, S, S, 3] in [0, 1] for uint8 pairs."""
  return np.asarray(_imagine(nn.meta.unbox(params), constants['tokenizer'], before, after,
                             model=model, tokenizer=tokenizer or vqgan_tokenizer(config)))


# ----------------------------------------------------------------------------- evaluation


def make_task(tokenizer_factory: Callable[[ml_collections.ConfigDict], FrozenTokenizer] =
              vqgan_tokenizer) -> train.Task:
  """The caption Task, with the frozen tokenizer built by `tokenizer_factory(config)`."""

  def loss_fn(params, model_state, constants, batch, rng, config, model):
    loss, metrics = batch_loss(params, constants['tokenizer'], batch, rng, config, model,
                               tokenizer_factory(config))
    return loss, (metrics, model_state)

  value_and_grad = train.micro_batched(
      'caption', loss_fn, lambda params, constants, batch, rng, config, model, m:
      micro_batched_value_and_grad(params, constants['tokenizer'], batch, rng, config, model,
                                   tokenizer_factory(config), m))

  def evaluate(state, constants, config, model, split, workdir, *, batches=None, info=None,
               vocab=None, write_predictions=True, use_meteor=None, use_spice=None):
    """Decodes `split`, scores it; METEOR/SPICE by default only on 'test' (val selects on CIDEr).

    `batches` defaults to the whole split for 'test' and `eval_batches` batches otherwise.
    Predictions go to `<workdir>/caption/predictions_<split>.json` (COCO results format).
    On the synthetic benchmark the metrics add its semantic scores (`semantic_scores.score`).
    """
    info = info if info is not None else pipeline.load_split_info(config, split, workdir)
    vocab = vocab if vocab is not None else pipeline.load_vocab(config, workdir)
    t = config.caption.train
    if batches is None:
      batches = pipeline.make_eval_iterator(
          config, split, workdir, t.batch_size,
          num_batches=0 if split == 'test' else t.eval_batches,
          cache=feature_cache.load(config, workdir, constants['tokenizer']))
    tokenizer = tokenizer_factory(config)
    predictions = {}
    for batch in batches:
      tokens = generate(state.params, constants, config, model, batch['before'], batch['after'],
                        tokenizer, keyframe_features=batch.get(encodings.CACHED))
      for row, index, valid in zip(tokens, batch['example_index'], batch['valid']):
        if valid:
          predictions[info[int(index)]['pair_id']] = vocab.decode(row)
    references = {rec['pair_id']: rec['captions'] for rec in info
                  if rec['pair_id'] in predictions}
    full = split == 'test'
    scores = evaluation.score_captions(
        predictions, references, groups=pipeline.change_groups(info, predictions),
        use_meteor=full if use_meteor is None else use_meteor,
        use_spice=full if use_spice is None else use_spice)
    if write_predictions:
      evaluation.write_results(os.path.join(workdir, 'caption', f'predictions_{split}.json'),
                               predictions)
    metrics = evaluation.flat_metrics(scores)
    if semantic_scores.applies(config):  # the synthetic benchmark: its truth is in the records
      metrics.update(semantic_scores.score(predictions, semantic_scores.split_truths(info))[0])
    return metrics

  return train.Task(name='caption', build_model=build_model, init_params=init_params,
                    loss_fn=loss_fn, value_and_grad=value_and_grad,
                    make_optimizer=caption_optimizer.make_optimizer,
                    evaluate=evaluate, feature_cache=tokenizer_factory,
                    load_constants=load_constants, restore_init=restore_init,
                    host_batch=lambda batch, mesh: encodings.share_before(
                        batch, mesh.shape['data']))


TASK = make_task()
