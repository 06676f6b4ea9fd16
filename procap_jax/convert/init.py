"""Starting a stage from the original's weights (`config.<stage>.init_from`).

  tokenizer.init_from   a taming `VQModel` checkpoint -> the whole VQGAN (a discriminator, when
                        the config trains one, keeps its random init); or a released ProCap
                        stage-1 / stage-2 checkpoint, which holds its frozen VQGAN under
                        `vae.model.` / `intermediate_generator.vae.model.` (VQGAN_PREFIXES).
  pretrain.init_from    OpenAI CLIP (the TorchScript `ViT-B-32.pt`, or any file holding
                        `visual.transformer.resblocks.*`) -> the encoder's first `depth` blocks,
                        as the original initialises stage 1; the other encoder parameters keep
                        their init. Or a released ProCap stage-1 checkpoint (`{'weights': ...}`
                        of train_stage1.py) -> the whole encoder.
  caption.init_from     a released ProCap stage-2 checkpoint (`{'model': ...}` of train_stage2.py)
                        -> the whole captioner; it replaces `init_from_pretrain`.

The trainer calls `restore(stage, params, config)` once after a fresh init (never on resume), so a
run started this way checkpoints and resumes like any other. Every mismatch is one sentence
naming the first bad key and both shapes, raised before training starts.
"""

import os
from typing import Any

import ml_collections

from procap_jax import config_lib
from procap_jax.convert import clip
from procap_jax.convert import common
from procap_jax.convert import procap_stage1
from procap_jax.convert import procap_stage2
from procap_jax.convert import taming
from procap_jax.convert import torch_files

CLIP_MARK = 'visual.transformer.resblocks.0.attn.in_proj_weight'
# Where a taming VQModel's keys start: its own checkpoint, a ProCap stage-1 BERT (`vae` is the
# VQGanVAE wrapper, `.model` the VQModel), a ProCap stage-2 MMVID_IDC.
VQGAN_PREFIXES = ('', 'vae.model.', 'intermediate_generator.vae.model.')
PROCAP_STAGE1_MARK = 'text_emb.weight'
PROCAP_STAGE2_MARK = 'text_decoder.decoder.out.weight'
# What `identify` can tell a file is, as the sentences name it.
KIND_NAMES = {'clip': 'an OpenAI CLIP file', 'taming': 'a taming VQGAN checkpoint',
              'procap_stage1': 'a ProCap stage-1 checkpoint',
              'procap_stage2': 'a ProCap stage-2 checkpoint'}


def read(path: str, what: str, config: ml_collections.ConfigDict | None = None,
         warn: bool = True) -> dict:
  """The flat state dict of `path`, with one sentence when the file is missing; `config`'s
  `weight_files` (strict, max_expansion) and `warn` go to the reader."""
  if not os.path.isfile(path):
    raise common.ConversionError(f'{what} {path} does not exist; download it by hand (README, '
                                 '"Start from the original\'s weights") and give its path')
  options = {} if config is None else dict(strict=bool(config.weight_files.strict),
                                           max_expansion=float(config.weight_files.max_expansion))
  return torch_files.state_dict(path, warn=warn, **options)


def identify(state: dict) -> str | None:
  """Which of KIND_NAMES a flat state dict is, from its keys; None when none fits."""
  if PROCAP_STAGE2_MARK in state or any(k.startswith('intermediate_generator.') for k in state):
    return 'procap_stage2'
  if PROCAP_STAGE1_MARK in state:
    return 'procap_stage1'
  if any(k.startswith('visual.') for k in state):
    return 'clip'
  if taming.MARK in state:
    return 'taming'
  return None


def describe(state: dict) -> str:
  """What a file looks like, for a sentence: a kind, or a few of its keys."""
  kind = identify(state)
  if kind:
    return KIND_NAMES[kind]
  keys = sorted(state)
  return (f'a file of none of the kinds the converters take (its {len(keys)} tensors start '
          f'{", ".join(keys[:3])})')


def vqgan_state(state: dict) -> dict:
  """The taming VQModel keys of `state`, wherever in VQGAN_PREFIXES they sit (unprefixed)."""
  for prefix in VQGAN_PREFIXES:
    if prefix + taming.MARK in state:
      return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
  return state  # taming.convert says what is missing


def pretrain_source(state: dict) -> str:
  """'clip' | 'procap_stage1': what a file given as `pretrain.init_from` holds."""
  if CLIP_MARK in state:
    return 'clip'
  if PROCAP_STAGE1_MARK in state:
    return 'procap_stage1'
  raise common.ConversionError(
      f'the file has neither {CLIP_MARK!r} (OpenAI CLIP) nor {PROCAP_STAGE1_MARK!r} (a ProCap '
      'stage-1 checkpoint), so it cannot start the stage-1 encoder')


def converted(stage: str, config: ml_collections.ConfigDict, path: str,
              state: dict | None = None) -> dict:
  """The converted parameters (nested numpy) that `path` gives `stage`'s model: the whole tree,
  or for CLIP only the encoder's blocks. `state`: the file's flat state dict when already read."""
  if stage == 'tokenizer':
    state = vqgan_state(state if state is not None else
                        read(path, 'the taming VQGAN checkpoint', config))
    return taming.convert(state, config.tokenizer.model.to_dict(),
                          drop_unused_attention=config.tokenizer.init_drop_unused_attention)
  if stage == 'pretrain':
    state = state if state is not None else read(path, 'the stage-1 init file', config)
    kwargs = _encoder_kwargs(config)
    if pretrain_source(state) == 'clip':
      return clip.encoder_blocks(state, kwargs,
                                 fp16_round_trip=config.pretrain.clip_fp16_round_trip)
    return procap_stage1.encoder_params(state, kwargs)
  if stage == 'caption':
    state = state if state is not None else read(path, 'the ProCap stage-2 checkpoint', config)
    return procap_stage2.captioner_params(state, config)
  raise ValueError(f'unknown stage {stage!r}')


def _encoder_kwargs(config: ml_collections.ConfigDict) -> dict:
  return config_lib.encoder_kwargs(config)


def restore(stage: str, params: Any, config: ml_collections.ConfigDict) -> Any:
  """`params` (a fresh init, boxed or not) with `config.<stage>.init_from`'s weights in place;
  unchanged when init_from is ''."""
  path = config[stage].init_from
  if not path:
    return params
  new = converted(stage, config, path)
  what = {'tokenizer': 'the tokenizer', 'pretrain': 'the stage-1 encoder',
          'caption': 'the captioner'}[stage]
  merged = common.merge_into(params, new, what=what)
  print(f'[{stage}] initialised from {path}', flush=True)
  return merged
