"""Shared measurement helpers for the benchmarks: one JSON line per measurement.

MFU is model FLOPs per second (from the compiled step's XLA cost analysis) divided by the peak
of a matmul of the same precision measured in the same process, so the figure is a ratio that
stays stable on a noisy shared machine.
"""

import json
import resource
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def peak_rss_gib() -> float:
  """Peak resident set size of this process so far, GiB (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def emit(record: dict) -> None:
  """Prints one JSON line (rounded floats) and flushes."""
  out = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()}
  print(json.dumps(out), flush=True)


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


def compiled_flops(jitted: Callable, *args) -> float | None:
  """FLOPs of one call from XLA's cost analysis of the compiled function (None if absent)."""
  try:
    analysis = jitted.lower(*args).compile().cost_analysis()
  except Exception:  # noqa: BLE001 - cost analysis is optional on some backends
    return None
  if isinstance(analysis, list):
    analysis = analysis[0] if analysis else {}
  flops = (analysis or {}).get('flops')
  return float(flops) if flops else None


def time_calls(fn: Callable[[], object], warmup: int = 1, repeats: int = 3) -> float:
  """Median wall time of `fn()` (which must block on its result), seconds."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main_guard() -> None:
  if any(a in ('-h', '--help') for a in sys.argv[1:]):
    print(__doc__)
    raise SystemExit(0)
