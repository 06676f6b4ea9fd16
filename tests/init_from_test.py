"""Runs that start from the original's weights: `<stage>.init_from` and `python -m
procap_jax.convert` (conversion parity itself: tests/parity_*_test.py)."""

import json
import os
import pathlib
import shutil
import struct

import flax
import numpy as np
import pytest

from procap_jax import checkpointing
from procap_jax import errors
from procap_jax import train
from procap_jax.convert import __main__ as convert_cli
from procap_jax.convert import taming
from procap_jax.convert import torch_files
from procap_jax.data import pipeline
from procap_jax.tasks import pretrain
from procap_jax.tasks import tokenizer

PARITY = pathlib.Path(__file__).parent / 'parity' / 'fixtures'


def _write_safetensors(path, state: dict) -> None:
  header, body = {}, b''
  for name, a in state.items():
    raw = np.asarray(a, np.float32).astype('<f4').tobytes()
    header[name] = {'dtype': 'F32', 'shape': list(np.shape(a)),
                    'data_offsets': [len(body), len(body) + len(raw)]}
    body += raw
  text = json.dumps(header).encode()
  pathlib.Path(path).write_bytes(struct.pack('<Q', len(text)) + text + body)


def _write_clip_shaped(path, width: int, blocks: int, seed: int = 0) -> dict:
  """A CLIP-shaped state dict (`visual.transformer.resblocks.*`) as safetensors; returns it."""
  rng = np.random.default_rng(seed)
  state = {'visual.proj': rng.normal(size=(width, 8)).astype(np.float32)}
  for i in range(blocks):
    p = f'visual.transformer.resblocks.{i}.'
    shapes = {'ln_1.weight': (width,), 'ln_1.bias': (width,), 'ln_2.weight': (width,),
              'ln_2.bias': (width,), 'attn.in_proj_weight': (3 * width, width),
              'attn.in_proj_bias': (3 * width,), 'attn.out_proj.weight': (width, width),
              'attn.out_proj.bias': (width,), 'mlp.c_fc.weight': (4 * width, width),
              'mlp.c_fc.bias': (4 * width,), 'mlp.c_proj.weight': (width, 4 * width),
              'mlp.c_proj.bias': (width,)}
    for name, shape in shapes.items():
      state[p + name] = (0.05 * rng.normal(size=shape)).astype(np.float32)
  _write_safetensors(path, state)
  return state


def _params(workdir, stage, which='latest'):
  return flax.traverse_util.flatten_dict(
      checkpointing.load_stage_variables(workdir, stage, which)['params'], sep='/')


def test_stage1_from_a_clip_file_trains_and_resumes_like_any_other(tiny_config, tmp_path):
  config = tiny_config
  config.pretrain.model.heads = 1                 # width 64 // 64, CLIP's rule
  config.tokenizer.train.steps = 1
  config.pretrain.train.steps = 2
  clip = _write_clip_shaped(tmp_path / 'clip.safetensors', config.pretrain.model.width, 3)
  config.pretrain.init_from = str(tmp_path / 'clip.safetensors')
  resumed, straight = str(tmp_path / 'resumed'), str(tmp_path / 'straight')
  pipeline.resolve_vocab_sizes(config, resumed)  # as main does before the stages
  train.run(tokenizer.TASK, config, resumed)
  shutil.copytree(os.path.join(resumed, 'tokenizer'), os.path.join(straight, 'tokenizer'))
  # Killed after 1 step (a checkpoint at the stop), then resumed to 2.
  train.run(pretrain.TASK, config, resumed, max_steps=1)
  after_one = _params(resumed, 'pretrain')
  # The first depth (2) of the file's 3 blocks, moved only by 1 small Adam step.
  kernel = clip['visual.transformer.resblocks.1.attn.in_proj_weight'].T
  assert np.abs(after_one['resblocks_1/attn/in_proj/kernel'] - kernel).max() < 0.01
  assert not np.allclose(after_one['resblocks_1/attn/in_proj/kernel'], kernel)
  assert 'resblocks_2/attn/in_proj/kernel' not in after_one
  train.run(pretrain.TASK, config, resumed)
  train.run(pretrain.TASK, config, straight)
  a, b = _params(resumed, 'pretrain'), _params(straight, 'pretrain')
  assert a.keys() == b.keys()
  for k in a:  # resuming did not re-apply init_from: the same run as one without the stop
    np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _fixture_tokenizer_config(config):
  model = taming.infer_config(torch_files.state_dict(str(PARITY / 'vqgan.ckpt')))
  t = config.tokenizer.model
  t.ch, t.ch_mult, t.num_res_blocks = model['ch'], model['ch_mult'], model['num_res_blocks']
  t.z_channels, t.embed_dim, t.n_embed = model['z_channels'], model['embed_dim'], model['n_embed']
  t.resolution, t.attn_resolutions = 32, (16,)
  p = config.pretrain.model  # consistent with this tokenizer (checked by config validation)
  p.grid, p.feature_dim, p.codebook_size = (16, 16), model['z_channels'], model['n_embed']
  config.stages = ('tokenizer',)
  return config


