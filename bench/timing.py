"""Wall-clock timing without JAX: `bench.common` re-exports it, and the torch child of
`bench.matmul_shapes` (a Python without JAX) imports it directly."""

import time
from typing import Callable


def time_all(fn: Callable[[], object], warmup: int = 1, repeats: int = 3) -> list[float]:
  """Wall times of `repeats` calls of `fn()` (which must block) after `warmup` calls."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return times
