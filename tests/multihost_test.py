"""Two processes on localhost (4 CPU devices each) train together like one 8-device process.

The parent runs a few tokenizer-stage steps of `train.run` on the tiny synthetic dataset in this
process (8 fake devices, mesh (4, 2)), then launches this file twice as a script: each child
initialises `jax.distributed` through `procap_jax.main` (JAX_NUM_PROCESSES / JAX_COORDINATOR_ADDRESS
/ JAX_PROCESS_ID), reads only its rows of every global batch and runs the same steps on the same
(4, 2) mesh spanning both processes. The logged losses must equal the one-process run's.

A second test runs `procap_jax.main.run` itself in two processes on one fresh workdir: the
dataset build (process 0 builds, process 1 waits), the tokenizer, stage-1 and caption training
with orbax checkpoints, the stage-1 test evaluation, the caption test evaluation and the HTML
report, then a second launch that must find every stage done.
"""

import json
import os
import socket
import subprocess
import sys

import xla_settings

STEPS = 3


def _config(data_dir: str):
  from configs import synthetic
  config = synthetic.get_config('tiny')
  config.data.data_dir = data_dir
  return _small(config)


def _small(config):
  """A (4, 2) mesh and a smaller model: these tests are about the processes, not it."""
  config.mesh.data, config.mesh.model = 4, 2
  config.data.image_size = 16
  config.tokenizer.model.update(ch=8, ch_mult=(1, 2), resolution=16, z_channels=8, embed_dim=8,
                                n_embed=16)
  config.pretrain.model.update(feature_dim=8, codebook_size=16)  # the same 8 x 8 token grid
  # One encoder block and one decoder layer: each stage still splits its parameters over
  # 'model' and its batch over 'data', with half the program to compile in each process.
  config.pretrain.model.depth = 1
  config.caption.model.layers = 1
  return config


def _train(data_dir: str) -> list[float]:
  """STEPS tokenizer steps of the trainer's pieces (pipeline share, sharded state, jitted step)
  on the global mesh; returns the losses."""
  import jax
  import numpy as np
  from procap_jax import sharding
  from procap_jax import stages
  from procap_jax import train
  from procap_jax.data import pipeline
  config = _config(data_dir)
  task = stages.TASKS['tokenizer']
  mesh = sharding.mesh_from_config(config)
  batch_size = int(config.tokenizer.train.batch_size)
  rows = sharding.process_batch_rows(mesh, batch_size) if jax.process_count() > 1 else None
  ds = pipeline.make_train_dataset(config, data_dir, batch_size, int(config.seed), rows=rows)
  example = ds[0]
  model = task.build_model(config)
  tx = task.make_optimizer(config, 100)
  state, state_sh = train.create_state(task, model, config, tx, jax.random.key(1), example, mesh)
  batch_sh = {k: sharding.batch_sharding(mesh, np.asarray(v).ndim) for k, v in example.items()}
  step = train.make_train_step(task, model, config, tx, state_sh, batch_sh, None, mesh)
  losses = []
  for i in range(STEPS):
    state, metrics = step(state, sharding.shard_batch(ds[i], mesh), None, jax.random.key(0))
    losses.append(float(metrics['loss']))
  return losses


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def test_two_processes_match_one(tiny_data_dir):
  import jax
  assert jax.device_count() == 8
  expected = _train(tiny_data_dir)

  outputs = _launch([tiny_data_dir], timeout=600)
  assert 'process 0 of 2, 4 local / 8 global devices' in outputs[0], outputs[0][-2000:]
  got = [json.loads(line[len('losses '):]) for line in outputs[0].splitlines()
         if line.startswith('losses ')]
  assert got, outputs[0][-2000:]
  got = got[0]
  assert len(got) == STEPS
  assert all(abs(g - e) <= 1e-4 * abs(e) + 1e-6 for g, e in zip(got, expected)), (got, expected)


