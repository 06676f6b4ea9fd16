"""The tables and goal lines `python -m procap_jax.ablations` writes into docs/results.md.

Input: {variant: [results of each seed's run]}, each run's results.json (its 'metrics', flat, and
'reference_rows') with the 'seed' and 'distinct_captions' the runner adds. Scores are x 100,
mean ± std over the seeds (the sample std, n - 1, as the docs' hand-made tables).
"""

import numpy as np

from procap_jax import semantic_scores

# The table's rows, in this order (each a configs/synthetic.py variant).
VARIANTS = ('static', 'no_queries', 'no_stage1', 'k1', 'k2', 'k4', 'oracle', 'faithful',
            'duda_patches')
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
    'duda_patches': 'DUDA (Park et al., ICCV 2019) on pixel patches, from scratch',
}
METRICS = ('Bleu_4', 'METEOR', 'ROUGE_L', 'CIDEr')
CHANGE_TYPES = ('none', 'color', 'material', 'add', 'drop', 'move')

# A metric read from runs whose results.json predates it: the older metric with its meaning
# (the semantic decision counts "no change" as `change_decision` does).
_OLDER_NAME = {'semantic/decision': 'change_decision'}
# (column, metric) after METRICS in the main table; semantic scores: procap_jax/semantic_scores.py.
_TABLE_COLUMNS = (('CIDEr change pairs', 'change/CIDEr'),
                  ('change / no-change decision %', 'semantic/decision'),
                  ('change type %', 'semantic/type'),
                  ('all named attributes %', 'semantic/attributes'),
                  ('new colour right %', 'semantic/color/new_value'),
                  ('CIDEr no-change', 'no_change/CIDEr'))
# How many different sentences a reference captioner writes ('-' for the others).
_REFERENCE_DISTINCT = {'no_change_constant': '1', 'change_constant': '1',
                       'decision_and_change_constant': '2'}
# (title, metric of a column, columns): the tables by change type, then by attribute of the
# changed object (which attribute a captioner cannot see).
TYPE_TABLES = (('CIDEr by change type (mean ± std over seeds)', '{}/CIDEr', CHANGE_TYPES),
               ('Change type right % by change type (over the change pairs of each type; mean ± '
                'std over seeds)', 'semantic/{}/type', CHANGE_TYPES[1:]),
               ('Each attribute of the changed object right % (over the change pairs whose caption '
                'names it; a blind guess is right for ' + ', '.join(
                    f'{a} {100 / len(semantic_scores.WORDS[a]):.1f}'
                    for a in semantic_scores.ATTRIBUTES) + ' %; mean ± std over seeds)',
                'semantic/{}', semantic_scores.ATTRIBUTES))


def _cell(values, scale: float = 100.0) -> str:
  vals = np.array(values, float) * scale
  if np.all(np.isnan(vals)):
    return 'n/a'
  if len(vals) == 1:
    return f'{vals[0]:.1f}'
  return f'{np.nanmean(vals):.1f} ± {np.nanstd(vals, ddof=1):.1f}'


def metric_values(runs: list[dict], name: str) -> list[float]:
  """Each run's metric `name` (x 1, NaN where a run has none)."""
  return [r['metrics'].get(name, r['metrics'].get(_OLDER_NAME.get(name), np.nan)) for r in runs]


def reference_rows(all_results: dict[str, list[dict]]) -> dict[str, dict]:
  """The 'reference_rows' of the first run (VARIANTS order, then seeds) that has them: every
  run scores them on the same test split, so one run's are all runs'."""
  for variant in VARIANTS:
    for run in all_results.get(variant) or []:
      if run.get('reference_rows'):
        return run['reference_rows']
  return {}


def table(all_results: dict[str, list[dict]]) -> str:
  """The main table: one row per variant, mean ± std over seeds (x 100), then one row per
  reference row (captioners that need no model, on the same test split)."""
  names = METRICS + tuple(m for _, m in _TABLE_COLUMNS)
  lines = ['| variant | seeds | ' + ' | '.join(METRICS) + ' | ' +
           ' | '.join(c for c, _ in _TABLE_COLUMNS) + ' | distinct test captions per seed '
           '| paper CLEVR-Change CIDEr |',
           '|---' * (len(METRICS) + len(_TABLE_COLUMNS) + 4) + '|']
  for variant in VARIANTS:
    runs = all_results.get(variant) or []
    if not runs:
      continue
    cells = [_cell(metric_values(runs, m)) for m in names]
    distinct = ', '.join(str(r.get('distinct_captions', '?')) for r in runs)
    lines.append(f'| {LABELS[variant]} | {len(runs)} | ' + ' | '.join(cells) +
                 f' | {distinct} | {PAPER.get(variant, "n/a")} |')
  for name, row in reference_rows(all_results).items():
    cells = [_cell(metric_values([row], m)) for m in names]
    label = row.get('captioner', name).replace('|', '\\|')
    lines.append(f'| reference: {label} | - | ' + ' | '.join(cells) +
                 f' | {_REFERENCE_DISTINCT.get(name, "-")} | - |')
  return '\n'.join(lines)


