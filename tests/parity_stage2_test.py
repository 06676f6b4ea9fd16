"""The stage-2 captioner against the original's own MMVID_IDC: a train_stage2.py checkpoint
converted by `convert.procap_stage2` gives the original's logits, summed label-smoothed loss,
greedy captions and parameters after one BertAdam step.

The fixtures (`stage2_<size>_model.pt`, a checkpoint laid out as train_stage2.py saves it, with
random weights; `_word2idx.json`; `_io.npz`, the original's inputs and outputs; `_after.npz`, its
parameters after the optimiser step) are written by hand with torch by tests/parity/gen_stage2.py
(its docstring says how each number was computed); no torch here. The committed ones are a small
model (encoder 2 x 48, 4 heads, 4 frames of 3 x 3 tokens of 16 features; decoder 2 x 32, 4 heads,
FFN 64, 25 words). PROCAP_PARITY_DIR=<dir> runs the same checks on every `stage2_*` fixture in
<dir>, e.g. the paper's captioner:

  python tests/parity/gen_stage2.py --original ORIG \
      --out P --size paper
  PROCAP_PARITY_DIR=P python -m pytest -q -n 0 tests/parity_stage2_test.py

The model runs with the paper presets (configs/clevr_change.py:paper) resized to the fixture,
i.e. the original's code paths: text_slot 'code', stage2_mask 'code', attention_scale 'd_model',
qkv_bias False, layernorm 'unbiased_std', frame_difference 'none'.
"""

import functools
import json
import os
import pathlib

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import clevr_change
from procap_jax.convert import common
from procap_jax.convert import procap_stage2
from procap_jax.convert import torch_files
from procap_jax.data import vocab as vocab_lib
from procap_jax.models import captioner as captioner_lib
from procap_jax.tasks import caption
from procap_jax.tasks import caption_loss
from procap_jax.tasks import caption_optimizer

FIXTURES = pathlib.Path(os.environ.get('PROCAP_PARITY_DIR')
                        or pathlib.Path(__file__).parent / 'parity' / 'fixtures')
SIZES = sorted(p.name[len('stage2_'):-len('_io.npz')] for p in FIXTURES.glob('stage2_*_io.npz'))
TOLERANCE = 1e-4  # logits and loss: max |ours - original| / max |original|
STEP_TOLERANCE = 1e-5  # parameters after the optimiser step: max |ours - original|


def config_for(meta: dict, word2idx: str):
  """The paper preset resized to the fixture's model (its code paths are the original's)."""
  config = clevr_change.get_config('paper')
  config.compute_dtype = config.tokenizer.frozen_dtype = 'float32'  # the original's precision
  s = meta['sizes']
  p = config.pretrain.model
  p.width, p.depth, p.heads, p.mlp_ratio = s['width'], s['depth'], s['heads'], 4
  p.text_len, p.text_vocab_size = meta['text_len'], meta['text_rows'] - meta['text_len'] - 1
  p.grid = (s['grid'], s['grid'])
  p.feature_dim, p.codebook_size = s['feature_dim'], s['codebook']
  config.data.num_keyframes = meta['num_targets'] - 2
  config.data.word2idx_file = word2idx
  m = config.caption.model
  m.hidden, m.heads, m.ffn, m.layers = s['hidden'], s['dec_heads'], s['ffn'], s['layers']
  m.vocab_size, m.max_len = meta['vocab_size'], meta['max_t_len']
  t = config.caption.train
  t.lr, t.lr_encoder, t.warmup_frac = meta['lr'], meta['lr_finetune'], meta['warmup']
  t.weight_decay, t.clip, t.label_smoothing = meta['weight_decay'], meta['clip'], 0.1
  t.t_total_factor = 1.0
  return config


@pytest.fixture(scope='module', params=SIZES)
def fixture(request):
  """(state dict read without torch, the original's inputs/outputs, meta, config, params)."""
  prefix = FIXTURES / f'stage2_{request.param}'
  state = torch_files.state_dict(f'{prefix}_model.pt')
  with np.load(f'{prefix}_io.npz') as io:
    arrays = {k: io[k] for k in io.files}
  meta = json.loads(str(arrays.pop('meta')))
  config = config_for(meta, f'{prefix}_word2idx.json')
  params = procap_stage2.captioner_params(state, config)
  return dict(prefix=prefix, state=state, io=arrays, meta=meta, config=config,
              params=common.as_jax(params), model=caption.build_model(config))


