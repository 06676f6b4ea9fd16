r"""Converts the original's weight files into a run's workdir.

  # A taming VQGAN (e.g. ProCap's clevr_epoch=000035.ckpt): W/tokenizer becomes a finished stage.
  python -m procap_jax.convert taming VQGAN.ckpt --config configs/clevr_change.py:paper --workdir W
  # Released ProCap checkpoints: W/caption (and W/pretrain with --stage1) become finished stages.
  python -m procap_jax.convert procap STAGE2.chkpt --stage1 STAGE1.pth \
      --config configs/clevr_change.py:paper --config.data.word2idx_file=clevr_word2idx.json \
      --workdir W
  # OpenAI CLIP: checks that the file converts into the stage-1 encoder and prints the flag that
  # starts stage 1 from it (CLIP gives the blocks only, so no stage is finished by it).
  python -m procap_jax.convert clip ViT-B-32.pt --config configs/clevr_change.py:paper --workdir W

Each file must be the kind its conversion takes (from its keys: a taming VQModel, an OpenAI CLIP
ViT, a ProCap stage-1 or stage-2 checkpoint), and a stage is written as finished only when every
one of its parameters came from the file; `--allow_init` writes it anyway, listing the ones that
keep their fresh initialisation. A file whose pickle names code outside the reader's allow-list
is read for its tensors with one warning line; `--strict` (config.weight_files.strict) refuses it.

Then `python -m procap_jax.main ... --mode evaluate` and `python -m procap_jax.caption --workdir
W` use the converted stages like trained ones (the caption stage needs W/tokenizer too). A stage
that already has a checkpoint in W is refused; on any error nothing is written.
"""

import json
import os
import sys

from absl import app
from absl import flags
from absl import logging

from procap_jax import checkpointing
from procap_jax import config_lib
from procap_jax import errors
from procap_jax import main as main_lib  # --config, --workdir and their one-sentence errors
from procap_jax import sharding
from procap_jax import stages
from procap_jax import train
from procap_jax.convert import common
from procap_jax.convert import init
from procap_jax.convert import taming
from procap_jax.convert import torch_files
from procap_jax.data import pipeline
from procap_jax.diagnostics import stand_ins

_STAGE1 = flags.DEFINE_string('stage1', '', 'procap: a released stage-1 checkpoint as well.')
_STRICT = flags.DEFINE_bool('strict', False, 'Refuse a weight file whose pickle names code '
                            'outside the reader\'s allow-list (= config.weight_files.strict).')
_ALLOW_INIT = flags.DEFINE_bool('allow_init', False, 'Write a stage as finished even when some '
                                'of its parameters keep their fresh initialisation (listed).')
KINDS = ('taming', 'clip', 'procap')
# (conversion, role) -> the file kind it takes (convert.init.KIND_NAMES).
_EXPECTED = {('taming', 'tokenizer'): 'taming', ('clip', 'pretrain'): 'clip',
             ('procap', 'caption'): 'procap_stage2', ('procap', 'pretrain'): 'procap_stage1'}


def _what_takes(kind: str | None, path: str) -> str:
  """The command (or setting) that takes a file of `kind`."""
  if kind == 'clip':
    return ('CLIP gives only the stage-1 encoder\'s blocks, so no stage is finished from it: '
            f'start stage 1 from it with --config.pretrain.init_from={path} (python -m '
            f'procap_jax.convert clip {path} checks that it fits)')
  if kind == 'taming':
    return f'convert it with python -m procap_jax.convert taming {path}'
  if kind == 'procap_stage1':
    return (f'convert it with python -m procap_jax.convert procap STAGE2 --stage1 {path}, or '
            f'start stage 1 from it with --config.pretrain.init_from={path}')
  if kind == 'procap_stage2':
    return f'convert it with python -m procap_jax.convert procap {path}'
  return 'check that it is the file you meant'


def check_kind(conversion: str, role: str, path: str, state: dict) -> None:
  """Raises one sentence unless `state` (read from `path`) is the kind `conversion` takes in
  `role`: naming the file, what it looks like and the command that takes it."""
  want = _EXPECTED[(conversion, role)]
  kind = init.identify(state)
  if want == 'taming' and taming.MARK in init.vqgan_state(state):
    return  # a taming checkpoint, or a ProCap one holding its frozen VQGAN
  if kind == want:
    return
  flag = ' --stage1' if role == 'pretrain' and conversion == 'procap' else ''
  raise common.ConversionError(
      f'{path} is {init.describe(state)}, not {init.KIND_NAMES[want]} as convert {conversion}'
      f'{flag} takes; {_what_takes(kind, path)}')


def _initialised_why(path: tuple[str, ...]) -> str:
  if path[0] == 'disc':
    return 'the discriminator, which only tokenizer training uses'
  return 'not in the file'


def _fresh_state(config, stage: str):
  """(task, a freshly initialised TrainState of `stage`, its shardings) on the config's mesh."""
  import jax
  task = stages.TASKS[stage]
  model = task.build_model(config)
  mesh = sharding.mesh_from_config(config)
  tx = task.make_optimizer(config, int(config[stage].train.steps))
  state, state_sh = train.create_state(task, model, config, tx, jax.random.key(int(config.seed)),
                                       stand_ins.fake_batch(config, 1), mesh)  # shapes only
  return task, state, state_sh


