r"""The paper's ablations on the synthetic benchmark, several seeds, written to docs/results.md.

  python -m procap_jax.ablations --root workdir/ablations --seeds 0,1,2
  python -m procap_jax.ablations --root R --data_dir W/data --tokenizer_from W/tokenizer \
      --override pretrain.train.steps=100 --override caption.train.steps=300   # reuse a run
  python -m procap_jax.ablations --root workdir/ablations --seeds 0 --preset default \
      --override caption.train.steps=400 --override pretrain.train.steps=200   # shorter runs

Variants (configs/synthetic.py): static (no stage 1, no queries), no_queries (stage 1, no
queries), no_stage1 (queries without stage 1, k = 1), k1, k2 (the full model), k4, and oracle
(k = 2 with keyframes from the renderer's true procedure instead of flow frames).
Each variant x seed is an ordinary run in `<root>/<variant>_s<seed>` (resumable; finished runs
are skipped). The tokenizer does not depend on the variant, so it is trained once per seed and
copied into the other runs of that seed. Test CIDEr (and the other metrics, by change type) is
reported as mean and std over seeds, beside the paper's CLEVR-Change numbers for context.
"""

import argparse
import json
import os
import shutil

import numpy as np

from procap_jax import errors

VARIANTS = ('static', 'no_queries', 'no_stage1', 'k1', 'k2', 'k4', 'oracle')
# Runs in this order, so a variant can reuse an earlier variant's finished stage 1 of the same
# seed: 'no_queries' trains exactly the stage 1 of 'k2' (same config, same seed).
RUN_ORDER = ('static', 'no_stage1', 'k2', 'no_queries', 'k1', 'k4', 'oracle')
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
}
METRICS = ('Bleu_4', 'METEOR', 'ROUGE_L', 'CIDEr')


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
                data_dir: str = '', tokenizer_from: str = '') -> dict:
  """Trains (or reads back) one variant x seed run in `<root>/<variant>_s<seed>`.

  Args:
    variant: one of VARIANTS.
    seed: config.seed.
    root: folder of all runs.
    preset: configs/synthetic.py preset.
    overrides: 'key=json' config overrides.
    data_dir: an already built dataset folder ('' = `<root>/data`, built when missing).
    tokenizer_from: a finished tokenizer stage folder copied into every run ('' = train one per
      seed and share it among that seed's variants).
  """
  from configs import synthetic
  from procap_jax import main
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
  shared_tok = tokenizer_from or os.path.join(root, f'tokenizer_s{seed}')
  if tokenizer_from and not os.path.exists(os.path.join(tokenizer_from, 'DONE')):
    raise errors.UserError(f'--tokenizer_from {tokenizer_from} is not a finished tokenizer stage '
                           '(no DONE file)')
  _copy_stage(shared_tok, os.path.join(workdir, 'tokenizer'))
  if variant in SHARED_STAGE1 and 'pretrain' in config.stages:
    _copy_stage(os.path.join(root, f'{SHARED_STAGE1[variant]}_s{seed}', 'pretrain'),
                os.path.join(workdir, 'pretrain'))
  results = main.run(config, workdir)
  _copy_stage(os.path.join(workdir, 'tokenizer'), shared_tok)
  return _with_distinct_captions(dict(results), workdir)


def _with_distinct_captions(results: dict, workdir: str) -> dict:
  """Adds 'distinct_captions': how many different sentences the run wrote for the test split
  (1 = the captioner ignores its images)."""
  path = os.path.join(workdir, 'caption', 'predictions_test.json')
  if os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      results['distinct_captions'] = len({p['caption'] for p in json.load(f)})
  return results


def table(all_results: dict[str, list[dict]]) -> str:
  lines = ['| variant | seeds | ' + ' | '.join(METRICS) + ' | CIDEr change | CIDEr no-change '
           '| distinct test captions per seed | paper CLEVR-Change CIDEr |',
           '|---' * (len(METRICS) + 6) + '|']
  for variant in VARIANTS:
    runs = all_results.get(variant) or []
    if not runs:
      continue
    cells = []
    for m in METRICS + ('change/CIDEr', 'no_change/CIDEr'):
      vals = np.array([r['metrics'].get(m, np.nan) for r in runs], float) * 100
      cells.append(f'{np.nanmean(vals):.1f} ± {np.nanstd(vals):.1f}' if len(vals) > 1
                   else f'{vals[0]:.1f}')
    distinct = ', '.join(str(r.get('distinct_captions', '?')) for r in runs)
    lines.append(f'| {LABELS[variant]} | {len(runs)} | ' + ' | '.join(cells) +
                 f' | {distinct} | {PAPER.get(variant, "n/a")} |')
  return '\n'.join(lines)


def by_type(all_results: dict[str, list[dict]]) -> str:
  types = ('none', 'color', 'material', 'add', 'drop', 'move')
  lines = ['| variant | ' + ' | '.join(types) + ' |', '|---' * (len(types) + 1) + '|']
  for variant in VARIANTS:
    runs = all_results.get(variant) or []
    if runs:
      cells = [f'{np.nanmean([r["metrics"].get(f"{t}/CIDEr", np.nan) for r in runs]) * 100:.1f}'
               for t in types]
      lines.append(f'| {LABELS[variant]} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


@errors.exit_on_user_error
def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--root', required=True)
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--preset', default='default')
  parser.add_argument('--data_dir', default='',
                      help='an already built synthetic dataset folder (default <root>/data)')
  parser.add_argument('--tokenizer_from', default='',
                      help='a finished tokenizer stage folder shared by every run (default: one '
                      'tokenizer per seed)')
  parser.add_argument('--override', action='append', default=[],
                      help='config override key=value (JSON value), repeatable')
  parser.add_argument('--out', default='docs/results.md')
  args = parser.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(',')]
  variants = [v for v in args.variants.split(',') if v]
  for v in variants:
    if v not in VARIANTS:
      raise errors.UserError(f'unknown variant {v!r}; choose from {", ".join(VARIANTS)}')
  all_results = {}
  for seed in seeds:
    for v in [v for v in RUN_ORDER if v in variants]:
      print(f'=== {v} seed {seed}', flush=True)
      all_results.setdefault(v, []).append(run_variant(
          v, seed, args.root, args.preset, args.override, data_dir=args.data_dir,
          tokenizer_from=args.tokenizer_from))
  command = ' '.join(['python -m procap_jax.ablations'] + (argv or []))
  text = (f'### Measured ablations\n\nMeasured with `{command}` (preset '
          f'`{args.preset}`, overrides {args.override or "none"}, seeds {seeds}). Test split, '
          'checkpoint chosen on val; scores x 100, mean ± std over seeds. The paper column is '
          'CLEVR-Change, for context only: a different dataset and scale.\n\n'
          + table(all_results) + '\n\nCIDEr by change type (mean over seeds):\n\n'
          + by_type(all_results) + '\n')
  errors.write_text_atomic(args.out, merge_into(args.out, text))
  print(text)


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
  import sys
  main(sys.argv[1:])
