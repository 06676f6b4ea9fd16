"""Checkpoint saving in one process (procap_jax.checkpointing)."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from procap_jax import checkpointing
from procap_jax import errors


def _replicated_state():
  """A small state replicated over the session's 8 CPU devices, and its abstract form."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = {'w': jnp.arange(128.0).reshape(16, 8), 'b': jnp.ones((6,), jnp.bfloat16),
           'step': jnp.asarray(3, jnp.int32)}
  state = jax.device_put(state, sharding)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                          state)
  return state, abstract


def _slices_on_devices(monkeypatch) -> list:
  """Records orbax's device-side slicing of arrays (replica-parallel saving)."""
  calls = []
  original = jax.lax.slice_in_dim

  def recording(*args, **kwargs):
    calls.append(args[0].shape)
    return original(*args, **kwargs)

  monkeypatch.setattr(jax.lax, 'slice_in_dim', recording)
  return calls


def test_one_process_saves_whole_shards_and_restores_the_values(tmp_path, monkeypatch):
  assert jax.device_count() == 8 and jax.process_count() == 1
  calls = _slices_on_devices(monkeypatch)
  state, abstract = _replicated_state()
  ckpts = checkpointing.StageCheckpoints(str(tmp_path / 'stage'))
  ckpts.save(5, state, {'epoch': 1}, {'step': 5}, best=True)
  assert calls == []  # no array was split among the 8 replicas
  restored, data, meta = ckpts.restore_latest(abstract)
  ckpts.close()
  assert data == {'epoch': 1} and meta['step'] == 5
  for key in state:
    np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(state[key]))
    assert restored[key].dtype == state[key].dtype


def test_orbax_default_would_slice_on_devices(tmp_path, monkeypatch):
  """The case the switch exists for: orbax's own handler splits replicated arrays (if a later
  orbax stops doing so, the switch is no longer needed)."""
  checkpointing.StageCheckpoints(str(tmp_path / 'first')).close()  # switches the split off
  handler = ocp.type_handlers.get_type_handler(jax.Array)
  monkeypatch.setattr(handler, '_use_replica_parallel', True)  # orbax's default, for this test
  calls = _slices_on_devices(monkeypatch)
  state, _ = _replicated_state()
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / 'default', state)
  if not calls:
    pytest.skip('this orbax does not split replicated arrays on save')
  assert len(calls) >= 2


@pytest.mark.parametrize('layout', ['dicts', 'with_a_list'])
def test_stage_variables_are_the_saved_params_and_model_state_without_the_optimiser(
    tmp_path, monkeypatch, layout):
  """`load_stage_variables` restores params and model_state (sharded over 8 devices when saved)
  to host arrays of their values and dtypes and leaves the optimiser state on disk; nested dicts
  (flax variables) take their key paths from orbax's metadata file, other trees from orbax's
  metadata call."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ('data', 'model'))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data', 'model'))
  params = {'dense': jax.device_put({'kernel': jnp.arange(64.0).reshape(8, 8),
                                     'bias': jnp.ones((8,))}, replicated),
            'embed': jax.device_put(jnp.full((4, 8), 0.5, jnp.bfloat16), sharded)}
  if layout == 'with_a_list':
    params['layers'] = [jnp.zeros((3,)), jnp.arange(4, dtype=jnp.int32)]
  model_state = {'codebook_usage': jnp.arange(5, dtype=jnp.int32)}
  state = {'params': params, 'model_state': model_state,
           'opt_state': {'mu': jax.tree.map(jnp.zeros_like, params),
                         'count': jnp.asarray(7, jnp.int32)},
           'step': jnp.asarray(7, jnp.int32)}
  ckpts = checkpointing.StageCheckpoints(str(tmp_path / 'W' / 'pretrain'))
  ckpts.save(7, state, {}, {'step': 7}, best=True)
  ckpts.close()
  handler = ocp.type_handlers.get_type_handler(np.ndarray)
  read, deserialize = [], handler.deserialize

  async def recording(infos, args=None):
    read.extend(info.name for info in infos)
    return await deserialize(infos, args)

  monkeypatch.setattr(handler, 'deserialize', recording)
  metadata_calls, metadata = [], ocp.StandardCheckpointHandler.metadata

  def counted(self, directory):
    metadata_calls.append(directory)
    return metadata(self, directory)

  monkeypatch.setattr(ocp.StandardCheckpointHandler, 'metadata', counted)
  loaded = checkpointing.load_stage_variables(str(tmp_path / 'W'), 'pretrain')
  assert len(metadata_calls) == (0 if layout == 'dicts' else 1)
  assert read and not [name for name in read if 'opt_state' in name or name == 'step'], read
  assert sorted(loaded) == ['model_state', 'params', 'step'] and loaded['step'] == 7
  for want, got in ((params, loaded['params']), (model_state, loaded['model_state'])):
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      assert isinstance(b, np.ndarray) and b.dtype == a.dtype
      np.testing.assert_array_equal(b, np.asarray(a))
  with pytest.raises(errors.UserError, match='no caption checkpoint'):
    checkpointing.load_stage_variables(str(tmp_path / 'W'), 'caption')


def test_stage_variables_of_a_model_without_state(tmp_path):
  state = {'params': {'w': jnp.ones((2, 3))}, 'model_state': {}, 'opt_state': {},
           'step': jnp.asarray(1, jnp.int32)}
  ckpts = checkpointing.StageCheckpoints(str(tmp_path / 'W' / 'caption'))
  ckpts.save(1, state, {}, {'step': 1})
  ckpts.close()
  loaded = checkpointing.load_stage_variables(str(tmp_path / 'W'), 'caption', 'latest')
  assert loaded['model_state'] == {} and loaded['step'] == 1
  np.testing.assert_array_equal(loaded['params']['w'], np.ones((2, 3), np.float32))