def converted_from_file(config, stage: str, path: str, state: dict, allow_init: bool):
  """The TrainState of `stage` with `path`'s weights (nothing written).

  Raises:
    ConversionError: some parameters would keep their fresh initialisation and not
      `allow_init` (one sentence listing them and why).
  """
  import flax
  import jax
  from flax import linen as nn
  _, fresh, state_sh = _fresh_state(config, stage)
  new = init.converted(stage, config, path, state)
  ours = flax.traverse_util.flatten_dict(nn.meta.unbox(jax.device_get(fresh.params)))
  given = flax.traverse_util.flatten_dict(dict(new))
  kept = [p for p in ours if p not in given]
  if kept:
    names = ', '.join(f'{"/".join(p)} ({_initialised_why(p)})' for p in kept[:4])
    more = f' and {len(kept) - 4} more' if len(kept) > 4 else ''
    message = (f'{path} gives {len(ours) - len(kept)} of the {len(ours)} parameters of the '
               f'{stage} stage; {len(kept)} would keep their fresh initialisation: {names}{more}')
    if not allow_init:
      raise common.ConversionError(f'{message}; so the stage is not written as finished (pass '
                                   '--allow_init to write it anyway)')
    print(f'warning: {message}; written as finished because of --allow_init', file=sys.stderr,
          flush=True)
  what = {'tokenizer': 'the tokenizer', 'pretrain': 'the stage-1 encoder',
          'caption': 'the captioner'}[stage]
  params = common.merge_into(jax.device_get(fresh.params), new, what=what)
  return fresh.replace(params=jax.device_put(params, state_sh.params))


def converted_state(config, stage: str):
  """The TrainState of `stage` with `config.<stage>.init_from`'s weights (nothing written)."""
  import jax
  task, state, state_sh = _fresh_state(config, stage)
  params = task.restore_init(jax.device_get(state.params), config, None)
  return state.replace(params=jax.device_put(params, state_sh.params))


def write_stage(config, workdir: str, stage: str, state, source: str) -> None:
  """Saves `state` as `stage`'s step-0 best checkpoint in `workdir` and marks the stage done."""
  ckpts = checkpointing.StageCheckpoints(os.path.join(workdir, stage))
  meta = {'config': config.to_dict(), 'stage': stage, 'step': 0, 'best_value': None,
          'metrics': {}, 'converted_from': os.path.abspath(source)}
  ckpts.save(0, state, {}, meta, best=True)
  ckpts.close()
  summary = {'stage': stage, 'steps': 0, 'val': {}, 'best': {'step': 0},
             'converted_from': os.path.abspath(source)}
  errors.write_text_atomic(train.stage_done_path(workdir, stage), json.dumps(summary, indent=1))
  print(f'[{stage}] wrote the weights of {source} to {os.path.join(workdir, stage)}', flush=True)


@errors.exit_on_user_error
def convert(config, workdir: str, kind: str, source: str, stage1: str = '',
            allow_init: bool = False) -> list[str]:
  """Converts `source` (and `stage1`) as `kind`; returns the stages written.

  Every file is read and checked (its kind, every parameter of a finished stage from it,
  the shapes) before anything is written; `allow_init`: see `converted_from_file`."""
  if kind not in KINDS:
    raise errors.UserError(f'unknown conversion {kind!r}; choose one of {", ".join(KINDS)}')
  config_lib.validate(config)
  print(config_lib.resolve_compute_path(config, workdir), flush=True)
  if kind == 'clip':
    state = init.read(source, 'the CLIP file', config, warn=False)
    check_kind('clip', 'pretrain', source, state)
    torch_files.warn_foreign(source, state.foreign)
    config.pretrain.init_from = source
    init.converted('pretrain', config, source, state)  # raises on any mismatch
    print(f'{source} converts into the stage-1 encoder\'s {config.pretrain.model.depth} blocks; '
          f'start stage 1 from it with --config.pretrain.init_from={source}', flush=True)
    return []
  plan = [('tokenizer', source)] if kind == 'taming' else [('caption', source)]
  if kind == 'procap':
    if not config.data.word2idx_file:
      raise errors.UserError('a ProCap stage-2 checkpoint needs its official vocabulary: set '
                             '--config.data.word2idx_file=<clevr_word2idx.json or the like>')
    if stage1:
      plan.insert(0, ('pretrain', stage1))
    pipeline.resolve_vocab_sizes(config, workdir)
  for stage, path in plan:
    if checkpointing.has_checkpoint(workdir, stage):
      raise errors.UserError(f'{os.path.join(workdir, stage)} already has a checkpoint; convert '
                             'into a new --workdir')
    if not os.path.isfile(path):
      raise common.ConversionError(f'{path} does not exist; give the path of the downloaded file')
  states = []
  for stage, path in plan:  # every conversion checked before anything is written
    state = init.read(path, 'the weight file', config, warn=False)
    check_kind(kind, stage, path, state)
    torch_files.warn_foreign(path, state.foreign)
    config[stage].init_from = path
    states.append((stage, converted_from_file(config, stage, path, state, allow_init), path))
    del state
  config_lib.check_workdir(config, workdir)
  for stage, state, path in states:
    write_stage(config, workdir, stage, state, path)
  return [stage for stage, _, _ in states]


def main(argv):
  logging.set_verbosity(logging.WARNING)
  args = argv[1:]
  if len(args) != 2 or args[0] not in KINDS:
    main_lib._fail(f'usage: python -m procap_jax.convert {{{",".join(KINDS)}}} FILE --config C '
                   '--workdir W [--stage1 FILE]')
  config = main_lib._CONFIG.value
  if _STRICT.value:
    config.weight_files.strict = True
  convert(config, main_lib._WORKDIR.value, args[0], args[1], _STAGE1.value, _ALLOW_INIT.value)


if __name__ == '__main__':
  sys.exit(app.run(main, flags_parser=main_lib.parse_flags))
