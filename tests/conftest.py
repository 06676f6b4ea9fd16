"""Test setup: 8 fake CPU devices (for the sharding tests) and the shared fixtures folder."""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

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
  synthetic_change.build('tiny', d)
  return d


@pytest.fixture()
def tiny_config(tiny_data_dir):
  """The tiny preset of the default config, reading the session's tiny dataset."""
  from configs import synthetic
  config = synthetic.get_config('tiny')
  config.data.data_dir = tiny_data_dir
  return config
