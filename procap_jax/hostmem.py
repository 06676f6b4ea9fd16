"""Large host buffers on transparent huge pages: the command lines re-execute themselves once
with glibc malloc's `hugetlb` tunable.

XLA:CPU allocates a program's temporaries as one large block per call (1.7 GB for the bf16
encode of 16 paper-size images), which glibc maps fresh from the kernel each time. On a
kernel whose transparent huge pages are `madvise` (the usual default), that block is faulted
in and zeroed 4 KiB at a time (about 400,000 page faults a call) and then walked with 4 KiB
TLB entries. `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc 2.35 and later) makes malloc
advise huge pages on what it maps, so the same block takes about a thousand faults. The
tunable is read when the process starts, so the entry points (`procap_jax.main`,
`procap_jax.caption`, the benches) call `reexec_with_hugepages` first: when the tunable would
help and is not set, the same command is executed again with it, once. docs/performance.md,
"Huge pages for XLA's buffers", has the measurements.

`PROCAP_HUGEPAGES=0` in the environment keeps a process as it was started; elsewhere than
Linux with glibc 2.35 or later, or when the kernel's huge pages are `always` or `never`,
nothing happens.
"""

import os
import platform
import sys

OPT_OUT = 'PROCAP_HUGEPAGES'  # '0': never re-execute
TUNABLE = 'glibc.malloc.hugetlb'
THP_MODE_FILE = '/sys/kernel/mm/transparent_hugepage/enabled'


def thp_mode(path: str = THP_MODE_FILE) -> str | None:
  """The kernel's transparent huge page mode ('always', 'madvise', 'never'), None if unknown."""
  try:
    with open(path, encoding='ascii') as f:
      text = f.read()
  except OSError:
    return None
  for word in text.split():
    if word.startswith('[') and word.endswith(']'):
      return word[1:-1]
  return None


def glibc_version() -> tuple[int, int] | None:
  """(major, minor) of the C library when it is glibc, else None."""
  lib, version = platform.libc_ver()
  if lib != 'glibc' or not version:
    return None
  try:
    major, minor = version.split('.')[:2]
    return int(major), int(minor)
  except ValueError:
    return None


def tunables_with_hugepages(environ: dict, glibc: tuple[int, int] | None,
                            mode: str | None) -> str | None:
  """The `GLIBC_TUNABLES` value to re-execute with, or None to leave the process as it is.

  Args:
    environ: the process environment.
    glibc: `glibc_version()`.
    mode: `thp_mode()`.
  """
  if environ.get(OPT_OUT, '1') == '0' or glibc is None or glibc < (2, 35) or mode != 'madvise':
    return None
  current = environ.get('GLIBC_TUNABLES', '')
  names = [item.split('=', 1)[0] for item in current.split(':') if item]
  if TUNABLE in names:  # set already, by the user or by the re-execution
    return None
  return f'{current}:{TUNABLE}=1' if current else f'{TUNABLE}=1'


def reexec_with_hugepages() -> None:
  """Executes this process's command again with `glibc.malloc.hugetlb=1` when that applies
  (module docstring); returns only when nothing is to be done. Call it before anything else
  starts (threads, files, JAX)."""
  if not sys.platform.startswith('linux') or not getattr(sys, 'orig_argv', None):
    return
  value = tunables_with_hugepages(os.environ, glibc_version(), thp_mode())
  if value is None:
    return
  env = dict(os.environ, GLIBC_TUNABLES=value)
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, sys.orig_argv, env)
  except OSError:  # not re-executable (e.g. an embedded interpreter): run as started
    return
