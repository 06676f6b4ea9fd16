"""Stage 1 against the original PyTorch code: converted weights give its logits, losses and step.

The fixtures come from the original's own modules (tests/parity/gen_stage1.py, run by hand with
torch): a TorchScript CLIP archive, train_stage1.py checkpoints before and after one update, and
the inputs (text, features, corrupted features, codes, masks) with the outputs of its forward.
Here they are read without torch (`torch_files`), converted (`convert.clip`,
`convert.procap_stage1`) and run through the paper preset's code paths (frame_difference 'none',
embedding_std 1, binary_inputs 'masked', csy_normalisation 'code', fused or not).

Reads tests/parity/fixtures/, or the folder in PROCAP_PARITY_DIR (e.g. the paper-size fixtures
of `gen_stage1.py --size paper --out DIR`); every `stage1_<size>_io.npz` there is one case.
"""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import clevr_change
from procap_jax.convert import clip
from procap_jax.convert import common
from procap_jax.convert import procap_stage1
from procap_jax.convert import torch_files
from procap_jax.tasks import pretrain

FIXTURES = pathlib.Path(os.environ.get('PROCAP_PARITY_DIR') or
                        pathlib.Path(__file__).parent / 'parity' / 'fixtures')
SIZES = sorted(p.name[len('stage1_'):-len('_io.npz')] for p in FIXTURES.glob('stage1_*_io.npz'))
OUTPUT_TOL = 1e-4   # max |ours - original| / max |original|, per output
STEP_TOL = 1e-5     # max |ours - original| of the parameters after one update


def _config(io, fused: bool):
  """The CLEVR paper preset with the fixture's sizes."""
  config = clevr_change.get_config('paper')
  config.compute_dtype = config.tokenizer.frozen_dtype = 'float32'  # the original's precision
  m = config.pretrain.model
  m.width, m.depth, m.heads = int(io['width']), int(io['depth']), int(io['heads'])
  m.text_len, m.text_vocab_size = int(io['text_len']), int(io['text_vocab_size'])
  m.grid = (int(io['grid']),) * 2
  m.feature_dim, m.codebook_size = int(io['feature_dim']), int(io['codebook_size'])
  config.pretrain.fused_forwards = fused
  config.data.num_keyframes = int(io['num_frames']) - 2
  return config


