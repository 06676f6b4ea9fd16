r"""The paper's ablations on the synthetic benchmark, several seeds, written to docs/results.md.

  python -m procap_jax.ablations --root workdir/ablations --seeds 0,1,2
  python -m procap_jax.ablations --root R --data_dir W/data --tokenizer_from W/tokenizer  # reuse
      # the dataset and tokenizer of a README command 1 run (W = its workdir)
  python -m procap_jax.ablations --root R --preset large --seeds 0 \
      --override caption.train.steps=400   # the larger stage 1 of `large`, shorter stage 2

Variants (configs/synthetic.py): static (no stage 1, no queries), no_queries (stage 1, no
queries), no_stage1 (queries without stage 1, k = 1), k1, k2 (the full model), k4, and oracle
(k = 2 with keyframes from the renderer's true procedure instead of flow frames) and faithful
(k = 2 with the paper presets' stage-1 switches instead of the synthetic default's departures).
Each variant x seed is an ordinary run in `<root>/<variant>_s<seed>` (resumable; finished runs
are skipped). The preset is `ablation` unless `--preset` says otherwise: the default (the
`small` dataset and its tokenizer, a small 200-step stage 1 and a 2,000-step stage 2) with a
smaller report, so the full k = 2 row trains the default (`--report_only` writes the table from
the finished runs, training nothing).
The tokenizer does not depend on the variant: one is trained (in `<root>/tokenizer`) and copied
into every run, so every run reads one feature cache (`--tokenizer_per_seed` trains one per seed
instead). Test metrics (overall and by change type) are reported as mean and std over seeds,
beside the paper's CLEVR-Change numbers for context.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from configs import synthetic
from procap_jax import errors
from procap_jax import main as main_lib
from procap_jax.data import datasets

VARIANTS = ('static', 'no_queries', 'no_stage1', 'k1', 'k2', 'k4', 'oracle', 'faithful')
# Runs in this order, so a variant can reuse an earlier variant's finished stage 1 of the same
# seed: 'no_queries' trains exactly the stage 1 of 'k2' (same config, same seed).
RUN_ORDER = ('static', 'no_stage1', 'k2', 'no_queries', 'k1', 'k4', 'oracle', 'faithful')
SHARED_STAGE1 = {'no_queries': 'k2'}
PAPER = {  # CLEVR-Change CIDEr from the paper (ablation table and k table)
    'static': 108.4, 'no_queries': 112.7, 'no_stage1': 106.2, 'k1': 128.5, 'k2': 135.6,
    'k4': 130.5,
}
LABELS = {
    'static': 'static baseline (no stage 1, no queries)',
    'no_queries': 'stage 1, no queries',
    'no_stage1': 'queries without stage 1 (k = 1)',
    'k1': 'full, k = 1', 'k2': 'full, k = 2 (default)', 'k4': 'full, k = 4',
    'oracle': 'full, k = 2, oracle keyframes',
    'faithful': "full, k = 2, the paper presets' stage-1 switches",
}
METRICS = ('Bleu_4', 'METEOR', 'ROUGE_L', 'CIDEr')
# Relative cost of a variant's run (stage 1 + stage 2 + evaluations; k4 encodes 6 frame slots,
# oracle builds its own feature cache once), measured on the ablation preset; used only to
# balance the variants between `--jobs` processes.
COST = {'static': 1.0, 'no_stage1': 1.0, 'no_queries': 1.0, 'k1': 1.9, 'k2': 2.0, 'k4': 2.3,
        'oracle': 2.4, 'faithful': 1.9}
# Each job process runs its matmuls on one thread: on 2 cores two such processes do about 1.3
# times the work of one process with two threads (small matmuls scale poorly; docs/results.md).
ONE_THREAD = '--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1'


def job_groups(variants: list[str], jobs: int) -> list[list[str]]:
  """Splits `variants` into at most `jobs` groups of about equal COST (longest first, each to
  the lightest group); a variant that reuses another's stage 1 goes with it. Each group keeps
  RUN_ORDER."""
  groups = [[] for _ in range(max(1, min(jobs, len(variants))))]
  load = [0.0] * len(groups)
  followers = {v: src for v, src in SHARED_STAGE1.items() if src in variants}
  for v in sorted((v for v in variants if v not in followers), key=lambda v: -COST[v]):
    i = load.index(min(load))
    groups[i].append(v)
    load[i] += COST[v]
  for v, src in followers.items():
    if v in variants:
      i = next(i for i, g in enumerate(groups) if src in g)
      groups[i].append(v)
  return [[v for v in RUN_ORDER if v in g] for g in groups if g]


def _apply_override(config, item: str) -> None:
  key, _, value = item.partition('=')
  node = config
  parts = key.split('.')
  for p in parts[:-1]:
    node = node[p]
  old = node[parts[-1]]
  node[parts[-1]] = type(old)(json.loads(value)) if not isinstance(old, str) else value


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
  """
  config = synthetic.get_config(f'{preset},{variant}' if variant != 'k2' else preset)
  config.seed = seed
  config.data.data_dir = data_dir or os.path.join(root, 'data')
  for item in overrides:
    _apply_override(config, item)
  workdir = os.path.join(root, f'{variant}_s{seed}')
  results_path = os.path.join(workdir, 'results.json')
  if os.path.exists(results_path):
    with open(results_path, encoding='utf-8') as f:
      return _with_distinct_captions(json.load(f), workdir)
  shared_tok = shared_tokenizer_dir(root, seed, tokenizer_from, tokenizer_per_seed)
  if tokenizer_from and not os.path.exists(os.path.join(tokenizer_from, 'DONE')):
    raise errors.UserError(f'--tokenizer_from {tokenizer_from} is not a finished tokenizer stage '
                           '(no DONE file)')
  _copy_stage(shared_tok, os.path.join(workdir, 'tokenizer'))
  if variant in SHARED_STAGE1 and 'pretrain' in config.stages:
    _copy_stage(os.path.join(root, f'{SHARED_STAGE1[variant]}_s{seed}', 'pretrain'),
                os.path.join(workdir, 'pretrain'))
  results = main_lib.run(config, workdir)
  _copy_stage(os.path.join(workdir, 'tokenizer'), shared_tok)
  return _with_distinct_captions(dict(results), workdir)


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


