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
from procap_jax import semantic_scores  # noqa: E402
from procap_jax.data import pipeline  # noqa: E402
from procap_jax.procedure import sampling

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
  note = (' Groups change and no_change: the test pairs the dataset labels changed and unchanged '
          '(change type none), each scored on its own.' if 'no_change' in groups else '')
  return '<table>' + ''.join(rows) + f'</table><p>Scores x 100 (COCO caption metrics).{note}</p>'


# (column, metric name in `semantic/<group>/<name>`, or a CIDEr key) of the semantic table.
_SEMANTIC_COLUMNS = (
    ('decision', 'decision'), ('type', 'type'), ('all named attributes', 'attributes'),
    ('size', 'size'), ('colour', 'color'), ('material', 'material'), ('shape', 'shape'),
    ('new value', 'new_value'), ('right', 'right'), ('missed change', 'missed_change'),
    ('invented change', 'invented_change'), ('wrong type', 'wrong_type'),
    ('wrong object', 'wrong_object'), ('wrong value', 'wrong_value'))


def _percent(value) -> str:
  return f'<td>{100 * value:.1f}</td>' if isinstance(value, (int, float)) else '<td></td>'


def semantic_table(metrics: dict) -> str:
  """Per true change type: CIDEr of the type's pairs alone, then the semantic scores
  (`semantic_scores`); the first row is all pairs, with the change pairs' CIDEr."""
  head = ['group', 'CIDEr', 'CIDEr, change pairs'] + [c for c, _ in _SEMANTIC_COLUMNS]
  rows = ['<tr>' + ''.join(f'<th>{html.escape(h)}</th>' for h in head) + '</tr>']
  for group in ('all', semantic_scores.NONE) + semantic_scores.CHANGE_TYPES:
    prefix = 'semantic/' if group == 'all' else f'semantic/{group}/'
    if not any(k.startswith(prefix) for k in metrics):
      continue
    cider = metrics.get('CIDEr' if group == 'all' else f'{group}/CIDEr')
    change = metrics.get('change/CIDEr') if group == 'all' else None
    rows.append(f'<tr><td>{html.escape(group)}</td>{_percent(cider)}{_percent(change)}' +
                ''.join(_percent(metrics.get(prefix + n)) for _, n in _SEMANTIC_COLUMNS) +
                '</tr>')
  return ('<table>' + ''.join(rows) + '</table><p>Per true change type, x 100. CIDEr is scored '
          'on the group\'s pairs alone. Decision: change / no-change said right; type, all '
          'named attributes: over change pairs; an attribute: over the change pairs whose '
          'caption names it; new value: colour and material changes; the error classes share '
          'out the pairs (procap_jax/semantic_scores.py).</p>')


def reference_table(metrics: dict, reference_rows: dict) -> str:
  """This run beside captioners that need no model (`semantic_scores.reference_rows`)."""
  cols = (('CIDEr', 'CIDEr'), ('CIDEr, change pairs', 'change/CIDEr'),
          ('decision', 'semantic/decision'), ('type', 'semantic/type'),
          ('all named attributes', 'semantic/attributes'))
  rows = ['<tr><th>captioner</th>' + ''.join(f'<th>{c}</th>' for c, _ in cols) + '</tr>']
  entries = [('this run', metrics)] + [(f'{name}: {row["captioner"]}', row['metrics'])
                                       for name, row in reference_rows.items()]
  for label, m in entries:
    rows.append(f'<tr><td style="text-align:left">{html.escape(label)}</td>' +
                ''.join(_percent(m.get(k)) for _, k in cols) + '</tr>')
  return ('<table>' + ''.join(rows) + '</table><p>The same scorers on the same pairs, x 100.'
          '</p>')


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
  if any(k.startswith('semantic/') for k in results['metrics']):
    parts += ['<h2>Semantic scores</h2>', semantic_table(results['metrics'])]
  if results.get('reference_rows'):
    parts += ['<h2>Reference rows</h2>', reference_table(results['metrics'],
                                                         results['reference_rows'])]
  parts.append('<h2>Training curves</h2>')
  for stage, path in curves.items():
    with open(path, 'rb') as f:
      parts.append(f'<h3>{stage}</h3><img src="data:image/png;base64,'
                   f'{base64.b64encode(f.read()).decode("ascii")}">')
  parts.append(_gallery(config, workdir, imagine_fn))
  if semantic_scores.applies(config):
    parts.append(_error_gallery(config, workdir))
  parts.append('</body></html>')
  path = os.path.join(workdir, 'report.html')
  errors.write_text_atomic(path, '\n'.join(parts))
  return path