class Case:
  """One fixture size: the original's files, read and converted once."""

  def __init__(self, size: str):
    self.size = size
    self.io = dict(np.load(FIXTURES / f'stage1_{size}_io.npz'))
    self.init = torch_files.state_dict(str(FIXTURES / f'stage1_{size}_init.pt'))
    self.clip = torch_files.state_dict(str(FIXTURES / f'clip_{size}.pt'))
    self.step1 = torch_files.load(str(FIXTURES / f'stage1_{size}_step1.pt'))
    self.config = _config(self.io, fused=True)
    self.kwargs = procap_stage1.model_kwargs(self.init, heads=int(self.io['heads']))
    self.params = procap_stage1.encoder_params(self.init, self.kwargs)

  def inputs(self):
    io = self.io
    return (jnp.asarray(io['text']), jnp.asarray(io['features']), jnp.asarray(io['features_neg']),
            jnp.asarray(io['mask']), jnp.asarray(io['fully_masked']))

  def loss_fn(self, config):
    model = pretrain.build_model(config)
    codes = jnp.asarray(self.io['codes'])
    text, features, features_neg, mask, fully_masked = self.inputs()

    def loss(params):
      out = pretrain.forward_logits(params, config, model, text, features, features_neg, mask,
                                    fully_masked)
      sums = pretrain.statistics_from_logits(
          out['frame_logits'], codes, out['token_mask'], out['fully_masked'],
          jnp.ones(text.shape[0], bool), out['rel_pos'], out['rel_neg'], out['vid_pos'],
          out['vid_neg'])
      metrics = pretrain.losses_from_sums(sums, config)
      return metrics['loss'], (metrics, out)

    return loss

  def torch_named(self, values: dict) -> dict:
    """Per-parameter values keyed by torch name (e.g. Adam moments) -> our tree, through the
    converter; trainable parameters without an entry (no gradient in torch) are zeros."""
    names = [str(n) for n in self.io['param_names']]
    state = {**self.init, **{n: np.zeros_like(self.init[n]) for n in names}, **values}
    return procap_stage1.encoder_params(state, self.kwargs)

  def one_step(self):
    """Our first update from the checkpoint: (gradient norm, optimizer state, params after)."""
    config = self.config
    tx = pretrain.make_optimizer(config, config.pretrain.train.steps)
    loss = self.loss_fn(config)

    @jax.jit
    def step(params):
      grads, _ = jax.grad(loss, has_aux=True)(params)
      updates, state = tx.update(grads, tx.init(params), params)
      return optax.global_norm(grads), state, optax.apply_updates(params, updates)

    return step(jax.tree.map(jnp.asarray, self.params))

  def torch_moments(self) -> dict:
    """Adam's exp_avg and exp_avg_sq after the original's update, as our trees 'mu', 'nu'."""
    opt = self.step1['optimizer']
    names = [str(n) for n in self.io['param_names']]
    return {ours: self.torch_named({names[i]: s[theirs] for i, s in opt['state'].items()})
            for ours, theirs in (('mu', 'exp_avg'), ('nu', 'exp_avg_sq'))}

  def torch_after(self) -> dict:
    return procap_stage1.encoder_params(
        torch_files.state_dict(str(FIXTURES / f'stage1_{self.size}_step1.pt')), self.kwargs)


_CASES = {}


@pytest.fixture(scope='module', params=SIZES or [None])
def case(request):
  if request.param is None:
    pytest.fail(f'no stage1_*_io.npz in {FIXTURES}; write them with tests/parity/gen_stage1.py')
  if request.param not in _CASES:
    _CASES[request.param] = Case(request.param)
  return _CASES[request.param]


def _rel(ours, theirs) -> float:
  ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
  return float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30))


def test_fixture_holds_the_paper_switches_and_sizes(case):
  """The test runs what it claims: the paper preset's switches, the file's sizes, an included
  and a fully masked sample, and the recorded lr is our schedule's first value."""
  p = case.config.pretrain
  assert (p.model.frame_difference, p.model.embedding_std, p.binary_inputs,
          p.csy_normalisation) == ('none', 1.0, 'masked', 'code')
  assert case.io['fully_masked'].any() and not case.io['fully_masked'].all()
  assert {k: case.kwargs[k] for k in ('width', 'depth', 'text_len', 'num_frames')} == {
      'width': int(case.io['width']), 'depth': int(case.io['depth']),
      'text_len': int(case.io['text_len']), 'num_frames': int(case.io['num_frames'])}
  assert tuple(case.io['loss_weights']) == (p.loss_weights.msm, p.loss_weights.align,
                                            p.loss_weights.csy)
  lr0 = float(pretrain.learning_rate(case.config, p.train.steps)(0))
  assert lr0 == pytest.approx(float(case.io['lr']), rel=1e-6)


def test_lr_schedule_equals_deepspeeds(case):
  """The original's lr (DeepSpeed 0.18.5 WarmupLR stepped after each update, recorded for
  updates 0..11): its constructor sets the min lr and its first step() computes ln(0 + 1) = 0
  again, so update n >= 1 gets ln(n) / ln(W); `pretrain.learning_rate` gives the same."""
  theirs = case.io['lr_schedule']
  ours = np.asarray(pretrain.learning_rate(case.config, case.config.pretrain.train.steps)(
      np.arange(len(theirs))))
  assert ours[0] == ours[1] == pytest.approx(theirs[0], rel=1e-6)
  np.testing.assert_allclose(ours, theirs, rtol=1e-5)


