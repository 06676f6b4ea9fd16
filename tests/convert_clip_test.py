"""convert.clip on a real TorchScript CLIP archive (tests/parity/fixtures/clip_small.pt).

The archive is what tests/parity/gen_stage1.py traced from the original's clip_model.CLIP with
OpenAI's float16 cast: 3 visual blocks 40 wide with 4 heads (the generator gives the small
width 4 heads; build_model's own rule, width // 64, would give 0), MLP 160.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from procap_jax.convert import clip
from procap_jax.convert import common
from procap_jax.convert import torch_files
from procap_jax.models import procedure_encoder

FIXTURES = pathlib.Path(__file__).parent / 'parity' / 'fixtures'
HEADS = 4


@pytest.fixture(scope='module')
def state():
  return torch_files.state_dict(str(FIXTURES / 'clip_small.pt'))


def _kwargs(**overrides):
  kwargs = dict(width=40, depth=2, heads=HEADS, mlp_ratio=4, text_len=5, text_vocab_size=7,
                num_frames=2, grid=(2, 3), feature_dim=3, codebook_size=11)
  return dict(kwargs, **overrides)


def _error(fn) -> str:
  with pytest.raises(common.ConversionError) as e:
    fn()
  message = str(e.value)
  assert '\n' not in message
  return message


def test_the_archive_is_openai_style(state):
  """TorchScript names, float16 projections and float32 LayerNorms, plus OpenAI's scalars."""
  assert clip.file_depth(state) == 3
  assert state['visual.transformer.resblocks.0.attn.in_proj_weight'].dtype == np.float16
  assert state['visual.transformer.resblocks.0.ln_1.weight'].dtype == np.float32
  assert {'input_resolution', 'context_length', 'vocab_size'} <= set(state)


def test_first_depth_blocks_transposed(state):
  blocks = clip.encoder_blocks(state, _kwargs(depth=2), file_heads=HEADS)
  assert sorted(blocks) == ['resblocks_0', 'resblocks_1']
  p = 'visual.transformer.resblocks.1.'
  b = blocks['resblocks_1']
  np.testing.assert_array_equal(b['attn']['in_proj']['kernel'],
                                state[p + 'attn.in_proj_weight'].astype(np.float32).T)
  np.testing.assert_array_equal(b['mlp']['c_proj']['kernel'],
                                state[p + 'mlp.c_proj.weight'].astype(np.float32).T)
  np.testing.assert_array_equal(b['ln_2']['scale'], state[p + 'ln_2.weight'])
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(blocks))
  assert sorted(clip.encoder_blocks(state, _kwargs(depth=3), file_heads=HEADS)) == [
      'resblocks_0', 'resblocks_1', 'resblocks_2']


def test_fp16_round_trip_switch(state):
  """Off (default, the original): float32 values are kept. On: the tensors convert_weights casts
  are rounded through float16, the LayerNorms are not. On a float16 file both are the same."""
  half = clip.encoder_blocks(state, _kwargs(), file_heads=HEADS)
  rounded = clip.encoder_blocks(state, _kwargs(), file_heads=HEADS, fp16_round_trip=True)
  for a, b in zip(jax.tree.leaves(half), jax.tree.leaves(rounded)):
    np.testing.assert_array_equal(a, b)
  rng = np.random.default_rng(0)
  fine = {k: (v.astype(np.float32) + rng.normal(0, 1e-5, v.shape).astype(np.float32)
              if v.dtype.kind == 'f' else v) for k, v in state.items()}
  kept = clip.encoder_blocks(fine, _kwargs(), file_heads=HEADS)
  cast = clip.encoder_blocks(fine, _kwargs(), file_heads=HEADS, fp16_round_trip=True)
  p = 'visual.transformer.resblocks.0.'
  np.testing.assert_array_equal(kept['resblocks_0']['mlp']['c_fc']['bias'],
                                fine[p + 'mlp.c_fc.bias'])
  np.testing.assert_array_equal(cast['resblocks_0']['mlp']['c_fc']['bias'],
                                fine[p + 'mlp.c_fc.bias'].astype(np.float16).astype(np.float32))
  assert not np.array_equal(kept['resblocks_0']['mlp']['c_fc']['bias'],
                            cast['resblocks_0']['mlp']['c_fc']['bias'])
  np.testing.assert_array_equal(cast['resblocks_0']['ln_1']['scale'], fine[p + 'ln_1.weight'])


def test_size_mismatches_are_one_sentence(state):
  msg = _error(lambda: clip.encoder_blocks(state, _kwargs(width=64), file_heads=HEADS))
  assert "'visual.transformer.resblocks.0.ln_1.weight' has shape (40,)" in msg and '(64,)' in msg
  msg = _error(lambda: clip.encoder_blocks(state, _kwargs(depth=4), file_heads=HEADS))
  assert 'has 3 visual blocks, the encoder needs 4' in msg
  msg = _error(lambda: clip.encoder_blocks(state, _kwargs(mlp_ratio=2), file_heads=HEADS))
  assert "'visual.transformer.resblocks.0.mlp.c_fc.weight' has shape (160, 40)" in msg
  assert '(80, 40)' in msg
  msg = _error(lambda: clip.encoder_blocks(state, _kwargs(heads=5), file_heads=HEADS))
  assert 'pretrain.model.heads=4' in msg
  # Without file_heads, OpenAI's rule: a 768-wide file has 12 heads.
  wide = {clip.PREFIX + '0.attn.in_proj_weight': np.zeros((3, 1)),
          clip.PREFIX + '0.ln_1.weight': np.zeros(768)}
  msg = _error(lambda: clip.encoder_blocks(wide, _kwargs(width=768, heads=8)))
  assert '12 heads' in msg


def test_other_files_are_one_sentence():
  stage1 = torch_files.state_dict(str(FIXTURES / 'stage1_small_init.pt'))
  msg = _error(lambda: clip.encoder_blocks(stage1, _kwargs()))
  assert 'not an OpenAI CLIP ViT file' in msg
  resnet = {'visual.layer1.0.conv1.weight': np.zeros((1, 1, 1, 1))}
  assert 'ResNet CLIP' in _error(lambda: clip.encoder_blocks(resnet, _kwargs()))


def test_init_encoder_replaces_only_the_blocks(state):
  kwargs = _kwargs()
  model = procedure_encoder.ProcedureEncoder(**kwargs)
  fresh = jax.jit(lambda key: model.init(key, jnp.zeros((1, 5), jnp.int32),
                                         jnp.zeros((1, 2, 2, 3, 3)), jnp.zeros((1, 2, 6), bool),
                                         use_rel=True))(jax.random.PRNGKey(0))['params']
  merged = clip.init_encoder(fresh, state, kwargs, file_heads=HEADS)
  blocks = clip.encoder_blocks(state, kwargs, file_heads=HEADS)
  assert sorted(merged) == sorted(fresh)
  for name, sub in merged.items():
    assert jax.tree.structure(sub) == jax.tree.structure(fresh[name])  # boxes kept
    want = blocks[name] if name in blocks else fresh[name]
    for a, b in zip(jax.tree.leaves(sub), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