def by_type(all_results: dict[str, list[dict]], metric: str = '{}/CIDEr',
            types: tuple[str, ...] = CHANGE_TYPES) -> str:
  """One row per variant: `metric` (formatted with the change type) for each of `types`, mean ±
  std over seeds (x 100)."""
  lines = ['| variant | ' + ' | '.join(types) + ' |', '|---' * (len(types) + 1) + '|']
  for variant in VARIANTS:
    runs = all_results.get(variant) or []
    if runs:
      cells = [_cell(metric_values(runs, metric.format(t))) for t in types]
      lines.append(f'| {LABELS[variant]} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def report(all_results: dict[str, list[dict]]) -> str:
  """The main table, the tables by change type and the goal lines, as markdown."""
  parts = [table(all_results)]
  for title, metric, types in TYPE_TABLES:
    parts.append(f'{title}:\n\n' + by_type(all_results, metric, types))
  parts.append('Goals (full ProCap, k = 2; mean of the seeds):\n\n' + goals(all_results))
  return '\n\n'.join(parts)


def _by_seed(runs: list[dict], name: str) -> dict[int, float]:
  return {int(r.get('seed', i)): 100 * float(metric_values([r], name)[0])
          for i, r in enumerate(runs)}


def _mean(runs: list[dict], name: str) -> float:
  vals = [100 * float(v) for v in metric_values(runs, name) if not np.isnan(v)]
  return float(np.mean(vals)) if vals else float('nan')


def _diffs(full: list[dict], runs: list[dict], name: str) -> list[float]:
  """Full minus the other run of the same seed, for each seed both have a score on."""
  a, b = _by_seed(full, name), _by_seed(runs, name)
  return [a[s] - b[s] for s in sorted(set(a) & set(b)) if not np.isnan(a[s] - b[s])]


def _over_seeds(diffs: list[float], unit: str) -> str:
  spread = f' ± {np.std(diffs, ddof=1):.1f}' if len(diffs) > 1 else ''
  return (f'{np.mean(diffs):+.1f}{spread}{unit} over {len(diffs)} '
          f'seed{"s" * (len(diffs) > 1)}')


# (metric, goal before the threshold, threshold, text after it, unit of the value): the full
# model's mean over seeds against each threshold.
_TARGETS = (
    ('semantic/decision', 'change / no-change decision', 88, ' % (acceptance line)', ' %'),
    ('change/CIDEr', 'change-pair CIDEr', 110, ' (acceptance line)', ''),
    ('semantic/decision', 'change / no-change decision', 90, ' %', ' %'),
    ('semantic/type', 'change type', 90, ' %', ' %'),
    ('semantic/attributes', 'all named attributes right', 70, ' %', ' %'),
    ('semantic/color/new_value', 'new colour right', 80, ' % of colour changes', ' %'),
    ('change/CIDEr', 'change-pair CIDEr', 150, '', ''),
    ('CIDEr', 'CIDEr', 150, '', ''),
)


def goals(all_results: dict[str, list[dict]]) -> str:
  """The goal lines of the full model (k2), each stated as met or missed (an ordering: holds or
  does not hold) with the measured numbers (x 100): its mean over seeds against each target;
  against DUDA, static and the paper's orderings, per-seed differences on change-pair CIDEr
  (full minus the variant's run of the same seed; mean ± std over the seeds both have).
  Variants not run give no line."""
  full = all_results.get('k2') or []
  if not full:
    return 'The full model (k2) was not run: no goal can be checked.\n'
  out = []
  for name, goal, threshold, after, unit in _TARGETS:
    value = _mean(full, name)
    want = f'- {goal} >= {threshold}{after}'
    out.append(f'{want}: not measured (the runs predate this score)' if np.isnan(value) else
               f'{want}: {"met" if value >= threshold else "missed"} ({value:.1f}{unit})')
  for name, what, unit in (('change/CIDEr', 'change-pair CIDEr', ' CIDEr'),
                           ('semantic/type', 'change type right', ' points')):
    diffs = _diffs(full, all_results.get('duda_patches') or [], name)
    if diffs:
      out.append(f'- full >= DUDA (pixel patches) on {what}: '
                 f'{"holds" if np.mean(diffs) >= 0 else "does not hold"} (full minus it: '
                 f'{_over_seeds(diffs, unit)})')
  diffs = _diffs(full, all_results.get('static') or [], 'change/CIDEr')
  if diffs:
    spread = [v for v in _by_seed(full, 'change/CIDEr').values() if not np.isnan(v)]
    twice = 2 * float(np.std(spread, ddof=1)) if len(spread) > 1 else 0.0
    out.append(f'- full >= {LABELS["static"]} on change-pair CIDEr by more than twice the '
               f"seeds' spread: {'holds' if np.mean(diffs) > twice else 'does not hold'} "
               f'(full minus it: {_over_seeds(diffs, " CIDEr")}; 2 x the std of full over its '
               f'{len(spread)} seed{"s" * (len(spread) > 1)}: {twice:.1f})')
  for variant in ('no_queries', 'no_stage1', 'faithful'):
    diffs = _diffs(full, all_results.get(variant) or [], 'change/CIDEr')
    if diffs:
      out.append(f'- {LABELS[variant]} < full on change-pair CIDEr: '
                 f'{"holds" if np.mean(diffs) > 0 else "does not hold"} (full minus it: '
                 f'{_over_seeds(diffs, " CIDEr")})')
  ks = {v: (all_results.get(v) or []) for v in ('k1', 'k2', 'k4')}
  if all(ks.values()):
    means = {v: _mean(runs, 'change/CIDEr') for v, runs in ks.items()}
    values = ', '.join(f'{v[1]} = {m:.1f}' for v, m in means.items())
    best = max(means, key=means.get)
    out.append('- k sweep on change-pair CIDEr (paper, CIDEr on CLEVR-Change: k = 2 best, '
               f'128.5 / 135.6 / 130.5): k {values}; best k = {best[1]}')
  diffs = [-d for d in _diffs(full, all_results.get('oracle') or [], 'change/CIDEr')]
  if diffs:
    out.append('- oracle keyframes minus flow keyframes (k = 2) on change-pair CIDEr: '
               f'{_over_seeds(diffs, " CIDEr")}')
  return '\n'.join(out) + '\n'
