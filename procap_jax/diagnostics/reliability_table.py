"""Writes docs/reliability.md: runs the reliability tests and tables the faults they injected.

  python -m procap_jax.diagnostics.reliability_table --out docs/reliability.md
  python -m procap_jax.diagnostics.reliability_table --out R.md -- -n 0   # pytest flags

Run from a source checkout: the tests (tests/reliability_*_test.py) each inject faults at one
entry point and assert what happens; their `fault` fixture (tests/conftest.py) puts a row per
fault (entry point, fault, result observed) on the test's report. This command runs them with
pytest in this process (the repository's pytest settings: two workers), with
tests/images_test.py, whose decoding tests the image row names, keeps the rows of the tests
that passed and writes the table, sorted by entry point, atomically. Tests that failed are named
above the table (their rows are missing) and the exit status is pytest's. About 8 minutes on
two CPU cores. Prints one JSON line: {rows, failed, seconds, out}.
"""

import argparse
import glob
import os
import sys
import time
from typing import Sequence

from procap_jax import errors
from procap_jax.diagnostics import records

ROW_PROPERTY = 'reliability_row'  # the name of a row among a test report's user properties
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMAND = 'python -m procap_jax.diagnostics.reliability_table --out docs/reliability.md'


class RowCollector:
  """A pytest plugin: the fault rows of the tests that passed, the ids of those that failed."""

  def __init__(self):
    self.rows: list[dict] = []
    self.failed: list[str] = []

  def pytest_runtest_logreport(self, report) -> None:
    """Keeps a passing call's rows (with its test as `file.py::name`) or a failure's id."""
    if report.failed and report.nodeid not in self.failed:
      self.failed.append(report.nodeid)
    if report.when == 'call' and report.passed:
      test = report.nodeid.rsplit('/', 1)[-1]
      self.rows += [dict(row, test=test) for key, row in report.user_properties
                    if key == ROW_PROPERTY]


def table(rows: Sequence[dict], failed: Sequence[str]) -> str:
  """The Markdown page: a header naming this command, failed tests if any, one row a fault."""
  lines = [
      '# Reliability: faults tried and what happened',
      '',
      'Written by a command that runs the reliability tests (tests/reliability_*_test.py, which',
      'assert what each fault does); do not edit by hand. Regenerate with (about 8 minutes):',
      '',
      '```bash',
      COMMAND,
      '```',
      '',
      'Each row is one fault a passing test injected, the entry point it hit, and the result the '
      'test observed (error sentences verbatim; every error exits with status 2 and no '
      'traceback). `<tmp>` stands for the test\'s temporary folder.',
      '',
  ]
  if failed:
    lines += [f'**Missing rows: these tests failed: {", ".join(failed)}.**', '']
  lines += ['| entry point | fault | result | test |', '|---|---|---|---|']
  cell = lambda s: str(s).replace('|', '\\|')  # noqa: E731
  for r in sorted(rows, key=lambda r: r['entry point']):
    lines.append(f'| {cell(r["entry point"])} | {cell(r["fault"])} | {cell(r["result"])} | '
                 f'`{r["test"]}` |')
  return '\n'.join(lines) + '\n'


@errors.exit_on_user_error
def main(argv: Sequence[str] | None = None) -> int:
  """Runs the tests, writes the table; returns pytest's exit status."""
  parser = argparse.ArgumentParser(prog='python -m procap_jax.diagnostics.reliability_table',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'reliability.md'),
                      help='the Markdown file to write (default: docs/reliability.md)')
  parser.add_argument('pytest_args', nargs='*', help='more pytest flags, after --')
  args = parser.parse_args(argv)
  out = os.path.abspath(args.out)
  files = sorted(glob.glob(os.path.join(REPO, 'tests', 'reliability_*_test.py')))
  if not files or not os.path.exists(os.path.join(REPO, 'tests', 'conftest.py')):
    raise errors.UserError(f'{REPO} has no tests/reliability_*_test.py; run this command from a '
                           'source checkout of procap-jax')
  import pytest  # pylint: disable=import-outside-toplevel
  collector = RowCollector()
  start = time.time()
  os.chdir(REPO)  # as the tests are run in CI: relative config paths, the repository's settings
  status = pytest.main(['-q', *files, os.path.join(REPO, 'tests', 'images_test.py'),
                        *args.pytest_args], plugins=[collector])
  if not collector.rows:
    raise errors.UserError(f'no test recorded a fault (pytest exit status {int(status)}); '
                           f'{out} is left as it was')
  errors.write_text_atomic(out, table(collector.rows, collector.failed))
  records.emit({'rows': len(collector.rows), 'failed': collector.failed,
                'seconds': time.time() - start, 'out': out})
  return int(status)


if __name__ == '__main__':
  sys.exit(main())
