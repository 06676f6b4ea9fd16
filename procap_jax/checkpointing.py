"""Checkpoints: the only module that imports orbax.

Layout of a stage directory `W/<stage>/`:
  checkpoints/<step>/   the latest checkpoints (train state + data-iterator state + meta)
  best/<step>/          the best checkpoint by the stage's selection metric (validation split)

Each checkpoint holds three items: `state` (the TrainState pytree), `data` (the data iterator's
state, JSON) and `meta` (the resolved config as JSON, the step, and the metrics that chose it).
Orbax writes into a temporary directory and renames it when complete, so a run killed during a
write leaves only the previous complete checkpoints; the temporary leftovers are removed on the
next start (`cleanup_tmp_directories`).

Restore order (documented once, here): latest checkpoint of the stage in the workdir, else the
initialisation the stage's task defines (e.g. stage 2 from the best stage-1 checkpoint), else
from scratch.
"""

import json
import os
from typing import Any

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

from procap_jax import config_lib
from procap_jax import config_migrate
from procap_jax import errors


def _single_process_saves_whole_shards() -> None:
  """In a one-process job, orbax's jax.Array handler without replica-parallel saving.

  By default orbax splits each replicated array among its replicas (devices) so that several
  hosts can write it together; in one process that only adds a device-side slice per array and
  replica (a small jitted program each, compiled per shape): checkpoint saving took 20 s of the
  `tiny` preset's 95 s run on 8 CPU devices, 5 s without it (docs/performance.md,
  "Checkpoints"). The files written are the same. Jobs of several processes keep
  orbax's default."""
  if jax.process_count() > 1:
    return
  # Set on the registered handler itself: registering a copy would log orbax's warning about
  # overriding the jax.Array handler in every process that saves or restores.
  handler = ocp.type_handlers.get_type_handler(jax.Array)
  if getattr(handler, '_use_replica_parallel', False):
    handler._use_replica_parallel = False  # pylint: disable=protected-access


def _manager(directory: str, max_to_keep: int, read_only: bool = False) -> ocp.CheckpointManager:
  _single_process_saves_whole_shards()
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=not read_only, cleanup_tmp_directories=not read_only,
      enable_async_checkpointing=False)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                               item_names=('state', 'data', 'meta'))


class StageCheckpoints:
  """Latest and best checkpoints of one stage."""

  def __init__(self, stage_dir: str, max_to_keep: int = 2):
    self.stage_dir = stage_dir
    self.latest = _manager(os.path.join(stage_dir, 'checkpoints'), max_to_keep)
    self.best = _manager(os.path.join(stage_dir, 'best'), 1)

  def latest_step(self) -> int | None:
    return self.latest.latest_step()

  def save(self, step: int, state: Any, data_state: dict, meta: dict, *, best: bool = False):
    """Saves `state` at `step` (synchronously). `best=True` also stores it as the best one.

    The best copy is written first: the latest checkpoint's meta records that its step is the
    best, so a run killed between the two writes resumes from the previous latest checkpoint
    and writes both again, rather than resuming with a best checkpoint that was never saved.
    """
    def args():
      return ocp.args.Composite(state=ocp.args.StandardSave(state),
                                data=ocp.args.JsonSave(data_state),
                                meta=ocp.args.JsonSave(_jsonable(meta)))

    if best and self.best.latest_step() != step:
      self.best.save(step, args=args(), force=True)
    if self.latest.latest_step() != step:
      self.latest.save(step, args=args(), force=True)

  def restore_latest(self, abstract_state: Any) -> tuple[Any, dict, dict]:
    """Restores (state, data_state, meta) of the latest checkpoint into `abstract_state`'s
    shapes and shardings (a pytree of jax.ShapeDtypeStruct with `sharding`)."""
    step = self.latest.latest_step()
    restored = self.latest.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore()))
    return restored['state'], restored['data'], restored['meta']

  def close(self):
    self.latest.close()
    self.best.close()