def test_clip_blocks_convert_as_the_original_loads_them(case):
  """The stage-1 checkpoint's blocks were loaded by the original from the CLIP archive (first
  `depth` of its blocks, float16 widened): our CLIP conversion gives them exactly."""
  assert clip.file_depth(case.clip) == int(case.io['clip_layers']) >= case.kwargs['depth']
  blocks = clip.encoder_blocks(case.clip, case.kwargs, file_heads=int(case.io['heads']))
  assert set(blocks) == {f'resblocks_{i}' for i in range(case.kwargs['depth'])}
  for got, want in zip(jax.tree.leaves(blocks), jax.tree.leaves({k: case.params[k]
                                                                  for k in blocks})):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('fused', [True, False])
def test_logits_and_losses_match_the_original(case, fused):
  config = _config(case.io, fused)
  loss = jax.jit(case.loss_fn(config))
  _, (metrics, out) = loss(case.params)
  io = case.io
  for name in ('frame_logits', 'rel_pos', 'rel_neg', 'vid_pos', 'vid_neg'):
    assert _rel(out[name], io[name]) <= OUTPUT_TOL, name
  for ours, theirs in (('loss_msm', 'loss_msm'), ('loss_align', 'loss_align'),
                       ('loss_csy', 'loss_csy'), ('loss', 'loss')):
    assert abs(float(metrics[ours]) - float(io[theirs])) <= OUTPUT_TOL * max(
        1.0, abs(float(io[theirs]))), ours


def test_one_adam_step_matches_the_original(case):
  """Gradients (as Adam's first moments: exp_avg = 0.1 * clipped gradient), second moments and
  the parameters after train_stage1.py's first update (clip 1.0, Adam, the schedule's lr)."""
  norm, state, after = case.one_step()
  assert float(norm) == pytest.approx(float(case.io['grad_norm']), rel=1e-4)
  moments = case.torch_moments()
  for key, theirs in moments.items():
    ours = optax.tree_utils.tree_get(state, key)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(ours),
                                 jax.tree.leaves(theirs)):
      worst = float(np.abs(np.asarray(got) - want).max())
      tol = OUTPUT_TOL * (2 if key == 'nu' else 1)  # nu ~ g**2 doubles the relative error
      assert worst <= tol * max(float(np.abs(want).max()), 1e-30), (key, path)

  expected, lr = case.torch_after(), float(case.io['lr'])
  for path, got in jax.tree_util.tree_leaves_with_path(after):
    keys = tuple(k.key for k in path)
    want, before, got = _at(expected, keys), _at(case.params, keys), np.asarray(got)
    assert np.abs(got - want).max() <= STEP_TOL, keys
    # Sharper than STEP_TOL (an update is only ~lr): the update agrees to two rounding units of
    # the parameter plus a hundredth of the lr wherever the gradient is at least 1e-3 of its
    # leaf's largest. Smaller ones are within both sides' gradient rounding (up to 3e-5 of the
    # leaf's largest at paper size; the key bias's true gradient is 0), which Adam's first
    # step, ~ lr * sign(g), turns into +-lr at random.
    mu = np.abs(_at(moments['mu'], keys))
    resolved = mu >= 1e-3 * mu.max()
    slack = 2 * np.spacing(np.maximum(np.abs(before), np.abs(want))) + 0.01 * lr
    assert (np.abs(got - want)[resolved] <= slack[resolved]).all(), keys


def _at(tree, keys):
  for key in keys:
    tree = tree[key]
  return tree


def _error(fn) -> str:
  with pytest.raises(common.ConversionError) as e:
    fn()
  assert '\n' not in str(e.value)
  return str(e.value)


