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
