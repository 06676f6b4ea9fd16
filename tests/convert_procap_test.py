"""A released ProCap captioner, converted by `python -m procap_jax.convert procap`, is a workdir
that the checkpoint restore and the caption command use like a trained run (the converter's
numbers against the original: tests/parity_stage2_test.py)."""

import json
import pathlib

import flax
import jax
import numpy as np

import margins  # tests/ is on the path (pytest's default import mode)
import parity_stage2_test
from procap_jax import caption
from procap_jax import checkpointing
from procap_jax.convert import __main__ as convert_cli
from procap_jax.convert import common
from procap_jax.convert import procap_stage2
from procap_jax.convert import torch_files
from procap_jax.data import vocab as vocab_lib
from procap_jax.models import captioner as captioner_lib
from procap_jax.models import vqgan
from procap_jax.tasks import caption as caption_task

SMALL = pathlib.Path(__file__).parent / 'parity' / 'fixtures' / 'stage2_small'


def _config():
  """The paper preset at the small fixture's size, with a tokenizer that gives its 3 x 3 grid."""
  with np.load(f'{SMALL}_io.npz') as io:
    meta = json.loads(str(io['meta']))
  config = parity_stage2_test.config_for(meta, f'{SMALL}_word2idx.json')
  p, t = config.pretrain.model, config.tokenizer.model
  config.data.encoder_text = 'words'  # the small fixture's text table is not CLIP's 49,408 rows
  side = 8 * p.grid[0]
  config.data.image_size = t.resolution = side
  t.ch, t.ch_mult, t.num_res_blocks, t.attn_resolutions = 32, (1, 1, 1, 1), 1, ()
  t.z_channels, t.embed_dim, t.n_embed = p.feature_dim, p.feature_dim, p.codebook_size
  return config


def test_converted_captioner_restores_and_captions(tmp_path):
  config, workdir = _config(), str(tmp_path / 'run')
  assert convert_cli.convert(config, workdir, 'procap', f'{SMALL}_model.pt') == ['caption']
  # The tokenizer would come from `convert taming`; a random one of the same shape here.
  tokenizer_state = convert_cli.converted_state(config, 'tokenizer')
  convert_cli.write_stage(config, workdir, 'tokenizer', tokenizer_state, 'random init (test)')

  want = procap_stage2.captioner_params(torch_files.state_dict(f'{SMALL}_model.pt'), config)
  saved = checkpointing.load_stage_variables(workdir, 'caption')['params']
  flat_want = flax.traverse_util.flatten_dict(want)
  flat_saved = flax.traverse_util.flatten_dict(saved)
  assert flat_saved.keys() == flat_want.keys()
  for key, value in flat_want.items():
    np.testing.assert_array_equal(flat_saved[key], value, err_msg='/'.join(key))

  rng = np.random.default_rng(0)
  side = config.data.image_size
  before, after = (rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(2))
  got = caption.Captioner(workdir, cache=False)(before, after)

  tokenizer_params = checkpointing.load_stage_variables(workdir, 'tokenizer')['params']
  images = np.stack([before, after]).astype(np.float32) / 255.0
  feats = vqgan.frozen(config.tokenizer.model).encode_features(tokenizer_params, images)
  model = caption_task.build_model(config)
  ids = captioner_lib.generate(model, common.as_jax(want), feats[:1], feats[1:],
                               max_len=config.caption.model.max_len)
  # The command and this reference are two programs: their words can be equal on any CPU only
  # where each greedy choice wins by more than the logits' float error (tests/margins.py).
  ids = np.asarray(jax.device_get(ids))
  forward = np.asarray(model.apply({'params': common.as_jax(want)}, feats[:1], feats[1:],
                                   ids[:, :-1]))  # [1, L-1, V]
  gaps = margins.greedy_gaps(forward, ids, vocab_lib.EOS, banned=(vocab_lib.UNK,))
  error = margins.sum_tolerance(np.abs(forward).max(), config.caption.model.ffn, ulps=64)
  assert gaps.min() > 2 * error, f'a near-tie: smallest top-2 gap {gaps.min():.3g}'
  vocab = vocab_lib.Vocab.load(f'{SMALL}_word2idx.json')
  assert got == vocab.decode(ids[0])
  assert got  # the fixture's captioner writes words, not an empty caption
