"""Shared measurement helpers for the benchmarks: one JSON line per measurement.

Every line carries the same core fields (`FIELDS`): the benchmark, config, batch, samples/s,
tokens/s, peak RSS (GiB) and MFU (None where it does not apply, e.g. a dataset build), and last
`cpu`, the CPU it ran on with the instruction sets that decide its speed
(`procap_jax.cpu_info.summary`: model name, family / model, avx2, avx512f, avx512_bf16, amx_bf16,
XLA's ISA cap when XLA_FLAGS sets one).

MFU is model FLOPs per second (from the compiled step's XLA cost analysis) divided by the peak
of a matmul of the same precision measured in the same process, so the figure is a ratio that
stays stable on a noisy shared machine.

Peak RSS is the process's high-water mark (`getrusage`): `run_child` runs each measurement in a
fresh Python process so the figure belongs to that measurement alone.
"""

import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import time_all  # noqa: F401  (re-exported: common.time_all)
from procap_jax import cpu_info
from procap_jax.diagnostics import records as records_lib

FIELDS = ('bench', 'config', 'batch', 'samples_per_s', 'tokens_per_s', 'peak_rss_gib', 'mfu')


def peak_rss_gib() -> float:
  """Peak resident set size of this process so far, GiB (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def emit(record: dict) -> None:
  """Prints one JSON line (floats rounded) and flushes.

  A benchmark record (one with a 'bench' key) gets the core `FIELDS` first, null when missing.
  """
  out = {k: record.get(k) for k in FIELDS} if 'bench' in record else {}
  out.update(record)
  if 'bench' in record and 'cpu' not in record:
    out['cpu'] = cpu_info.summary(cpu_info.read())
  records_lib.emit(out)


def run_child(module: str, args: Sequence[str], env: dict | None = None,
              timeout: float | None = None) -> list[dict]:
  """Runs `python -m <module> <args>` in a fresh process and returns its JSON lines.

  The child inherits this process's environment (and niceness) plus `env`. A child that fails
  gives one record with `error` set to the last line of its stderr, so a suite goes on.
  """
  cmd = [sys.executable, '-m', module, *args]
  full_env = dict(os.environ, **(env or {}))
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  full_env['PYTHONPATH'] = os.pathsep.join(p for p in (repo, full_env.get('PYTHONPATH')) if p)
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout,
                          check=False)
  except subprocess.TimeoutExpired:
    return [{'bench': module.split('.')[-1], 'args': ' '.join(args),
             'error': f'timed out after {timeout} s'}]
  records = []
  for line in proc.stdout.splitlines():
    if line.startswith('{'):
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  if proc.returncode != 0 or not records:
    tail = [l for l in proc.stderr.strip().splitlines() if l.strip()] or ['(no stderr)']
    records.append({'bench': module.split('.')[-1], 'args': ' '.join(args),
                    'error': f'exit {proc.returncode}: {tail[-1][:300]}'})
  return records


def matmul_peak_flops(dtype: str = 'float32', n: int = 2048, repeats: int = 5) -> float:
  """Best observed FLOP/s of an n x n matmul on one device (bf16 in, f32 accumulate for
  'bfloat16', as the mixed-precision model computes)."""
  dt = jnp.bfloat16 if dtype == 'bfloat16' else jnp.float32
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dt)
  f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
  f(a, a).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2.0 * n**3 / best


def cost(compiled: Any) -> dict:
  """XLA's cost analysis of a compiled function as a dict ({} when unavailable)."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - cost analysis is optional on some backends
    return {}
  if isinstance(analysis, list):
    analysis = analysis[0] if analysis else {}
  return dict(analysis or {})


def compiled_flops(jitted_or_compiled: Callable, *args) -> float | None:
  """FLOPs of one call from XLA's cost analysis (a jitted function is lowered with `args`).

  Loops (`while`) are counted once, not per iteration: use it for straight-line steps.
  """
  compiled = jitted_or_compiled
  if not hasattr(compiled, 'cost_analysis'):
    compiled = jitted_or_compiled.lower(*args).compile()
  flops = cost(compiled).get('flops')
  return float(flops) if flops else None


def memory_gib(compiled: Any) -> dict:
  """Argument / output / temp / alias sizes (GiB, per device) of a compiled function."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001
    return {}
  if m is None:
    return {}
  out = {}
  for name in ('argument', 'output', 'temp', 'alias', 'generated_code'):
    value = getattr(m, f'{name}_size_in_bytes', None)
    if value is not None:
      out[f'{name}_gib'] = value / 2**30
  return out
