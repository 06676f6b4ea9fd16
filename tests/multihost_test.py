"""Two processes on localhost (4 CPU devices each) train together like one 8-device process.

The parent runs a few tokenizer-stage steps of `train.run` on the tiny synthetic dataset in this
process (8 fake devices, mesh (4, 2)), then launches this file twice as a script: each child
initialises `jax.distributed` through `procap_jax.main` (JAX_NUM_PROCESSES / JAX_COORDINATOR_ADDRESS
/ JAX_PROCESS_ID), reads only its rows of every global batch and runs the same steps on the same
(4, 2) mesh spanning both processes. The logged losses must equal the one-process run's.
"""

import json
import os
import socket
import subprocess
import sys

STEPS = 3


def _config(data_dir: str):
  from configs import synthetic
  config = synthetic.get_config('tiny')
  config.data.data_dir = data_dir
  config.mesh.data, config.mesh.model = 4, 2
  config.data.image_size = 16  # a smaller tokenizer: this test is about the processes, not it
  config.tokenizer.model.update(ch=8, ch_mult=(1, 2), resolution=16, z_channels=8, embed_dim=8,
                                n_embed=16)
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

  port = _free_port()
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  children = []
  for pid in range(2):
    env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_NUM_PROCESSES='2', JAX_PROCESS_ID=str(pid),
               JAX_COORDINATOR_ADDRESS=f'localhost:{port}',
               XLA_FLAGS='--xla_force_host_platform_device_count=4',
               PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get('PYTHONPATH')) if p))
    children.append(subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), tiny_data_dir],
        env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outputs = []
  for child in children:
    try:
      out, _ = child.communicate(timeout=600)
    except subprocess.TimeoutExpired:
      for c in children:
        c.kill()
      raise
    outputs.append(out)
  for child, out in zip(children, outputs):
    assert child.returncode == 0, out[-3000:]
  assert 'process 0 of 2, 4 local / 8 global devices' in outputs[0], outputs[0][-2000:]
  got = [json.loads(line[len('losses '):]) for line in outputs[0].splitlines()
         if line.startswith('losses ')]
  assert got, outputs[0][-2000:]
  got = got[0]
  assert len(got) == STEPS
  assert all(abs(g - e) <= 1e-4 * abs(e) + 1e-6 for g, e in zip(got, expected)), (got, expected)


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
  _child(sys.argv[1])
