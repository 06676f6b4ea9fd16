"""Reliability of training (issue 8): kill and resume, non-finite values, another config's
checkpoint, temporary files of killed writers.

Each test records the faults it injects through the `fault` fixture (tests/conftest.py);
`python -m procap_jax.diagnostics.reliability_table` tables them in docs/reliability.md.

Subprocess runs use one CPU device, unoptimised XLA code (JAX_DISABLE_MOST_OPTIMIZATIONS: about
40 % less compile time) and a persistent compilation cache shared by the runs of a test, so only
the first process of a test pays for compiling.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from procap_jax import checkpointing
from procap_jax import errors
from procap_jax import main
from procap_jax import train

import reliability_helpers as helpers


# ------------------------------------------------------------------------ kill and resume: runs

# Runs procap_jax.main; with PROCAP_TEST_KILL_AT=step:n the process SIGKILLs itself when orbax
# commits its n-th checkpoint (every file written into a temporary directory, not yet renamed to
# the step); with item:n, when it commits the n-th item (state, data or meta) of a checkpoint,
# the others not being written yet.
_KILL_WRAPPER = '''
import os, runpy, signal, sys
kind, _, n = os.environ.get('PROCAP_TEST_KILL_AT', '').partition(':')
if kind:
  from orbax.checkpoint._src.path import atomicity
  original = atomicity.AtomicRenameTemporaryPath.finalize
  calls = []
  async def finalize(self, *args, **kwargs):
    if self.get_final().name.isdigit() == (kind == 'step'):
      calls.append(1)
      if len(calls) == int(n):
        print('KILLED INSIDE THE COMMIT OF', self.get(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return await original(self, *args, **kwargs)
  atomicity.AtomicRenameTemporaryPath.finalize = finalize
sys.argv = ['procap_jax.main'] + sys.argv[1:]
runpy.run_module('procap_jax.main', run_name='__main__', alter_sys=True)
'''

_STEPS = 6


def _run_args(workdir: str, data_dir: str) -> list[str]:
  """The tiny preset, tokenizer stage only, with a smaller tokenizer (faster to compile)."""
  t = '--config.tokenizer.train.'
  return [sys.executable, '-c', _KILL_WRAPPER, '--config', 'configs/synthetic.py:tiny',
          '--workdir', workdir, f'--config.data.data_dir={data_dir}',
          "--config.stages=('tokenizer',)", '--config.tokenizer.model.ch=8',
          '--config.tokenizer.model.ch_mult=(1,2)', '--config.pretrain.model.grid=(16,16)',
          f'{t}steps={_STEPS}', f'{t}log_every=1', f'{t}checkpoint_every=2', f'{t}eval_every=4',
          f'{t}eval_batches=1']


class _Run:
  """One `procap_jax.main` process whose output lines are read as they come."""

  def __init__(self, args: list[str], env: dict):
    self.t0 = time.time()
    self.proc = subprocess.Popen(args, cwd=helpers.REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1)
    self.lines: list[str] = []

  def wait_for(self, pattern: str, timeout: float = 300) -> bool:
    """Reads lines until one matches `pattern` (True) or the process ends (False)."""
    regex = re.compile(pattern)
    while time.time() - self.t0 < timeout:
      line = self.proc.stdout.readline()
      if not line:
        return False
      self.lines.append(line)
      if regex.search(line):
        return True
    raise TimeoutError(f'no line matching {pattern!r} in {timeout} s')

  def kill(self) -> None:
    self.proc.send_signal(signal.SIGKILL)
    self.finish()

  def finish(self) -> int:
    out, _ = self.proc.communicate(timeout=300)
    self.lines += out.splitlines(keepends=True)
    return self.proc.returncode

  def text(self) -> str:
    return ''.join(self.lines)


def _metrics(workdir: str) -> list[dict]:
  """metrics.jsonl without its wall-clock fields."""
  with open(os.path.join(workdir, 'tokenizer', 'metrics.jsonl'), encoding='utf-8') as f:
    recs = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if k not in ('steps_per_s', 'eval_seconds')} for r in recs]


def _steps(directory: str) -> list[int]:
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _resumed_from(text: str) -> str:
  m = re.search(r'resuming from step (\d+)', text)
  return f'restarted from checkpoint step {m.group(1)}' if m else 'restarted from scratch'


def test_sigkill_at_random_moments_resumes_to_the_uninterrupted_run(tiny_data_dir, tmp_path,
                                                                    fault):
  env = helpers.subprocess_env(str(tmp_path / 'jax_cache'))
  straight, killed = str(tmp_path / 'straight'), str(tmp_path / 'killed')
  ref = _Run(_run_args(straight, tiny_data_dir), env)
  assert ref.finish() == 0, ref.text()

  rng = random.Random(8)
  # Checkpoints: latest at 2, 4, 6 and best at 4 and 6 (each written before the latest one), so
  # the 3rd checkpoint of a fresh run is the step-4 latest one, right after the step-4 best one.
  plan = [('step:3', 'the commit of its 3rd checkpoint (all files written, directory not yet '
                     'renamed)'),
          ('random', ''),
          ('item:2', 'its first checkpoint, between the commits of its items (one done)'),
          ('random', '')]
  moments, outputs = [], []
  for how, where in plan:
    env_k = dict(env, PROCAP_TEST_KILL_AT='' if how == 'random' else how)
    ckpt_dir = os.path.join(killed, 'tokenizer', 'checkpoints')
    resume = max(_steps(ckpt_dir), default=0) if os.path.isdir(ckpt_dir) else 0
    run = _Run(_run_args(killed, tiny_data_dir), env_k)
    if how == 'random':
      step, delay = rng.randint(resume + 1, _STEPS - 1), rng.uniform(0.0, 0.6)
      assert run.wait_for(rf'step {step}/{_STEPS}'), run.text()
      time.sleep(delay)
      run.kill()
      moments.append(f'SIGKILL at a random moment: {delay:.2f} s after the step-{step} '
                     'progress line')
    else:
      assert run.finish() == -signal.SIGKILL, run.text()
      assert 'KILLED INSIDE THE COMMIT' in run.text()
      moments.append(f'SIGKILL inside {where}')
    outputs.append(run.text())
  final = _Run(_run_args(killed, tiny_data_dir), env)
  assert final.finish() == 0, final.text()
  outputs.append(final.text())
  for moment, after in zip(moments, outputs[1:]):
    fault('main (train)', moment, f'the next start {_resumed_from(after)}')

  assert _metrics(killed) == _metrics(straight)
  for which in ('latest', 'best'):
    a = checkpointing.load_stage_variables(straight, 'tokenizer', which)
    b = checkpointing.load_stage_variables(killed, 'tokenizer', which)
    assert a['step'] == b['step']
    jax.tree.map(np.testing.assert_array_equal, a['params'], b['params'])
  # A workdir given relative to the current directory, as the README's command gives it.
  relative = checkpointing.load_stage_variables(os.path.relpath(straight), 'tokenizer', 'best')
  jax.tree.map(np.testing.assert_array_equal, relative['params'], b['params'])
  for sub in ('checkpoints', 'best'):
    assert (_steps(os.path.join(killed, 'tokenizer', sub))
            == _steps(os.path.join(straight, 'tokenizer', sub)))
  assert helpers.leftovers(killed) == []
  with open(train.stage_done_path(killed, 'tokenizer')) as f:
    done = json.load(f)
  with open(train.stage_done_path(straight, 'tokenizer')) as f:
    assert done == json.load(f)
  fault('main (train)', f'{len(plan)} kills as above in one tiny tokenizer run, then a full run',
        'metrics.jsonl step for step, latest and best checkpoints (parameters bitwise) and the '
        'stage summary equal those of an uninterrupted run; no temporary file or directory left')


# --------------------------------------------------------------------------- a stand-in stage

_BAD_FROM_STEP = 7


@jax.custom_vjp
def _poison_gradient(x, on):
  return x


def _poison_fwd(x, on):
  return x, on


def _poison_bwd(on, g):
  return jnp.where(on, jnp.nan, g), None


_poison_gradient.defvjp(_poison_fwd, _poison_bwd)


def _toy_task(bad: str = '', bad_from: int = _BAD_FROM_STEP) -> train.Task:
  """A one-layer stand-in for stage 1 on the tiny dataset (cheap to compile).

  bad: '' (healthy), 'loss' (NaN loss from step `bad_from`) or 'grad' (finite loss, NaN
  gradients from step `bad_from`). Named 'pretrain' so it uses `config.pretrain.train`.
  """

  def features(batch):
    x = jnp.asarray(batch['before'], jnp.float32) / 255.0
    return x.reshape(x.shape[0], -1)[:, :16]

  def init_params(model, config, rng, batch):
    del config
    return model.init(rng, features(batch))['params']

  def loss_fn(params, model_state, constants, batch, rng, config, model):
    del constants, rng, config
    step = model_state['step'] + 1  # the step this call trains
    poisoned = step >= bad_from
    if bad == 'grad':
      params = jax.tree.map(lambda p: _poison_gradient(p, poisoned), params)
    loss = jnp.mean((model.apply({'params': params}, features(batch)) - 1.0) ** 2)
    if bad == 'loss':
      loss = jnp.where(poisoned, jnp.nan, loss)
    return loss, ({}, {'step': step})

  def evaluate(state, constants, config, model, split, workdir):
    del constants, config, model, split, workdir
    return {'loss': 1.0 / (1.0 + float(state.step))}  # every evaluation is the best so far

  return train.Task(
      name='pretrain', build_model=lambda config: nn.Dense(1), init_params=init_params,
      loss_fn=loss_fn, make_optimizer=lambda config, total: optax.sgd(0.1), evaluate=evaluate,
      init_model_state=lambda model, config, rng, batch: {'step': jnp.zeros([], jnp.int32)})


def _toy_config(tiny_config, steps: int = 10):
  tr = tiny_config.pretrain.train
  tr.steps, tr.log_every, tr.checkpoint_every, tr.eval_every = steps, 5, 2, 4
  return tiny_config


@pytest.mark.parametrize('bad,bad_from', [('loss', _BAD_FROM_STEP), ('grad', _BAD_FROM_STEP),
                                          ('loss', 1)])


def test_non_finite_loss_or_gradient_stops_the_run(tiny_config, tmp_path, fault, bad, bad_from):
  config = _toy_config(tiny_config)
  workdir = str(tmp_path)
  with pytest.raises(errors.UserError) as info:
    train.run(_toy_task(bad, bad_from), config, workdir)
  message = str(info.value)
  assert f'non-finite at step {bad_from}' in message
  stage = os.path.join(workdir, 'pretrain')
  if bad_from == 1:
    assert 'no good checkpoint yet' in message
    assert not os.path.isdir(os.path.join(stage, 'checkpoints')) or not _steps(
        os.path.join(stage, 'checkpoints'))
  else:
    # Checked at step 8 (a checkpoint and evaluation step): nothing at 8 was written.
    assert 'last good checkpoint is step 6' in message
    assert _steps(os.path.join(stage, 'checkpoints')) == [4, 6]
    assert _steps(os.path.join(stage, 'best')) == [4]
    for which in ('latest', 'best'):
      variables = checkpointing.load_stage_variables(workdir, 'pretrain', which)
      assert all(np.isfinite(x).all() for x in jax.tree.leaves(variables['params']))
    with open(os.path.join(stage, 'metrics.jsonl')) as f:
      assert max(json.loads(line)['step'] for line in f) == 5
  assert not os.path.exists(train.stage_done_path(workdir, 'pretrain'))
  what = {'loss': 'NaN loss', 'grad': 'NaN gradients (finite loss)'}[bad]
  kept = ('no checkpoint is written' if bad_from == 1 else
          'the best (4) and latest (4, 6) checkpoints keep their good state; step 8 is not saved')
  fault('main (train)', f'{what} from step {bad_from} (checked at log/eval/checkpoint steps)',
        f'stops with exit status 2: "{message}"; {kept}')


def test_checkpoint_of_another_model_config_says_what_differs(tiny_config, tmp_path, fault):
  config = _toy_config(tiny_config, steps=2)
  train.run(_toy_task(), config, str(tmp_path))
  with open(train.stage_done_path(str(tmp_path), 'pretrain')) as f:
    assert json.load(f)['steps'] == 2
  meta = checkpointing.read_meta(str(tmp_path), 'pretrain', 'latest')
  assert meta['config']['pretrain']['model']['width'] == config.pretrain.model.width
  os.remove(train.stage_done_path(str(tmp_path), 'pretrain'))
  config.pretrain.train.steps = 4
  config.pretrain.model.width = 96
  with pytest.raises(errors.UserError, match=r'pretrain\.model\.width: checkpoint 64 vs config '
                     r'96') as info:
    train.run(_toy_task(), config, str(tmp_path))
  fault('main (train), evaluation, caption command',
        'resume from or load a checkpoint with another model config',
        f'"{info.value}" (every checkpoint stores its config; checked before restoring)')


def test_a_second_start_says_what_it_reuses_and_where_each_stage_starts(tiny_config, tmp_path,
                                                                        capsys, fault):
  from procap_jax import stages
  workdir = str(tmp_path)
  stages.prepare_data(tiny_config, workdir)  # the session's dataset, already built
  line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith('using'))
  assert line.startswith('using the dataset synthetic_change/tiny already built in ')
  assert line.endswith(os.path.join('synthetic_change', 'tiny', '1.0.0'))
  fault('main (train)', 'a start on a workdir whose dataset is built', line)

  # Killed before its first checkpoint, after logging steps 1-4 (metrics.jsonl, as train writes).
  config = _toy_config(tiny_config)
  stage = os.path.join(workdir, 'pretrain')
  os.makedirs(stage)
  with open(os.path.join(stage, 'metrics.jsonl'), 'w', encoding='utf-8') as f:
    f.writelines(json.dumps({'step': s, 'split': 'train', 'loss': 1.0}) + '\n' for s in (1, 4))
  train.run(_toy_task(), config, workdir, max_steps=3)
  line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith('[pretrain] st'))
  assert line == (f'[pretrain] starting from step 0 of 10 (no checkpoint in '
                  f'{os.path.join(stage, "checkpoints")}); steps 1-4 of an earlier start were '
                  'not checkpointed and are trained again')
  fault('main (train)', 'a start after a kill before the stage\'s first checkpoint (steps 1-4 '
        'logged)', line)

  # Killed after its step-3 checkpoint, with step 5 logged.
  with open(os.path.join(stage, 'metrics.jsonl'), 'a', encoding='utf-8') as f:
    f.write(json.dumps({'step': 5, 'split': 'train', 'loss': 1.0}) + '\n')
  train.run(_toy_task(), config, workdir, max_steps=1)
  line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith('[pretrain] re'))
  assert line.startswith('[pretrain] resuming from step 3 of 10 (checkpoint in ')
  assert line.endswith('; steps 4-5 of an earlier start were not checkpointed and are trained '
                       'again')
  fault('main (train)', 'a start after a kill after the step-3 checkpoint (step 5 logged)', line)


def test_temporary_files_of_killed_writers_are_removed(tiny_config, tmp_path, fault):
  dead = subprocess.Popen(['true'])
  dead.wait()
  tag = errors._writer_tag().rsplit('-', 1)[0]  # pylint: disable=protected-access
  stale = tmp_path / 'caption' / f'.predictions_test.json.{tag}-{dead.pid}.ab_c12d3.tmp'
  live = tmp_path / f'.config.json.{tag}-{os.getppid()}.x1y2z3ab.tmp'
  other_host = tmp_path / f'.config.json.otherhost-{dead.pid}.x1y2z3ab.tmp'
  for p in (stale, live, other_host):
    p.parent.mkdir(exist_ok=True)
    p.write_text('half')
  main.run(tiny_config, str(tmp_path), mode='build')
  assert not stale.exists() and live.exists() and other_host.exists()
  fault('main (every mode)', 'temporary file left by a writer killed with SIGKILL',
        'removed at the next start (only those of dead processes on this host)')
