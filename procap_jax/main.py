r"""Entry point: runs the stages of a config in order, skipping finished ones.

  python -m procap_jax.main --config configs/synthetic.py --workdir W
  python -m procap_jax.main --config configs/synthetic.py:quick --workdir W
  python -m procap_jax.main --config configs/synthetic.py --workdir W --mode evaluate \
      --split test --which best        # evaluate a saved caption checkpoint alone

Modes: `train` (default: build the dataset if needed, train every stage in `config.stages`,
then evaluate the best caption checkpoint on test and write W/results.json and W/report.html;
from the command line it then fills the caption command's inference cache, a few seconds, so
`python -m procap_jax.caption --workdir W` starts fast from its first call),
`evaluate` (restore a caption checkpoint and score a split; it first checks that W is a run made
with this config's model/data sections, with caption and tokenizer checkpoints, and that the
dataset is built, and builds nothing), `build` (only build the dataset and print its
statistics). Every mode refuses a W made with another model/data setup before building anything.

Multi-process (one process per host): set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID (see README); `jax.distributed.initialize` is called before anything else.
"""

import ast
import contextlib
import json
import os
import sys
from typing import NoReturn

from absl import app
from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags

from procap_jax import errors
from procap_jax import hostmem

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output directory of the run.')
_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'evaluate', 'build'], 'What to do.')
_SPLIT = flags.DEFINE_string('split', 'test', 'Split for --mode=evaluate.')
_WHICH = flags.DEFINE_enum('which', 'best', ['best', 'latest'], 'Checkpoint for --mode=evaluate.')
flags.mark_flags_as_required(['config', 'workdir'])


def _maybe_init_distributed() -> None:
  import jax
  if int(os.environ.get('JAX_NUM_PROCESSES', '1')) > 1:
    jax.distributed.initialize(
        coordinator_address=os.environ['JAX_COORDINATOR_ADDRESS'],
        num_processes=int(os.environ['JAX_NUM_PROCESSES']),
        process_id=int(os.environ['JAX_PROCESS_ID']))
    # The first collective opens the processes' connections, and a process that reaches it
    # while another is still busy (process 0 building the dataset or the feature cache) times
    # out connecting. Open them now, while every process is only starting.
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices('procap_jax.main.start')


@errors.exit_on_user_error
def _use_cpu_devices(config) -> None:
  """Applies `config.mesh.cpu_devices` (1 by default; 0 = one device per core) before JAX starts."""
  from procap_jax import sharding  # lazy: start-up (stages ~9 s, main ~0.2 s)
  n = sharding.use_cpu_devices(config)
  if n is not None and n > 1:
    print(f'running on {n} CPU devices, data-parallel (config.mesh.cpu_devices=1: one device)',
          flush=True)


@errors.exit_on_user_error
def run(config, workdir: str, mode: str = 'train', split: str = 'test',
        which: str = 'best') -> dict:
  """Does what `mode` says; returns the results dict (tests call this directly).

  `evaluate` checks its inputs first and builds nothing (`_evaluate`); `train` and `build`
  build the dataset when it is missing.
  """
  from procap_jax import config_lib  # lazy: start-up (stages ~9 s, main ~0.2 s)
  config_lib.validate(config)  # before the slow imports below
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise errors.UserError(f'--workdir {workdir} is a file, not a directory; give the directory '
                           'of a run (a new one is created)')
  # 'auto' bf16 switches -> bfloat16 or float32, once; the run's config.json records the result
  print(config_lib.resolve_compute_path(config, workdir), flush=True)
  if mode == 'evaluate':
    return _evaluate(config, workdir, split, which)
  config_lib.check_saved_config(config, workdir)  # a run of another setup: before any build

  from procap_jax import stages  # lazy: start-up (stages ~9 s, main ~0.2 s)
  from procap_jax.data import pipeline  # lazy: start-up (stages ~9 s, main ~0.2 s)

  errors.remove_stale_temp_files(workdir)  # left by a run killed while writing a file
  stages.prepare_data(config, workdir)
  errors.remove_stale_temp_files(pipeline.dataset_dir(config, workdir), max_depth=0)
  config = pipeline.resolve(config, workdir)  # vocabulary sizes, then frozen
  config_lib.check_workdir(config, workdir)
  if mode == 'build':
    stats = stages.dataset_statistics(config, workdir)
    print(json.dumps(stats, indent=1))
    return stats
  return stages.run_all(config, workdir)


def _evaluate(config, workdir: str, split: str, which: str) -> dict:
  """`--mode evaluate`, in this order: the split name, the workdir (a run, made with this
  config's model/data sections, with caption and tokenizer checkpoints), the dataset (built:
  evaluation never builds it), then the slow imports, the restore and the scoring. The run's
  config.json is left as it is."""
  from procap_jax import config_lib  # lazy: start-up (stages ~9 s, main ~0.2 s)
  if split not in config_lib.EVAL_SPLITS:
    raise errors.UserError(f'--split {split} is not a split; choose one of '
                           f'{", ".join(config_lib.EVAL_SPLITS)}')
  config_lib.check_run(workdir, which, config)
  from procap_jax.data import datasets  # lazy: TFDS, a second or two; only evaluate checks it
  datasets.check_built(config, workdir)

  from procap_jax import stages  # lazy: start-up (stages ~9 s, main ~0.2 s)
  from procap_jax.data import pipeline  # lazy: start-up (stages ~9 s, main ~0.2 s)

  errors.remove_stale_temp_files(workdir)
  # No prepare_data: the dataset is built, and the captioner reads only the before and after
  # images, so a missing confidence-scores file (keyframes) does not change what is scored.
  config = pipeline.resolve(config, workdir)  # vocabulary sizes, then frozen
  return stages.evaluate_caption(config, workdir, split, which)


