"""Checkpoint saving in one process (procap_jax.checkpointing)."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from procap_jax import checkpointing


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
