"""DUDA, the field's baseline (procap_jax/models/duda.py): shapes, attention maps, learning, and
its preset through the same pipeline as ProCap's."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from procap_jax import main
from procap_jax import train
from procap_jax.data import vocab as vocab_lib
from procap_jax.models import duda


def _model(from_pixels: bool) -> duda.Duda:
  return duda.Duda(vocab_size=13, from_pixels=from_pixels, stem_patch=4, stem_channels=(11,),
                   attention_hidden=7, feature_dim=5, embed=3, hidden=17, dropout=0.1)


def _pair(b: int, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  before = jax.random.uniform(jax.random.key(0), (b,) + shape)
  return before, before.at[:, :4, :4].set(1.0)  # a change in one corner


def test_shapes_and_attention_maps_sum_to_one():
  tokens = jnp.array([[vocab_lib.BOS, 8, 9, vocab_lib.EOS, 0]] * 3, jnp.int32)  # [B=3, L=5]
  for from_pixels, shape in ((True, (12, 12, 3)), (False, (7, 7, 11))):
    model = _model(from_pixels)
    before, after = _pair(3, shape)
    params = model.init(jax.random.key(1), before, after, tokens)['params']
    logits = model.apply({'params': params}, before, after, tokens)
    assert logits.shape == (3, 5, 13)
    maps = model.apply({'params': params}, before, after, method='attention_maps')
    side = 3 if from_pixels else 7  # 12 px in 4-px patches, or the feature grid
    assert maps.shape == (3, 2, side, side)
    np.testing.assert_allclose(np.asarray(maps.sum((2, 3))), 1.0, rtol=1e-5)
    weights = model.apply({'params': params}, before, after, tokens, method='word_weights')
    assert weights.shape == (3, 5, 3)
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-5)
    ids = duda.generate(model, params, before, after, max_len=6)
    assert ids.shape == (3, 6) and bool(jnp.all(ids[:, 0] == vocab_lib.BOS))
    assert not bool(jnp.any(ids == vocab_lib.UNK))


def test_greedy_decoding_matches_teacher_forcing_on_its_own_output():
  """The decoding cache (one word at a time) gives the same logits as the full sequence."""
  model = _model(True)
  before, after = _pair(2, (8, 8, 3))
  tokens = jnp.array([[vocab_lib.BOS, 8, 9, 10]] * 2, jnp.int32)
  params = model.init(jax.random.key(2), before, after, tokens)['params']
  full = model.apply({'params': params}, before, after, tokens)  # [B, L, V]
  cache = model.apply({'params': params}, before, after, method='init_cache')
  for pos in range(tokens.shape[1]):
    step, cache = model.apply({'params': params}, cache, tokens[:, pos], jnp.int32(pos),
                              method='decode_step')
    np.testing.assert_allclose(np.asarray(step), np.asarray(full[:, pos]), atol=1e-5)


def test_loss_decreases_on_a_tiny_batch():
  model = _model(True)
  before, after = _pair(2, (8, 8, 3))
  after = after.at[1].set(before[1])  # pair 1 unchanged: the captions must tell them apart
  tokens = jnp.array([[vocab_lib.BOS, 8, 9, vocab_lib.EOS], [vocab_lib.BOS, 10, 11, vocab_lib.EOS]],
                     jnp.int32)
  params = model.init(jax.random.key(3), before, after, tokens)['params']
  tx = optax.adam(1e-2)
  opt = tx.init(params)

  def loss_fn(p):
    logits = model.apply({'params': p}, before, after, tokens)[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  @jax.jit
  def step(p, o):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss

  first = None
  for _ in range(30):
    params, opt, loss = step(params, opt)
    first = float(loss) if first is None else first
  assert float(loss_fn(params)) < 0.2 * first


def test_patches_preset_runs_only_stage_2_end_to_end(tiny_data_dir, tmp_path):
  from configs import synthetic
  config = synthetic.get_config('tiny,duda_patches')
  config.data.data_dir = tiny_data_dir
  workdir = str(tmp_path)
  assert tuple(config.stages) == ('caption',)
  results = main.run(config, workdir)
  assert os.path.exists(train.stage_done_path(workdir, 'caption'))
  assert not os.path.exists(os.path.join(workdir, 'tokenizer'))  # no tokenizer was trained
  with open(os.path.join(workdir, 'results.json')) as f:
    saved = json.load(f)
  assert saved['split'] == 'test' and saved['selected_on'] == 'val'
  assert np.isfinite(saved['metrics']['CIDEr']) and saved['metrics'] == results['metrics']
  assert os.path.exists(os.path.join(workdir, 'report.html'))


def test_stem_convolutions_give_each_cell_its_neighbours():
  """Without convolutions a cell's features come from its own patch only; with two 3 x 3
  convolutions a change in one patch reaches the cells up to two away (spatial context that a
  small viewpoint shift does not undo)."""
  images = jax.random.uniform(jax.random.key(4), (1, 24, 24, 3))  # 4 px patches: a 6 x 6 grid
  changed = images.at[:, 8:12, 8:12].set(1.0)  # patch (2, 2)
  for convs, reach in ((0, 0), (2, 2)):
    stem = duda.PatchStem(4, (8,), convs)
    params = stem.init(jax.random.key(5), images)
    moved = np.abs(np.asarray(stem.apply(params, changed) - stem.apply(params, images))).sum(-1)
    rows, cols = np.nonzero(moved[0] > 0)
    assert rows.size > 0
    assert max(np.abs(rows - 2).max(), np.abs(cols - 2).max()) == reach


def test_coordinates_are_appended_and_reach_the_attended_features():
  grid = jnp.zeros((2, 3, 4, 5))
  out = np.asarray(duda.with_coordinates(grid))
  assert out.shape == (2, 3, 4, 7)
  # float32 coordinates against float64 references: a few ulps
  np.testing.assert_allclose(out[0, :, :, 5], np.tile(np.arange(4) * 2.0 / 4 - 1.0, (3, 1)),
                             rtol=1e-6)
  np.testing.assert_allclose(out[0, :, :, 6], np.tile((np.arange(3) * 2.0 / 3 - 1.0)[:, None],
                                                      (1, 4)), rtol=1e-6)
  model = duda.Duda(vocab_size=13, from_pixels=True, stem_patch=4, stem_channels=(6,),
                    stem_convs=1, coords=True, attention_hidden=7, feature_dim=5, embed=3,
                    hidden=17)
  before, after = _pair(2, (16, 16, 3))
  tokens = jnp.array([[vocab_lib.BOS, 8]] * 2, jnp.int32)
  params = model.init(jax.random.key(6), before, after, tokens)['params']
  # the projection reads C + 2 channels: the stem's and the two coordinates
  assert params['project']['kernel'].shape == (6 + 2, 5)


def test_sigmoid_maps_weigh_each_cell_on_its_own():
  """Softmax maps share one unit of weight over the grid; the original's sigmoid maps weigh each
  cell on its own, so one map can cover two places (a moved object's old and new place), and
  the attended features are weighted sums, not averages."""
  before, after = _pair(2, (5, 5, 4))
  attention = duda.DualAttention(hidden=6, dropout=0.0, normalise='sigmoid')
  params = attention.init(jax.random.key(7), before, after)['params']
  for bias in (0.0, -3.0):
    # a zero kernel: every cell's logit is the bias, so every cell weighs sigmoid(bias)
    logits = {'kernel': jnp.zeros_like(params['att_logits']['kernel']),
              'bias': jnp.full_like(params['att_logits']['bias'], bias)}
    features, maps = attention.apply({'params': dict(params, att_logits=logits)}, before, after)
    weight = 1.0 / (1.0 + np.exp(-bias))
    # float32 sigmoid and sums of 25 cells against float64 references: a few ulps
    np.testing.assert_allclose(np.asarray(maps), weight, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(features[:, 0]),
                               weight * np.asarray(before).sum((1, 2)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(features[:, 2]),
                               weight * np.asarray(after).sum((1, 2)), rtol=1e-5)
