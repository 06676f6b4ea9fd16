"""Config validation: one clear sentence for every inconsistent or misspelt setting.

The config files in `configs/` are the schema; `ml_collections` already rejects unknown keys in
`--config.key=value` overrides. This module checks values and the relations between sections
(the encoder's token grid must match the tokenizer's, and so on).
"""

import ast
import difflib
import json
import os
from typing import Any

import ml_collections

from procap_jax import config_migrate
from procap_jax import cpu_info
from procap_jax import errors

_CHOICES = {
    'data.encoder_text': ('words', 'clip_bpe'),
    'data.frame_source': ('frames', 'oracle', 'crossfade'),
    'data.sampler': ('confidence', 'uniform', 'topk'),
    'data.scores_feature': ('stats', 'tokenizer'),
    'data.feature_cache_dtype': ('float32', 'float16'),
    'tokenizer.model.feature_input_scale': ('unit', 'signed'),
    'tokenizer.model.token_input_scale': ('unit', 'signed'),
    'tokenizer.frozen_dtype': ('float32', 'bfloat16', 'auto'),
    'pretrain.train.warmup': ('log', 'linear'),
    'caption.model.attention_scale': ('d_model', 'head_dim'),
    'caption.model.layernorm': ('unbiased_std', 'standard'),
    'caption.model.text_slot': ('code', 'padding', 'none'),
    'caption.model.stage2_mask': ('code', 'aligned'),
    'caption.model.kind': ('procap', 'duda'), 'caption.model.memory_frames': ('all', 'ends'),
    'caption.model.duda.input': ('pixels', 'features'),
    'caption.model.duda.attention_norm': ('softmax', 'sigmoid'),
    'caption.decoding.method': ('greedy', 'beam'),
    'caption.train.loss_reduction': ('sum', 'mean'),
    'pretrain.csy_normalisation': ('code', 'mean'),
    'pretrain.binary_inputs': ('masked', 'visible'),
    'compute_dtype': ('float32', 'bfloat16', 'auto'),
}
STAGES = ('tokenizer', 'pretrain', 'caption')
# Ids of CLIP's BPE (`procap_jax.data.bpe.VOCAB_SIZE`, not imported here: it loads numpy).
CLIP_BPE_VOCAB_SIZE = 49408
# Data entries whose value changes what a trained model reads; `check_workdir` compares them.
_WORKDIR_DATA_KEYS = ('name', 'builder_config', 'image_size', 'num_keyframes', 'frame_source',
                      'encoder_text')


def _get(config, dotted: str):
  node = config
  for part in dotted.split('.'):
    node = node[part]
  return node


