r"""Dataset build speed: pairs per second of the synthetic builder (render, interpolate, write).

  python -m bench.dataset_build                       # `tiny` (80 pairs), one worker per core
  python -m bench.dataset_build --config small --modes local:2
  python -m bench.dataset_build --scenes 200 --image_size 64 \
      --modes local:1,local:2,beam:1,beam:2 --repeats 2          # Beam vs. no Beam, one run

Builds the config into a fresh temporary directory (removed afterwards) and prints one JSON
line per build: pairs (records over all splits), build seconds, `samples_per_s` = pairs/s,
`tokens_per_s` = frames/s (before, after and the 9 interpolated frames per pair), the CPU
seconds of the build's processes (`cpu_s`, `cpu_ms_per_pair`: less sensitive than the wall time
to other jobs on a shared machine, and it shows the cost of Beam's machinery; `cores_used` =
cpu_s / build_s, what the build got of the machine), the CPU model and the peak RSS of the
build's process and of its worker processes (`children_peak_rss_gib`). `mfu` is null (no
model). Modes (`--modes`, comma-separated):
  local:N   the build without Beam (the default path): N rendering processes, N=1 in this process
  beam:N    TFDS's Beam path on the DirectRunner, N worker processes (multi_processing)
  beam:memory  the DirectRunner in this process (in_memory)
With several modes or `--repeats` > 1, every build runs in a fresh child process (modes
interleaved per repeat), so each line's RSS is its own; the `beam:*` modes need the [beam] extra.
`--scenes N` builds a custom config of N scenes (80 % train, 10 % val, 10 % test; 2 pairs each)
at `--image_size` instead of a named one.
"""

import argparse
import os
import resource
import shutil
import tempfile
import time

from bench import common

FRAMES_PER_PAIR = 2 + 9  # before, after and the stored 9-frame interpolation (incl. ends)


def cpu_model() -> str:
  """The CPU's model name (Linux /proc/cpuinfo; '' elsewhere)."""
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return ''


def _cpu_seconds() -> float:
  """User + system CPU time of this process and its finished (waited-for) children."""
  own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def beam_options(mode: str) -> str:
  """The Beam flags of a `beam:*` mode ('' for `local:*`)."""
  kind, _, arg = mode.partition(':')
  if kind == 'local':
    return ''
  if arg == 'memory':
    return '--runner=DirectRunner --direct_running_mode=in_memory'
  return (f'--runner=DirectRunner --direct_num_workers={int(arg)} '
          '--direct_running_mode=multi_processing')


def _builder_config(config_name: str, scenes: int, image_size: int):
  from tfds_builders.synthetic_change import synthetic_change_dataset_builder as scb
  if not scenes:
    return config_name
  val = test = max(1, scenes // 10)
  return scb.SyntheticChangeConfig(
      name=f'bench{scenes}_{image_size}', description='bench.dataset_build',
      image_size=image_size, train_scenes=scenes - val - test, val_scenes=val, test_scenes=test)


def measure(config_name: str, mode: str, scenes: int = 0, image_size: int = 64) -> dict:
  """Builds a synthetic_change config from scratch in `mode` and times it."""
  from tfds_builders import beam_build
  from tfds_builders.synthetic_change import synthetic_change_dataset_builder as scb
  kind, _, arg = mode.partition(':')
  if kind not in ('local', 'beam') or not arg:
    raise ValueError(f'unknown mode {mode!r}: local:N, beam:N or beam:memory')
  workers = int(arg) if kind == 'local' else None
  options = beam_options(mode)
  config = _builder_config(config_name, scenes, image_size)
  tmp = tempfile.mkdtemp(prefix='bench_build_')
  try:
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    builder = scb.Builder(config=config, data_dir=tmp, file_format='array_record',
                          num_workers=workers)
    builder.download_and_prepare(file_format='array_record',
                                 download_config=beam_build.download_config(options))
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    pairs = sum(int(s.num_examples) for s in builder.info.splits.values())
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
  cfg = builder.builder_config
  return {
      'bench': 'dataset_build', 'config': f'synthetic_change/{cfg.name}', 'batch': None,
      'image_size': cfg.image_size, 'mode': mode, 'beam_options': options,
      'workers': scb.resolve_workers(workers) if kind == 'local' else arg,
      'pairs': pairs, 'build_s': seconds, 'cpu_s': cpu, 'cpu_ms_per_pair': 1e3 * cpu / pairs,
      'cores_used': cpu / seconds,
      'samples_per_s': pairs / seconds, 'tokens_per_s': pairs * FRAMES_PER_PAIR / seconds,
      'mfu': None, 'peak_rss_gib': common.peak_rss_gib(), 'children_peak_rss_gib': children,
      'cpu': cpu_model(), 'cores': len(os.sched_getaffinity(0)),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='tiny', choices=('tiny', 'small', 'full'))
  parser.add_argument('--scenes', type=int, default=0,
                      help='build a custom config of this many scenes instead of --config')
  parser.add_argument('--image_size', type=int, default=64, help='with --scenes')
  parser.add_argument('--workers', type=int, default=None,
                      help='shorthand for --modes local:N (default: one per core)')
  parser.add_argument('--modes', default='',
                      help='comma-separated local:N, beam:N, beam:memory (see the docstring)')
  parser.add_argument('--repeats', type=int, default=1, help='builds per mode (interleaved)')
  args = parser.parse_args()
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  modes = [m for m in args.modes.split(',') if m]
  if not modes:
    modes = [f'local:{args.workers or len(os.sched_getaffinity(0))}']
  if len(modes) == 1 and args.repeats == 1:
    common.emit(measure(args.config, modes[0], args.scenes, args.image_size))
    return
  for repeat in range(args.repeats):
    for mode in modes:
      child = ['--config', args.config, '--scenes', str(args.scenes),
               '--image_size', str(args.image_size), '--modes', mode]
      for record in common.run_child('bench.dataset_build', child):
        record['repeat'] = repeat
        common.emit(record)


if __name__ == '__main__':
  main()
