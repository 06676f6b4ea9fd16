"""The ablation table as a picture: one panel per headline score, a bar per variant.

Input: the {variant: [results of each seed's run]} of `procap_jax.ablation_table`. Each panel
shows, for every variant that was run, its mean over seeds (bar), the sample std (n - 1, error
bar) and each seed's own score (dots), with the full model's acceptance line (dashed) and goal
(dotted), and the reference captioners that need no model (thin grey lines); each panel's lines
are named under it. A reader sees at a glance which variants clear which line and how far the
seeds scatter.
"""

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from procap_jax import ablation_table  # noqa: E402
from procap_jax import errors  # noqa: E402

# (metric, panel title, acceptance line, goal): scores x 100, as in the table.
PANELS = (
    ('semantic/decision', 'change / no-change decision %', 88, 90),
    ('semantic/type', 'change type right % (change pairs)', None, 90),
    ('change/CIDEr', 'CIDEr on change pairs', 110, 150),
)
# Reference rows drawn as grey lines (their short names under each panel).
_REFERENCE_SHORT = {'no_change_constant': 'constant no-change',
                    'decision_and_change_constant': 'perfect decision + one sentence'}


def seed_scores(all_results: dict[str, list[dict]], metric: str) -> dict[str, list[float]]:
  """{variant: its seeds' scores x 100 (NaN-free)} for the variants that were run, in the
  table's order."""
  out = {}
  for variant in ablation_table.VARIANTS:
    runs = all_results.get(variant) or []
    vals = [100 * float(v) for v in ablation_table.metric_values(runs, metric)]
    vals = [v for v in vals if not np.isnan(v)]
    if vals:
      out[variant] = vals
  return out


def plot(all_results: dict[str, list[dict]], path: str) -> bool:
  """Writes the figure to `path` (PNG, atomically); False (nothing written) when no variant has
  a score."""
  panels = [(p, seed_scores(all_results, p[0])) for p in PANELS]
  variants = [v for v in ablation_table.VARIANTS if any(v in s for _, s in panels)]
  if not variants:
    return False
  refs = ablation_table.reference_rows(all_results)
  fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 0.45 * len(variants) + 2.2),
                           sharey=True, squeeze=False)
  ys = np.arange(len(variants))[::-1]
  for ax, ((metric, title, accept, goal), scores) in zip(axes[0], panels):
    for y, variant in zip(ys, variants):
      vals = scores.get(variant)
      if not vals:
        continue
      colour = 'tab:blue' if variant == 'k2' else 'tab:gray'
      std = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
      ax.barh(y, float(np.mean(vals)), xerr=std, color=colour, alpha=0.35, capsize=3)
      ax.plot(vals, [y] * len(vals), 'o', color=colour, markersize=4)
    named = []
    if accept is not None:
      ax.axvline(accept, color='tab:red', linestyle='--', linewidth=1.2)
      named.append(f'red dashed: acceptance line {accept}')
    ax.axvline(goal, color='tab:green', linestyle=':', linewidth=1.2)
    named.append(f'green dotted: goal {goal}')
    for key, short in _REFERENCE_SHORT.items():
      if key in refs:
        value = 100 * float(refs[key]['metrics'].get(metric, np.nan))
        if not np.isnan(value):
          ax.axvline(value, color='0.55', linewidth=0.8)
          named.append(f'grey: {short} {value:.1f}')
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, 105 if metric.startswith('semantic/') else None)
    ax.set_xlabel('\n'.join(named), fontsize=7)
  axes[0][0].set_yticks(ys)
  axes[0][0].set_yticklabels([ablation_table.LABELS[v] for v in variants], fontsize=8)
  seeds = sorted({len(v) for _, s in panels for v in s.values()})
  fig.suptitle('Ablations on the synthetic benchmark, test split (bar: mean, error bar: std, '
               f'dots: seeds; {"/".join(map(str, seeds))} seeds per variant)', fontsize=10)
  fig.tight_layout()
  try:
    with errors.atomic_path(path, '.png') as tmp:
      fig.savefig(tmp, format='png', dpi=90, bbox_inches='tight')
  finally:
    plt.close(fig)
  return True
