"""What the reliability tests (tests/reliability_*_test.py) share: subprocess settings, the
check for leftover temporary files, the one-sentence exit check and hand-made image bytes."""

import io
import os
import struct
import zlib

import numpy as np
import PIL.Image
import pytest

from procap_jax import errors
import xla_settings


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subprocess_env(cache_dir: str) -> dict:
  """The environment of a subprocess run: one CPU device, unoptimised XLA code and a
  persistent compilation cache in `cache_dir` shared by the runs of a test."""
  env = dict(os.environ)
  env.update(XLA_FLAGS=xla_settings.xla_flags(1), JAX_PLATFORMS='cpu',
             PYTHONUNBUFFERED='1', TF_CPP_MIN_LOG_LEVEL='3', JAX_DISABLE_MOST_OPTIMIZATIONS='1',
             JAX_COMPILATION_CACHE_DIR=cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  return env


def leftovers(directory: str) -> list[str]:
  """Temporary files and directories a clean run must not leave behind."""
  out = []
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      if ('orbax-checkpoint-tmp' in name or name.startswith('incomplete.')
          or errors._TEMP_NAME.match(name)):  # pylint: disable=protected-access
        out.append(os.path.relpath(os.path.join(root, name), directory))
  return out


def exit_message(capsys, fn, *args, **kwargs) -> str:
  """Calls an entry point that must exit with status 2; returns its one `error:` line."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as info:
    fn(*args, **kwargs)
  assert info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: ') and '\n' not in err and 'Traceback' not in err, err
  return err


def png(width: int = 8, height: int = 6, mode: str = 'RGB') -> bytes:
  """A PNG of one grey level."""
  buf = io.BytesIO()
  PIL.Image.new(mode, (width, height), 100).save(buf, format='PNG')
  return buf.getvalue()


def jpeg() -> bytes:
  """A 24 x 24 JPEG of random pixels."""
  buf = io.BytesIO()
  rgb = np.random.default_rng(0).integers(0, 255, (24, 24, 3), np.uint8)
  PIL.Image.fromarray(rgb).save(buf, format='JPEG')
  return buf.getvalue()


def huge_png(width: int = 20000, height: int = 20000) -> bytes:
  """A small PNG whose header claims `width` x `height` pixels."""
  small = png()
  body = struct.pack('>II', width, height) + small[24:29]
  return small[:16] + body + struct.pack('>I', zlib.crc32(b'IHDR' + body) & 0xFFFFFFFF) + small[33:]
