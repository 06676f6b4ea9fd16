"""Test setup: 8 fake CPU devices (for the sharding tests) and the shared fixtures folder."""

import os

import xla_settings  # tests/ is on the path (pytest's default import mode)

os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {xla_settings.xla_flags(8)}".strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Tests run tiny models for a few steps, so XLA's compile time outweighs the run time it saves:
# without most of its optimisation passes the slowest compile-bound test takes 43 s instead of
# 68 s, and the whole suite 749 s instead of 1,046 s (with the (2, 4) mesh kept for stage 1
# only). The passes left out change speed, not what a program computes (beyond float rounding),
# and sharding is still partitioned. The training runs themselves (`procap_jax.main`) compile
# with every optimisation. JAX_DISABLE_MOST_OPTIMIZATIONS=0 tests with the optimised compiler.
os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# One persistent XLA compilation cache per test session, shared with the subprocesses tests
# start: most of a tiny run's time is compiling, and many tests (and the two-process and
# kill-and-resume runs) compile the same train steps again. Entries are keyed by the program and
# its options, so a hit is the same executable. Removed when the session ends.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix='procap-jax-test-xla-cache-')
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _CACHE
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.5')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / 'shared' / 'fixtures'


@pytest.fixture(scope='session')
def fixtures_dir() -> pathlib.Path:
  """The real third-party fixture files (../shared/fixtures); skips the test when absent."""
  if not FIXTURES.is_dir():
    pytest.skip('../shared/fixtures is absent')
  return FIXTURES


@pytest.fixture(autouse=True, scope='session')
def _absl_flags_parsed():
  # grain worker processes and some libraries read absl flags.
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


@pytest.fixture(scope='session')
def tiny_data_dir(tmp_path_factory) -> str:
  """The `tiny` synthetic benchmark, built once per test session."""
  from tfds_builders import synthetic_change
  d = str(tmp_path_factory.mktemp('data'))
  synthetic_change.prepare('tiny', d)
  return d


@pytest.fixture()
def tiny_config(tiny_data_dir):
  """The tiny preset of the default config, reading the session's tiny dataset."""
  from configs import synthetic
  config = synthetic.get_config('tiny')
  config.data.data_dir = tiny_data_dir
  return config


@pytest.fixture(scope='session')
def short_tiny_config(tiny_data_dir):
  """`make(steps, every)`: the tiny preset on the session's tiny dataset with `steps` steps a
  stage, a checkpoint every `every` steps and one evaluation at the end (for module-scoped
  finished runs: the suite runs unoptimised XLA code, so steps cost seconds)."""
  from configs import synthetic

  def make(steps: int, every: int):
    config = synthetic.get_config('tiny')
    config.data.data_dir = tiny_data_dir
    for stage in ('tokenizer', 'pretrain', 'caption'):
      t = config[stage].train
      t.steps, t.checkpoint_every, t.eval_every, t.log_every = steps, every, steps, every
    return config

  return make


# The slowest files first (descending, by their summed test durations): the two xdist workers
# take whole files in collection order (pyproject.toml's --no-loadscope-reorder keeps this
# order; without it xdist sorts files by their number of tests), so a long file left for the
# end would run alone while the other worker idles.
_SLOW_FILES_FIRST = ('end_to_end_test.py', 'real_builders_test.py', 'multihost_test.py',
                     'train_sharding_test.py', 'paper_preset_test.py',
                     'reliability_train_test.py', 'duda_test.py', 'levir_cc_test.py',
                     'init_from_test.py', 'convert_procap_test.py')


def pytest_collection_modifyitems(session, config, items):
  del session, config
  rank = {name: i for i, name in enumerate(_SLOW_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within each file


# ---------------------------------------------------------------------------------------------
# docs/reliability.md: tests record each fault they try and what happened on their report;
# `python -m procap_jax.diagnostics.reliability_table` runs them and writes the table.
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def fault(request):
  """`fault(entry_point, fault, result)` records one row of docs/reliability.md.

  `result` is what the test observed (e.g. the error sentence); paths under pytest's temporary
  folder are shortened to `<tmp>/name`. The row goes on the test's report (a user property);
  the table command keeps the rows of the tests that passed.
  """
  import re
  from procap_jax.diagnostics import reliability_table
  base = str(request.config._tmp_path_factory.getbasetemp())  # pylint: disable=protected-access

  def record(entry_point: str, what: str, result: str) -> None:
    text = re.sub(re.escape(base) + r'/[^/\s]+', '<tmp>', ' '.join(str(result).split()))
    row = {'entry point': entry_point, 'fault': what, 'result': text}
    request.node.user_properties.append((reliability_table.ROW_PROPERTY, row))

  return record
