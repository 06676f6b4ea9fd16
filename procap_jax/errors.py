"""The one exception type whose message is shown to users.

A `UserError` means the user can fix it (a missing file, a corrupt image, an unknown config
key, an empty caption). Entry points catch it, print its message as one sentence and exit
with a non-zero status; every other exception is a bug and keeps its traceback.
"""

import contextlib
import json
import os
import re
import socket
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


def _writer_tag() -> str:
  """`<host>-<pid>` of this process, as it appears in temporary file names."""
  return f'{re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())}-{os.getpid()}'


# `.<name>.<host>-<pid>.<random>[<mode suffix>].tmp`, as `atomic_path` names its temporary files.
_TEMP_NAME = re.compile(r'^\..+\.(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)\.[a-z0-9_]+(\.\w+)?\.tmp$')


@contextlib.contextmanager
def atomic_path(path: str, mode_suffix: str = '') -> Iterator[str]:
  """Yields a temporary path next to `path`; renames it onto `path` only on success.

  Usage: `with atomic_path(out) as tmp: write(tmp)`. Nothing is left half-written: on an
  exception the temporary file is removed and `path` is untouched. A process killed during the
  write (SIGKILL) leaves its temporary file, named after the host and process id;
  `remove_stale_temp_files` deletes it on the next start.
  """
  directory = os.path.dirname(os.path.abspath(path)) or '.'
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    raise UserError(f'cannot create directory {directory}: {e.strerror}') from None
  if not os.access(directory, os.W_OK):
    raise UserError(f'directory {directory} is not writable; choose another output location')
  fd, tmp = tempfile.mkstemp(prefix=f'.{os.path.basename(path)}.{_writer_tag()}.',
                             suffix=mode_suffix + '.tmp', dir=directory)
  os.close(fd)
  try:
    yield tmp
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def remove_stale_temp_files(directory: str, max_depth: int = 2) -> list[str]:
  """Deletes the temporary files of killed `atomic_path` writers under `directory`.

  Only files this host's dead processes left are removed (their names carry host and process
  id), so writers on other hosts sharing the directory and live writers here are untouched.

  Args:
    directory: the folder to clean (missing: nothing to do).
    max_depth: how many folder levels below `directory` to visit (checkpoint trees are deeper).

  Returns:
    The removed paths.
  """
  host = _writer_tag().rsplit('-', 1)[0]
  removed = []
  base = os.path.abspath(directory)
  for root, dirs, files in os.walk(base):
    if root[len(base):].count(os.sep) >= max_depth:
      dirs[:] = []
    for name in files:
      m = _TEMP_NAME.match(name)
      if m and m['host'] == host and int(m['pid']) != os.getpid() and not _alive(int(m['pid'])):
        with contextlib.suppress(FileNotFoundError):
          os.remove(os.path.join(root, name))
          removed.append(os.path.join(root, name))
  return removed


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