def test_a_tokenizer_stage_of_0_steps_keeps_the_converted_vqgan(tiny_config, tmp_path):
  config = _fixture_tokenizer_config(tiny_config)
  config.tokenizer.init_from = str(PARITY / 'vqgan.ckpt')
  config.tokenizer.train.steps = 0
  workdir = str(tmp_path / 'run')
  train.run(tokenizer.TASK, config, workdir)
  assert os.path.exists(train.stage_done_path(workdir, 'tokenizer'))
  saved = _params(workdir, 'tokenizer', 'best')
  want = flax.traverse_util.flatten_dict(
      taming.convert(torch_files.state_dict(str(PARITY / 'vqgan.ckpt')),
                     config.tokenizer.model.to_dict()), sep='/')
  assert saved.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(saved[k], want[k], err_msg=k)


def test_convert_command_writes_a_finished_stage_once(tiny_config, tmp_path):
  config = _fixture_tokenizer_config(tiny_config)
  workdir = str(tmp_path / 'run')
  # A wrong file: one sentence, and nothing written (not even the workdir).
  with pytest.raises(SystemExit) as e:
    convert_cli.convert(config, workdir, 'taming', str(PARITY / 'clip_small.pt'))
  assert e.value.code == 2 and not os.path.exists(workdir)
  assert convert_cli.convert(config, workdir, 'taming', str(PARITY / 'vqgan.ckpt')) == [
      'tokenizer']
  with open(train.stage_done_path(workdir, 'tokenizer'), encoding='utf-8') as f:
    assert json.load(f)['converted_from'].endswith('vqgan.ckpt')
  assert os.path.exists(os.path.join(workdir, 'config.json'))
  with pytest.raises(SystemExit):  # a second conversion into the same stage is refused
    convert_cli.convert(config, workdir, 'taming', str(PARITY / 'vqgan.ckpt'))


def test_the_vqgan_inside_a_procap_checkpoint_converts_like_its_own_file(tiny_config, tmp_path):
  from procap_jax.convert import init
  config = _fixture_tokenizer_config(tiny_config)
  plain = torch_files.state_dict(str(PARITY / 'vqgan.ckpt'))
  want = init.converted('tokenizer', config, str(PARITY / 'vqgan.ckpt'))
  for prefix in init.VQGAN_PREFIXES[1:]:  # inside a stage-1 BERT / a stage-2 MMVID_IDC
    state = {prefix + k: v for k, v in plain.items()}
    state[prefix.replace('vae.model.', '') + 'image_mask'] = np.zeros(4)
    _write_safetensors(tmp_path / 'procap.safetensors', state)
    got = init.converted('tokenizer', config, str(tmp_path / 'procap.safetensors'))
    for a, b in zip(flax.traverse_util.flatten_dict(got).values(),
                    flax.traverse_util.flatten_dict(want).values()):
      np.testing.assert_array_equal(a, b)


def test_init_from_errors_are_one_sentence(tiny_config, tmp_path):
  from procap_jax.convert import init
  config = tiny_config
  config.pretrain.init_from = str(tmp_path / 'absent.pt')
  with pytest.raises(errors.UserError, match='does not exist'):
    init.converted('pretrain', config, config.pretrain.init_from)
  _write_clip_shaped(tmp_path / 'wide.safetensors', 2 * config.pretrain.model.width, 2)
  with pytest.raises(errors.UserError, match=r"\(128,\)"):
    init.converted('pretrain', config, str(tmp_path / 'wide.safetensors'))
  with pytest.raises(errors.UserError, match='neither'):
    init.converted('pretrain', config, str(PARITY / 'vqgan.ckpt'))
