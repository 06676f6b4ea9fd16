"""XLA flags every test process runs with, the suite's own and those of the runs it starts.

The legacy elemental emitters instead of XLA:CPU's fusion emitters: a tiny train step compiles
in about two thirds of the time and the process spends about a third less CPU
(docs/performance.md, "The test suite's time"). The emitters change how a fusion's loop is
generated, not what it computes.
"""

COMPILE_FLAGS = '--xla_cpu_use_fusion_emitters=false'


def xla_flags(devices: int) -> str:
  """XLA_FLAGS of a test process with `devices` host CPU devices."""
  return f'--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}'
