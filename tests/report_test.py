"""Loss-curve figures: one metric per panel, a lone evaluation labelled."""

import json

from PIL import Image

from procap_jax import report


def _write(workdir, stage, records):
  (workdir / stage).mkdir(parents=True)
  with open(workdir / stage / 'metrics.jsonl', 'w', encoding='utf-8') as f:
    for r in records:
      f.write(json.dumps(r) + '\n')


def test_every_metric_gets_its_own_panel(tmp_path):
  train = [{'step': s, 'split': 'train', 'loss': 2.0 / s, 'loss_msm': 1.0 / s,
            'steps_per_s': 3.0} for s in range(1, 6)]
  val = [{'step': 5, 'split': 'val', 'psnr': 21.0, 'perplexity': 180.0, 'frames': 16,
          'eval_seconds': 2.0, 'change/CIDEr': 0.5}]
  _write(tmp_path, 'tokenizer', train + val)
  assert report.curve_panels(train, val) == [('train', 'loss'), ('train', 'loss_msm'),
                                             ('val', 'psnr'), ('val', 'perplexity'),
                                             ('val', 'frames')]
  paths = report.plot_curves(str(tmp_path), ('tokenizer', 'caption'))
  assert list(paths) == ['tokenizer']  # a stage without metrics gets no figure
  with Image.open(paths['tokenizer']) as image:
    width, height = image.size
  assert width > 2 * height  # five panels laid out in a row of four and one more row


def test_semantic_and_reference_tables():
  metrics = {'CIDEr': 0.8, 'change/CIDEr': 0.25, 'move/CIDEr': 0.5, 'semantic/decision': 0.75,
             'semantic/type': 0.5, 'semantic/move/type': 0.125, 'semantic/move/decision': 1.0}
  table = report.semantic_table(metrics)
  assert table.count('<tr>') == 3  # header, all, move (no other type has semantic scores)
  assert '<td>move</td><td>50.0</td><td></td><td>100.0</td><td>12.5</td>' in table
  assert '<td>all</td><td>80.0</td><td>25.0</td><td>75.0</td><td>50.0</td>' in table
  rows = {'no_change_constant': {'captioner': '"nothing" for <every> pair',
                                 'metrics': {'CIDEr': 0.862, 'change/CIDEr': 0.008}}}
  ref = report.reference_table(metrics, rows)
  assert 'this run' in ref and '&lt;every&gt;' in ref
  assert '<td>86.2</td><td>0.8</td><td></td>' in ref