def _test_predictions(config, workdir: str):
  """(predictions, split info, pair id -> (record index, record), references) of the test
  split's saved predictions, or None when there are none."""
  pred_path = os.path.join(workdir, 'caption', 'predictions_test.json')
  if not os.path.exists(pred_path):
    return None
  with open(pred_path, encoding='utf-8') as f:
    predictions = {str(r['image_id']): r['caption'] for r in json.load(f)}
  info = pipeline.load_split_info(config, 'test', workdir)
  by_id = {r['pair_id']: (i, r) for i, r in enumerate(info)}
  references = {p: by_id[p][1]['captions'] for p in predictions if p in by_id}
  predictions = {p: c for p, c in predictions.items() if p in references}
  return predictions, info, by_id, references


def _gallery(config, workdir: str, imagine_fn) -> str:
  loaded = _test_predictions(config, workdir)
  if loaded is None:
    return '<p>No test predictions.</p>'
  predictions, info, by_id, references = loaded
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


def _error_gallery(config, workdir: str) -> str:
  """One row per error class of `semantic_scores.error_class` (missed change, invented
  change, wrong type, wrong object, wrong value): its first test pairs in record order, with
  before, after, the generated caption, what happened and the references."""
  loaded = _test_predictions(config, workdir)
  if loaded is None:
    return ''
  predictions, info, by_id, references = loaded
  truths = semantic_scores.split_truths([by_id[p][1] for p in predictions])
  _, classes = semantic_scores.score(predictions, truths)
  per = int(config.report.gallery_per_type)
  ordered = sorted(predictions, key=lambda p: by_id[p][0])
  counts = {c: sum(classes[p] == c for p in ordered) for c in semantic_scores.ERROR_CLASSES}
  chosen = [(c, p) for c in semantic_scores.ERROR_CLASSES[1:]
            for p in [p for p in ordered if classes[p] == c][:per]]
  out = ['<h2>Gallery by error class (test pairs)</h2>',
         '<p>Per error class (procap_jax/semantic_scores.py) its first pairs in record order: '
         'before | after. Pairs per class: ' + ', '.join(
             f'{c.replace("_", " ")} {n}' for c, n in counts.items()) + '.</p>']
  if not chosen:
    return '\n'.join(out + ['<p>No test pair is in an error class.</p>'])
  batch = _batch_for(config, workdir, [by_id[p][0] for _, p in chosen])
  current = None
  for row, (cls, pid) in enumerate(chosen):
    if cls != current:
      out.append(f'<h3>{html.escape(cls.replace("_", " "))}</h3>')
      current = cls
    truth = truths[pid]
    what = truth.type if truth.type == 'none' else ' '.join(
        [truth.type, 'of the'] + [truth.object[a] for a in semantic_scores.ATTRIBUTES] +
        ([f'to {truth.new}'] if truth.new else []))
    cells = ''.join(f'<img title="{t}" src="data:image/png;base64,{_png(batch[t][row])}">'
                    for t in ('before', 'after'))
    refs = '; '.join(html.escape(r) for r in references[pid][:3])
    out.append(f'<div class="pair"><div>{cells}</div><div class="cap"><b>{html.escape(pid)}'
               f'</b> <b>truth:</b> {html.escape(what)} <b>generated:</b> '
               f'{html.escape(predictions[pid])}<br><b>references:</b> {refs}</div></div>')
  return '\n'.join(out)


def _batch_for(config, workdir: str, indices: list[int]) -> dict:
  src = pipeline.open_source(config, workdir, 'test')
  transform = pipeline.make_transform(config, workdir, train=False)
  rows = [transform(src[i], i, sampling.keyframe_rng(config.seed, i, 0)) for i in indices]
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
