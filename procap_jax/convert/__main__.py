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

from procap_jax import errors
from procap_jax import main as main_lib  # --config, --workdir and their one-sentence errors

_STAGE1 = flags.DEFINE_string('stage1', '', 'procap: a released stage-1 checkpoint as well.')
KINDS = ('taming', 'clip', 'procap')


def converted_state(config, stage: str):
  """The TrainState of `stage` with `config.<stage>.init_from`'s weights (nothing written)."""
  import jax
  from procap_jax import sharding
  from procap_jax import stages
  from procap_jax import train
  from procap_jax.diagnostics import stand_ins
  task = stages.TASKS[stage]
  model = task.build_model(config)
  mesh = sharding.mesh_from_config(config)
  tx = task.make_optimizer(config, int(config[stage].train.steps))
  state, state_sh = train.create_state(task, model, config, tx, jax.random.key(int(config.seed)),
                                       stand_ins.fake_batch(config, 1), mesh)  # shapes only
  params = task.restore_init(jax.device_get(state.params), config, None)
  return state.replace(params=jax.device_put(params, state_sh.params))


def write_stage(config, workdir: str, stage: str, state, source: str) -> None:
  """Saves `state` as `stage`'s step-0 best checkpoint in `workdir` and marks the stage done."""
  from procap_jax import checkpointing
  from procap_jax import train
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
def convert(config, workdir: str, kind: str, source: str, stage1: str = '') -> list[str]:
  """Converts `source` (and `stage1`) as `kind`; returns the stages written."""
  from procap_jax import checkpointing
  from procap_jax import config_lib
  from procap_jax.convert import common
  from procap_jax.convert import init
  from procap_jax.data import pipeline
  if kind not in KINDS:
    raise errors.UserError(f'unknown conversion {kind!r}; choose one of {", ".join(KINDS)}')
  config_lib.validate(config)
  if kind == 'clip':
    config.pretrain.init_from = source
    init.converted('pretrain', config, source)  # raises on any mismatch
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
    config[stage].init_from = path
    states.append((stage, converted_state(config, stage), path))
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
  convert(main_lib._CONFIG.value, main_lib._WORKDIR.value, args[0], args[1], _STAGE1.value)


if __name__ == '__main__':
  sys.exit(app.run(main, flags_parser=main_lib.parse_flags))
