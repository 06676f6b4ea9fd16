"""The ablation table's wall time over every call of the command that made it.

The table takes longer than one sitting (docs/results.md), and a killed call resumes: the time
one call measures is then not the table's. `Clock` keeps `<root>/wall_clock.json` instead:

  {"calls": 2, "seconds": 25210.4, "runs": {"k2_s0": 2290.1, ...}, "command": "python -m ..."}

command: the last training call's command line (what `--report_only` names as the runs' maker);
calls: how many training calls of the command have run; seconds: their wall time summed; runs:
each run's wall time in the jobs that trained it (summed over calls; a run whose job shares the
machine takes longer than alone). The file is rewritten at every `tick` (the `--jobs` loop ticks
once a minute and when a job ends), so a killed call loses at most the time since its last tick;
a run trained in the command's own process (`--jobs 1`, or the first run that builds what the
jobs share) is ticked when it ends.
"""

import json
import os
import time

from procap_jax import errors

FILE = 'wall_clock.json'


def run_name(variant: str, seed: int) -> str:
  """A run's name, `<variant>_s<seed>` (its folder in the root, its key in the ledger)."""
  return f'{variant}_s{seed}'


def variant_of(name: str) -> str:
  """The variant of a `run_name`: 'no_queries_s2' -> 'no_queries'."""
  return name.rsplit('_s', 1)[0]


def read(root: str) -> dict:
  """The ledger in `root` ({'calls': 0, 'seconds': 0.0, 'runs': {}, 'command': ''} when there
  is none)."""
  path = os.path.join(root, FILE)
  if not os.path.exists(path):
    return {'calls': 0, 'seconds': 0.0, 'runs': {}, 'command': ''}
  try:
    with open(path, encoding='utf-8') as f:
      data = json.load(f)
    return {'calls': int(data['calls']), 'seconds': float(data['seconds']),
            'runs': {str(k): float(v) for k, v in data['runs'].items()},
            'command': str(data.get('command', ''))}
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise errors.UserError(f'{path} is not a wall-clock ledger of this command ({e}); '
                           'delete it to start counting again') from e


class Clock:
  """Counts one training call into `<root>/wall_clock.json` (see the module docstring)."""

  def __init__(self, root: str, command: str = '', now=time.time):
    self.root, self.now = root, now
    self.data = read(root)
    self.data['calls'] += 1
    self.data['command'] = command or self.data['command']
    self.last = now()
    self._write()

  def tick(self, running: list[str]) -> None:
    """Adds the time since the last tick to the call and to each run in `running`."""
    t = self.now()
    dt, self.last = max(0.0, t - self.last), t
    self.data['seconds'] += dt
    for name in running:
      self.data['runs'][name] = self.data['runs'].get(name, 0.0) + dt
    self._write()

  def _write(self) -> None:
    os.makedirs(self.root, exist_ok=True)
    errors.write_text_atomic(os.path.join(self.root, FILE), json.dumps(self.data, indent=1))


def describe(data: dict, this_call_minutes: float | None, finished: set[str]) -> str:
  """The table's time, for its 'Measured with' sentence: the calls' wall time in all, this
  call's, and each variant's minutes per run (mean over its `finished` runs' seeds)."""
  parts = []
  if data['calls']:
    parts.append(f'{data["calls"]} call{"s" * (data["calls"] > 1)} of it trained for '
                 f'{data["seconds"] / 3600:.1f} h of wall time in all')
  if this_call_minutes is not None:
    parts.append(f'this call took {this_call_minutes:.0f} min')
  by_variant: dict[str, list[float]] = {}
  for name, seconds in data['runs'].items():
    if name not in finished:
      continue
    by_variant.setdefault(variant_of(name), []).append(seconds / 60)
  if by_variant:
    parts.append('minutes per run (mean over seeds; a run\'s wall time in its job): ' + ', '.join(
        f'{v} {sum(m) / len(m):.0f}' for v, m in sorted(by_variant.items())))
  return '; '.join(parts)
