r"""bfloat16 against float32: the training losses of two runs of the same config, overlaid.

  python -m procap_jax.main --config configs/synthetic.py --workdir F32 \
      "--config.stages=('tokenizer','pretrain')"
  python -m procap_jax.main --config configs/synthetic.py --workdir BF16 \
      "--config.stages=('tokenizer','pretrain')" --config.compute_dtype=bfloat16
  python -m bench.precision_curves --a F32 --b BF16 --stage pretrain --out curves.png \
      --labels float32,bfloat16

(The runs may share a finished tokenizer stage: copy F32/tokenizer into BF16 first.) Prints one
JSON line per loss: the mean over the last quarter of the logged steps for each run and their
relative difference, plus the largest relative difference at any logged step; writes the PNG.
"""

import argparse
import os

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from procap_jax import errors  # noqa: E402
from procap_jax import hostmem  # noqa: E402
from procap_jax import report  # noqa: E402


def _train_curves(workdir: str, stage: str) -> dict[str, dict[int, float]]:
  records = [r for r in report.read_metrics(workdir, stage) if r.get('split') == 'train']
  if not records:
    raise SystemExit(f'error: {workdir} has no {stage} training metrics')
  keys = [k for k in records[-1] if k.startswith('loss')]
  return {k: {r['step']: r[k] for r in records if k in r} for k in keys}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--a', required=True, help='workdir of the reference run (float32)')
  parser.add_argument('--b', required=True, help='workdir of the compared run (bfloat16)')
  parser.add_argument('--stage', default='pretrain')
  parser.add_argument('--out', required=True, help='PNG to write')
  parser.add_argument('--labels', default='',
                      help='legend names "A,B" (default: the workdirs\' folder names)')
  args = parser.parse_args()
  names = args.labels.split(',') if args.labels else [
      os.path.basename(os.path.normpath(w)) for w in (args.a, args.b)]
  if len(names) != 2:
    raise SystemExit(f'error: --labels takes two names separated by a comma, got {args.labels!r}')
  a, b = _train_curves(args.a, args.stage), _train_curves(args.b, args.stage)
  keys = [k for k in a if k in b]
  fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3), squeeze=False)
  for ax, k in zip(axes[0], keys):
    steps = sorted(set(a[k]) & set(b[k]))
    va, vb = np.array([a[k][s] for s in steps]), np.array([b[k][s] for s in steps])
    ax.plot(steps, va, label=names[0])
    ax.plot(steps, vb, '--', label=names[1])
    ax.set_title(f'{args.stage}: {k}', fontsize=9)
    ax.set_xlabel('step')
    ax.legend(fontsize=7)
    tail = slice(len(steps) - max(1, len(steps) // 4), None)
    rel = np.abs(vb - va) / np.maximum(np.abs(va), 1e-12)
    common.emit({'stage': args.stage, 'loss': k, 'steps': len(steps),
                 'a_last_quarter': float(va[tail].mean()), 'b_last_quarter': float(vb[tail].mean()),
                 'rel_diff_last_quarter': float(abs(vb[tail].mean() - va[tail].mean())
                                                / max(abs(va[tail].mean()), 1e-12)),
                 'max_rel_diff': float(rel.max())})
  with errors.atomic_path(args.out, '.png') as tmp:
    fig.savefig(tmp, format='png', dpi=90, bbox_inches='tight')
  plt.close(fig)


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
