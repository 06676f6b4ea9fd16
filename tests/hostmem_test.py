"""The entry points' re-execution with glibc malloc's huge-page tunable (`hostmem`)."""

import json
import os
import subprocess
import sys

import pytest

from procap_jax import hostmem

MADVISE, GLIBC = 'madvise', (2, 36)


def test_tunable_added_when_it_applies():
  assert hostmem.tunables_with_hugepages({}, GLIBC, MADVISE) == 'glibc.malloc.hugetlb=1'
  kept = {'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'}
  assert (hostmem.tunables_with_hugepages(kept, GLIBC, MADVISE)
          == 'glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1')


@pytest.mark.parametrize('environ, glibc, mode', [
    ({'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=1'}, GLIBC, MADVISE),  # set already: no loop
    ({'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=0'}, GLIBC, MADVISE),  # the user's choice stays
    ({'PROCAP_HUGEPAGES': '0'}, GLIBC, MADVISE),  # opted out
    ({}, (2, 34), MADVISE),  # glibc without the tunable
    ({}, None, MADVISE),  # not glibc (musl, macOS)
    ({}, GLIBC, 'always'),  # huge pages already everywhere
    ({}, GLIBC, 'never'),  # none to be had
    ({}, GLIBC, None),  # unknown kernel setting
])
def test_nothing_to_do(environ, glibc, mode):
  assert hostmem.tunables_with_hugepages(environ, glibc, mode) is None


def test_thp_mode_reads_the_bracketed_word(tmp_path):
  path = tmp_path / 'enabled'
  path.write_text('always [madvise] never\n')
  assert hostmem.thp_mode(str(path)) == 'madvise'
  assert hostmem.thp_mode(str(tmp_path / 'absent')) is None


SCRIPT = """
import json, os, sys
from procap_jax import hostmem
print('start', flush=True)
hostmem.reexec_with_hugepages()
print(json.dumps({'argv': sys.argv[1:], 'tunables': os.environ.get('GLIBC_TUNABLES')}))
sys.exit(3)
"""


def _run(tmp_path, **env):
  script = tmp_path / 'entry.py'
  script.write_text(SCRIPT)
  environ = {k: v for k, v in os.environ.items() if k not in ('GLIBC_TUNABLES', hostmem.OPT_OUT)}
  environ.update(env)
  return subprocess.run([sys.executable, str(script), '--a', 'b c'], env=environ,
                        capture_output=True, text=True, check=False, timeout=60)


def test_reexecutes_once_with_the_same_arguments(tmp_path):
  if hostmem.tunables_with_hugepages({}, hostmem.glibc_version(), hostmem.thp_mode()) is None:
    pytest.skip('this machine would not re-execute (no glibc 2.35+ or huge pages not madvise)')
  proc = _run(tmp_path)
  lines = proc.stdout.splitlines()
  assert proc.returncode == 3, proc.stderr
  assert lines[:2] == ['start', 'start']  # the script ran twice: started, then re-executed
  assert json.loads(lines[2]) == {'argv': ['--a', 'b c'], 'tunables': 'glibc.malloc.hugetlb=1'}
  assert len(lines) == 3


def test_opt_out_runs_as_started(tmp_path):
  proc = _run(tmp_path, PROCAP_HUGEPAGES='0')
  lines = proc.stdout.splitlines()
  assert proc.returncode == 3, proc.stderr
  assert lines[0] == 'start'
  assert json.loads(lines[1]) == {'argv': ['--a', 'b c'], 'tunables': None}