def feature_channels(tokenizer_model: Any) -> int:
  """C, the channels of the frozen tokenizer's features: its z_channels, plus 3 P^2 pooled pixels
  per token cell with `feature_pixels` P."""
  return tokenizer_model.z_channels + 3 * tokenizer_model.feature_pixels ** 2


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
      ('pretrain.model.feature_dim', p.feature_dim, feature_channels(t)),
      ('pretrain.model.codebook_size', p.codebook_size, t.n_embed),
  ]
  for key, got, want in checks:
    if got != want:
      raise errors.UserError(f'config.{key} is {got} but the other settings need {want}; '
                             'set it to match (see configs/ for consistent presets)')
  if p.pixel_stem and not t.feature_pixels:
    raise errors.UserError('config.pretrain.model.pixel_stem reads the pooled pixels of '
                           'config.tokenizer.model.feature_pixels; set that above 0 too')
  if not 1 <= d.num_keyframes <= 7:
    raise errors.UserError(f'config.data.num_keyframes is {d.num_keyframes}; it must be 1..7 '
                           '(interior frames of a 9-frame sequence)')
  for stage in STAGES:
    tr = config[stage].train
    if tr.steps < 1 or tr.batch_size < 1:
      raise errors.UserError(f'config.{stage}.train.steps and batch_size must be positive')
  for stage in ('pretrain', 'caption'):
    tr = config[stage].train
    micro = tr.micro_batches
    if not isinstance(micro, int) or micro < 1 or tr.batch_size % micro:
      raise errors.UserError(f'config.{stage}.train.micro_batches is {micro!r}; it must be a '
                             f'positive integer dividing the batch size ({tr.batch_size})')
  ct = config.caption.train
  if ct.scene_pairs and ct.batch_size % 2:
    raise errors.UserError(f'config.caption.train.scene_pairs puts two pairs of a scene in every '
                           f'batch, so the batch size must be even (it is {ct.batch_size})')
  cm = config.caption.model
  if not (isinstance(cm.change_head, int) and cm.change_head >= 0 and ct.change_loss >= 0):
    raise errors.UserError(f'config.caption.model.change_head ({cm.change_head!r}) and '
                           f'config.caption.train.change_loss ({ct.change_loss!r}) must not be '
                           'negative')
  if ct.change_loss and (not cm.change_head or caption_kind(config) != 'procap'):
    raise errors.UserError('config.caption.train.change_loss trains ProCap\'s change head; set '
                           'config.caption.model.change_head above 0 (kind procap) or the loss '
                           'to 0')
  rows = config.caption.decoding.encode_rows
  if not isinstance(rows, int) or rows < 0:
    raise errors.UserError(f'config.caption.decoding.encode_rows is {rows!r}; it must be 0 (the '
                           'whole batch at once) or a positive number of pairs')
  pt = config.pretrain.train
  if not 0 <= pt.decay_steps <= pt.steps:
    raise errors.UserError(f'config.pretrain.train.decay_steps is {pt.decay_steps}; it must be '
                           f'between 0 (no decay) and the {pt.steps} training steps')


def apply_override(config: ml_collections.ConfigDict, item: str) -> None:
  """Sets 'key.sub=value' in `config` (value: JSON or a Python literal; a str entry takes the
  text as written), in place; an unknown key or a value of the wrong type is a UserError."""
  key, sep, text = item.partition('=')
  *parents, leaf = key.split('.')
  node = config
  for i, part in enumerate(parents + [leaf]):
    if not sep or not isinstance(node, ml_collections.ConfigDict) or part not in node:
      near = difflib.get_close_matches(part, list(node) if hasattr(node, 'keys') else [], 1)
      hint = f'did you mean {near[0]!r}?' if sep and near else 'write key.sub=value'
      raise errors.UserError(f'override {item!r}: config has no key {key!r} ({hint})')
    node = node[part] if i < len(parents) else node
  value = text
  for parse in () if isinstance(node[leaf], str) else (json.loads, ast.literal_eval):
    try:
      value = parse(text)
      break
    except (ValueError, SyntaxError):
      pass
  try:
    node[leaf] = value
  except (TypeError, ValueError) as e:
    raise errors.UserError(f'override {item!r}: config.{key} must be of type '
                           f'{type(node[leaf]).__name__}, not {value!r}') from e


# The bf16 switches: 'auto' is resolved once at start-up (`resolve_compute_path`).
PATH_KEYS = ('compute_dtype', 'tokenizer.frozen_dtype')


def _saved_values(workdir: str | None) -> dict:
  """PATH_KEYS' resolved values in `workdir/config.json` ({} without a readable one)."""
  if not workdir:
    return {}
  try:
    with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return {}
  if not isinstance(saved, dict):
    return {}
  saved = config_migrate.migrated_json(saved)  # frozen_dtype: float32 before the entry
  out = {}
  for key in PATH_KEYS:
    try:
      value = _get(saved, key)
    except (KeyError, TypeError):
      value = None
    if value in ('float32', 'bfloat16'):
      out[key] = value
  return out


