"""Mesh construction and the logical-axis rules."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from procap_jax import errors
from procap_jax import sharding

RULES = (('batch', 'data'), ('embed', None), ('mlp', 'model'), ('heads', 'model'))


def test_eight_fake_devices():
  assert len(jax.devices()) == 8


@pytest.mark.parametrize('shape', [(1, 1), (8, 1), (4, 2), (2, 4), (1, 8)])
def test_make_mesh_shapes(shape):
  n = shape[0] * shape[1]
  mesh = sharding.make_mesh(*shape, devices=jax.devices()[:n])
  assert dict(mesh.shape) == {'data': shape[0], 'model': shape[1]}


def test_make_mesh_fills_data_axis():
  mesh = sharding.make_mesh(-1, 2)
  assert dict(mesh.shape) == {'data': 4, 'model': 2}


def test_make_mesh_rejects_non_divisor():
  with pytest.raises(errors.UserError, match='does not divide'):
    sharding.make_mesh(-1, 3)


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(12, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ('embed', 'mlp')))(x)
    return nn.Dense(5, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ('mlp', 'embed')))(x)


def test_logical_shardings_follow_rules_and_replicate_indivisible():
  mesh = sharding.make_mesh(2, 4)
  boxed = jax.eval_shape(_Mlp().init, jax.random.key(0), jnp.ones([2, 7]))
  sh = sharding.logical_shardings(boxed, mesh, RULES)
  # mlp (12) divides model (4) -> sharded; biases carry no names -> replicated.
  assert sh['params']['Dense_0']['kernel'].spec == P(None, 'model')
  assert sh['params']['Dense_1']['kernel'].spec == P('model', None)
  assert sh['params']['Dense_0']['bias'].spec == P()
  mesh8 = sharding.make_mesh(1, 8)
  sh8 = sharding.logical_shardings(boxed, mesh8, RULES)
  # 12 is not divisible by 8 -> that dimension is replicated instead of failing.
  assert sh8['params']['Dense_0']['kernel'].spec == P(None, None)


def test_fsdp_rules_come_from_the_config_table():
  from configs import synthetic
  rules = synthetic.get_config('tiny').sharding.rules
  fsdp = dict(sharding.fsdp_rules(rules))
  assert list(fsdp) == [name for name, _ in rules]        # same names, same order
  for name, axis in rules:
    if name in sharding.ACTIVATION_AXES or name in ('norm', 'pos'):
      assert fsdp[name] == axis, name
    else:
      assert fsdp[name] == 'model', name
  assert fsdp['batch'] == 'data' and fsdp['embed'] == 'model' and fsdp['pos'] is None


def _device_config(cpu_devices=0, data=-1, model=1, batches=(16, 8, 16)):
  from configs import synthetic
  config = synthetic.get_config('tiny')
  for stage, b in zip(('tokenizer', 'pretrain', 'caption'), batches):
    config[stage].train.batch_size = b
  config.mesh.cpu_devices, config.mesh.data, config.mesh.model = cpu_devices, data, model
  return config


@pytest.mark.parametrize('cores, want', [(1, 1), (2, 2), (3, 2), (4, 4), (8, 8), (12, 8), (16, 8)])
def test_cpu_devices_auto_one_per_core_dividing_every_batch(cores, want):
  assert sharding.cpu_device_count(_device_config(), cores) == want


def test_cpu_devices_auto_only_counts_the_configs_stages():
  config = _device_config(batches=(16, 6, 16))
  assert sharding.cpu_device_count(config, 4) == 2   # 6 is not divisible by 4 or 3
  config.stages = ('tokenizer', 'caption')
  assert sharding.cpu_device_count(config, 4) == 4


def test_cpu_devices_explicit_count_and_explicit_mesh():
  assert sharding.cpu_device_count(_device_config(cpu_devices=1), 8) == 1
  assert sharding.cpu_device_count(_device_config(cpu_devices=3), 2) == 3
  assert sharding.cpu_device_count(_device_config(data=2, model=2), 16) == 4
  with pytest.raises(errors.UserError, match='cpu_devices'):
    sharding.cpu_device_count(_device_config(cpu_devices=-1), 2)


def test_use_cpu_devices_leaves_a_set_device_count_alone(monkeypatch):
  # The suite sets the host device count in XLA_FLAGS (conftest), and once JAX has started the
  # count cannot change: either keeps it as it is.
  assert len(jax.devices()) == 8   # starts the backends if no test did yet
  assert sharding.use_cpu_devices(_device_config()) is None
  monkeypatch.setenv('XLA_FLAGS', '')
  assert sharding.use_cpu_devices(_device_config()) is None
  assert len(jax.devices()) == 8


def test_place_eval_batch_splits_the_rows_the_data_axis_divides():
  import numpy as np
  config = _device_config()   # mesh (data=-1, model=1): 8 rows of devices here
  batch = {'frames': np.arange(16 * 3, dtype=np.float32).reshape(16, 3),
           'odd': np.zeros((6, 2), np.float32), 'scalar': np.float32(1.0)}
  placed = sharding.place_eval_batch(batch, config)
  assert placed['frames'].sharding.spec[0] == 'data'
  assert len(placed['frames'].sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(placed['frames']), batch['frames'])
  assert isinstance(placed['odd'], np.ndarray) and isinstance(placed['scalar'], np.ndarray)
  # A function of replicated parameters and the placed rows gives the host rows' values.
  w = jax.device_put(jnp.ones((3, 4)), sharding.replicated(sharding.mesh_from_config(config)))
  f = jax.jit(lambda w, x: x @ w)
  np.testing.assert_allclose(np.asarray(f(w, placed['frames'])), batch['frames'] @ np.ones((3, 4)))


def test_eval_context_puts_the_eval_mesh_in_context():
  """Functions traced for evaluation see the mesh its rows are split over (the frozen
  tokenizer's encode reads it to run on each device's own images)."""
  config = _device_config()
  assert jax.sharding.get_abstract_mesh().empty
  with sharding.eval_context(config):
    assert dict(jax.sharding.get_abstract_mesh().shape) == {'data': 8, 'model': 1}
  assert jax.sharding.get_abstract_mesh().empty
  assert sharding.eval_mesh(config) == sharding.mesh_from_config(config)


def test_interleaved_rows_and_rows_in_order():
  """Group j holds rows j, j + groups, ...; `rows_in_order` puts them back in row order."""
  x = jnp.arange(12 * 2).reshape(12, 2)
  grouped = sharding.interleaved_rows(x, 3)  # [3, 4, 2]
  assert grouped.shape == (3, 4, 2)
  assert grouped[1, :, 0].tolist() == [2, 8, 14, 20]  # rows 1, 4, 7, 10
  assert (sharding.rows_in_order(grouped) == x).all()


def test_replicated_work_notes_name_the_settings_that_do_not_divide_the_data_axis():
  from configs import synthetic
  config = synthetic.get_config('tiny')
  assert sharding.replicated_work_notes(config, 'pretrain', 1) == []
  assert sharding.replicated_work_notes(config, 'pretrain', 2) == []   # tiny: no loop set
  config.pretrain.train.batch_size = 8
  config.pretrain.train.micro_batches = 8            # one row per micro-batch
  config.pretrain.model.attention_group = 3
  notes = sharding.replicated_work_notes(config, 'pretrain', 2)
  assert len(notes) == 2
  assert notes[0].startswith('config.pretrain.train.micro_batches=8: rows per micro-batch 1,')
  assert notes[1].startswith('config.pretrain.model.attention_group=3:')
  assert sharding.replicated_work_notes(config, 'pretrain', 3)[0].startswith(
      'config.pretrain.train.micro_batches=8')
  config.pretrain.train.micro_batches, config.pretrain.model.attention_group = 4, 4
  assert sharding.replicated_work_notes(config, 'pretrain', 2) == []
  assert len(sharding.replicated_work_notes(config, 'pretrain', 4)) == 1   # 2 rows on 4
  config.caption.decoding.encode_rows = 3
  assert any('encode_rows=3' in n for n in sharding.replicated_work_notes(config, 'caption', 2))
  config.tokenizer.train.frames_chunk = 4
  assert sharding.replicated_work_notes(config, 'tokenizer', 4) == []
  assert 'frames_chunk=4' in sharding.replicated_work_notes(config, 'tokenizer', 8)[0]
