"""Reliability (issue 8): kill and resume, non-finite values, atomic outputs, bad input.

Every test records the faults it injects through the `fault` fixture (tests/conftest.py); with
PROCAP_WRITE_RELIABILITY=1 the session writes them to docs/reliability.md.

Subprocess runs use one CPU device, unoptimised XLA code (JAX_DISABLE_MOST_OPTIMIZATIONS: about
40 % less compile time) and a persistent compilation cache shared by the runs of a test, so only
the first process of a test pays for compiling.
"""

import glob
import io
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
import zlib

import flax.linen as nn
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import PIL.Image
import pytest

from procap_jax import checkpointing
from procap_jax import errors
from procap_jax import main
from procap_jax import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROPERTY = hypothesis.settings(max_examples=60, deadline=None, derandomize=True,
                                suppress_health_check=list(hypothesis.HealthCheck))


def _subprocess_env(cache_dir: str) -> dict:
  env = dict(os.environ)
  env.update(XLA_FLAGS='--xla_force_host_platform_device_count=1', JAX_PLATFORMS='cpu',
             PYTHONUNBUFFERED='1', TF_CPP_MIN_LOG_LEVEL='3', JAX_DISABLE_MOST_OPTIMIZATIONS='1',
             JAX_COMPILATION_CACHE_DIR=cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  return env


def _leftovers(directory: str) -> list[str]:
  """Temporary files and directories a clean run must not leave behind."""
  out = []
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      if ('orbax-checkpoint-tmp' in name or name.startswith('incomplete.')
          or errors._TEMP_NAME.match(name)):  # pylint: disable=protected-access
        out.append(os.path.relpath(os.path.join(root, name), directory))
  return out


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
    self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
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
  m = re.search(r'resumed from step (\d+)', text)
  return f'restarted from checkpoint step {m.group(1)}' if m else 'restarted from scratch'


def test_sigkill_at_random_moments_resumes_to_the_uninterrupted_run(tiny_data_dir, tmp_path,
                                                                    fault):
  env = _subprocess_env(str(tmp_path / 'jax_cache'))
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
  assert _leftovers(killed) == []
  with open(train.stage_done_path(killed, 'tokenizer')) as f:
    done = json.load(f)
  with open(train.stage_done_path(straight, 'tokenizer')) as f:
    assert done == json.load(f)
  fault('main (train)', f'{len(plan)} kills as above in one tiny tokenizer run, then a full run',
        'metrics.jsonl step for step, latest and best checkpoints (parameters bitwise) and the '
        'stage summary equal those of an uninterrupted run; no temporary file or directory left')


def test_sigkill_during_a_dataset_build_then_rebuild(tiny_data_dir, tmp_path, fault):
  from tfds_builders import synthetic_change
  data_dir = tmp_path / 'data'
  config_dir = data_dir / 'synthetic_change' / 'tiny'
  delay = random.Random(80).uniform(0.2, 1.5)
  proc = subprocess.Popen(
      [sys.executable, '-m', 'tfds_builders.synthetic_change.build', '--config', 'tiny',
       '--data_dir', str(data_dir), '--num_workers', '1'], cwd=REPO,
      env=_subprocess_env(str(tmp_path / 'jax_cache')), stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL)
  deadline = time.time() + 120
  while not glob.glob(str(config_dir / 'incomplete.*')):
    assert proc.poll() is None and time.time() < deadline, 'the build ended before the kill'
    time.sleep(0.02)
  time.sleep(delay)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, 'the build finished before the kill'
  assert glob.glob(str(config_dir / 'incomplete.*')) and not (config_dir / '1.0.0').exists()

  builder = synthetic_change.prepare('tiny', str(data_dir), num_workers=1)
  reference = synthetic_change.prepare('tiny', tiny_data_dir)
  for split in ('train', 'val', 'test'):
    a, b = builder.as_data_source(split), reference.as_data_source(split)
    assert len(a) == len(b)
    for i in (0, len(a) - 1):
      assert a[i]['pair_id'] == b[i]['pair_id']
      np.testing.assert_array_equal(a[i]['frames'], b[i]['frames'])
  assert _leftovers(str(data_dir)) == []
  fault('synthetic_change builder', f'SIGKILL {delay:.2f} s into writing the build (TFDS '
        'temporary directory present)', 'no dataset is visible (TFDS renames its temporary '
        'directory only when complete); the next build removes the leftover directory and '
        'builds records equal to an uninterrupted build')


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


# ---------------------------------------------------------------------------- atomic outputs


def _writers(tmp_path) -> dict:
  from procap_jax import evaluation
  from procap_jax.data import vocab as vocab_lib
  from procap_jax.procedure import scores as scores_lib
  from procap_jax.tasks import tokenizer
  images = np.zeros((2, 4, 4, 3), np.float32)
  return {
      'results.json, report.html, DONE, config.json, --out files (write_text_atomic)':
          lambda p: errors.write_text_atomic(p, 'new'),
      'predictions (evaluation.write_results)':
          lambda p: evaluation.write_results(p, {'a': 'a cube'}),
      'references (evaluation.write_references)':
          lambda p: evaluation.write_references(p, {'a': ['a cube']}),
      'vocabulary word2idx.json (Vocab.save)':
          lambda p: vocab_lib.Vocab.build(['a cube'], 0).save(p),
      'confidence scores file (scores.write_scores)':
          lambda p: scores_lib.write_scores(p, {'x': (np.ones((1, 9)), np.ones((1, 9)))}, 'flat'),
      'PNG reconstructions (tokenizer.write_reconstructions)':
          lambda p: tokenizer.write_reconstructions(p, images, images),
  }


def test_writers_replace_files_atomically(tmp_path, monkeypatch, fault):
  for name, write in _writers(tmp_path).items():
    path = str(tmp_path / 'out')
    with open(path, 'w') as f:
      f.write('old')

    def crash(*args):
      raise OSError('simulated crash before the rename')

    with monkeypatch.context() as m:
      m.setattr(os, 'replace', crash)
      with pytest.raises(OSError, match='simulated'):
        write(path)
    with open(path) as f:
      assert f.read() == 'old', name
    assert sorted(os.listdir(tmp_path)) == ['out'], name
    write(path)
    assert os.path.getsize(path) > 0
    fault('output writers', f'{name}: crash between writing and renaming',
          'the previous file stays intact and the temporary file is removed')


_WRITE_CALL = re.compile(r"open\([^)]*['\"](w|a|x)b?['\"]|\.savefig\(|\.save\(|json\.dump\(|"
                         r"np\.save|\.write_bytes\(|\.write_text\(")
_EXPLAINED = (
    re.compile(r'\((tmp|buf)\b'),            # inside errors.atomic_path, or to memory
    re.compile(r'\.save\(step'),             # orbax (a temporary directory, then a rename)
    re.compile(r'[Vv]ocab.*\.save\(|^\s*min_word_count=.*\.save\('),  # Vocab.save is atomic
)
_DIRECT_WRITES = {  # the only writes that are not atomic, and why that is safe
    ('procap_jax/train.py', "open(path, 'a'"): 'metrics.jsonl is append-only; a line cut by a '
                                               'kill is dropped when the run resumes',
    ('procap_jax/evaluation.py', "open(path, 'wb')"): "the Java tokenizer's input, in a private "
                                                      'temporary directory',
}


def test_every_file_write_in_the_code_is_atomic(fault):
  unexplained = []
  for root in ('procap_jax', 'tfds_builders'):
    for path in glob.glob(os.path.join(REPO, root, '**', '*.py'), recursive=True):
      rel = os.path.relpath(path, REPO)
      if rel == 'procap_jax/errors.py':
        continue
      with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
          if not _WRITE_CALL.search(line) or any(p.search(line) for p in _EXPLAINED):
            continue
          if not any(rel == f_ and snippet in line for f_, snippet in _DIRECT_WRITES):
            unexplained.append(f'{rel}:{n}: {line.strip()}')
  assert not unexplained, unexplained
  fault('output writers', 'audit of every file write in procap_jax/ and tfds_builders/',
        'all go through errors.atomic_path (temporary file + rename) or orbax, except: '
        + '; '.join(f'{f} ({why})' for (f, _), why in _DIRECT_WRITES.items()))


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


# --------------------------------------------------------------------------------- bad input


def _png(width: int = 8, height: int = 6, mode: str = 'RGB') -> bytes:
  buf = io.BytesIO()
  PIL.Image.new(mode, (width, height), 100).save(buf, format='PNG')
  return buf.getvalue()


def _jpeg() -> bytes:
  buf = io.BytesIO()
  rgb = np.random.default_rng(0).integers(0, 255, (24, 24, 3), np.uint8)
  PIL.Image.fromarray(rgb).save(buf, format='JPEG')
  return buf.getvalue()


def _huge_png(width: int = 20000, height: int = 20000) -> bytes:
  """A small PNG whose header claims `width` x `height` pixels."""
  png = _png()
  body = struct.pack('>II', width, height) + png[24:29]
  return png[:16] + body + struct.pack('>I', zlib.crc32(b'IHDR' + body) & 0xFFFFFFFF) + png[33:]


_MAIN_CASES = [
    (['--config', 'configs/nope.py'], 'missing config file', 'config file configs/nope.py does '
     'not exist'),
    (['--config', 'configs/synthetic.py:tiny,bogus'], 'unknown preset/variant',
     "unknown config variant 'bogus'"),
    (['--config', 'configs/synthetic.py:tiny', '--config.tokenizer.train.stepz=3'],
     'misspelt config key', "unknown key 'stepz' (Did you mean \"steps\""),
    (['--config', 'configs/synthetic.py:tiny', '--config.data.nokey.x=3'], 'unknown config '
     'section', "unknown key 'nokey'"),
    (['--config', 'configs/synthetic.py:tiny', '--config.seed=abc'], 'mistyped config value',
     "--config.seed=abc: invalid literal for int()"),
    (['--config', 'configs/synthetic.py:tiny', '--config.data.frame_source=magic'],
     'config value outside its choices', 'config.data.frame_source is'),
    (['--config', 'configs/synthetic.py:tiny', '--which', 'bestest'], 'bad --which',
     'value should be one of'),
    (['--config', '{bad_syntax}'], 'config file with a syntax error', 'has a syntax error at '
     'line 1'),
    (['--config', '{no_get_config}'], 'config file without get_config()',
     'has no get_config() function'),
]


def test_main_rejects_bad_configs_and_flags_with_one_sentence(tmp_path, fault):
  (tmp_path / 'bad_syntax.py').write_text('def get_config(:\n')
  (tmp_path / 'no_get_config.py').write_text('x = 1\n')
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  for args, what, expected in _MAIN_CASES:
    args = [a.format(bad_syntax=tmp_path / 'bad_syntax.py',
                     no_get_config=tmp_path / 'no_get_config.py') for a in args]
    proc = subprocess.run([sys.executable, '-m', 'procap_jax.main', *args, '--workdir',
                           str(tmp_path / 'w')], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [l for l in proc.stderr.splitlines() if l.startswith('error: ')]
    assert proc.returncode == 2, (what, proc.stderr)
    assert 'Traceback' not in proc.stderr and len(lines) == 1, (what, proc.stderr)
    assert expected in lines[0], (what, lines[0])
    fault('main (config loading)', what, lines[0])


def _exit_message(capsys, fn, *args, **kwargs) -> str:
  """Calls an entry point that must exit with status 2; returns its one `error:` line."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as info:
    fn(*args, **kwargs)
  assert info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: ') and '\n' not in err and 'Traceback' not in err, err
  return err


def test_main_bad_workdirs_and_missing_stages(tiny_config, tmp_path, capsys, fault):
  import copy
  workdir = str(tmp_path / 'w')
  os.makedirs(workdir)
  from procap_jax import config_lib
  other = copy.deepcopy(tiny_config)
  other.caption.model.hidden = 32
  from procap_jax.data import pipeline
  pipeline.resolve_vocab_sizes(other, workdir)  # as main.run does before saving config.json
  config_lib.check_workdir(other, workdir)
  err = _exit_message(capsys, main.run, tiny_config, workdir, mode='build')
  assert 'another config (differs in caption.model)' in err
  fault('main', 'a workdir made with another model config', err)

  fresh = str(tmp_path / 'fresh')
  stage2 = copy.deepcopy(tiny_config)
  stage2.stages = ('caption',)
  err = _exit_message(capsys, main.run, stage2, fresh)
  assert 'starts from the tokenizer checkpoint' in err
  fault('main', "a stage-2 run in a workdir without any checkpoint", err)
  tokenizer = checkpointing.StageCheckpoints(os.path.join(fresh, 'tokenizer'))
  tokenizer.save(1, {'params': {'w': np.zeros(2)}, 'model_state': {}}, {}, {})
  tokenizer.close()
  err = _exit_message(capsys, main.run, stage2, fresh)
  assert 'starts from the pretrain checkpoint' in err and 'init_from_pretrain' in err
  fault('main', 'a stage-2 run pointed at a missing stage-1 (pretrain) checkpoint', err)

  err = _exit_message(capsys, main.run, tiny_config, fresh, mode='evaluate')
  assert 'no caption checkpoint' in err
  fault('main --mode evaluate', 'no caption checkpoint in the workdir', err)

  (tmp_path / 'file').write_text('x')
  not_dir = copy.deepcopy(tiny_config)
  not_dir.data.data_dir = str(tmp_path / 'file')
  err = _exit_message(capsys, main.run, not_dir, str(tmp_path / 'w2'), mode='build')
  assert 'is a file' in err
  fault('main', 'config.data.data_dir is a file', err)


@pytest.fixture()
def run_dir(tiny_config, tmp_path):
  """A workdir holding a run's config.json only (enough for the caption command's checks)."""
  from procap_jax import config_lib
  workdir = tmp_path / 'run'
  config_lib.check_workdir(tiny_config, str(workdir))
  return workdir


def test_caption_command_bad_input(run_dir, tmp_path, capsys, fault):
  from procap_jax import caption
  ok = tmp_path / 'ok.png'
  ok.write_bytes(_png())
  files = {
      'missing image file': None,
      'zero-size image file': b'',
      'truncated PNG': _png(40, 40)[:60],
      'truncated JPEG': _jpeg()[:300],
      'image of 20000 x 20000 px (header)': _huge_png(),
      'not an image (text file)': b'hello, world\n',
  }
  for (what, data), name in zip(files.items(), ('missing.png', 'empty.png', 'cut.png',
                                                 'cut.jpg', 'huge.png', 'text.png')):
    path = tmp_path / name
    if data is not None:
      path.write_bytes(data)
    err = _exit_message(capsys, caption.main, ['--workdir', str(run_dir), str(ok), str(path)])
    assert path.name in err
    fault('caption command', what, err)
  err = _exit_message(capsys, caption.main, ['--workdir', str(run_dir), str(ok), str(tmp_path)])
  fault('caption command', 'a directory given as an image', err)

  csv_cases = {
      'non-UTF-8 CSV': b'before,after\n\xff\xfe.png,b.png\n',
      'CSV row with one column': b'before,after\nonly.png\n',
      'CSV naming images that do not exist': b'before,after\na.png,b.png\n',
  }
  for what, data in csv_cases.items():
    (tmp_path / 'pairs.csv').write_bytes(data)
    err = _exit_message(capsys, caption.main, ['--workdir', str(run_dir), '--csv',
                                               str(tmp_path / 'pairs.csv')])
    fault('caption command', what, err)
  err = _exit_message(capsys, caption.main, ['--workdir', str(run_dir), '--csv', str(tmp_path)])
  fault('caption command', 'CSV path is a directory', err)
  (tmp_path / 'A').mkdir()
  (tmp_path / 'B').mkdir()
  (tmp_path / 'A' / 'x.png').write_bytes(_png())
  (tmp_path / 'B' / 'y.png').write_bytes(_png())
  err = _exit_message(capsys, caption.main, ['--workdir', str(run_dir), '--before_dir',
                                             str(tmp_path / 'A'), '--after_dir',
                                             str(tmp_path / 'B')])
  fault('caption command', 'before/after folders with different file names', err)
  err = _exit_message(capsys, caption.main, ['--workdir', str(tmp_path / 'A'), str(ok), str(ok)])
  fault('caption command', '--workdir that is not a training run', err)
  (run_dir / 'config.json').write_bytes(b'{"data": {"name": ')
  err = _exit_message(capsys, caption.main, ['--workdir', str(run_dir), str(ok), str(ok)])
  fault('caption command', "truncated config.json in the run's workdir", err)


@pytest.mark.parametrize('mode,fmt', [('L', 'PNG'), ('RGBA', 'PNG'), ('P', 'GIF'),
                                      ('I;16', 'PNG'), ('CMYK', 'JPEG'), ('1', 'BMP')])
def test_caption_inputs_of_any_mode_and_size_are_converted(tiny_config, mode, fmt, fault):
  from procap_jax.data import images
  from procap_jax.data import pipeline
  buf = io.BytesIO()
  PIL.Image.new(mode, (51, 17), 1).save(buf, format=fmt)
  before = images.load_image(_png(300, 200))
  after = images.load_image(buf.getvalue())
  size = tiny_config.data.image_size
  for x in (before, after):
    out = pipeline.resize(x, size)
    assert out.shape == (size, size, 3) and out.dtype == np.uint8
  fault('caption command', f'{mode} {fmt} after image (51 x 17) with an RGB before image '
        '(300 x 200)', f'converted to RGB, both resized to the run\'s {size} x {size}')


def test_evaluation_command_bad_input(tmp_path, capsys, fault):
  from procap_jax import evaluation
  refs = tmp_path / 'refs.json'
  evaluation.write_references(str(refs), {'a': ['a cube'], 'b': ['a ball']})
  cases = {
      'results with unknown ids': b'[{"image_id": "zzz", "caption": "a cube"}]',
      'non-UTF-8 results file': b'[{"image_id": "a", "caption": "\xff"}]',
      'truncated results file': b'[{"image_id": "a", "capt',
      'empty results list': b'[]',
      'caption that is not a string': b'[{"image_id": "a", "caption": 3}]',
      'entry without "caption"': b'[{"image_id": "a"}]',
      'missing results file': None,
  }
  for what, data in cases.items():
    results = tmp_path / 'results.json'
    if results.exists():
      results.unlink()
    if data is not None:
      results.write_bytes(data)
    err = _exit_message(capsys, evaluation.main, ['--results', str(results), '--references',
                                                  str(refs), '--no-meteor', '--no-spice'])
    fault('evaluation command', what, err)
  (tmp_path / 'ok.json').write_bytes(b'[{"image_id": "a", "caption": "a cube"}]')
  refs.write_bytes(refs.read_bytes()[:30])
  err = _exit_message(capsys, evaluation.main, ['--results', str(tmp_path / 'ok.json'),
                                                '--references', str(refs), '--no-meteor',
                                                '--no-spice'])
  fault('evaluation command', 'truncated reference file', err)


def _spot_manual(man, problem: str = '') -> None:
  """A 2-pairs-per-split Spot-the-Diff manual directory with odd but valid inputs: after images
  of another size and mode than the before images, and empty captions."""
  rng = np.random.default_rng(0)
  (man / 'annotations').mkdir(parents=True)
  (man / 'resized_images').mkdir()
  n = 0
  for split in ('train', 'val', 'test'):
    data = []
    for _ in range(2):
      n += 1
      data.append({'img_id': str(n), 'sentences': ['the car is gone', '', '   ']})
      PIL.Image.fromarray(rng.integers(0, 255, (40, 50, 3), np.uint8)).save(
          man / 'resized_images' / f'{n}.png')
      after = rng.integers(0, 255, (70, 33), np.uint8)
      mode_image = PIL.Image.fromarray(after).convert('LA' if n % 2 else 'P')
      mode_image.save(man / 'resized_images' / f'{n}_2.png')
    (man / 'annotations' / f'{split}.json').write_text(json.dumps(data))
  bad = man / 'resized_images' / '3.png'
  if problem == 'non-UTF-8 annotation file':
    (man / 'annotations' / 'val.json').write_bytes(b'[{"img_id": "3", "sentences": ["\xff"]}]')
  elif problem == 'image of 20000 x 20000 px (header)':
    bad.write_bytes(_huge_png())
  elif problem == 'zero-size image file':
    bad.write_bytes(b'')
  elif problem == 'truncated JPEG':
    bad.write_bytes(_jpeg()[:300])
  elif problem == 'missing image file':
    bad.unlink()
  elif problem == 'a split whose captions are all empty':
    (man / 'annotations' / 'val.json').write_text(json.dumps(
        [{'img_id': '3', 'sentences': ['', ' ']}]))


def test_real_dataset_builders_bad_input(tmp_path, fault):
  from tfds_builders import spot_the_diff
  man = tmp_path / 'ok'
  _spot_manual(man)
  builder = spot_the_diff.prepare('tiny32', str(tmp_path / 'data_ok'), str(man), num_workers=1)
  record = builder.as_data_source('train')[0]
  assert record['before'].shape == record['after'].shape == (32, 32, 3)
  assert [c.decode() for c in record['captions']] == ['the car is gone']
  fault('dataset builders (spot_the_diff shown)', 'before 50 x 40 RGB, after 33 x 70 LA / P '
        '(mismatched sizes, non-RGB), empty captions', 'built: both images converted to RGB '
        'and resized to the config size; empty captions dropped')
  for i, problem in enumerate(('non-UTF-8 annotation file', 'image of 20000 x 20000 px (header)',
                                'zero-size image file', 'truncated JPEG', 'missing image file',
                                'a split whose captions are all empty')):
    man = tmp_path / f'manual{i}'
    _spot_manual(man, problem)
    data_dir = tmp_path / f'data{i}'
    with pytest.raises(errors.UserError) as info:
      spot_the_diff.prepare('tiny32', str(data_dir), str(man), num_workers=1)
    config_dir = data_dir / 'spot_the_diff' / 'tiny32'
    assert not config_dir.exists() or not os.listdir(config_dir)  # nothing half-written
    fault('dataset builders (spot_the_diff shown)', problem, f'error: {info.value}')


def test_synthetic_builder_command_bad_input(tmp_path, capsys, fault):
  import importlib
  build = importlib.import_module('tfds_builders.synthetic_change.build')  # the command module
  err = _exit_message(capsys, build.main, ['--config', 'huge', '--data_dir', str(tmp_path)])
  fault('synthetic_change builder command', 'unknown builder config', err)
  (tmp_path / 'file').write_text('x')
  err = _exit_message(capsys, build.main, ['--config', 'tiny', '--data_dir',
                                           str(tmp_path / 'file')])
  fault('synthetic_change builder command', '--data_dir is a file', err)


# ------------------------------------------------------- property tests: decoding never crashes

_MODES_BY_FORMAT = {
    'PNG': ('1', 'L', 'LA', 'P', 'RGB', 'RGBA', 'I;16', 'I'),
    'JPEG': ('L', 'RGB', 'CMYK'),
    'BMP': ('1', 'L', 'P', 'RGB'),
    'GIF': ('L', 'P'),
    'TIFF': ('1', 'L', 'LA', 'P', 'RGB', 'RGBA', 'CMYK', 'I;16', 'I', 'F'),
    'WEBP': ('RGB', 'RGBA'),
}


@_PROPERTY
@hypothesis.given(st.data(), st.integers(1, 48), st.integers(1, 48),
                  st.sampled_from([None, 1, 7, 32]), st.integers(0, 2**32 - 1))
def test_property_images_of_any_format_mode_and_size_decode_to_rgb(data, width, height, size,
                                                                   seed):
  from procap_jax.data import images
  fmt = data.draw(st.sampled_from(sorted(_MODES_BY_FORMAT)))
  mode = data.draw(st.sampled_from(_MODES_BY_FORMAT[fmt]))
  rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
  img = PIL.Image.fromarray(rgb).convert('RGBA').convert(mode) if mode not in (
      'I;16', 'I', 'F') else PIL.Image.fromarray(rgb[..., 0]).convert(mode)
  buf = io.BytesIO()
  try:
    img.save(buf, format=fmt)
  except (OSError, ValueError, KeyError):
    hypothesis.assume(False)  # PIL cannot write this combination
  out = images.load_image(buf.getvalue(), size=size)
  assert out.dtype == np.uint8 and out.shape == ((size, size, 3) if size else (height, width, 3))


def _valid_or_user_error(fn, *args):
  """Calls fn; a UserError (one line) is fine, any other exception fails the property."""
  try:
    return fn(*args)
  except errors.UserError as e:
    assert str(e) and '\n' not in str(e)
    return None


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(['image_id', 'caption', 'results', 'sentence', '[PAD]', 'a', 'sentences']),
        children, max_size=4),
    max_leaves=12)
_FILE_BYTES = st.one_of(st.binary(max_size=200),
                        _JSONISH.map(lambda v: json.dumps(v).encode()),
                        st.text(max_size=60).map(lambda t: t.encode('utf-8', 'surrogatepass')))


_PROPERTY_DIRS: list = []


def _property_dir(tmp_path_factory) -> str:
  if not _PROPERTY_DIRS:
    _PROPERTY_DIRS.append(str(tmp_path_factory.mktemp('property')))
  return _PROPERTY_DIRS[0]


def _make_vocab():
  from procap_jax.data import vocab as vocab_lib
  return vocab_lib.Vocab.build(['the red cube moved', 'a blue ball is gone'], min_word_count=0)


_VOCAB = _make_vocab()


@_PROPERTY
@hypothesis.given(st.text(max_size=80))
def test_property_any_unicode_caption_tokenises_or_is_a_user_error(caption):
  from procap_jax.data import vocab as vocab_lib
  vocab = _VOCAB
  tokens = vocab_lib.tokenize(caption)
  assert all(isinstance(t, str) for t in tokens)
  for encode in (vocab.encode_decoder, vocab.encode_encoder_text):
    ids = _valid_or_user_error(encode, caption, 12)
    if not caption.strip():
      assert ids is None  # empty captions are refused with one sentence
      continue
    assert ids.shape == (12,) and ids.dtype == np.int32 and (0 <= ids).all()
    assert (ids < vocab.size).all()
  if caption.strip():
    assert isinstance(vocab.decode(vocab.encode_decoder(caption, 12)), str)


@_PROPERTY
@hypothesis.given(st.binary(max_size=80))
def test_property_caption_bytes_decode_or_are_a_user_error(raw):
  from procap_jax.data import pipeline
  text = _valid_or_user_error(pipeline._text, raw)  # pylint: disable=protected-access
  try:
    assert text == raw.decode('utf-8')
  except UnicodeDecodeError:
    assert text is None


@_PROPERTY
@hypothesis.given(_FILE_BYTES)
def test_property_any_file_content_reads_or_is_a_user_error(tmp_path_factory, content):
  from procap_jax import caption
  from procap_jax import evaluation
  from procap_jax.data import vocab as vocab_lib
  from procap_jax.procedure import scores as scores_lib
  from tfds_builders import common
  import argparse
  d = _property_dir(tmp_path_factory)
  path = os.path.join(d, 'file.json')
  with open(path, 'wb') as f:
    f.write(content)
  _valid_or_user_error(evaluation.read_results, path)
  _valid_or_user_error(evaluation.read_references, path)
  _valid_or_user_error(vocab_lib.Vocab.load, path)
  _valid_or_user_error(scores_lib.load_scores, path)
  _valid_or_user_error(common.read_json, d, 'file.json')
  os.replace(path, os.path.join(d, 'config.json'))
  _valid_or_user_error(caption.load_run_config, d)
  os.replace(os.path.join(d, 'config.json'), os.path.join(d, 'pairs.csv'))
  args = argparse.Namespace(csv=os.path.join(d, 'pairs.csv'), before_dir=None, after_dir=None,
                            images=[])
  _valid_or_user_error(caption.pairs_from_args, args)


def test_property_tests_are_recorded(fault):
  fault('image decoding (builders, caption command)', 'hypothesis: any format (PNG, JPEG, BMP, '
        'GIF, TIFF, WebP) x mode (1, L, LA, P, RGB, RGBA, CMYK, I;16, I, F) x size 1-48 px, '
        'resized or not; plus random bytes, truncations, byte flips and header sizes up to '
        '2^31 (tests/images_test.py)', 'always RGB uint8 of the right shape, or one UserError '
        'sentence; never another exception')
  fault('caption decoding', 'hypothesis: any unicode caption (empty, whitespace, control '
        'characters, surrogates) through tokenize / encode_decoder / encode_encoder_text; any '
        'bytes as a stored caption', 'token ids of the right shape and range; empty captions and '
        'non-UTF-8 bytes give one UserError sentence; never another exception')
  fault('file readers', 'hypothesis: random bytes, random JSON and random text as a results, '
        'references, vocabulary, scores, annotation, run config or pairs CSV file',
        'parsed, or one UserError sentence naming the file; never another exception')