def _cell(values, scale: float = 100.0) -> str:
  vals = np.array(values, float) * scale
  if np.all(np.isnan(vals)):
    return 'n/a'
  return f'{np.nanmean(vals):.1f} ± {np.nanstd(vals):.1f}' if len(vals) > 1 else f'{vals[0]:.1f}'


# A metric read from runs whose results.json predates it: the older metric with its meaning
# (the semantic decision counts "no change" as `change_decision` does).
_OLDER_NAME = {'semantic/decision': 'change_decision'}
# (column, metric) after METRICS in the main table; semantic scores: procap_jax/semantic_scores.py.
_TABLE_COLUMNS = (('CIDEr change pairs', 'change/CIDEr'),
                  ('change / no-change decision %', 'semantic/decision'),
                  ('change type %', 'semantic/type'),
                  ('all named attributes %', 'semantic/attributes'),
                  ('CIDEr no-change', 'no_change/CIDEr'))


def _metric(runs: list[dict], name: str) -> list[float]:
  return [r['metrics'].get(name, r['metrics'].get(_OLDER_NAME.get(name), np.nan)) for r in runs]


def table(all_results: dict[str, list[dict]]) -> str:
  """The main table: one row per variant, mean ± std over seeds (x 100)."""
  lines = ['| variant | seeds | ' + ' | '.join(METRICS) + ' | ' +
           ' | '.join(c for c, _ in _TABLE_COLUMNS) + ' | distinct test captions per seed '
           '| paper CLEVR-Change CIDEr |',
           '|---' * (len(METRICS) + len(_TABLE_COLUMNS) + 4) + '|']
  for variant in VARIANTS:
    runs = all_results.get(variant) or []
    if not runs:
      continue
    cells = [_cell(_metric(runs, m)) for m in METRICS + tuple(m for _, m in _TABLE_COLUMNS)]
    distinct = ', '.join(str(r.get('distinct_captions', '?')) for r in runs)
    lines.append(f'| {LABELS[variant]} | {len(runs)} | ' + ' | '.join(cells) +
                 f' | {distinct} | {PAPER.get(variant, "n/a")} |')
  return '\n'.join(lines)


CHANGE_TYPES = ('none', 'color', 'material', 'add', 'drop', 'move')


