r"""Start-up of the caption command: time to the first caption in a fresh process, then per pair.

  python -m procap_jax.main --config configs/synthetic.py:tiny --workdir W
  python -m bench.caption_startup --workdir W

Prints one JSON line:
  first_caption_s_cold    `python -m procap_jax.caption --workdir W b.png a.png` from process
                          start to its caption line on stdout, on a first start (an empty
                          W/caption/inference_cache: restore with orbax, compile)
  first_caption_s_warm    the same again, the cache now filled (what every later start costs)
  command_cpu_s_cold/_warm  the CPU seconds (user + system) of those commands: less inflated
                          than wall clock when other processes share the cores
  phases_cold/_warm       the same start taken apart with the Python API: interpreter start,
                          `import procap_jax.caption` (run checks: no JAX yet), the model imports
                          (jax, flax, the model modules), the restore (cold: orbax, imported
                          then; warm: the cached parameters), the first call (cold: compile)
  per_pair_s              further single pairs through one `Captioner` (`captioner(b, a)`)
  per_pair_batched_s      the same in one `caption_batch` of `--pairs` pairs
  python_jax_import_s     `python -c "import jax"` alone, the floor of any JAX start
  import_breakdown_s      `python -X importtime` of the warm command: seconds per top-level
                          package (its modules' own times; what dominates the imports)
  load_avg_1m             the machine's load when the measurement ended (2 cores here: the
                          figures are wall clock, inflated on a busy machine)

The measurement runs on a copy of W in a temporary folder whose checkpoints are symbolic links
to W's, with its own inference cache, so W's own cache is neither used nor changed; a
JAX_COMPILATION_CACHE_DIR of the caller is not passed on.
"""

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import PIL.Image

from procap_jax import caption

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The Python API start, phase by phase (one JSON line on stdout).
_PHASES = r'''
import json, sys, time
t0 = time.perf_counter()
from procap_jax import caption
caption.check_run(sys.argv[1])
t1 = time.perf_counter()
import jax, flax.linen
from procap_jax.models import captioner, vqgan
t2 = time.perf_counter()
c = caption.Captioner(sys.argv[1])
t3 = time.perf_counter()
c(sys.argv[2], sys.argv[3])
t4 = time.perf_counter()
out = {'caption_module_s': t1 - t0, 'model_imports_s': t2 - t1, 'restore_s': t3 - t2,
       'first_call_s': t4 - t3}
n = int(sys.argv[4])
if n:
  t = time.perf_counter()
  for _ in range(n):
    c(sys.argv[2], sys.argv[3])
  out['per_pair_s'] = (time.perf_counter() - t) / n
  pairs = [sys.argv[2]] * n
  c.caption_batch(pairs, [sys.argv[3]] * n)  # compiles the batch shape
  t = time.perf_counter()
  c.caption_batch(pairs, [sys.argv[3]] * n)
  out['per_pair_batched_s'] = (time.perf_counter() - t) / n
out['in_process_s'] = time.perf_counter() - t0
print(json.dumps(out))
'''


