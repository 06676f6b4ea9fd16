"""A stage's log: metrics.jsonl (appended, cut back to the restored step on resume) and the line
a stage prints when it starts or resumes. Used by the training loop (`train.run`).
"""

import json
import os

import jax

from procap_jax import errors


class MetricsLog:
  """Appends JSON lines to `metrics.jsonl`; on resume drops lines past the restored step.

  Only process 0 writes (every process of a multi-process run computes the same metrics).
  """

  def __init__(self, path: str, resume_step: int | None):
    self.path = path
    self._f = None
    if jax.process_index() != 0:
      return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = []
    if os.path.exists(path):
      with open(path, encoding='utf-8') as f:
        for line in f:
          try:
            rec = json.loads(line)
          except json.JSONDecodeError:
            continue  # a line cut by a kill
          if resume_step is not None and rec.get('step', 0) <= resume_step:
            lines.append(line if line.endswith('\n') else line + '\n')
    errors.write_text_atomic(path, ''.join(lines))
    self._f = open(path, 'a', encoding='utf-8')

  def write(self, record: dict) -> None:
    if self._f is None:
      return
    self._f.write(json.dumps(record) + '\n')
    self._f.flush()

  def close(self):
    if self._f is not None:
      self._f.close()


def last_logged_step(path: str) -> int:
  """The highest step in a stage's metrics.jsonl (0 when it is missing or has no step)."""
  if not os.path.exists(path):
    return 0
  steps = [0]
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        steps.append(int(json.loads(line).get('step', 0)))
      except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        continue  # a line cut by a kill
  return max(steps)


def start_line(stage: str, checkpoint_dir: str, start: int | None, logged: int,
               total: int) -> str:
  """The line a stage prints when it starts: whether it resumes from a checkpoint (its step
  `start`) or starts from step 0 (`start` None: no checkpoint), and which logged steps of an
  earlier start are trained again because no checkpoint kept them, e.g.
  `[tokenizer] starting from step 0 of 100 (no checkpoint in W/tokenizer/checkpoints); steps
  1-3 of an earlier start were not checkpointed and are trained again`."""
  if start is not None:
    head = f'[{stage}] resuming from step {start} of {total} (checkpoint in {checkpoint_dir})'
  else:
    start = 0
    head = f'[{stage}] starting from step 0 of {total} (no checkpoint in {checkpoint_dir})'
  if logged > start:
    first = start + 1
    head += (f'; step {first} of an earlier start was not checkpointed and is trained again'
             if logged == first else f'; steps {first}-{logged} of an earlier start were not '
             'checkpointed and are trained again')
  return head