def _jsonable(x: Any) -> Any:
  return json.loads(json.dumps(x, default=lambda o: o.tolist() if hasattr(o, 'tolist') else str(o)))


def read_meta(workdir: str, stage: str, which: str = 'best') -> dict | None:
  """The `meta` item of the stage's best (or latest) checkpoint, or None if there is none."""
  directory = _pick_dir(workdir, stage, which)
  if directory is None:
    return None
  mngr = _manager(directory, 1, read_only=True)
  step = mngr.latest_step()
  meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  mngr.close()
  return meta


def _pick_dir(workdir: str, stage: str, which: str) -> str | None:
  stage_dir = os.path.join(workdir, stage)
  order = {'best': ('best', 'checkpoints'), 'latest': ('checkpoints',)}[which]
  for sub in order:
    d = os.path.join(stage_dir, sub)
    if os.path.isdir(d) and any(name.isdigit() for name in os.listdir(d)):
      return d
  return None


def has_checkpoint(workdir: str, stage: str) -> bool:
  """Whether `workdir/<stage>` holds a complete (best or latest) checkpoint."""
  return _pick_dir(workdir, stage, 'best') is not None


_VARIABLES = ('params', 'model_state')
_DICT_KEY = 2  # orbax's KeyType.DICT in the tree metadata file


def _variables_target(state_dir: str) -> dict:
  """The saved `params` and `model_state` subtrees, every leaf `RestoreArgs` of a numpy array.

  The key paths come from orbax's tree metadata file (`_METADATA`, JSON) when it has the form
  known here (nested dicts, as flax variables are), instead of orbax's metadata call, which opens
  every saved array and took most of a small checkpoint's load (docs/performance.md,
  "Checkpoints"). Any other form goes through that call."""
  leaf = ocp.RestoreArgs(restore_type=np.ndarray)
  target = {}
  try:
    with open(os.path.join(state_dir, '_METADATA'), encoding='utf-8') as f:
      entries = json.load(f)['tree_metadata'].values()
    for entry in entries:
      keys = entry['key_metadata']
      if keys[0]['key'] not in _VARIABLES:
        continue
      if any(k['key_type'] != _DICT_KEY for k in keys):
        raise ValueError('not nested dicts')
      value = entry['value_metadata']
      if value['value_type'] == 'jax.Array' and not value['skip_deserialize']:
        kept = leaf
      elif value['value_type'] == 'Dict' and value['skip_deserialize']:
        kept = {}  # an empty dict (e.g. a model without state)
      else:
        raise ValueError(f'a leaf of type {value["value_type"]}')
      node = target
      for k in keys[:-1]:
        node = node.setdefault(k['key'], {})
      node[keys[-1]['key']] = kept
    if 'params' in target:
      return target
  except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
    pass
  tree = ocp.StandardCheckpointHandler().metadata(epath.Path(os.path.abspath(state_dir)))
  return {k: jax.tree.map(lambda _: leaf, tree[k], is_leaf=lambda m: hasattr(m, 'shape'))
          for k in _VARIABLES if k in tree}


def load_stage_variables(workdir: str, stage: str, which: str = 'best') -> dict:
  """Host (numpy) copies of a finished stage's `params` and `model_state`.

  Args:
    workdir: the run's workdir `W` (stages live in `W/<stage>/`).
    stage: 'tokenizer' | 'pretrain' | 'caption'.
    which: 'best' (falls back to the latest when no best exists) or 'latest'.

  Raises:
    UserError: when the stage has no checkpoint in `workdir`.
  """
  directory = _pick_dir(workdir, stage, which)
  if directory is None:
    raise errors.UserError(
        f'no {stage} checkpoint in {os.path.join(workdir, stage)}; run the {stage} stage first '
        f'(python -m procap_jax.main --config ... --workdir {workdir} '
        f'--config.stages=\'("{stage}",)\') or point --workdir at a run that has it')
  mngr = _manager(directory, 1, read_only=True)
  step = mngr.latest_step()
  # Only the variables, as host arrays whatever mesh and processes saved them (a run trained on a
  # multi-process mesh is evaluated or used for captioning on one machine); the optimiser state
  # (twice the parameters with Adam) stays on disk.
  target = _variables_target(os.path.join(directory, str(step), 'state'))
  restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      item=target, restore_args=target, partial_restore=True)))
  mngr.close()
  state = jax.tree.map(np.asarray, restored['state'])
  return {'params': state['params'], 'model_state': state.get('model_state', {}), 'step': step}


