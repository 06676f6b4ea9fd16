"""The decoder cross-attention diagnostic: token cells of a box, and the shares it reports."""

import numpy as np

from procap_jax.diagnostics import memory_attention as ma


def test_cross_attention_takes_the_cross_layers_in_order_averaged_over_heads():
  w = lambda v: (np.full([1, 2, 3, 4], v),)  # sown as a tuple: [B, N_h, L, M]
  tree = {'decoder': {f'blocks_{i}': {'cross_attn': {'attention_weights': w(i)},
                                      'self_attn': {'attention_weights': w(-1)}}
                      for i in (0, 2, 10)}}
  layers = ma.cross_attention(tree)
  assert [float(x[0, 0, 0]) for x in layers] == [0.0, 2.0, 10.0]
  assert layers[0].shape == (1, 3, 4)


def test_box_cells_are_the_cells_the_box_overlaps():
  cells = ma.box_cells([0.30, 0.55, 0.45, 0.70], (4, 4))  # x in cells 1, y in cell 2
  assert np.argwhere(cells).tolist() == [[2, 1]]
  wide = ma.box_cells([-0.1, 0.9, 0.6, 1.2], (4, 4))  # clipped to the image
  assert np.argwhere(wide).tolist() == [[3, 0], [3, 1], [3, 2]]
  assert not ma.box_cells(None, (4, 4)).any()


def test_object_slots_put_each_box_in_its_frame():
  params = {'bbox_before': [0.0, 0.0, 0.2, 0.2], 'bbox_after': None}  # a drop: before only
  slots = ma.object_slots(params, (2, 2), frames=4).reshape(2, 4, 4)
  assert slots[0, 0].tolist() == [True, False, False, False] and not slots[0, 1:].any()
  # the query frames (1 and 2) hold the same cells; before and after do not
  assert slots[1, 1].tolist() == slots[1, 2].tolist() == [True, False, False, False]
  assert not slots[1, 0].any() and not slots[1, 3].any()
  assert not ma.object_slots({'type': 'none'}, (2, 2), frames=2).any()


def test_summarise_shares_by_frame_and_on_the_object():
  b, length, frames, n = 2, 3, 3, 4
  weights = np.zeros([b, length, frames * n])  # averaged over heads
  weights[..., 0] = 1.0  # every position looks at slot 0 of the before frame...
  weights[1, 2] = 0.0
  weights[1, 2, -1] = 1.0  # ...but pair 1's last position, at the after frame's last slot
  positions = np.array([[True, True, True], [True, True, False]])  # pair 1's last is padding
  objects = np.zeros([b, 2, frames * n], bool)
  objects[0, 0, [0, 1]] = True
  objects[0, 1, [n, n + 1]] = True  # the same cells in the query frame
  out = ma.summarise(weights, positions, objects, frames)
  assert out['frames'] == {'before': 1.0, 'query_1': 0.0, 'after': 0.0}
  assert out['object'] == 1.0 and out['object_pairs'] == 1  # pair 1 has no object: skipped
  assert out['object_uniform'] == round(2 / 12, 4)
  assert out['object_in_queries'] == 0.0 and out['object_in_queries_uniform'] == round(2 / 12, 4)
  positions[1, 2] = True  # counted now: pair 1 puts 1/3 of its attention on the after frame
  shares = ma.summarise(weights, positions, objects, frames)['frames']
  assert abs(shares['after'] - 1 / 6) < 1e-4 and abs(sum(shares.values()) - 1) < 1e-3  # rounded
