"""procap_jax.progress: plain periodic lines when the output is not a terminal."""

import io

import tqdm

from procap_jax import progress


class _Clock:
  """A settable time function."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


class _Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_lines_give_count_rate_and_eta_every_10_percent_or_minute_and_a_final_line():
  out, clock = io.StringIO(), _Clock()
  bar = progress.LineProgress(total=100, desc='feature cache', unit='record', file=out,
                              clock=clock)
  clock.now = 1.0
  bar.update(5)  # 5 %, 1 s: nothing yet
  clock.now = 12.0
  bar.update(10)  # 15 % after 12 s: a line
  clock.now = 20.0
  bar.update(1)  # 8 s after the last line: nothing
  clock.now = 75.0
  bar.update(1)  # a minute since the last line, though only 2 % more
  clock.now = 80.0
  bar.close()
  bar.close()  # once only
  assert out.getvalue().splitlines() == [
      'feature cache: 15/100 (15 %), 1.25 record/s, ETA 68 s',
      'feature cache: 17/100 (17 %), 0.227 record/s, ETA 6.1 min',
      'feature cache: 17/100 in 80 s (0.212 record/s)',
  ]
  assert '\r' not in out.getvalue() and '\x1b' not in out.getvalue()


def test_a_resumed_loop_counts_its_rate_from_the_new_items_only():
  out, clock = io.StringIO(), _Clock()
  with progress.LineProgress(total=1000, initial=900, desc='x', unit='pair', file=out,
                             clock=clock) as bar:
    clock.now = 7200.0
    bar.update(50)
  assert out.getvalue().splitlines() == ['x: 950/1000 (95 %), 0.00694 pair/s, ETA 2.0 h',
                                         'x: 950/1000 in 2.0 h (0.00694 pair/s)']


def test_iterating_a_short_loop_prints_only_its_final_line():
  out = io.StringIO()
  items = list(progress.bar(range(3), desc='reading test', unit='pair', file=out,
                            mininterval=2.0))
  assert items == [0, 1, 2]
  assert out.getvalue().startswith('reading test: 3/3 in 0 s (')
  quiet = io.StringIO()
  assert list(progress.bar(iter('ab'), desc='d', leave=False, file=quiet)) == ['a', 'b']
  with progress.bar(total=4, desc='d', disable=True, file=quiet) as bar:
    bar.update(4)
  assert quiet.getvalue() == ''


def test_a_terminal_gets_the_tqdm_bar():
  assert isinstance(progress.bar(total=2, file=_Terminal()), tqdm.tqdm)
  assert isinstance(progress.bar(total=2, file=io.StringIO()), progress.LineProgress)
  assert progress.is_terminal(_Terminal()) and not progress.is_terminal(io.StringIO())
