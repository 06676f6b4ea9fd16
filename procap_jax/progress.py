"""Progress of long loops: a tqdm bar on a terminal, a plain periodic line in a log.

On a terminal `bar` is `tqdm.tqdm`. When stderr is not a terminal (a log file, a pipe, a batch
system), redrawn bars would fill the file with carriage returns and escape codes, and their
first ETA, taken from the first item (which pays for compiling or starting workers), can read
hours. There `bar` gives `LineProgress` instead: one line now and then with the count, the mean
rate since the start and the ETA from it, e.g.

  feature cache: 1200/5000 (24 %), 35.2 record/s, ETA 1.8 min

at most every `LINE_SECONDS`, and only after `MIN_LINE_SECONDS` and a further 10 % done (so a
short loop prints its final line only), then `feature cache: 5000/5000 in 2.4 min
(35 record/s)` at the end. TFDS's own bars (the builds' "Generating splits" and "Shuffling",
nested around ours) are turned off in that case by `quiet_library_bars`.
"""

import sys
import time
from typing import Any, Iterable, TextIO

import tqdm

LINE_SECONDS = 60.0  # a line at least this often while the loop runs
MIN_LINE_SECONDS = 10.0  # ... and no more often than this
LINE_FRACTION = 0.1  # between those, a line each time another 10 % is done


def is_terminal(stream: TextIO | None = None) -> bool:
  """Whether `stream` (default: sys.stderr, where the bars go) is a terminal."""
  stream = sys.stderr if stream is None else stream
  isatty = getattr(stream, 'isatty', None)
  try:
    return bool(isatty and isatty())
  except ValueError:  # a closed stream
    return False


def duration(seconds: float) -> str:
  """`42 s`, `3.5 min` or `2.1 h`."""
  if seconds < 100:
    return f'{seconds:.0f} s'
  if seconds < 6000:
    return f'{seconds / 60:.1f} min'
  return f'{seconds / 3600:.1f} h'


class LineProgress:
  """What `bar` gives when the output is not a terminal: tqdm's `update` / `close` /
  iteration / context manager, printing plain lines (see the module docstring).

  Args:
    iterable: the items to iterate over, or None (then call `update`).
    total: the number of items (default: `len(iterable)` when it has one).
    desc: the name shown at the start of each line.
    unit: the items' unit ('it' by default, as tqdm).
    initial: items already done (a resumed loop); the rate counts only the new ones.
    disable: print nothing.
    leave: print the final line (tqdm's `leave`).
    file: where the lines go (default: sys.stderr).
    clock: the time function (tests pass a fake one).
  """

  def __init__(self, iterable: Iterable | None = None, *, total: int | None = None,
               desc: str = '', unit: str = 'it', initial: int = 0, disable: bool = False,
               leave: bool = True, file: TextIO | None = None, clock=time.monotonic):
    if total is None and iterable is not None and hasattr(iterable, '__len__'):
      total = len(iterable)
    self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
    self.n = self.initial = int(initial)
    self.disable, self.leave, self.file, self.clock = disable, leave, file, clock
    self.start = self.last_time = clock()
    self.last_n = self.n
    self.closed = False

  def __iter__(self):
    for item in self.iterable:
      yield item
      self.update()
    self.close()

  def __enter__(self) -> 'LineProgress':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _rate(self, now: float) -> float:
    return (self.n - self.initial) / max(now - self.start, 1e-9)

  def _count(self) -> str:
    return f'{self.n}/{self.total}' if self.total else f'{self.n}'

  def line(self, now: float) -> str:
    """The periodic line: count, percent, mean rate since the start, ETA."""
    rate = self._rate(now)
    text = f'{self.desc}: {self._count()}'
    if self.total:
      text += f' ({100 * self.n / self.total:.0f} %)'
    text += f', {rate:.3g} {self.unit}/s'
    if self.total and rate > 0:
      text += f', ETA {duration((self.total - self.n) / rate)}'
    return text

  def final_line(self, now: float) -> str:
    """The closing line: count, time taken, mean rate."""
    return (f'{self.desc}: {self._count()} in {duration(now - self.start)} '
            f'({self._rate(now):.3g} {self.unit}/s)')

  def _print(self, text: str) -> None:
    stream = sys.stderr if self.file is None else self.file
    print(text, file=stream, flush=True)

  def update(self, n: int = 1) -> None:
    """Counts `n` more items; prints a line when one is due."""
    self.n += n
    if self.disable:
      return
    now = self.clock()
    since = now - self.last_time
    step = LINE_FRACTION * self.total if self.total else float('inf')
    if since >= LINE_SECONDS or (since >= MIN_LINE_SECONDS and self.n - self.last_n >= step):
      if self.total is None or self.n < self.total:
        self._print(self.line(now))
        self.last_time, self.last_n = now, self.n

  def close(self) -> None:
    """Prints the final line (once; not with `leave=False` or `disable`)."""
    if self.closed:
      return
    self.closed = True
    if not self.disable and self.leave:
      self._print(self.final_line(self.clock()))


def bar(iterable: Iterable | None = None, **kwargs: Any):
  """`tqdm.tqdm(iterable, **kwargs)` when stderr is a terminal, else `LineProgress` with the
  kwargs it takes (total, desc, unit, initial, disable, leave); tqdm's display options
  (mininterval, dynamic_ncols, ...) apply to the bar only."""
  if is_terminal(kwargs.get('file')):
    return tqdm.tqdm(iterable, **kwargs)
  keep = ('total', 'desc', 'unit', 'initial', 'disable', 'leave', 'file')
  return LineProgress(iterable, **{k: v for k, v in kwargs.items() if k in keep})


def quiet_library_bars() -> None:
  """Turns TFDS's own progress bars off when stderr is not a terminal (call before a build)."""
  if not is_terminal():
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
    tfds.disable_progress_bar()