def _relative_error(ours, reference) -> float:
  ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
  assert ours.shape == reference.shape
  return float(np.abs(ours - reference).max() / np.abs(reference).max())


def _loss_fn(model, params, io):
  """The original's CLEVR step loss: the label-smoothed KL summed over both halves."""
  logits = model.apply({'params': params}, io['before'], io['after'], io['caption_in'])
  return caption_loss.label_smoothing_loss(logits, jnp.asarray(io['labels']), 0.1)[0]


def test_runs_the_paper_presets_code_paths(fixture):
  m, p = fixture['config'].caption.model, fixture['config'].pretrain.model
  assert (m.text_slot, m.stage2_mask, m.attention_scale, m.qkv_bias, m.layernorm) == (
      'code', 'code', 'd_model', False, 'unbiased_std')
  assert (p.frame_difference, m.use_queries) == ('none', True)


def test_every_key_converts_and_only_vqgan_and_buffers_are_left(fixture):
  state = fixture['state']
  left = {k for k in state if k.startswith(procap_stage2.VQGAN_PREFIX)
          or procap_stage2.is_buffer(k)}
  assert any(k.startswith(procap_stage2.VQGAN_PREFIX) for k in left)  # ignored, not an error
  assert 'text_decoder.loss_func.one_hot' in left
  leaves = jax.tree.leaves(fixture['params'])
  assert all(leaf.dtype == np.float32 for leaf in leaves)
  assert sum(leaf.size for leaf in leaves) == sum(
      v.size for k, v in state.items() if k not in left)


def test_teacher_forced_logits_and_summed_loss_match(fixture):
  io, model, params = fixture['io'], fixture['model'], fixture['params']
  logits = jax.jit(model.apply)({'params': params}, io['before'], io['after'], io['caption_in'])
  assert _relative_error(logits, io['logits']) <= TOLERANCE
  np.testing.assert_array_equal(caption_loss.teacher_forcing_labels(io['caption_in']), io['labels'])
  n = io['labels'].shape[0] // 2  # change half, then no-change half
  labels = jnp.asarray(io['labels'])
  halves = [caption_loss.label_smoothing_loss(logits[s], labels[s], 0.1)[0]
            for s in (slice(0, n), slice(n, None))]
  assert _relative_error(halves[0], io['loss_change']) <= TOLERANCE
  assert _relative_error(halves[1], io['loss_no_change']) <= TOLERANCE
  total = caption_loss.label_smoothing_loss(logits, labels, 0.1)[0]
  assert _relative_error(total, io['loss']) <= TOLERANCE


def test_greedy_captions_equal_the_originals(fixture):
  io, model, params = fixture['io'], fixture['model'], fixture['params']
  assert io['greedy_margin'].min() > 1e-3  # no near-ties (the generator's choice of weights)
  generate = jax.jit(functools.partial(captioner_lib.generate, model, method='greedy',
                                       max_len=fixture['meta']['max_t_len']))
  ours = np.asarray(generate(params, io['before'], io['after']))
  # The original decodes all 24 positions and keeps writing after [EOS]; its captions stop at
  # the first [EOS] (detokenisation), where ours pad.
  theirs = io['greedy'].copy()
  for row in theirs:
    eos = np.flatnonzero(row == vocab_lib.EOS)
    if len(eos):
      row[eos[0] + 1:] = vocab_lib.PAD
  np.testing.assert_array_equal(ours, theirs)
  assert (ours == vocab_lib.EOS).any() and not (ours == vocab_lib.UNK).any()


def _flat(tree) -> dict:
  return flax.traverse_util.flatten_dict(tree, sep='/')