def _launch(args: list[str], timeout: float = 900) -> list[str]:
  """Runs this file as a script in 2 processes (4 CPU devices each); returns their outputs."""
  port = _free_port()
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  children = []
  for pid in range(2):
    env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_NUM_PROCESSES='2', JAX_PROCESS_ID=str(pid),
               JAX_COORDINATOR_ADDRESS=f'localhost:{port}',
               XLA_FLAGS=xla_settings.xla_flags(4),
               PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get('PYTHONPATH')) if p))
    children.append(subprocess.Popen(
        [sys.executable, os.path.abspath(__file__)] + args,
        env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outputs = []
  for child in children:
    try:
      out, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for c in children:
        c.kill()
      raise
    outputs.append(out)
  for child, out in zip(children, outputs):
    assert child.returncode == 0, out[-3000:]
  return outputs


# Steps of each stage in the main-run test: a checkpoint after each, an evaluation after the last.
RUN_STEPS = 2


def _run_config(workdir: str):
  """Tiny run of every stage on a (4, 2) mesh; the dataset is built inside `workdir`."""
  from configs import synthetic
  config = _small(synthetic.get_config('tiny'))
  for section in (config.tokenizer.train, config.pretrain.train, config.caption.train):
    section.steps, section.eval_every = RUN_STEPS, RUN_STEPS
    section.checkpoint_every, section.log_every = 1, 1
  return config


def test_two_processes_run_main_build_train_checkpoint_and_resume(tmp_path):
  import jax
  import numpy as np
  from procap_jax import checkpointing
  from procap_jax import stages
  workdir = str(tmp_path / 'run')
  outputs = _launch(['--run', workdir])
  assert 'building synthetic_change/tiny' in outputs[0], outputs[0][-2000:]
  assert 'building synthetic_change/tiny' not in outputs[1], outputs[1][-2000:]
  for stage in ('tokenizer', 'pretrain', 'caption'):
    lines = [json.loads(l) for l in open(os.path.join(workdir, stage, 'metrics.jsonl'))]
    train_steps = [l['step'] for l in lines if l.get('split', 'train') == 'train']
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == RUN_STEPS, train_steps
    variables = checkpointing.load_stage_variables(workdir, stage, 'latest')
    assert int(variables['step']) == RUN_STEPS
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(variables['params']))
  test = json.load(open(stages.pretrain_test_path(workdir)))
  assert test['split'] == 'test' and 0.0 <= test['metrics']['msm_acc'] <= 1.0
  # The caption test evaluation: every test pair captioned once, scored, and the report.
  from procap_jax.data import pipeline
  results = json.load(open(os.path.join(workdir, 'results.json')))
  assert results['split'] == 'test' and results['checkpoint'] == 'best'
  assert 0.0 <= results['metrics']['CIDEr'] and 0.0 <= results['metrics']['Bleu_4'] <= 1.0
  predictions = json.load(open(os.path.join(workdir, 'caption', 'predictions_test.json')))
  test_ids = [r['pair_id'] for r in pipeline.load_split_info(_run_config(workdir), 'test', workdir)]
  assert sorted(p['image_id'] for p in predictions) == sorted(test_ids)
  assert os.path.getsize(os.path.join(workdir, 'report.html')) > 0
  # A second launch finds every stage finished and the results kept.
  again = _launch(['--run', workdir])
  for stage in ('tokenizer', 'pretrain', 'caption'):
    assert all(f'[{stage}] already finished' in out for out in again), again[0][-2000:]


def _run_child(workdir: str) -> None:
  """One of the two processes of the main-run test."""
  from absl import flags
  flags.FLAGS.mark_as_parsed()
  from procap_jax import main
  main._maybe_init_distributed()  # pylint: disable=protected-access
  main.run(_run_config(workdir), workdir)


def _child(data_dir: str) -> None:
  """One of the two processes: main's distributed initialisation, then the same steps."""
  from absl import flags
  flags.FLAGS.mark_as_parsed()
  from procap_jax import main
  main._maybe_init_distributed()  # pylint: disable=protected-access
  import jax
  print(f'process {jax.process_index()} of {jax.process_count()}, {jax.local_device_count()} '
        f'local / {jax.device_count()} global devices', flush=True)
  print('losses', json.dumps(_train(data_dir)), flush=True)


if __name__ == '__main__':
  if sys.argv[1] == '--run':
    _run_child(sys.argv[2])
  else:
    _child(sys.argv[1])
