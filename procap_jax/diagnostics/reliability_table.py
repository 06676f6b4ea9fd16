"""Writes docs/reliability.md: runs the reliability tests and tables the faults they injected.

  python -m procap_jax.diagnostics.reliability_table --out docs/reliability.md
  python -m procap_jax.diagnostics.reliability_table --out R.md -- -n 0   # pytest flags

Run from a source checkout: the tests (tests/reliability_*_test.py, and the tests of other files
that take the `fault` fixture: the demo service's, the images' decoding, ...) each inject faults
at one entry point and assert what happens; the `fault` fixture (tests/conftest.py) puts a row
per fault (entry point, fault, result observed) on the test's report. This command runs those
files with pytest in this process (the repository's pytest settings: two workers), keeps the
rows of the tests that passed and writes the table, sorted by entry point, atomically. Tests
that failed are named above the table (their rows are missing) and the exit status is pytest's.
About 10 minutes on two CPU cores. Prints one JSON line: {rows, failed, seconds, out}.
"""

import argparse
import ast
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
      'Written by a command that runs the tests that inject faults (tests/reliability_*_test.py',
      'and the other tests that take the `fault` fixture, which assert what each fault does); do',
      'not edit by hand. Regenerate with (about 10 minutes):',
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
def fault_test_files(tests_dir: str) -> list[str]:
  """tests/reliability_*_test.py, and every other test file with a test that takes the `fault`
  fixture (the demo service's, the images', ...), sorted."""
  files = set(glob.glob(os.path.join(tests_dir, 'reliability_*_test.py')))
  for path in glob.glob(os.path.join(tests_dir, '*_test.py')):
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read(), path)
    if any(isinstance(node, ast.FunctionDef) and node.name.startswith('test')
           and any(a.arg == 'fault' for a in node.args.args) for node in ast.walk(tree)):
      files.add(path)
  return sorted(files)


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the tests, writes the table; returns pytest's exit status."""
  parser = argparse.ArgumentParser(prog='python -m procap_jax.diagnostics.reliability_table',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'reliability.md'),
                      help='the Markdown file to write (default: docs/reliability.md)')
  parser.add_argument('pytest_args', nargs='*', help='more pytest flags, after --')
  args = parser.parse_args(argv)
  out = os.path.abspath(args.out)
  files = fault_test_files(os.path.join(REPO, 'tests'))
  if not files or not os.path.exists(os.path.join(REPO, 'tests', 'conftest.py')):
    raise errors.UserError(f'{REPO} has no tests/reliability_*_test.py; run this command from a '
                           'source checkout of procap-jax')
  import pytest  # pylint: disable=import-outside-toplevel
  collector = RowCollector()
  start = time.time()
  os.chdir(REPO)  # as the tests are run in CI: relative config paths, the repository's settings
  status = pytest.main(['-q', *files, *args.pytest_args], plugins=[collector])
  if not collector.rows:
    raise errors.UserError(f'no test recorded a fault (pytest exit status {int(status)}); '
                           f'{out} is left as it was')
  errors.write_text_atomic(out, table(collector.rows, collector.failed))
  records.emit({'rows': len(collector.rows), 'failed': collector.failed,
                'seconds': time.time() - start, 'out': out})
  return int(status)


if __name__ == '__main__':
  sys.exit(main())