def test_optimiser_groups_are_the_originals(fixture):
  """The original's 4 BertAdam groups (lr, decay) and frozen tensors, mapped through the
  converter, are our labels and decay mask for every parameter."""
  state, meta, config = fixture['state'], fixture['meta'], fixture['config']
  codes = dict(state)
  for name, (group, trainable) in meta['groups'].items():  # group 0/1 encoder, 0/2 decayed
    codes[name] = np.full(state[name].shape, 10 * group + trainable, np.float32)
  flat_codes = _flat(procap_stage2.captioner_params(codes, config))
  labels = _flat(caption_optimizer.param_labels(fixture['params']))
  decays = _flat(caption_optimizer.decay_mask(fixture['params']))
  for path, code in flat_codes.items():
    group, trainable = divmod(int(code.flat[0]), 10)
    assert (code == code.flat[0]).all(), path
    want = ('encoder' if group < 2 else 'decoder') if trainable else 'frozen'
    assert labels[path] == want, path
    if trainable:
      assert decays[path] == (group in (0, 2)), path


def test_one_bert_adam_step_matches(fixture):
  """Two steps from the checkpoint on the same batch, as the generator: the first has lr 0
  (BertAdam counts from 0) and moves nothing; the parameters after the second match."""
  io, model, params, meta = fixture['io'], fixture['model'], fixture['params'], fixture['meta']
  tx = caption_optimizer.make_optimizer(fixture['config'], meta['t_total'])
  grads = jax.jit(jax.grad(functools.partial(_loss_fn, model)))(params, io)
  opt_state = tx.init(params)
  updates, opt_state = jax.jit(tx.update)(grads, opt_state, params)
  assert all(not np.asarray(u).any() for u in jax.tree.leaves(updates))
  updates, opt_state = jax.jit(tx.update)(grads, opt_state, params)
  ours = _flat(optax.apply_updates(params, updates))
  with np.load(f'{fixture["prefix"]}_after.npz') as after:
    theirs = _flat(procap_stage2.captioner_params(
        {**fixture['state'], **{k: after[k] for k in after.files}}, fixture['config']))
  before = _flat(params)
  moved = 0
  for path, value in theirs.items():
    assert np.abs(np.asarray(ours[path]) - value).max() <= STEP_TOLERANCE, path
    moved += int((value != np.asarray(before[path])).any())
  assert moved > len(theirs) // 2  # the step did move the parameters


def _error(fixture, state=None, **changes) -> str:
  config = fixture['config'].copy_and_resolve_references()
  for key, value in changes.items():
    *parents, name = key.split('.')
    functools.reduce(lambda node, part: node[part], parents, config)[name] = value
  with pytest.raises(common.ConversionError) as info:
    procap_stage2.captioner_params(fixture['state'] if state is None else state, config)
  message = str(info.value)
  assert '\n' not in message
  return message


def test_wrong_vocabulary_is_one_sentence_naming_the_key_and_both_shapes(fixture, tmp_path):
  v, h = fixture['meta']['vocab_size'], fixture['meta']['sizes']['hidden']
  message = _error(fixture, **{'caption.model.vocab_size': v - 1})
  assert 'text_decoder.decoder.out.weight' in message
  assert str((v, h)) in message and str((v - 1, h)) in message
  with open(f'{fixture["prefix"]}_word2idx.json') as f:
    word2idx = json.load(f)
  word2idx['an extra word'] = v
  path = tmp_path / 'word2idx.json'
  path.write_text(json.dumps(word2idx))
  message = _error(fixture, **{'data.word2idx_file': str(path)})
  assert 'text_decoder.decoder.out.weight' in message and str(path) in message
  assert str((v, h)) in message and str((v + 1, h)) in message


def test_missing_unexpected_or_misshaped_keys_are_one_sentence(fixture):
  state = dict(fixture['state'])
  key = 'text_decoder.decoder.layers.1.attention.layer.wk.weight'
  del state[key]
  assert key in _error(fixture, state)
  state = {**fixture['state'], 'text_decoder.decoder.layers.7.feedforward.layernorm.gamma':
           np.ones(3, np.float32)}
  assert 'layers.7.feedforward.layernorm.gamma' in _error(fixture, state)
  h, ffn = fixture['meta']['sizes']['hidden'], fixture['meta']['sizes']['ffn']
  key = 'text_decoder.decoder.layers.0.feedforward.layer.linear1.weight'
  state = {**fixture['state'], key: np.zeros((ffn + 1, h), np.float32)}
  message = _error(fixture, state)
  assert key in message and str((ffn + 1, h)) in message and str((ffn, h)) in message
