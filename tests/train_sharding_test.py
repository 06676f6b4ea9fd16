"""Every stage's jitted train step gives the same results on any (data, model) mesh."""

import jax
import numpy as np
import pytest

from procap_jax import sharding
from procap_jax import stages
from procap_jax import train
from procap_jax.diagnostics import stand_ins
from procap_jax.models import vqgan

MESHES = [(1, 1), (8, 1), (4, 2), (2, 4)]
# Every mesh for stage 1 (its parameters are the ones split over 'model' below); the other
# stages on (4, 2) only, which splits both the batch and the model: each extra mesh is a compile
# of 10-15 s, and the data axis alone is the case (8, 1) checks for stage 1.
STAGE_MESHES = {'pretrain': MESHES, 'caption': [MESHES[0], MESHES[2]],
                'tokenizer': [MESHES[0], MESHES[2]]}


def _step(config, stage, mesh, batch_size=8):
  """(jitted train step, state, placed batch, placed constants) of `stage` on `mesh`."""
  task = stages.TASKS[stage]
  model = task.build_model(config)
  tx = task.make_optimizer(config, 100)
  batch = train.host_batch(task, stand_ins.fake_batch(config, batch_size, seed=1), mesh)
  state, state_sh = train.create_state(task, model, config, tx, jax.random.key(0), batch, mesh)
  constants = None if stage == 'tokenizer' else {'tokenizer': _TOKENIZER[0]}
  const_sh = jax.tree.map(lambda _: sharding.replicated(mesh), constants)
  batch_sh = {k: sharding.batch_sharding(mesh, np.asarray(v).ndim) for k, v in batch.items()}
  step = train.make_train_step(task, model, config, tx, state_sh, batch_sh, const_sh, mesh)
  return step, state, sharding.shard_batch(batch, mesh), jax.device_put(constants, const_sh)


def _two_steps(config, stage, mesh_shape):
  n = mesh_shape[0] * mesh_shape[1]
  mesh = sharding.make_mesh(*mesh_shape, devices=jax.devices()[:n])
  step, state, batch, constants = _step(config, stage, mesh)
  losses = []
  for _ in range(2):
    state, metrics = step(state, batch, constants, jax.random.key(7))
    losses.append(float(metrics['loss']))
  leaf = jax.tree.leaves(state.params)[0]
  return losses, np.asarray(jax.device_get(leaf)), state


_TOKENIZER = []
_RUNS = {}


def _cached_two_steps(config, stage, mesh_shape):
  """`_two_steps` of the module's `config`, computed once per (stage, mesh) for this module."""
  key = (stage, tuple(mesh_shape))
  if key not in _RUNS:
    _RUNS[key] = _two_steps(config, stage, mesh_shape)
  return _RUNS[key]


@pytest.fixture(scope='module')
def config():
  from configs import synthetic
  cfg = synthetic.get_config('tiny')
  # Smaller than tiny, each kind of layer still there (the tests compare meshes, not models):
  # a 2-level VQGAN at 16 px giving the same 8 x 8 token grid, one encoder block, one decoder
  # layer. Every step here is a fresh compile for its mesh.
  cfg.data.image_size = 16
  cfg.tokenizer.model.update(ch=8, ch_mult=(1, 2), resolution=16, z_channels=8, embed_dim=8,
                             n_embed=16)
  cfg.pretrain.model.update(feature_dim=8, codebook_size=16, depth=1)
  cfg.caption.model.layers = 1
  cfg.pretrain.model.text_vocab_size = 40
  cfg.caption.model.vocab_size = 40
  cfg.caption.init_from_pretrain = False
  if not _TOKENIZER:
    _TOKENIZER.append(stand_ins.random_tokenizer(cfg))
  return cfg


