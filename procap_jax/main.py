r"""Entry point: runs the stages of a config in order, skipping finished ones.

  python -m procap_jax.main --config configs/synthetic.py --workdir W
  python -m procap_jax.main --config configs/synthetic.py:quick --workdir W
  python -m procap_jax.main --config configs/synthetic.py --workdir W --mode evaluate \
      --split test --which best        # evaluate a saved caption checkpoint alone

Modes: `train` (default: build the dataset if needed, train every stage in `config.stages`,
then evaluate the best caption checkpoint on test and write W/results.json and W/report.html),
`evaluate` (restore a caption checkpoint and score a split), `build` (only build the dataset
and print its statistics).

Multi-process (one process per host): set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID (see README); `jax.distributed.initialize` is called before anything else.
"""

import json
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from procap_jax import errors

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output directory of the run.')
_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'evaluate', 'build'], 'What to do.')
_SPLIT = flags.DEFINE_string('split', 'test', 'Split for --mode=evaluate.')
_WHICH = flags.DEFINE_string('which', 'best', "Checkpoint for --mode=evaluate: 'best', 'latest'.")
flags.mark_flags_as_required(['config', 'workdir'])


def _maybe_init_distributed() -> None:
  import jax
  if int(os.environ.get('JAX_NUM_PROCESSES', '1')) > 1:
    jax.distributed.initialize(
        coordinator_address=os.environ['JAX_COORDINATOR_ADDRESS'],
        num_processes=int(os.environ['JAX_NUM_PROCESSES']),
        process_id=int(os.environ['JAX_PROCESS_ID']))


@errors.exit_on_user_error
def run(config, workdir: str, mode: str = 'train', split: str = 'test',
        which: str = 'best') -> dict:
  """Does what `mode` says; returns the results dict (tests call this directly)."""
  from procap_jax import config_lib
  from procap_jax import stages

  from procap_jax.data import pipeline

  config_lib.validate(config)
  stages.prepare_data(config, workdir)
  pipeline.resolve_vocab_sizes(config, workdir)
  config_lib.check_workdir(config, workdir)
  if mode == 'build':
    stats = stages.dataset_statistics(config, workdir)
    print(json.dumps(stats, indent=1))
    return stats
  if mode == 'evaluate':
    return stages.evaluate_caption(config, workdir, split, which)
  return stages.run_all(config, workdir)


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing with one clear sentence for bad flags or unknown config keys."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f'error: {e}', file=sys.stderr)
    raise SystemExit(2) from None
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    bad = [a for a in argv if a.startswith('--config.')]
    print(f'error: bad config override ({", ".join(bad) or "?"}): {e}; check the key names in '
          'the config file', file=sys.stderr)
    raise SystemExit(2) from None


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  _maybe_init_distributed()
  run(_CONFIG.value, _WORKDIR.value, _MODE.value, _SPLIT.value, _WHICH.value)


if __name__ == '__main__':
  sys.exit(app.run(main, flags_parser=parse_flags))