def latest_meta(ckpts: StageCheckpoints) -> dict | None:
  step = ckpts.latest.latest_step()
  if step is None:
    return None
  return ckpts.latest.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']


# Config entries that change the shapes or meaning of a stage's parameters.
_SHAPE_KEYS = {
    'tokenizer': ('tokenizer.model', 'data.image_size'),
    'pretrain': ('pretrain.model', 'tokenizer.model', 'data.image_size', 'data.num_keyframes',
                 'data.encoder_text'),
    'caption': ('caption.model', 'pretrain.model', 'tokenizer.model', 'data.image_size',
                'data.num_keyframes', 'data.name'),
}
# Model entries that change neither the parameters nor the values computed, and num_frames,
# derived from data.num_keyframes (compared) since it left the config.
_IGNORED_KEYS = config_lib.SCHEDULE_ONLY_KEYS | {'pretrain.model.num_frames'}
# Entries added to the schema after checkpoints existed whose value for those checkpoints (the
# behaviour before the entry) differs from a shipped config's, so a checkpoint without them is
# compared as if it had this value (config_migrate's; the other entries it fills are compared
# only where the checkpoint has them).
_EARLIER_VALUES = {k: config_migrate.ADDED_LATER[k]
                   for k in ('pretrain.model.frame_difference', 'data.encoder_text')}


def _lookup(d: dict, dotted: str):
  for part in dotted.split('.'):
    if not isinstance(d, dict) or part not in d:
      return None
    d = d[part]
  return d


def _flat(prefix: str, x) -> dict:
  if isinstance(x, dict):
    out = {}
    for k, v in x.items():
      out.update(_flat(f'{prefix}.{k}', v))
    return out
  return {prefix: json.loads(json.dumps(x, default=str))}


def config_differences(saved: dict, config, stage: str) -> list[str]:
  """Human-readable differences between a checkpoint's config and `config` for `stage`."""
  current = json.loads(json.dumps(config.to_dict(), default=str))
  diffs = []
  for key in _SHAPE_KEYS[stage]:
    section = _lookup(saved, key)
    if section is None and key in _EARLIER_VALUES:  # a single entry the checkpoint predates
      section = _EARLIER_VALUES[key]
    a, b = _flat(key, section), _flat(key, _lookup(current, key))
    if section is not None:
      a.update({k: v for k, v in _EARLIER_VALUES.items() if k in b and k not in a})
    # Entries the checkpoint's config lacks were added to the schema after it was saved, with
    # defaults that keep the earlier behaviour, so only the checkpoint's own entries are
    # compared (a section missing altogether still differs).
    names = set(a) if section is not None else set(a) | set(b)
    for k in sorted(names - _IGNORED_KEYS):
      if _norm(a.get(k)) != _norm(b.get(k)):
        diffs.append(f'{k}: checkpoint {a.get(k)!r} vs config {b.get(k)!r}')
  return diffs


def _norm(x):
  return json.loads(json.dumps(x)) if not isinstance(x, tuple) else list(x)


def check_config_compatible(saved: dict | None, config, stage: str) -> None:
  """Raises UserError naming what differs when a checkpoint was trained with another model."""
  if not saved:
    return
  diffs = config_differences(saved, config, stage)
  if diffs:
    raise errors.UserError(
        f'the {stage} checkpoint in this workdir was trained with a different config ('
        + '; '.join(diffs[:6]) + (' ...' if len(diffs) > 6 else '')
        + '); use another --workdir or the same config')