def test_stage1_converter_keys(case):
  """`vae.*` and the mask buffers are ignored (the buffer checked), both axial names convert,
  the stage-2 prefix reads the same tensors, and anything else is one sentence."""
  state, kwargs = case.init, case.kwargs
  assert any(k.startswith('vae.') for k in state)
  mask_key = f'{procap_stage1.BLOCKS}0.attn_mask'
  assert mask_key in state
  renamed = {k.replace('target_pos_emb.weights.', 'target_pos_emb.weights_'): v
             for k, v in state.items()}
  staged = {procap_stage1.STAGE2_PREFIX + k: v for k, v in state.items()}
  staged['mlp.0.weight'] = np.zeros(3)  # stage-2 keys outside the BERT are not looked at
  for other in (procap_stage1.encoder_params(renamed, kwargs),
                procap_stage1.encoder_params(staged, kwargs, procap_stage1.STAGE2_PREFIX)):
    for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(case.params)):
      np.testing.assert_array_equal(a, b)
  assert procap_stage1.model_kwargs(staged, procap_stage1.STAGE2_PREFIX, heads=kwargs['heads'])\
      == kwargs

  msg = _error(lambda: procap_stage1.encoder_params(dict(state, **{'visual_emb.weight':
                                                                   np.zeros(2)}), kwargs))
  assert "'visual_emb.weight'" in msg
  msg = _error(lambda: procap_stage1.encoder_params(state, dict(kwargs, depth=1)))
  assert f"'{procap_stage1.BLOCKS}1." in msg
  msg = _error(lambda: procap_stage1.encoder_params(state, dict(kwargs, codebook_size=7)))
  assert "'image_emb.weight' has shape" in msg
  msg = _error(lambda: procap_stage1.encoder_params(state, dict(kwargs,
                                                                frame_difference='before')))
  assert "frame_difference='none'" in msg
  buffer = np.array(state[mask_key])
  buffer[0, 1] = -np.inf
  msg = _error(lambda: procap_stage1.encoder_params(dict(state, **{mask_key: buffer}), kwargs))
  assert mask_key in msg


def _figures(size: str) -> dict:
  """Per output (max |ours - original|, that / max |original|), fused and unfused; the gradient
  norm; Adam's moments (worst leaf, relative to its max); the parameters after the step (max
  abs). Printed by `[PROCAP_PARITY_DIR=DIR] python tests/parity_stage1_test.py`."""
  case = Case(size)
  out = {'size': size}
  for fused in (True, False):
    loss = jax.jit(case.loss_fn(_config(case.io, fused)))
    _, (metrics, logits) = loss(case.params)
    for name in ('frame_logits', 'rel_pos', 'rel_neg', 'vid_pos', 'vid_neg'):
      diff = float(np.abs(np.asarray(logits[name], np.float64) - case.io[name]).max())
      out[f'{name}{"" if fused else "_unfused"}'] = (diff, _rel(logits[name], case.io[name]))
    for name in ('loss_msm', 'loss_align', 'loss_csy', 'loss'):
      diff = abs(float(metrics[name]) - float(case.io[name]))
      out[f'{name}{"" if fused else "_unfused"}'] = (diff, diff / abs(float(case.io[name])))
  norm, state, after = case.one_step()
  out['grad_norm'] = (abs(float(norm) - float(case.io['grad_norm'])),
                      _rel(norm, case.io['grad_norm']))
  for key, theirs in case.torch_moments().items():  # worst leaf, relative to the leaf's max
    out[f'adam_{key}_leaf_rel'] = max(_rel(a, b) for a, b in zip(
        jax.tree.leaves(optax.tree_utils.tree_get(state, key)), jax.tree.leaves(theirs))
        if np.abs(b).max() > 0)
  out['params_after_step'] = max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(
      jax.tree.leaves(after), jax.tree.leaves(case.torch_after())))
  return out


if __name__ == '__main__':
  import json
  import time
  for size_ in SIZES:
    start = time.time()
    figures = _figures(size_)
    figures['seconds'] = round(time.time() - start, 1)
    print(json.dumps(figures))