def _env() -> dict:
  """The children's environment: no XLA cache of the caller's, so the command uses its own."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX_COMPILATION_CACHE',
                                                                  'JAX_PERSISTENT_CACHE'))}
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join(p for p in (_REPO, env.get('PYTHONPATH')) if p)
  return env


def scratch_run(workdir: str, folder: str) -> str:
  """A run in `folder` that reads `workdir`'s checkpoints (symbolic links) and vocabulary but has
  its own, empty, inference cache: what a first start finds."""
  os.makedirs(folder)
  shutil.copy(os.path.join(workdir, 'config.json'), folder)
  for stage in ('caption', 'tokenizer'):
    os.makedirs(os.path.join(folder, stage))
    for sub in ('best', 'checkpoints'):
      if os.path.isdir(os.path.join(workdir, stage, sub)):
        os.symlink(os.path.abspath(os.path.join(workdir, stage, sub)),
                   os.path.join(folder, stage, sub))
  vocab = caption.vocab_path(caption.load_run_config(workdir), workdir)
  data = os.path.join(os.path.abspath(workdir), 'data')
  if vocab.startswith(data + os.sep):  # the run's default data_dir: W/data
    target = os.path.join(folder, 'data', os.path.relpath(vocab, data))
    os.makedirs(os.path.dirname(target))
    shutil.copy(vocab, target)
  return folder


def _children_cpu_s() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def first_caption(workdir: str, before: str, after: str,
                  importtime: bool = False) -> tuple[float, float, str]:
  """Seconds from starting the caption command to its first stdout line, the CPU seconds of
  the whole command (user + system), and its stderr."""
  cpu0 = _children_cpu_s()
  cmd = [sys.executable] + (['-X', 'importtime'] if importtime else []) + [
      '-m', 'procap_jax.caption', '--workdir', workdir, before, after]
  with tempfile.TemporaryFile('w+') as stderr:  # not a pipe: a full one would block the child
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=_env())
    line = proc.stdout.readline()
    elapsed = time.perf_counter() - t0
    proc.communicate()
    stderr.seek(0)
    err = stderr.read()
  if proc.returncode != 0 or line.count('\t') != 2:
    raise SystemExit(f'the caption command failed: {err.strip().splitlines()[-1:]}')
  return elapsed, _children_cpu_s() - cpu0, err


def phases(workdir: str, before: str, after: str, pairs: int) -> dict:
  """The Python API start taken apart (see the module docstring)."""
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, '-c', _PHASES, workdir, before, after, str(pairs)],
                        capture_output=True, text=True, env=_env(), check=False)
  total = time.perf_counter() - t0
  if proc.returncode != 0:
    raise SystemExit(f'the Captioner failed: {proc.stderr.strip().splitlines()[-1:]}')
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  out['interpreter_and_exit_s'] = total - out.pop('in_process_s')  # start-up and shut-down
  return out


def import_breakdown(stderr: str, top: int = 10) -> dict:
  """Import seconds per top-level package from `-X importtime` output: the modules' own times
  (without what they import) summed by package, so the figures add up to the total."""
  totals: dict[str, float] = {}
  for line in stderr.splitlines():
    m = re.match(r'import time:\s+(\d+) \|\s+\d+ \| \s*(\S+)', line)
    if m:
      root = m.group(2).split('.')[0]
      totals[root] = totals.get(root, 0.0) + int(m.group(1)) / 1e6
  ranked = sorted(totals.items(), key=lambda kv: -kv[1])
  out = {k: v for k, v in ranked[:top]}
  out['others'] = sum(v for _, v in ranked[top:])
  out['total'] = sum(totals.values())
  return out


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(prog='python -m bench.caption_startup',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True, help='a finished run (e.g. the tiny preset)')
  parser.add_argument('--pairs', type=int, default=8, help='further pairs timed per call kind')
  args = parser.parse_args(argv)
  with open(os.path.join(args.workdir, 'config.json'), encoding='utf-8') as f:
    config = json.load(f)
  size = int(config['data']['image_size'])
  with tempfile.TemporaryDirectory(prefix='caption-startup-') as tmp:
    rng = np.random.default_rng(0)
    before, after = os.path.join(tmp, 'before.png'), os.path.join(tmp, 'after.png')
    for path in (before, after):
      PIL.Image.fromarray(rng.integers(0, 256, (size, size, 3), np.uint8)).save(path)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, '-c', 'import jax'], check=True, env=_env())
    jax_import = time.perf_counter() - t0
    run = scratch_run(args.workdir, os.path.join(tmp, 'run_cmd'))
    cold, cold_cpu, _ = first_caption(run, before, after)
    warm, warm_cpu, _ = first_caption(run, before, after)
    _, _, imports = first_caption(run, before, after, importtime=True)
    run = scratch_run(args.workdir, os.path.join(tmp, 'run_api'))
    phases_cold = phases(run, before, after, 0)
    phases_warm = phases(run, before, after, args.pairs)
  record = {
      'bench': 'caption_startup', 'config': f'{config.get("preset")} ({size} px)',
      'batch': 1, 'samples_per_s': 1.0 / phases_warm['per_pair_s'], 'tokens_per_s': None,
      'peak_rss_gib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
      'mfu': None,
      'first_caption_s_cold': cold, 'first_caption_s_warm': warm,
      'command_cpu_s_cold': cold_cpu, 'command_cpu_s_warm': warm_cpu,
      'per_pair_s': phases_warm.pop('per_pair_s'),
      'per_pair_batched_s': phases_warm.pop('per_pair_batched_s'), 'pairs': args.pairs,
      'phases_cold': phases_cold, 'phases_warm': phases_warm,
      'python_jax_import_s': jax_import, 'import_breakdown_s': import_breakdown(imports),
      'load_avg_1m': os.getloadavg()[0], 'cpus': os.cpu_count(),
  }
  print(json.dumps(_rounded(record)), flush=True)
  return record


def _rounded(x):
  if isinstance(x, float):
    return round(x, 4)
  if isinstance(x, dict):
    return {k: _rounded(v) for k, v in x.items()}
  return x


if __name__ == '__main__':
  main()
