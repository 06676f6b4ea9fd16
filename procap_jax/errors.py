"""The one exception type whose message is shown to users.

A `UserError` means the user can fix it (a missing file, a corrupt image, an unknown config
key, an empty caption). Entry points catch it, print its message as one sentence and exit
with a non-zero status; every other exception is a bug and keeps its traceback.
"""

import contextlib
import json
import os
import sys
import tempfile
from typing import Iterator


class UserError(Exception):
  """An error the user can fix; its message is one sentence naming the thing and the fix."""


def exit_on_user_error(fn):
  """Decorator for entry points: a UserError becomes one line on stderr and exit status 2."""

  def wrapper(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except UserError as e:
      print(f'error: {e}', file=sys.stderr)
      raise SystemExit(2) from None

  wrapper.__name__ = getattr(fn, '__name__', 'wrapper')
  wrapper.__doc__ = fn.__doc__
  return wrapper


@contextlib.contextmanager
def atomic_path(path: str, mode_suffix: str = '') -> Iterator[str]:
  """Yields a temporary path next to `path`; renames it onto `path` only on success.

  Usage: `with atomic_path(out) as tmp: write(tmp)`. Nothing is left half-written: on an
  exception the temporary file is removed and `path` is untouched.
  """
  directory = os.path.dirname(os.path.abspath(path)) or '.'
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    raise UserError(f'cannot create directory {directory}: {e.strerror}') from None
  if not os.access(directory, os.W_OK):
    raise UserError(f'directory {directory} is not writable; choose another output location')
  fd, tmp = tempfile.mkstemp(prefix='.' + os.path.basename(path) + '.', suffix=mode_suffix + '.tmp',
                             dir=directory)
  os.close(fd)
  try:
    yield tmp
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


def write_text_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` atomically (temp file + rename)."""
  with atomic_path(path) as tmp:
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write(text)


def check_writable_dir(path: str, hint: str = 'choose another one') -> None:
  """Creates `path` if needed and checks a file can be written there; UserError otherwise."""
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise UserError(f'data directory {path} is not writable ({e.strerror}); {hint}') from None


def read_json(path: str, what: str, missing_hint: str, corrupt_hint: str):
  """Parsed JSON of `path`; one UserError naming `what` when it is missing or unreadable."""
  if not os.path.isfile(path):
    raise UserError(f'{what} {path} does not exist; {missing_hint}')
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise UserError(f'{what} {path} is not readable JSON ({e}); {corrupt_hint}') from None