def resolve_compute_path(config: ml_collections.ConfigDict, workdir: str | None = None,
                         cpu=None, xla_flags: str | None = None,
                         platform: str | None = None) -> str:
  """Replaces 'auto' in PATH_KEYS by 'bfloat16' or 'float32', in place; returns the log line.

  Per key: a value set in the config is kept; 'auto' takes the value the run in `workdir` (None:
  no run) saved in its config.json, so a resumed or evaluated run computes as it started, also
  on another CPU; else `cpu_info.choose` (bfloat16 only on a CPU with bf16 dot products not
  capped away by XLA_FLAGS). `cpu`, `xla_flags`, `platform`: for tests (default /proc/cpuinfo,
  $XLA_FLAGS, JAX's backend, asked only when a value is left to choose).
  """
  saved = _saved_values(workdir)
  choice = None
  why = {}
  for key in PATH_KEYS:
    *parents, leaf = key.split('.')
    node = _get(config, '.'.join(parents)) if parents else config
    if node[leaf] != 'auto':
      why[key] = 'set in the config'
    elif key in saved:
      node[leaf] = saved[key]
      why[key] = f"auto: kept from {os.path.join(workdir, 'config.json')}"
    else:
      if choice is None:
        if platform is None:
          import jax  # pylint: disable=import-outside-toplevel
          platform = jax.default_backend()
        choice = cpu_info.choose(cpu_info.read() if cpu is None else cpu, xla_flags, platform)
      node[leaf] = choice[0]
      why[key] = f'auto: {choice[1]}'
  groups = {}
  for key in PATH_KEYS:
    groups.setdefault((_get(config, key), why[key]), []).append(key)
  parts = [f'{value} for {" and ".join(keys)} ({reason})' for (value, reason), keys in
           groups.items()]
  return 'compute path: ' + '; '.join(parts)


def caption_kind(config: ml_collections.ConfigDict) -> str:
  """'procap' | 'duda': the captioner of stage 2."""
  return config.caption.model.kind


def reads_tokenizer(config: ml_collections.ConfigDict) -> bool:
  """Whether stage 2 reads the frozen tokenizer (all but DUDA on pixels)."""
  return not (caption_kind(config) == 'duda' and config.caption.model.duda.input == 'pixels')


def decoding_settings(config: ml_collections.ConfigDict) -> dict:
  """`captioner.generate`'s keyword arguments from `config.caption.decoding`."""
  d = config.caption.decoding
  return dict(method=d.method, beam_size=int(d.beam_size), alpha=float(d.alpha),
              max_len=int(config.caption.model.max_len),
              encode_rows=int(d.encode_rows))


def frame_slots(config: ml_collections.ConfigDict) -> int:
  """T, the frames of a clip (the pipeline's batches, the encoder, its masks), derived here only
  from the one key that says how many frames are imagined: T = data.num_keyframes + 2 (before,
  k imagined frames, after)."""
  return int(config.data.num_keyframes) + 2


def encoder_kwargs(config: ml_collections.ConfigDict) -> dict:
  """The ProcedureEncoder's kwargs: `config.pretrain.model` with the frame count T
  (`frame_slots`)."""
  kwargs = config.pretrain.model.to_dict()
  kwargs['grid'] = tuple(kwargs['grid'])
  kwargs['num_frames'] = frame_slots(config)
  kwargs['pixels'] = config.tokenizer.model.feature_pixels
  return kwargs


def check_encoder_text(config: ml_collections.ConfigDict) -> None:
  """With `data.encoder_text='clip_bpe'` the encoder text table must be CLIP's (0 = fill it)."""
  size = config.pretrain.model.text_vocab_size
  if config.data.encoder_text == 'clip_bpe' and size not in (0, CLIP_BPE_VOCAB_SIZE):
    raise errors.UserError(
        f'config.pretrain.model.text_vocab_size is {size} but config.data.encoder_text '
        f"'clip_bpe' needs CLIP's {CLIP_BPE_VOCAB_SIZE} ids; set it to {CLIP_BPE_VOCAB_SIZE} "
        "or 0, or use encoder_text 'words'")


