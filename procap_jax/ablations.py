r"""The paper's ablations on the synthetic benchmark, several seeds, written to docs/results.md.

  python -m procap_jax.ablations --root workdir/ablations --seeds 0,1,2
  python -m procap_jax.ablations --root R --data_dir W/data --tokenizer_from W/tokenizer  # reuse
      # the dataset and tokenizer of a README command 1 run (W = its workdir)
  python -m procap_jax.ablations --root R --preset large --seeds 0 \
      --override caption.train.steps=400   # the larger stage 1 of `large`, shorter stage 2

Variants (configs/synthetic.py): static (no stage 1, no queries), no_queries (stage 1, no
queries), no_stage1 (queries without stage 1, k = 1), k1, k2 (the full model), k4, and oracle
(k = 2 with keyframes from the renderer's true procedure instead of flow frames) and faithful
(k = 2 with the paper presets' stage-1 switches instead of the synthetic default's departures),
and the field's baseline duda_patches (DUDA, Park et al., ICCV 2019, on pixel patches from
scratch: stage 2 alone, no tokenizer).
Each variant x seed is an ordinary run in `<root>/<variant>_s<seed>` (resumable; finished runs
are skipped). The preset is `ablation` unless `--preset` says otherwise: the default (the
`small` dataset and its tokenizer, a small 200-step stage 1 and a 3,000-step stage 2) with a
smaller report, so the full k = 2 row trains the default (`--report_only` writes the table from
the finished runs, training nothing).
The tokenizer does not depend on the variant: one is trained (in `<root>/tokenizer`) and copied
into every run that has a tokenizer stage (all but duda_patches), so every run reads one feature
cache (`--tokenizer_per_seed` trains one per seed instead). Test metrics (overall and by change
type) are reported as mean and std over seeds, beside the paper's CLEVR-Change numbers for
context and the reference rows (captioners that need no model, scored on the same test split;
read from a finished run's results.json), then the goal lines of the full model
(procap_jax/ablation_table.py renders them).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from configs import synthetic
from procap_jax import ablation_clock
from procap_jax import ablation_plot
from procap_jax import ablation_table
from procap_jax import config_lib
from procap_jax import errors
from procap_jax import main as main_lib
from procap_jax.data import datasets

VARIANTS = ablation_table.VARIANTS
# Runs in this order, every seed of a variant before the next variant: the full model first, so
# the row the acceptance lines judge is known first, and a variant can reuse an earlier
# variant's finished stage 1 of the same seed ('no_queries' trains exactly the stage 1 of 'k2':
# same config, same seed). 'duda_patches' trains no tokenizer: last, and never the run that
# builds what the jobs share (`first_run`).
RUN_ORDER = ('k2', 'no_queries', 'static', 'no_stage1', 'k1', 'k4', 'oracle', 'faithful',
             'duda_patches')
SHARED_STAGE1 = {'no_queries': 'k2'}
# Each job process runs its matmuls on one thread: on 2 cores two such processes do about 1.3
# times the work of one process with two threads (small matmuls scale poorly; docs/results.md).
ONE_THREAD = '--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1'


def run_dir(root: str, variant: str, seed: int) -> str:
  """The workdir of one variant x seed run: `<root>/<variant>_s<seed>`."""
  return os.path.join(root, run_name(variant, seed))


run_name = ablation_clock.run_name  # '<variant>_s<seed>', beside its inverse in the ledger's code


def _finished(root: str, variant: str, seed: int) -> bool:
  """Whether the run has written its results.json (it is read back, never trained again)."""
  return os.path.exists(os.path.join(run_dir(root, variant, seed), 'results.json'))


def _copy_stage(src: str, dst: str) -> None:
  """Copies a finished stage folder (one with DONE) to `dst` unless `dst` exists."""
  if os.path.exists(os.path.join(src, 'DONE')) and not os.path.exists(dst):
    shutil.copytree(src, dst + '.tmp', dirs_exist_ok=True)
    os.replace(dst + '.tmp', dst)


def run_variant(variant: str, seed: int, root: str, preset: str, overrides: list[str],
                data_dir: str = '', tokenizer_from: str = '',
                tokenizer_per_seed: bool = False) -> dict:
  """Trains (or reads back) one variant x seed run in `<root>/<variant>_s<seed>`.

  Args:
    variant: one of VARIANTS.
    seed: config.seed.
    root: folder of all runs.
    preset: configs/synthetic.py preset.
    overrides: 'key=json' config overrides.
    data_dir: an already built dataset folder ('' = `<root>/data`, built when missing).
    tokenizer_from: a finished tokenizer stage folder copied into every run ('' = train one in
      `<root>/tokenizer` and share it).
    tokenizer_per_seed: without `tokenizer_from`, train one tokenizer per seed
      (`<root>/tokenizer_s<seed>`) instead of one for all seeds.

  Returns:
    The run's results.json dict (with its 'reference_rows') and 'seed', 'distinct_captions'.
  """
  config = variant_config(variant, preset, overrides, seed=seed,
                          data_dir=data_dir or os.path.join(root, 'data'))
  workdir = run_dir(root, variant, seed)
  if _finished(root, variant, seed):
    with open(os.path.join(workdir, 'results.json'), encoding='utf-8') as f:
      return _with_distinct_captions(json.load(f), workdir)
  shared_tok = shared_tokenizer_dir(root, seed, tokenizer_from, tokenizer_per_seed)
  if tokenizer_from and not os.path.exists(os.path.join(tokenizer_from, 'DONE')):
    raise errors.UserError(f'--tokenizer_from {tokenizer_from} is not a finished tokenizer stage '
                           '(no DONE file)')
  trains_tokenizer = 'tokenizer' in config.stages  # not duda_patches: no tokenizer to copy
  if trains_tokenizer:
    _copy_stage(shared_tok, os.path.join(workdir, 'tokenizer'))
  if variant in SHARED_STAGE1 and 'pretrain' in config.stages:
    _copy_stage(os.path.join(run_dir(root, SHARED_STAGE1[variant], seed), 'pretrain'),
                os.path.join(workdir, 'pretrain'))
  results = main_lib.run(config, workdir)
  if trains_tokenizer:
    _copy_stage(os.path.join(workdir, 'tokenizer'), shared_tok)
  return _with_distinct_captions(dict(results), workdir)


def variant_config(variant: str, preset: str, overrides: list[str], seed: int = 0,
                   data_dir: str = ''):
  """The config of one variant's run: the preset with the variant, `seed`, `data_dir`, then
  the 'key=json' `overrides`."""
  config = synthetic.get_config(f'{preset},{variant}' if variant != 'k2' else preset)
  config.seed = seed
  config.data.data_dir = data_dir
  for item in overrides:
    config_lib.apply_override(config, item)
  return config


def first_run(variants: list[str], preset: str, overrides: list[str]) -> str:
  """The variant whose first-seed run builds what the `--jobs` processes share: the first in
  RUN_ORDER that trains the tokenizer (it builds the dataset too), else the first (the dataset
  alone)."""
  order = [v for v in RUN_ORDER if v in variants]
  return next((v for v in order if 'tokenizer' in variant_config(v, preset, overrides).stages),
              order[0])


def shared_tokenizer_dir(root: str, seed: int, tokenizer_from: str,
                         tokenizer_per_seed: bool) -> str:
  """The finished tokenizer stage a run of `seed` copies: `tokenizer_from`, else the one the
  runs train and share in `<root>` (one per seed with `tokenizer_per_seed`)."""
  return tokenizer_from or os.path.join(
      root, f'tokenizer_s{seed}' if tokenizer_per_seed else 'tokenizer')


def _with_distinct_captions(results: dict, workdir: str) -> dict:
  """Adds 'distinct_captions': how many different sentences the run wrote for the test split
  (1 = the captioner ignores its images), and 'seed' (from the run's config.json)."""
  config_path = os.path.join(workdir, 'config.json')
  if os.path.exists(config_path):
    with open(config_path, encoding='utf-8') as f:
      results['seed'] = int(json.load(f).get('seed', 0))
  path = os.path.join(workdir, 'caption', 'predictions_test.json')
  if os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      results['distinct_captions'] = len({p['caption'] for p in json.load(f)})
  return results


@errors.exit_on_user_error
def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--root', required=True)
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--preset', default='ablation',
                      help='configs/synthetic.py preset (ablation, default, large, quick, tiny)')
  parser.add_argument('--data_dir', default='',
                      help='an already built synthetic dataset folder (default <root>/data)')
  parser.add_argument('--tokenizer_from', default='',
                      help='a finished tokenizer stage folder shared by every run (default: one '
                      'trained in <root>/tokenizer)')
  parser.add_argument('--tokenizer_per_seed', action='store_true',
                      help='train one tokenizer per seed instead of one for all seeds')
  parser.add_argument('--override', action='append', default=[],
                      help='config override key=value (JSON or Python literal), repeatable')
  parser.add_argument('--jobs', type=int, default=1,
                      help='this many runs at once, each in its own one-thread process (2 on a '
                      '2-core machine: about 1.3 times the throughput)')
  parser.add_argument('--report_only', action='store_true',
                      help='train nothing: write the table from the runs already finished and '
                      'name the missing ones')
  parser.add_argument('--core', type=int, default=-1, help=argparse.SUPPRESS)  # set by --jobs
  # set by --jobs: a job process, whose run the parent's clock counts
  parser.add_argument('--job', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--out', default='docs/results.md')
  parser.add_argument('--figure', default='',
                      help='the table as a picture (PNG; default ablations.png beside --out)')
  args = parser.parse_args(argv)
  if args.core >= 0 and hasattr(os, 'sched_setaffinity'):
    os.sched_setaffinity(0, {args.core})
  seeds = [int(s) for s in args.seeds.split(',')]
  variants = [v for v in args.variants.split(',') if v]
  for v in variants:
    if v not in VARIANTS:
      raise errors.UserError(f'unknown variant {v!r}; choose from {", ".join(VARIANTS)}')
  all_results, missing = {}, {}
  start = time.time()
  todo = [t for t in tasks(variants, seeds) if not _finished(args.root, *t)]
  command = ' '.join(['python -m procap_jax.ablations'] +
                     [a for a in (argv or []) if a != '--report_only'])
  clock = (ablation_clock.Clock(args.root, command) if todo and not (args.report_only or args.job)
           else None)
  if args.jobs > 1 and clock:
    _run_jobs(args, argv or [], seeds, variants, clock=clock)
  for v, seed in tasks(variants, seeds):
    done = _finished(args.root, v, seed)
    if args.report_only and not done:
      missing.setdefault(v, []).append(str(seed))
      continue
    print(f'=== {v} seed {seed}', flush=True)
    trains = clock is not None and not done
    all_results.setdefault(v, []).append(run_variant(
        v, seed, args.root, args.preset, args.override, data_dir=args.data_dir,
        tokenizer_from=args.tokenizer_from, tokenizer_per_seed=args.tokenizer_per_seed))
    if trains:
      clock.tick([run_name(v, seed)])
  minutes = (time.time() - start) / 60
  ledger = ablation_clock.read(args.root)
  timing = ablation_clock.describe(
      ledger, None if args.report_only else minutes,
      {run_name(*t) for t in tasks(variants, seeds) if _finished(args.root, *t)})
  if args.report_only:
    how = (f'Runs made by `{ledger["command"] or command}`; this table read back the finished ones '
           f'(`--report_only`)' + (f'; not finished yet: {_seed_lists(missing)}' if missing
                                   else '') + (f'. Time: {timing}' if timing else ''))
  else:
    how = (f'Measured with `{command}` ({timing}; runs already finished are read back, not '
           'retrained)')
  figure = args.figure or os.path.join(os.path.dirname(args.out), 'ablations.png')
  picture = ''
  if ablation_plot.plot(all_results, figure):
    link = os.path.relpath(figure, os.path.dirname(os.path.abspath(args.out)))
    picture = f'![The table as a picture: a bar per variant and score]({link})\n\n'
  text = (f'### Measured ablations\n\n{how}. Preset `{args.preset}`, overrides '
          f'{args.override or "none"}, seeds {seeds}. Test split, '
          'checkpoint chosen on val; scores x 100, mean ± std over seeds. The reference rows are '
          'captioners that need no model, scored on the same test pairs '
          '(procap_jax/semantic_scores.py). The paper column is CLEVR-Change, for context only: '
          'a different dataset and scale.\n\n' + picture + ablation_table.report(all_results))
  errors.write_text_atomic(args.out, merge_into(args.out, text))
  print(text)


def _seed_lists(seeds_of: dict[str, list[str]]) -> str:
  """{'k4': ['0', '2']} -> 'k4 (seeds 0, 2)'."""
  return ', '.join(f'{v} (seed{"s" * (len(s) > 1)} {", ".join(s)})' for v, s in seeds_of.items())


def tasks(variants: list[str], seeds: list[int]) -> list[tuple[str, int]]:
  """Every (variant, seed) run, in RUN_ORDER, every seed of a variant before the next."""
  return [(v, seed) for v in RUN_ORDER if v in variants for seed in seeds]


def _prerequisite(task: tuple[str, int], queued: list) -> tuple[str, int] | None:
  """The run whose stage 1 `task` copies (SHARED_STAGE1, same seed), if it is one of `queued`."""
  source = (SHARED_STAGE1.get(task[0]), task[1])
  return source if source in queued else None


def _run_jobs(args, argv: list[str], seeds: list[int], variants: list[str],
              spawn=subprocess.Popen, poll_seconds: float = 1.0,
              clock: ablation_clock.Clock | None = None) -> None:
  """Trains every run in at most `args.jobs` child processes at a time, one run each (this
  module with --jobs 1, one variant and one seed), each on one thread and, where the OS allows,
  one core. A freed job takes the next run in `tasks` order whose stage-1 source has finished,
  so the full model's seeds run first and side by side, and the jobs stay busy to the end. A run
  that has its results.json is read back, not started again. Each run's output goes to
  `<root>/<variant>_s<seed>.log`, and a line per minute here shows where each job is. The first
  run (`first_run`: it builds the dataset and trains the shared tokenizer when missing) runs
  here first, so no two processes build the same thing. `clock` counts the wall time (the
  call's and each run's; `ablation_clock`). `spawn` and `poll_seconds`: for tests."""
  tick = clock.tick if clock else lambda running: None
  first = first_run(variants, args.preset, args.override)
  tokenizer = 'tokenizer' in variant_config(first, args.preset, args.override).stages
  if not _shared_inputs_ready(args, seeds[0], tokenizer):
    print(f'=== {first} seed {seeds[0]} (before the jobs: builds what they share)', flush=True)
    run_variant(first, seeds[0], args.root, args.preset, args.override, data_dir=args.data_dir,
                tokenizer_from=args.tokenizer_from, tokenizer_per_seed=args.tokenizer_per_seed)
    tick([run_name(first, seeds[0])])
  keep = child_argv(argv)
  env = dict(os.environ, XLA_FLAGS=' '.join(
      f for f in (os.environ.get('XLA_FLAGS', ''), ONE_THREAD) if f))
  cores = sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else []
  os.makedirs(args.root, exist_ok=True)
  queued = tasks(variants, seeds)
  finished = {t for t in queued if _finished(args.root, *t)}  # read back, not started again
  todo, failed, running = [t for t in queued if t not in finished], [], {}
  last = time.time()
  while todo or running:
    for slot, (task, log, proc) in list(running.items()):
      if proc.poll() is not None:
        tick([run_name(*t) for t, _, _ in running.values()])
        del running[slot]
        finished.add(task)
        if proc.returncode:
          failed.append(f'{task[0]} seed {task[1]} (log {log})')
        print(f'job {slot}: {task[0]} seed {task[1]} '
              f'{"failed" if proc.returncode else "finished"}', flush=True)
    for slot in [i for i in range(args.jobs) if i not in running]:
      task = next((t for t in todo if _prerequisite(t, queued) in (None, *finished)), None)
      if task is None:
        break
      todo.remove(task)
      log = run_dir(args.root, *task) + '.log'
      cmd = [sys.executable, '-m', 'procap_jax.ablations', *keep, '--job', '--variants',
             task[0], '--seeds', str(task[1]), '--out', os.path.join(args.root, f'job{slot}.md'),
             '--figure', os.path.join(args.root, f'job{slot}.png')]
      if len(cores) >= args.jobs:
        cmd += ['--core', str(cores[slot % len(cores)])]
      print(f'job {slot}: {task[0]} seed {task[1]} (log {log})', flush=True)
      with open(log, 'a', encoding='utf-8') as f:
        running[slot] = (task, log, spawn(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
    if not running:
      continue
    time.sleep(poll_seconds)
    if time.time() - last >= 60:
      last = time.time()
      tick([run_name(*t) for t, _, _ in running.values()])
      for slot, (task, log, _) in sorted(running.items()):
        print(f'job {slot}: {task[0]} seed {task[1]}: {_last_line(log)}', flush=True)
  if failed:
    raise errors.UserError(f'ablation run(s) failed: {"; ".join(failed)}')


def _shared_inputs_ready(args, seed: int, tokenizer: bool = True) -> bool:
  """Whether the dataset is built and (with `tokenizer`: some run trains one) the tokenizer the
  runs share is trained (then the jobs can start at once; else one run here builds them first,
  so no two processes build the same). With --tokenizer_per_seed only the first seed's tokenizer
  is built first."""
  config = synthetic.get_config(args.preset)
  ddir = args.data_dir or os.path.join(args.root, 'data')
  tok = shared_tokenizer_dir(args.root, seed, args.tokenizer_from, args.tokenizer_per_seed)
  return ((not tokenizer or os.path.exists(os.path.join(tok, 'DONE'))) and
          datasets.is_prepared(config.data.name, config.data.builder_config, ddir))


def child_argv(argv: list[str]) -> list[str]:
  """`argv` without the options the parent sets per job (--jobs, --variants, --seeds, --out,
  --figure, --core, --job), in either the '--flag value' or the '--flag=value' form."""
  keep, skip = [], ('--jobs', '--variants', '--seeds', '--out', '--figure', '--core')
  argv = [a for a in argv if a != '--job']
  it = iter(argv)
  for a in it:
    if a in skip:
      next(it, None)
    elif not a.startswith(tuple(f + '=' for f in skip)):
      keep.append(a)
  return keep


def _last_line(path: str) -> str:
  with open(path, 'rb') as f:
    f.seek(max(0, os.path.getsize(path) - 4096))
    lines = [l for l in f.read().decode('utf-8', 'replace').splitlines()
             if l.startswith(('[', '==='))]
  return lines[-1][:160] if lines else ''


BEGIN, END = '<!-- ablations:begin -->', '<!-- ablations:end -->'


def merge_into(path: str, generated: str) -> str:
  """The new content of `path`: `generated` between the BEGIN/END markers, keeping whatever the
  file has outside them (hand-written analysis); the whole file when it has no markers."""
  block = f'{BEGIN}\n{generated}{END}\n'
  if not os.path.exists(path):
    return block
  with open(path, encoding='utf-8') as f:
    old = f.read()
  if BEGIN not in old or END not in old:
    return block
  head, rest = old.split(BEGIN, 1)
  tail = rest.split(END, 1)[1].lstrip('\n')
  return head + block + ('\n' + tail if tail else '')


if __name__ == '__main__':
  main(sys.argv[1:])
