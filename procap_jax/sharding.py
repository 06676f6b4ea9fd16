"""Mesh creation and logical-axis sharding rules.

Parameters carry logical axis names (`nn.with_logical_partitioning`); `config.sharding.rules`
maps them to the mesh axes ('data', 'model'). A dimension whose size the mesh axis does not
divide is replicated instead (so every mesh shape that divides the devices works).
"""

import contextlib
import functools
import os
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


def available_cores() -> int:
  """CPU cores this process may run on (its affinity mask, not the machine's count)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


def cpu_device_count(config, cores: int) -> int:
  """How many devices `config.mesh.cpu_devices` splits a CPU host of `cores` cores into.

  0 (auto): an explicit mesh (`mesh.data` > 0) gets data x model devices; otherwise one per
  core, lowered until it divides every training batch size of `config.stages`. 1: one device
  running every op on all cores. N > 1: N devices.
  """
  n = int(config.mesh.cpu_devices)
  if n < 0:
    raise errors.UserError(f'config.mesh.cpu_devices is {n}; use 0 (one device per core), 1 or '
                           'a device count')
  if n:
    return n
  if config.mesh.data > 0:
    return int(config.mesh.data) * int(config.mesh.model)
  batches = [int(config[stage].train.batch_size) for stage in config.stages]
  n = max(1, cores)
  while n > 1 and any(b % n for b in batches):
    n -= 1
  return n


def _backends_started() -> bool:
  """Whether JAX has created its backends (JAX has no public test for it; a JAX without this
  private one is taken as not started, which is the case at the start of a command)."""
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    return False


def use_cpu_devices(config) -> int | None:
  """Splits the host CPU into `cpu_device_count` devices for this process (before JAX starts).

  The small synthetic models' ops are too small to keep two cores busy inside one device; as
  two devices, data-parallel, their steps took about a quarter less time on a 2-core machine
  (docs/performance.md, "One device per core"). Accelerators are unaffected (this sets only the
  CPU client's device count). Does nothing, returning None, when `XLA_FLAGS` already sets a
  host device count (tests, users) or JAX's backends have started (the count cannot change
  then); otherwise returns the count set.
  """
  if 'xla_force_host_platform_device_count' in os.environ.get('XLA_FLAGS', ''):
    return None
  if _backends_started():
    return None
  n = cpu_device_count(config, available_cores())
  if n > 1:   # 1 is JAX's own default: its CPU client is then set up exactly as without this
    jax.config.update('jax_num_cpu_devices', n)
  return n


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


@functools.lru_cache(maxsize=8)
def process_data_slices(mesh: Mesh) -> tuple[int, int]:
  """(first, count): the contiguous 'data' positions of the mesh that this process's devices
  occupy. One process: (0, mesh.shape['data']).

  A process feeds the rows of the global batch that belong to those positions; processes that
  share positions (a 'model' axis spanning processes) feed the same rows.

  Cached per mesh: `shard_batch` asks on every step.

  Raises:
    UserError: this process's devices hold non-contiguous 'data' positions (build the mesh with
      `make_mesh`, which keeps each process's devices together).
  """
  me = jax.process_index()
  rows = sorted({int(i) for (i, _), d in np.ndenumerate(mesh.devices) if d.process_index == me})
  if not rows:
    raise errors.UserError(f'process {me} has no device in the mesh {dict(mesh.shape)}')
  if rows != list(range(rows[0], rows[-1] + 1)):
    raise errors.UserError(f'process {me} holds non-contiguous data positions {rows} of the mesh; '
                           'order the devices by process (sharding.make_mesh does)')
  return rows[0], len(rows)


def process_batch_rows(mesh: Mesh, global_batch: int) -> tuple[int, int]:
  """[start, stop): the rows of a global batch of `global_batch` this process feeds.

  Contiguous, so the global batch assembled from every process's rows is in the same order as
  a one-process run's (losses that pair rows, like stage 1's swapped captions, stay equal).
  """
  data = mesh.shape['data']
  if global_batch % data:
    raise errors.UserError(f'batch size {global_batch} is not divisible by the mesh data axis '
                           f'({data})')
  first, count = process_data_slices(mesh)
  per = global_batch // data
  return first * per, (first + count) * per


def replicated_work_notes(config, stage: str, data: int) -> list[str]:
  """One sentence per setting of `stage` that makes a loop over rows run every device's rows on
  every device of a mesh with `data` positions on its 'data' axis (the values stay right; the
  work is up to `data` times): a loop step takes rows j, j + steps, ... and so spreads over the
  devices only when its rows are a multiple of the data axis. Empty for one data position."""
  if data <= 1:
    return []
  checks = []   # (setting, its value, rows per loop step, what a step holds, the fix)
  if stage in ('pretrain', 'caption'):
    train = config[stage].train
    micro, batch = int(train.micro_batches), int(train.batch_size)
    if micro > 1 and not batch % micro:
      checks.append((f'config.{stage}.train.micro_batches', micro, batch // micro,
                     'rows per micro-batch', f'batch_size / micro_batches a multiple of {data}'))
    group = int(config.pretrain.model.attention_group)
    checks.append(('config.pretrain.model.attention_group', group, group,
                   '(row, head) pairs per attention step', f'a multiple of {data} or 0'))
  if stage == 'caption':
    rows = int(config.caption.decoding.encode_rows)
    checks.append(('config.caption.decoding.encode_rows', rows, rows,
                   "pairs per evaluation encoder call", f'a multiple of {data} or 0'))
  if stage == 'tokenizer':
    chunk = int(config.tokenizer.train.frames_chunk)
    checks.append(('config.tokenizer.train.frames_chunk', chunk, chunk, 'frames per chunk',
                   f'a multiple of {data} or 0'))
  return [f'{key}={value}: {what} {rows}, not a multiple of the mesh\'s {data} data devices, so '
          f'each device computes all of them (right values, up to {data} times the work); make '
          f'it {fix}'
          for key, value, rows, what, fix in checks if rows > 0 and rows % data]


def interleaved_rows(x: jax.Array, groups: int) -> jax.Array:
  """[B, ...] -> [groups, B / groups, ...]: group j holds rows j, j + groups, j + 2 groups, ...
  (so a batch sharded over devices stays spread evenly over the groups). `groups` divides B."""
  return x.reshape((x.shape[0] // groups, groups) + x.shape[1:]).swapaxes(0, 1)


def rows_in_order(x: jax.Array) -> jax.Array:
  """The inverse of `interleaved_rows`: [groups, B / groups, ...] -> [B, ...] in row order."""
  return x.swapaxes(0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def shard_batch(batch: dict, mesh: Mesh) -> dict:
  """Places a host batch (numpy) on the mesh, batch axis over 'data'.

  Under multi-process runs each process passes its own rows (`process_batch_rows`) of the
  global batch, whose size follows from the mesh.
  """
  out = {}
  scale = None
  if jax.process_count() > 1:
    _, count = process_data_slices(mesh)
    scale = mesh.shape['data'] // count  # global rows per local row
  for k, v in batch.items():
    v = np.asarray(v)
    sharding = batch_sharding(mesh, v.ndim)
    if scale is None:
      out[k] = jax.device_put(v, sharding)
    else:
      global_shape = (v.shape[0] * scale,) + v.shape[1:]
      out[k] = jax.make_array_from_process_local_data(sharding, v, global_shape)
  return out


def eval_mesh(config) -> Mesh | None:
  """The mesh evaluation splits its rows over (`place_eval_batch`): `config.mesh` when one
  process has several devices, else None (one device; or several processes, each of which
  evaluates whole batches)."""
  if jax.device_count() == 1 or jax.process_count() > 1:
    return None
  return mesh_from_config(config)


def eval_context(config) -> Any:
  """A context manager for calling an evaluation function: `jax.set_mesh` of `eval_mesh`, so
  code traced inside sees the mesh (`jax.sharding.get_abstract_mesh`), or nothing without one."""
  mesh = eval_mesh(config)
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def place_eval_batch(tree: Any, config) -> Any:
  """Host arrays of an evaluation batch, rows split over the mesh's 'data' axis.

  Parameters replicated over several devices make a jitted function whose other inputs are
  host arrays run whole on every device (each device computing every row); rows split like a
  train step's batch make each device compute its share. Arrays whose rows the axis does not
  divide, scalars, and every array under several processes (each evaluates whole batches)
  stay as they are.
  """
  mesh = eval_mesh(config)
  if mesh is None:
    return tree
  rows = mesh.shape['data']

  def place(v):
    v = np.asarray(v)
    if v.ndim == 0 or v.shape[0] % rows:
      return v
    return jax.device_put(v, batch_sharding(mesh, v.ndim))

  return jax.tree.map(place, tree)


def unbox(tree: Any) -> Any:
  return nn.meta.unbox(tree)


# Logical axis names of activations (docs/architecture.md); every other name in the rules table
# names a parameter axis.
ACTIVATION_AXES = ('batch', 'length')


def fsdp_rules(rules, min_axes: Sequence[str] = ('norm', 'pos')) -> tuple:
  """`rules` with every parameter axis name mapped to 'model' (FSDP-style sharding).

  The parameter axis names are those of `rules` other than `ACTIVATION_AXES`, so the config's
  table stays the one list of names. `_spec_for` gives each array the 'model' axis on its first
  dimension that 'model' divides, so every matrix and embedding table (and the optimiser state
  that mirrors it) is split over 'model' and XLA all-gathers it where it is used. Names in
  `min_axes` (small vectors and position tables) keep their rule. Activation rules are unchanged.
  """
  rule_map = dict(rules)
  for name in rule_map:
    if name not in ACTIVATION_AXES and name not in min_axes:
      rule_map[name] = 'model'
  return tuple(rule_map.items())