def by_type(all_results: dict[str, list[dict]]) -> str:
  """Test CIDEr per change type, mean ± std over seeds (x 100)."""
  lines = ['| variant | ' + ' | '.join(CHANGE_TYPES) + ' |',
           '|---' * (len(CHANGE_TYPES) + 1) + '|']
  for variant in VARIANTS:
    runs = all_results.get(variant) or []
    if runs:
      cells = [_cell(_metric(runs, f'{t}/CIDEr')) for t in CHANGE_TYPES]
      lines.append(f'| {LABELS[variant]} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def _by_seed(runs: list[dict], name: str) -> dict[int, float]:
  return {int(r.get('seed', i)): 100 * float(r['metrics'].get(name, np.nan))
          for i, r in enumerate(runs)}


def goals(all_results: dict[str, list[dict]]) -> str:
  """Issue 24's goal lines, each stated as met or missed with the measured numbers: the full
  model's CIDEr, decision and per-type CIDEr, and every ordering as a per-seed difference
  (full minus the variant, the same seed; mean ± std)."""
  full = all_results.get('k2') or []
  if not full:
    return 'The full model (k2) was not run: no goal can be checked.\n'
  out = []

  def mean(name):
    return float(np.nanmean([100 * v for v in _metric(full, name)]))

  cider, decision = mean('CIDEr'), mean('change_decision')
  out.append(f'- full ProCap test CIDEr >= 120: {"met" if cider >= 120 else "missed"} '
             f'({cider:.1f})')
  out.append(f'- change / no-change decision >= 90 %: {"met" if decision >= 90 else "missed"} '
             f'({decision:.1f} %)')
  low = {t: mean(f'{t}/CIDEr') for t in CHANGE_TYPES if t != 'none'}
  worst = min(low, key=low.get)
  out.append(f'- CIDEr >= 80 on every change type: '
             f'{"met" if low[worst] >= 80 else "missed"} (lowest: {worst} {low[worst]:.1f})')
  full_seed = _by_seed(full, 'CIDEr')
  for variant, margin in (('static', 10.0), ('no_queries', 0.0), ('no_stage1', 0.0),
                          ('faithful', 0.0)):
    runs = all_results.get(variant) or []
    if not runs:
      continue
    other = _by_seed(runs, 'CIDEr')
    diffs = [full_seed[s] - other[s] for s in sorted(set(full_seed) & set(other))]
    if not diffs:
      continue
    d = float(np.mean(diffs))
    spread = f' ± {np.std(diffs):.1f}' if len(diffs) > 1 else ''
    want = f'full >= {LABELS[variant]} + {margin:g}' if margin else f'{LABELS[variant]} < full'
    out.append(f'- {want}: {"holds" if d > margin else "does not hold"} (full minus it: '
               f'{d:+.1f}{spread} CIDEr over {len(diffs)} seed{"s" * (len(diffs) > 1)})')
  ks = {v: (all_results.get(v) or []) for v in ('k1', 'k2', 'k4')}
  if all(ks.values()):
    values = ', '.join(f'{v[1]} = {np.mean(_metric(r, "CIDEr")) * 100:.1f}'
                       for v, r in ks.items())
    best = max(ks, key=lambda v: np.mean(_metric(ks[v], 'CIDEr')))
    out.append(f'- k sweep (paper: k = 2 best, 128.5 / 135.6 / 130.5): k {values}; best k = '
               f'{best[1]}')
  oracle = _by_seed(all_results.get('oracle') or [], 'CIDEr')
  diffs = [oracle[s] - full_seed[s] for s in sorted(set(full_seed) & set(oracle))]
  if diffs:
    spread = f' ± {np.std(diffs):.1f}' if len(diffs) > 1 else ''
    out.append(f'- oracle keyframes minus flow keyframes (k = 2): {np.mean(diffs):+.1f}{spread} '
               f'CIDEr over {len(diffs)} seed{"s" * (len(diffs) > 1)}')
  return '\n'.join(out) + '\n'


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
                      help='config override key=value (JSON value), repeatable')
  parser.add_argument('--jobs', type=int, default=1,
                      help='run the variants in this many processes at once, one thread each '
                      '(2 on a 2-core machine: about 1.3 times the throughput)')
  parser.add_argument('--report_only', action='store_true',
                      help='train nothing: write the table from the runs already finished and '
                      'name the missing ones')
  parser.add_argument('--core', type=int, default=-1, help=argparse.SUPPRESS)  # set by --jobs
  parser.add_argument('--out', default='docs/results.md')
  args = parser.parse_args(argv)
  if args.core >= 0 and hasattr(os, 'sched_setaffinity'):
    os.sched_setaffinity(0, {args.core})
  seeds = [int(s) for s in args.seeds.split(',')]
  variants = [v for v in args.variants.split(',') if v]
  for v in variants:
    if v not in VARIANTS:
      raise errors.UserError(f'unknown variant {v!r}; choose from {", ".join(VARIANTS)}')
  all_results, missing = {}, []
  start = time.time()
  if args.jobs > 1 and not args.report_only:
    _run_jobs(args, argv or [], seeds, variants)
  for seed in seeds:
    for v in [v for v in RUN_ORDER if v in variants]:
      if args.report_only and not os.path.exists(
          os.path.join(args.root, f'{v}_s{seed}', 'results.json')):
        missing.append(f'{v} seed {seed}')
        continue
      print(f'=== {v} seed {seed}', flush=True)
      all_results.setdefault(v, []).append(run_variant(
          v, seed, args.root, args.preset, args.override, data_dir=args.data_dir,
          tokenizer_from=args.tokenizer_from, tokenizer_per_seed=args.tokenizer_per_seed))
  command = ' '.join(['python -m procap_jax.ablations'] +
                     [a for a in (argv or []) if a != '--report_only'])
  minutes = (time.time() - start) / 60
  if args.report_only:
    how = (f'Runs made by `{command}`; this table read back the finished ones '
           f'(`--report_only`)' + (f'; not finished yet: {", ".join(missing)}' if missing
                                   else ''))
  else:
    how = (f'Measured with `{command}` (this call took {minutes:.0f} min; runs already finished '
           'are read back, not retrained)')
  text = (f'### Measured ablations\n\n{how}. Preset `{args.preset}`, overrides '
          f'{args.override or "none"}, seeds {seeds}. Test split, '
          'checkpoint chosen on val; scores x 100, mean ± std over seeds. The paper column is '
          'CLEVR-Change, for context only: a different dataset and scale.\n\n'
          + table(all_results) + '\n\nCIDEr by change type (mean ± std over seeds):\n\n'
          + by_type(all_results) + '\n\nGoals (issue 24):\n\n' + goals(all_results))
  errors.write_text_atomic(args.out, merge_into(args.out, text))
  print(text)


