"""Config validation: one clear sentence for every inconsistent or misspelt setting.

The config files in `configs/` are the schema; `ml_collections` already rejects unknown keys in
`--config.key=value` overrides. This module checks values and the relations between sections
(the encoder's token grid must match the tokenizer's, and so on).
"""

import json
import os

import ml_collections

from procap_jax import errors

_CHOICES = {
    'data.encoder_text': ('words', 'clip_bpe'),
    'data.frame_source': ('frames', 'oracle', 'crossfade'),
    'data.sampler': ('confidence', 'uniform', 'topk'),
    'data.scores_feature': ('stats', 'tokenizer'),
    'tokenizer.model.feature_input_scale': ('unit', 'signed'),
    'tokenizer.model.token_input_scale': ('unit', 'signed'),
    'pretrain.train.warmup': ('log', 'linear'),
    'caption.model.attention_scale': ('d_model', 'head_dim'),
    'caption.model.layernorm': ('unbiased_std', 'standard'),
    'caption.model.text_slot': ('code', 'padding', 'none'),
    'caption.model.stage2_mask': ('code', 'aligned'),
    'caption.decoding.method': ('greedy', 'beam'),
    'caption.train.loss_reduction': ('sum', 'mean'),
    'pretrain.csy_normalisation': ('code', 'mean'),
    'pretrain.binary_inputs': ('masked', 'visible'),
    'compute_dtype': ('float32', 'bfloat16'),
}
STAGES = ('tokenizer', 'pretrain', 'caption')
# Ids of CLIP's BPE (`procap_jax.data.bpe.VOCAB_SIZE`, not imported here: it loads numpy).
CLIP_BPE_VOCAB_SIZE = 49408
# Data entries whose value changes what a trained model reads; `check_workdir` compares them.
# `encoder_text` was added later: a saved config without it was trained on 'words'.
_WORKDIR_DATA_KEYS = {'name': None, 'builder_config': None, 'image_size': None,
                      'num_keyframes': None, 'frame_source': None, 'encoder_text': 'words'}


def _get(config, dotted: str):
  node = config
  for part in dotted.split('.'):
    node = node[part]
  return node


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises UserError with one sentence when the config is inconsistent."""
  for key, choices in _CHOICES.items():
    value = _get(config, key)
    if value not in choices:
      raise errors.UserError(f'config.{key} is {value!r}; choose one of {", ".join(choices)}')
  for stage in config.stages:
    if stage not in STAGES:
      raise errors.UserError(f'config.stages has unknown stage {stage!r}; stages are '
                             f'{", ".join(STAGES)}')
  check_encoder_text(config)
  t, p, d = config.tokenizer.model, config.pretrain.model, config.data
  down = 2 ** (len(t.ch_mult) - 1)
  if d.image_size % down:
    raise errors.UserError(f'config.data.image_size {d.image_size} is not divisible by the '
                           f'tokenizer downsampling factor {down}')
  if t.resolution != d.image_size:
    raise errors.UserError(f'config.tokenizer.model.resolution ({t.resolution}) must equal '
                           f'config.data.image_size ({d.image_size})')
  grid = (d.image_size // down, d.image_size // down)
  checks = [
      ('pretrain.model.grid', tuple(p.grid), grid),
      ('pretrain.model.num_frames', p.num_frames, d.num_keyframes + 2),
      ('pretrain.model.feature_dim', p.feature_dim, t.z_channels),
      ('pretrain.model.codebook_size', p.codebook_size, t.n_embed),
  ]
  for key, got, want in checks:
    if got != want:
      raise errors.UserError(f'config.{key} is {got} but the other settings need {want}; '
                             'set it to match (see configs/ for consistent presets)')
  if not 1 <= d.num_keyframes <= 7:
    raise errors.UserError(f'config.data.num_keyframes is {d.num_keyframes}; it must be 1..7 '
                           '(interior frames of a 9-frame sequence)')
  for stage in STAGES:
    tr = config[stage].train
    if tr.steps < 1 or tr.batch_size < 1:
      raise errors.UserError(f'config.{stage}.train.steps and batch_size must be positive')
  pt = config.pretrain.train
  if not 0 <= pt.get('decay_steps', 0) <= pt.steps:
    raise errors.UserError(f'config.pretrain.train.decay_steps is {pt.decay_steps}; it must be '
                           f'between 0 (no decay) and the {pt.steps} training steps')


def check_encoder_text(config: ml_collections.ConfigDict) -> None:
  """With `data.encoder_text='clip_bpe'` the encoder text table must be CLIP's (0 = fill it)."""
  size = config.pretrain.model.text_vocab_size
  if config.data.encoder_text == 'clip_bpe' and size not in (0, CLIP_BPE_VOCAB_SIZE):
    raise errors.UserError(
        f'config.pretrain.model.text_vocab_size is {size} but config.data.encoder_text '
        f"'clip_bpe' needs CLIP's {CLIP_BPE_VOCAB_SIZE} ids; set it to {CLIP_BPE_VOCAB_SIZE} "
        "or 0, or use encoder_text 'words'")


def check_workdir(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses a workdir whose saved config has another model/data setup; saves it otherwise."""
  path = os.path.join(workdir, 'config.json')
  current = json.loads(config.to_json_best_effort())
  if os.path.exists(path):
    try:
      with open(path, encoding='utf-8') as f:
        saved = json.load(f)
    except (OSError, json.JSONDecodeError):
      saved = None
    if saved is not None:
      diffs = []
      for section in ('data', 'tokenizer', 'pretrain', 'caption'):
        for key in ('model',) if section != 'data' else _WORKDIR_DATA_KEYS:
          earlier = _WORKDIR_DATA_KEYS[key] if section == 'data' else None
          a = (saved.get(section) or {}).get(key, earlier)
          b = current[section][key]
          if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            diffs.append(f'{section}.{key}')
      if diffs:
        raise errors.UserError(
            f'workdir {workdir} holds a run made with another config (differs in '
            f'{", ".join(diffs)}); use a new --workdir or the config it was made with')
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise errors.UserError(f'cannot create workdir {workdir}: {e.strerror}') from None
  errors.write_text_atomic(path, json.dumps(current, indent=1, sort_keys=True))
