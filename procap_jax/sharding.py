"""Mesh creation and logical-axis sharding rules.

Parameters carry logical axis names (`nn.with_logical_partitioning`); `config.sharding.rules`
maps them to the mesh axes ('data', 'model'). A dimension whose size the mesh axis does not
divide is replicated instead (so every mesh shape that divides the devices works).
"""

from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from procap_jax import errors

MESH_AXES = ('data', 'model')


def make_mesh(data: int = -1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, model) mesh with Auto axis types; -1 for `data` takes the remaining devices."""
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  if model < 1 or n % model:
    raise errors.UserError(f'mesh model axis {model} does not divide the {n} available devices')
  if data == -1:
    data = n // model
  if data < 1 or data * model != n:
    raise errors.UserError(f'mesh shape (data={data}, model={model}) does not use the {n} '
                           'available devices; set config.mesh.data=-1 or a divisor')
  arr = np.asarray(devices).reshape(data, model)
  return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def mesh_from_config(config) -> Mesh:
  return make_mesh(config.mesh.data, config.mesh.model)


def _spec_for(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules) -> P:
  rule_map = dict(rules)
  axes = []
  used = set()
  for name, dim in zip(names, shape):
    axis = rule_map.get(name) if name is not None else None
    if axis is not None and (axis in used or dim % mesh.shape[axis] != 0):
      axis = None
    if axis is not None:
      used.add(axis)
    axes.append(axis)
  return P(*axes)


def logical_shardings(tree: Any, mesh: Mesh, rules) -> Any:
  """NamedShardings for a pytree of (possibly boxed) abstract arrays.

  Leaves boxed by `nn.with_logical_partitioning` are sharded by their names through `rules`;
  other leaves are replicated. The result has the structure of the UNBOXED tree.
  """

  def one(leaf):
    if isinstance(leaf, nn.LogicallyPartitioned):
      value = leaf.value
      spec = _spec_for(leaf.names, value.shape, mesh, rules)
      return NamedSharding(mesh, spec)
    return NamedSharding(mesh, P())

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Leading axis over 'data', the rest replicated."""
  return NamedSharding(mesh, P('data', *([None] * (ndim - 1))))


def shard_batch(batch: dict, mesh: Mesh) -> dict:
  """Places a host batch (numpy) on the mesh, batch axis over 'data'.

  Under multi-process runs each process passes its local share of the global batch.
  """
  out = {}
  for k, v in batch.items():
    v = np.asarray(v)
    sharding = batch_sharding(mesh, v.ndim)
    if jax.process_count() == 1:
      out[k] = jax.device_put(v, sharding)
    else:
      out[k] = jax.make_array_from_process_local_data(sharding, v)
  return out


def unbox(tree: Any) -> Any:
  return nn.meta.unbox(tree)