def _run_jobs(args, argv: list[str], seeds: list[int], variants: list[str]) -> None:
  """Trains every run in `args.jobs` child processes (this module with --jobs 1 and a subset of
  the variants, all seeds), each on one thread and, where the OS allows, one core; their output
  goes to `<root>/job<i>.log`, and a line per minute here shows where each is. The first run
  (which builds the dataset and trains the shared tokenizer when missing) runs here first, so no
  two processes build the same thing."""
  if not _shared_inputs_ready(args, seeds[0]):
    first = next(v for v in RUN_ORDER if v in variants)
    print(f'=== {first} seed {seeds[0]} (before the jobs: builds what they share)', flush=True)
    run_variant(first, seeds[0], args.root, args.preset, args.override, data_dir=args.data_dir,
                tokenizer_from=args.tokenizer_from, tokenizer_per_seed=args.tokenizer_per_seed)
  keep = child_argv(argv)
  env = dict(os.environ, XLA_FLAGS=' '.join(
      f for f in (os.environ.get('XLA_FLAGS', ''), ONE_THREAD) if f))
  cores = sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else []
  os.makedirs(args.root, exist_ok=True)
  procs = []
  for i, group in enumerate(job_groups(variants, args.jobs)):
    log = os.path.join(args.root, f'job{i}.log')
    cmd = [sys.executable, '-m', 'procap_jax.ablations', *keep, '--variants', ','.join(group),
           '--out', os.path.join(args.root, f'job{i}.md')]
    if len(cores) >= args.jobs:
      cmd += ['--core', str(cores[i % len(cores)])]
    print(f'job {i}: {", ".join(group)} (log {log})', flush=True)
    with open(log, 'a', encoding='utf-8') as f:
      procs.append((i, log, subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)))
  # Polled every second, so the call returns as soon as the last job ends (a tiny run's jobs take
  # about a minute); the status line still comes once a minute.
  last = time.time()
  while any(p.poll() is None for _, _, p in procs):
    time.sleep(1)
    if time.time() - last < 60:
      continue
    last = time.time()
    for i, log, p in procs:
      print(f'job {i}: {"running" if p.poll() is None else "done"}: {_last_line(log)}',
            flush=True)
  failed = [i for i, _, p in procs if p.returncode]
  if failed:
    raise errors.UserError(f'ablation job(s) {failed} failed; see {args.root}/job<i>.log')


def _shared_inputs_ready(args, seed: int) -> bool:
  """Whether the dataset is built and the tokenizer the runs share is trained (then the jobs
  can start at once; else one run here builds them first, so no two processes build the same).
  With --tokenizer_per_seed only the first seed's tokenizer is built first."""
  config = synthetic.get_config(args.preset)
  ddir = args.data_dir or os.path.join(args.root, 'data')
  tok = shared_tokenizer_dir(args.root, seed, args.tokenizer_from, args.tokenizer_per_seed)
  return (os.path.exists(os.path.join(tok, 'DONE')) and
          datasets.is_prepared(config.data.name, config.data.builder_config, ddir))


def child_argv(argv: list[str]) -> list[str]:
  """`argv` without the options the parent sets per job (--jobs, --variants, --out, --core),
  in either the '--flag value' or the '--flag=value' form."""
  keep, skip = [], ('--jobs', '--variants', '--out', '--core')
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
