"""The run report: W/report.html with metrics tables, loss curves and a gallery of test pairs.

The gallery shows, per change type, the best and worst test pairs by sentence-level CIDEr:
before, the sampled keyframes, the frames the procedure queries imagine (their outputs through the
frozen stage-1 token head, decoded by the tokenizer), after, the generated caption and the
references. Everything is embedded in the one HTML file (PNG as base64) so it can be mailed.
"""

import base64
import html
import io
import json
import os

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from pycocoevalcap.cider import cider  # noqa: E402

from procap_jax import errors  # noqa: E402
from procap_jax.data import pipeline  # noqa: E402

_METRICS = ('Bleu_1', 'Bleu_2', 'Bleu_3', 'Bleu_4', 'METEOR', 'ROUGE_L', 'CIDEr', 'SPICE')


def _png(arr_or_fig) -> str:
  buf = io.BytesIO()
  if isinstance(arr_or_fig, np.ndarray):
    Image.fromarray(arr_or_fig).save(buf, format='PNG')
  else:
    arr_or_fig.savefig(buf, format='PNG', dpi=90, bbox_inches='tight')
  return base64.b64encode(buf.getvalue()).decode('ascii')


def read_metrics(workdir: str, stage: str) -> list[dict]:
  path = os.path.join(workdir, stage, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  out = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out


_SKIPPED = ('step', 'split', 'eval_seconds', 'steps_per_s', 'finite')
_COLUMNS = 4


def _panel(ax, records: list[dict], key: str, title: str, log: bool) -> None:
  """One metric against the step; a single point is drawn large and labelled with its value."""
  steps = [r['step'] for r in records if isinstance(r.get(key), (int, float))]
  values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
  ax.plot(steps, values, 'o-' if len(values) < 30 else '-', markersize=3 if len(values) > 1 else 7)
  if len(values) == 1:
    ax.annotate(f'{values[0]:.4g}', (steps[0], values[0]), textcoords='offset points',
                xytext=(6, 6), fontsize=8)
  ax.set_title(title, fontsize=9)
  ax.set_xlabel('step', fontsize=8)
  ax.tick_params(labelsize=7)
  if log and values and min(values) > 0:
    ax.set_yscale('log')


def curve_panels(train: list[dict], val: list[dict]) -> list[tuple[str, str]]:
  """(split, metric) of each panel: every training loss, then every validation metric."""
  losses = [k for k in train[-1] if k.startswith('loss') or k.endswith('_loss')][:8]
  metrics = [k for k in (val[-1] if val else {}) if k not in _SKIPPED and '/' not in k][:12]
  return [('train', k) for k in losses] + [('val', k) for k in metrics]


def plot_curves(workdir: str, stages) -> dict[str, str]:
  """One PNG per stage: one panel per training loss, then one per validation metric (each on
  its own axis); returns stage -> PNG path."""
  paths = {}
  os.makedirs(os.path.join(workdir, 'report'), exist_ok=True)
  for stage in stages:
    records = read_metrics(workdir, stage)
    train = [r for r in records if r.get('split') == 'train']
    val = [r for r in records if r.get('split') == 'val']
    if not train:
      continue
    by_split = {'train': train, 'val': val}
    panels = [(by_split[split], k, f'{split} {k}', split == 'train')
              for split, k in curve_panels(train, val)]
    rows = -(-len(panels) // _COLUMNS)
    fig, axes = plt.subplots(rows, _COLUMNS, figsize=(3.2 * _COLUMNS, 2.4 * rows), squeeze=False)
    for ax, (records_k, key, title, log) in zip(axes.flat, panels):
      _panel(ax, records_k, key, title, log)
    for ax in list(axes.flat)[len(panels):]:
      ax.axis('off')
    fig.suptitle(stage, fontsize=11)
    fig.tight_layout()
    path = os.path.join(workdir, 'report', f'curves_{stage}.png')
    with errors.atomic_path(path, '.png') as tmp:
      fig.savefig(tmp, format='png', dpi=90, bbox_inches='tight')
    plt.close(fig)
    paths[stage] = path
  return paths


def metrics_table(metrics: dict) -> str:
  groups = {}
  for k, v in metrics.items():
    group, _, name = k.rpartition('/')
    if name in _METRICS:
      groups.setdefault(group or 'all', {})[name] = v
  cols = [m for m in _METRICS if any(m in g for g in groups.values())]
  rows = ['<tr><th>group</th>' + ''.join(f'<th>{c}</th>' for c in cols) + '</tr>']
  for g, vals in groups.items():
    cells = ''.join(f'<td>{vals[c] * 100:.1f}</td>' if isinstance(vals.get(c), float)
                    else '<td>n/a</td>' for c in cols)
    rows.append(f'<tr><td>{html.escape(g)}</td>{cells}</tr>')
  return '<table>' + ''.join(rows) + '</table><p>Scores x 100 (COCO caption metrics).</p>'


def sentence_cider(predictions: dict, references: dict) -> dict[str, float]:
  """Per-pair CIDEr-D (whitespace tokens, lower case) to rank the gallery."""
  ids = sorted(predictions)
  gts = {i: [r.lower() for r in references[i]] for i in ids}
  res = {i: [predictions[i].lower() or '.'] for i in ids}
  _, per = cider.Cider().compute_score(gts, res)
  return dict(zip(ids, map(float, per)))


def write_report(config, workdir: str, results: dict, imagine_fn=None) -> str:
  """Writes W/report.html (and W/report/*.png); returns the HTML path.

  Args:
    config: the run's config.
    workdir: the run's workdir.
    results: the test results dict written to results.json.
    imagine_fn: optional (batch) -> uint8 [B, k, S, S, 3] images the procedure queries imagine.
  """
  curves = plot_curves(workdir, config.stages)
  parts = ['<html><head><meta charset="utf-8"><title>procap-jax report</title><style>'
           'body{font-family:sans-serif;margin:20px} table{border-collapse:collapse}'
           'td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}'
           '.pair{margin:8px 0;padding:6px;border:1px solid #ddd}'
           '.pair img{image-rendering:pixelated;height:96px;margin-right:2px}'
           '.cap{font-size:13px}</style></head><body>',
           f'<h1>procap-jax: {html.escape(results.get("dataset", ""))}</h1>',
           f'<p>Test split, checkpoint chosen on the validation split (step '
           f'{results.get("checkpoint_step")}). Config preset {html.escape(str(config.preset))}'
           f'{", variant " + html.escape(config.variant) if config.variant else ""}.</p>',
           '<h2>Metrics</h2>', metrics_table(results['metrics'])]
  parts.append('<h2>Training curves</h2>')
  for stage, path in curves.items():
    with open(path, 'rb') as f:
      parts.append(f'<h3>{stage}</h3><img src="data:image/png;base64,'
                   f'{base64.b64encode(f.read()).decode("ascii")}">')
  parts.append(_gallery(config, workdir, imagine_fn))
  parts.append('</body></html>')
  path = os.path.join(workdir, 'report.html')
  errors.write_text_atomic(path, '\n'.join(parts))
  return path


def _gallery(config, workdir: str, imagine_fn) -> str:
  pred_path = os.path.join(workdir, 'caption', 'predictions_test.json')
  if not os.path.exists(pred_path):
    return '<p>No test predictions.</p>'
  with open(pred_path, encoding='utf-8') as f:
    predictions = {str(r['image_id']): r['caption'] for r in json.load(f)}
  info = pipeline.load_split_info(config, 'test', workdir)
  by_id = {r['pair_id']: (i, r) for i, r in enumerate(info)}
  references = {p: by_id[p][1]['captions'] for p in predictions if p in by_id}
  predictions = {p: c for p, c in predictions.items() if p in references}
  scores = sentence_cider(predictions, references)
  per = int(config.report.gallery_per_type)
  chosen = []
  for t, name in enumerate(pipeline.CHANGE_TYPES):
    ids = sorted((p for p in predictions if by_id[p][1]['change_type'] == t), key=scores.get)
    if not ids:
      continue
    best = ids[::-1][:per]
    worst = [i for i in ids[:per] if i not in best]
    chosen += [(name, 'best', p) for p in best] + [(name, 'worst', p) for p in worst]
  if not chosen:
    return '<p>No gallery pairs.</p>'
  indices = [by_id[p][0] for _, _, p in chosen]
  batch = _batch_for(config, workdir, indices)
  imagined = imagine_fn(batch) if imagine_fn is not None else None
  out = ['<h2>Gallery (test pairs, best and worst by sentence CIDEr per change type)</h2>',
         '<p>Row: before | sampled keyframes | imagined by the procedure queries | after.</p>']
  current = None
  for row, (name, kind, pid) in enumerate(chosen):
    if name != current:
      out.append(f'<h3>{html.escape(name)}</h3>')
      current = name
    imgs = [batch['before'][row]] + list(batch['keyframes'][row][1:-1])
    cells = [f'<img title="before" src="data:image/png;base64,{_png(batch["before"][row])}">']
    cells += [f'<img title="keyframe" src="data:image/png;base64,{_png(x)}">'
              for x in imgs[1:]]
    if imagined is not None:
      cells += [f'<img title="imagined" style="outline:2px solid #e80" '
                f'src="data:image/png;base64,{_png(x)}">' for x in imagined[row]]
    cells.append(f'<img title="after" src="data:image/png;base64,{_png(batch["after"][row])}">')
    refs = '; '.join(html.escape(r) for r in references[pid][:5])
    out.append(f'<div class="pair"><div>{"".join(cells)}</div><div class="cap">'
               f'<b>{html.escape(pid)}</b> ({kind}, CIDEr {scores[pid]:.2f}) '
               f'<b>generated:</b> {html.escape(predictions[pid])}<br><b>references:</b> {refs}'
               '</div></div>')
  return '\n'.join(out)


def _batch_for(config, workdir: str, indices: list[int]) -> dict:
  src = pipeline.open_source(config, workdir, 'test')
  transform = pipeline.make_transform(config, workdir, train=False)
  from procap_jax.procedure import sampling
  rows = [transform(src[i], i, sampling.keyframe_rng(config.seed, i, 0)) for i in indices]
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