# Vocabulary sizes a config leaves at 0 until the run fills them from its dataset's vocabulary
# (`pipeline.resolve_vocab_sizes`); a saved config.json holds the filled values.
_FILLED_LATER = (('pretrain', 'text_vocab_size'), ('caption', 'vocab_size'))


# Model entries that change neither the parameters nor the values computed (memory and speed
# only): a run may resume, or a checkpoint load, with other values of them.
SCHEDULE_ONLY_KEYS = frozenset({'pretrain.model.remat', 'pretrain.model.scan_blocks',
                                'pretrain.model.scan_keep_dense', 'pretrain.model.attention_chunk',
                                'pretrain.model.attention_group'})


def _compared_model(section: str, model: dict) -> dict:
  """`model` without its SCHEDULE_ONLY_KEYS (a new dict)."""
  return {k: v for k, v in model.items() if f'{section}.model.{k}' not in SCHEDULE_ONLY_KEYS}


def workdir_differences(saved: dict, current: dict) -> list[str]:
  """The model/data entries (`data.<key>`, `<stage>.model`) in which two configs differ
  (`SCHEDULE_ONLY_KEYS` left out).

  Args:
    saved: a run's config.json (migrated here: `config_migrate.migrate`).
    current: a config as JSON (`json.loads(config.to_json_best_effort())`); vocabulary sizes
      it leaves at 0 (not filled from the dataset yet) are taken as the saved ones.
  """
  saved = config_migrate.migrated_json(saved)  # keys newer than the run: the run's behaviour
  diffs = []
  for section in ('data', 'tokenizer', 'pretrain', 'caption'):
    for key in ('model',) if section != 'data' else _WORKDIR_DATA_KEYS:
      a = (saved.get(section) or {}).get(key)
      b = current[section][key]
      if key == 'model' and isinstance(a, dict):
        a, b = _compared_model(section, a), _compared_model(section, b)
        for stage, size in _FILLED_LATER:
          if stage == section and not b.get(size) and size in a:
            b[size] = a[size]
      if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
        diffs.append(f'{section}.{key}')
  return diffs


def _another_config(workdir: str, diffs: list[str], saved: dict | None = None,
                    fix: str = 'use a new --workdir or the config it was made with'
                    ) -> errors.UserError:
  made_with = ''
  if isinstance(saved, dict) and saved.get('preset'):
    variant = f',{saved["variant"]}' if saved.get('variant') else ''
    made_with = f' (config.json says preset :{saved["preset"]}{variant})'
  return errors.UserError(
      f'workdir {workdir} holds a run made with another config (differs in '
      f'{", ".join(diffs)}); {fix}{made_with}')


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
    if isinstance(saved, dict):
      diffs = workdir_differences(saved, current)
      if diffs:
        raise _another_config(workdir, diffs, saved)
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise errors.UserError(f'cannot create workdir {workdir}: {e.strerror}') from None
  errors.write_text_atomic(path, json.dumps(current, indent=1, sort_keys=True))


def _check_same_setup(config: ml_collections.ConfigDict, workdir: str, saved: dict,
                      fix: str) -> None:
  diffs = workdir_differences(saved, json.loads(config.to_json_best_effort()))
  if diffs:
    raise _another_config(workdir, diffs, saved, fix)


def check_saved_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """`check_workdir`'s refusal alone (nothing written), for before the dataset is built: a run
  of another model/data setup in `workdir` is refused at once, not after a build. Vocabulary
  sizes still 0 in `config` are not compared."""
  path = os.path.join(workdir, 'config.json')
  try:
    with open(path, encoding='utf-8') as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return  # no run yet (or an unreadable file, which check_workdir replaces)
  if isinstance(saved, dict):
    _check_same_setup(config, workdir, saved,
                      'use a new --workdir or the config it was made with')


# ------------------------------------------------------------------ checks of a finished run
# `main --mode evaluate` and `procap_jax.caption` make them first, before any slow import, data
# build or checkpoint restore. They read files only (no JAX, no orbax, no TFDS).

