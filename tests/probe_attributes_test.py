"""procap_jax.diagnostics.probe_attributes: labels, the tiny dataset's records, a learnable probe."""

import numpy as np

from procap_jax.data import pipeline
from procap_jax.diagnostics import probe_attributes as pa


def test_labels_of_a_colour_change_and_a_distractor():
  params = {'type': 'color', 'object': {'color': 'red', 'material': 'metal', 'shape': 'cube',
                                        'size': 'small', 'position': [0.1, 0.2]},
            'from': 'red', 'to': 'blue', 'bbox_before': [0.7, 0.0, 0.9, 0.2],
            'bbox_after': [0.6, 0.1, 0.8, 0.3]}
  labels = pa.labels_of(params)
  assert labels == {'change': 1, 'type': 0, 'color': pa.COLORS.index('red'), 'material': 1,
                    'shape': 0, 'size': 0, 'new_color': pa.COLORS.index('blue'),
                    'where': 2}  # centre (0.8, 0.1): top row, right column (before box)
  added = dict(params, type='add', bbox_before=None, bbox_after=[0.0, 0.8, 0.2, 1.0])
  assert pa.labels_of(added)['where'] == 6 and pa.labels_of(added)['new_color'] == -1
  none = pa.labels_of({'type': 'none'})
  assert none['change'] == 0 and all(v == -1 for k, v in none.items() if k != 'change')


def test_load_split_reads_the_tiny_benchmark(tiny_config):
  data = pa.load_split(tiny_config, '', 'val')
  m = len(data['kind'])
  assert m == 16 and data['before'].shape == (m, 32, 32, 3) and data['before'].dtype == np.uint8
  none = data['kind'] == pipeline.CHANGE_TYPES.index('none')
  np.testing.assert_array_equal(data['change'], (~none).astype(np.int32))
  assert (data['type'][none] == -1).all() and (data['type'][~none] >= 0).all()
  colour = data['kind'] == pipeline.CHANGE_TYPES.index('color')
  assert (data['new_color'][colour] >= 0).all() and (data['new_color'][~colour] == -1).all()


def test_render_split_gives_the_built_records(tiny_config):
  from tfds_builders.synthetic_change import scene
  assert pa.COLORS == tuple(scene.COLORS) and pa.TASKS['shape'] == scene.SHAPES
  built = pa.load_split(tiny_config, '', 'test', limit=5)
  rendered = pa.render_split(tiny_config, 'test', limit=5)
  assert len(rendered['kind']) == 5
  assert set(built) == set(rendered)
  for key, value in built.items():
    np.testing.assert_array_equal(rendered[key], value, err_msg=key)
  larger = pa.render_split(tiny_config, 'test', limit=2, size=48)  # the same scenes, drawn larger
  assert larger['before'].shape == (2, 48, 48, 3)
  np.testing.assert_array_equal(larger['where'], built['where'][:2])


def test_pair_inputs_and_the_probe_shapes():
  x = pa.pair_inputs(np.ones((2, 8, 8, 3)), np.zeros((2, 8, 8, 3)))
  assert x.shape == (2, 8, 8, 9)
  np.testing.assert_array_equal(x[..., 6:], -1.0)
  import jax
  model = pa.Probe((2, 5), patch=4, width=8)
  params = model.init(jax.random.key(0), np.zeros((1, 32, 32, 9), np.float32))['params']
  logits = model.apply({'params': params}, np.zeros((3, 32, 32, 9), np.float32))
  assert [l.shape for l in logits] == [(3, 2), (3, 5)]


def _toy(m: int, rng: np.random.Generator):
  """Inputs [m, 4, 4, 3] whose channel 0 stays within +-1.5, except that in "change" pairs (half)
  one random position has 4.0 there; the `size` label of a change pair is the sign of channel 1
  at that position (a local signal), and the other tasks have no labels (-1)."""
  x = np.clip(rng.normal(size=(m, 4, 4, 3)), -1.5, 1.5).astype(np.float32)
  change = (np.arange(m) % 2).astype(np.int32)
  labels = {t: -np.ones(m, np.int32) for t in pa.TASKS}
  labels['change'] = change
  for i in np.flatnonzero(change):
    y, z = rng.integers(4), rng.integers(4)
    x[i, y, z, 0] = 4.0
    labels['size'][i] = int(x[i, y, z, 1] > 0)
  return x, labels


def test_fit_learns_a_local_signal_and_reports_on_test():
  rng = np.random.default_rng(0)
  splits = {s: _toy(n, rng) for s, n in (('train', 512), ('val', 128), ('test', 128))}
  inputs = {s: v[0] for s, v in splits.items()}
  labels = {s: v[1] for s, v in splits.items()}
  best = pa.fit(inputs, labels, patch=1, steps=300, every=100, batch=32, lr=3e-3, width=16)
  assert best['change']['val_acc'] > 0.9 and best['change']['test_acc'] > 0.9
  assert best['size']['test_acc'] > 0.7
  assert best['change']['best_step'] in (100, 200, 300)
  kinds = np.where(labels['test']['change'] == 1, 1, 0)  # 'color' for positives, else 'none'
  records = {r['task']: r for r in pa.report('toy', best, labels, kinds)}
  assert records['change']['n_test'] == 128 and records['size']['n_test'] == 64
  assert records['change']['majority_test_acc'] == 0.5
  assert set(records['change']['test_acc_by_type']) == {'none', 'color'}
  assert np.isnan(records['type']['test_acc'])  # no labels at all: nan, not an error