def _config_file_argument(argv: list[str]) -> str | None:
  """The value of `--config` in `argv` (`file.py[:preset]`), or None when absent."""
  for i, arg in enumerate(argv):
    if arg.startswith('--config='):
      return arg[len('--config='):]
    if arg == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _one_line(message: str) -> str:
  """A flag error as one line: an embedded traceback is reduced to its final line."""
  head, sep, trace = str(message).partition('Traceback (most recent call last):')
  if sep:
    last = [line for line in trace.strip().splitlines() if line.strip()][-1]
    head = f'{head.strip().rstrip(":")}: {last.strip()}'
  return ' '.join(head.split())


_QUOTES = '\'"'


def _override_problem(e: Exception) -> str:
  """What ml_collections says about a bad override, as one line.

  An unknown key arrives as AttributeError(KeyError("'key'\\nDid you mean ...")), whose text is
  the repr of the KeyError's message.
  """
  text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
  if text and text[0] in _QUOTES:
    with contextlib.suppress(ValueError, SyntaxError):
      text = str(ast.literal_eval(text))
  if isinstance(e, (AttributeError, KeyError)):
    key, _, hint = text.partition('\n')
    hint = ' '.join(hint.split())
    return f'unknown key {key.strip(_QUOTES)!r}' + (f' ({hint})' if hint else '')
  return _one_line(text)


def _fail(message: str) -> NoReturn:
  """Prints `error: <message>` on stderr and exits with status 2."""
  print(f'error: {message}', file=sys.stderr)
  raise SystemExit(2)


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing with one clear sentence for a bad config file, flag or override."""
  config_arg = _config_file_argument(argv[1:])
  if config_arg is not None:
    path = config_arg.split(':', 1)[0]
    if not os.path.isfile(path):
      _fail(f'config file {path} does not exist; pass --config <file.py>[:<preset>], e.g. '
            '--config configs/synthetic.py:quick')
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    if config_arg is not None and '--config=None' in str(e):
      _fail(f'config file {config_arg} did not give a config: its get_config() must return an '
            'ml_collections.ConfigDict')
    _fail(_one_line(str(e)))
  except SyntaxError as e:
    _fail(f'config file {e.filename} has a syntax error at line {e.lineno}: {e.msg}')
  except (AttributeError, KeyError, TypeError, ValueError, OSError) as e:
    if "attribute 'get_config'" in str(e):
      _fail(f'config file {config_arg} has no get_config() function; see configs/synthetic.py')
    bad = [a for a in argv if a.startswith('--config.')]
    _fail(f'bad config override ({", ".join(bad) or "?"}): {_override_problem(e)}; check the key '
          'names in the config file')
  value = _CONFIG.value
  if not isinstance(value, ml_collections.ConfigDict):
    if type(value).__name__ == '_ErrorConfig':  # config_flags defers load errors (OSError)
      error = getattr(value, '_error')
      _fail(f'cannot load the config file {config_arg}: {_one_line(str(error))}')
    _fail(f'config file {config_arg} did not give a config: its get_config() must return an '
          'ml_collections.ConfigDict')
  return rest


def warm_up_caption_command(workdir: str) -> bool:
  """Runs `python -m procap_jax.caption --workdir W --warm_up` in a fresh process (the
  command's own start, so its compiled model is what later commands find in the cache).
  A failure is a notice, not an error: the run itself is finished. Returns success."""
  import subprocess
  print('filling the caption command\'s inference cache (a few seconds) ...', flush=True)
  proc = subprocess.run([sys.executable, '-m', 'procap_jax.caption', '--workdir', workdir,
                         '--warm_up'], capture_output=True, text=True, check=False)
  lines = (proc.stdout + proc.stderr).strip().splitlines()
  if proc.returncode == 0:
    print(lines[-1] if lines else 'inference cache ready', flush=True)
    return True
  print('note: could not fill the inference cache (the first caption command will fill it): '
        + (lines[-1] if lines else f'exit status {proc.returncode}'), flush=True)
  return False


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config, workdir = _CONFIG.value, _WORKDIR.value
  if int(os.environ.get('JAX_NUM_PROCESSES', '1')) <= 1:
    _use_cpu_devices(config)
  _maybe_init_distributed()
  results = run(config, workdir, _MODE.value, _SPLIT.value, _WHICH.value)
  from procap_jax import config_lib  # lazy: start-up (stages ~9 s, main ~0.2 s)
  # Only ProCap runs are warmed: DUDA runs are the field's baseline, evaluated, seldom captioned.
  if (_MODE.value == 'train' and results and 'caption' in config.stages
      and config_lib.caption_kind(config) == 'procap'
      and int(os.environ.get('JAX_PROCESS_ID', '0')) == 0):
    warm_up_caption_command(workdir)


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  sys.exit(app.run(main, flags_parser=parse_flags))