_RUN_HINT = 'pass the --workdir of a finished training run'
EVAL_SPLITS = ('train', 'val', 'test')


def read_saved_config(workdir: str) -> dict:
  """The config a run saved in `workdir/config.json`, as JSON.

  Raises:
    UserError: `workdir` does not exist, is not a directory, has no readable config.json, or
      that file is not a run's config.
  """
  if not os.path.exists(workdir):
    raise errors.UserError(f'workdir {workdir} does not exist; {_RUN_HINT}')
  if not os.path.isdir(workdir):
    raise errors.UserError(f'workdir {workdir} is a file, not a directory; {_RUN_HINT}')
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise errors.UserError(f'{workdir} is not a procap-jax run (no config.json); {_RUN_HINT}')
  raw = errors.read_json(path, 'run config', _RUN_HINT, 'the run directory is damaged')
  missing = [s for s in ('data',) + STAGES if not isinstance(raw, dict) or
             not isinstance(raw.get(s), dict)]
  if missing:
    raise errors.UserError(f'{path} is not a procap-jax run config (no "{missing[0]}" section); '
                           f'{_RUN_HINT}')
  return raw


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The resolved config a run saved in `workdir/config.json` (UserError when it is no run),
  migrated to today's schema (`config_migrate.migrate`)."""
  return config_migrate.migrate(read_saved_config(workdir))


def checkpoint_dir(workdir: str, stage: str, which: str = 'best') -> str | None:
  """The folder `checkpointing.load_stage_variables` restores `stage` from, or None.

  The same rule as `checkpointing` (`best/` then `checkpoints/` for 'best', `checkpoints/` for
  'latest'; a folder counts when it holds a complete checkpoint, a step-number folder: orbax
  writes into a temporary folder and renames it), without importing orbax.
  """
  order = {'best': ('best', 'checkpoints'), 'latest': ('checkpoints',)}[which]
  for sub in order:
    d = os.path.join(workdir, stage, sub)
    if os.path.isdir(d) and any(name.isdigit() for name in os.listdir(d)):
      return d
  return None


def run_checkpoints(config: ml_collections.ConfigDict, which: str) -> tuple[tuple[str, str], ...]:
  """(stage, 'best' | 'latest') of the checkpoints captioning with a run restores: the caption
  stage's `which`, and the tokenizer's best unless stage 2 reads pixels (DUDA on patches)."""
  return (('caption', which),) + ((('tokenizer', 'best'),) if reads_tokenizer(config) else ())


def check_run(workdir: str, which: str = 'best',
              config: ml_collections.ConfigDict | None = None) -> dict:
  """Checks that `workdir` holds a run that can caption; returns its saved config (JSON).

  Args:
    workdir: the run's folder.
    which: the caption checkpoint to use, 'best' (else the latest) or 'latest'.
    config: when given (`main --mode evaluate`), its model/data sections must be the run's.

  Raises:
    UserError: one sentence naming the first problem: no such folder, not a run, another
      config, no caption checkpoint, no tokenizer checkpoint (when stage 2 reads it).
  """
  saved = read_saved_config(workdir)
  if config is not None:
    _check_same_setup(config, workdir, saved,
                      'pass the --config the run was made with or another --workdir')
  for stage, pick in run_checkpoints(config_migrate.migrate(saved), which):
    if checkpoint_dir(workdir, stage, pick) is not None:
      continue
    where = os.path.join(workdir, stage)
    if pick == 'latest' and checkpoint_dir(workdir, stage, 'best') is not None:
      raise errors.UserError(f'no latest {stage} checkpoint in {where}/checkpoints (only a best '
                             'one); use --which best')
    raise errors.UserError(
        f'no {stage} checkpoint in {where}; finish training this run first (python -m '
        f'procap_jax.main --config <its config> --workdir {workdir}) or {_RUN_HINT}')
  return saved