@pytest.mark.parametrize('stage', ['pretrain', 'caption', 'tokenizer'])
def test_step_equal_on_meshes(config, stage):
  """Every stage's two steps give the same losses and parameters on each (data, model) mesh."""
  ref_losses, ref_leaf, _ = _cached_two_steps(config, stage, MESHES[0])
  for shape in STAGE_MESHES[stage][1:]:
    losses, leaf, _ = _cached_two_steps(config, stage, shape)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-4, err_msg=str(shape))
    np.testing.assert_allclose(leaf, ref_leaf, rtol=2e-3, atol=2e-5, err_msg=str(shape))


def test_parameters_are_sharded_over_model_axis(config):
  _, _, state = _cached_two_steps(config, 'pretrain', (2, 4))
  specs = {str(x.sharding.spec) for x in jax.tree.leaves(state.params)}
  assert any('model' in s for s in specs), specs
  mu = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, 'ndim', 0) == 2]
  assert any('model' in str(x.sharding.spec) for x in mu)


def test_fsdp_rules_shard_every_matrix_and_keep_the_losses(config):
  """`sharding.fsdp_rules`: every parameter matrix (and its Adam moments) is split over 'model'
  where a dimension divides it, and the step computes the same losses as one device."""
  ref_losses, _, _ = _cached_two_steps(config, 'pretrain', (1, 1))
  fsdp = config.copy_and_resolve_references()
  fsdp.sharding.rules = sharding.fsdp_rules(config.sharding.rules)
  losses, _, state = _two_steps(fsdp, 'pretrain', (2, 4))
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-4)
  for tree in (state.params, state.opt_state):
    for x in jax.tree.leaves(tree):
      if getattr(x, 'ndim', 0) == 2 and any(d % 4 == 0 for d in x.shape):
        assert 'model' in str(x.sharding.spec), (x.shape, x.sharding.spec)


def test_step_is_traced_under_its_mesh(config, monkeypatch):
  """Code that splits work by device reads the step's mesh while it is traced (the frozen
  tokenizer's encode, `vqgan.Frozen`, runs each device's own images through `jax.shard_map`)."""
  seen = []
  encode = vqgan.Frozen._encode

  def recording(self, params, images, method):
    seen.append(dict(jax.sharding.get_abstract_mesh().shape))
    return encode(self, params, images, method)

  monkeypatch.setattr(vqgan.Frozen, '_encode', recording)
  step, state, batch, constants = _step(config, 'pretrain', sharding.make_mesh(4, 2))
  step.trace(state, batch, constants, jax.random.key(7))
  assert seen and all(s == {'data': 4, 'model': 2} for s in seen), seen


@pytest.mark.parametrize('stage', ['pretrain', 'caption', 'tokenizer'])
def test_no_step_gathers_activations_on_a_data_mesh(config, stage):
  """On a data-parallel mesh each device computes its own rows in every loop the presets use
  (attention pair groups, micro-batches, the bf16 frozen encode's chunks and row bands, the
  tokenizer's frame chunks), each set by its documented rule for the data axis: the compiled
  step gathers no floating-point array (a loop stepping over the sharded rows would make the
  partitioner gather the whole batch onto every device, right values at D times the work).
  Parameters are replicated on an (8, 1) mesh; rows paired across the batch (stage 1's rolled
  captions) move by collective-permute, and the batch's integer frame indices are gathered."""
  import re
  cfg = config.copy_and_resolve_references()
  cfg.pretrain.model.attention_group = 8          # a multiple of the data axis
  cfg.tokenizer.frozen_dtype = 'bfloat16'         # chunked, banded frozen encode
  cfg.pretrain.train.micro_batches = 2            # batch / M rows cover the devices
  cfg.caption.train.micro_batches = 2
  cfg.tokenizer.train.frames_chunk = 8            # a multiple of the data axis
  step, state, batch, constants = _step(cfg, stage, sharding.make_mesh(8, 1), batch_size=16)
  hlo = step.lower(state, batch, constants, jax.random.key(7)).compile().as_text()
  gathered = re.findall(r'= ((?:f|bf)\d+\[[^\]]*\])\S* all-gather\(', hlo)
  assert not gathered, gathered
  assert 'all-reduce(' in hlo   # the gradients' sum over devices: the pattern reads this HLO
