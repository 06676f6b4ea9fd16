"""The VQGAN port against taming's own `VQModel`: a taming checkpoint converted by
`convert.taming` gives the original's codes, encoder features and decoded images.

The fixtures (`vqgan.ckpt`, a Lightning-style torch checkpoint with random weights, and
`vqgan_io.npz`, the original's inputs and outputs) are written by hand with torch by
tests/parity/gen_vqgan.py; no torch here. The committed ones are a small model (32 px, ch 32,
ch_mult (2, 1), attention in encoder level 1 and decoder level 1, nin_shortcuts, float16 storage).
PROCAP_PARITY_DIR=<dir> runs the same checks on other fixtures, e.g. the paper's tokenizer:

  python tests/parity/gen_vqgan.py --original ORIG \
      --out P --size paper
  PROCAP_PARITY_DIR=P python -m pytest -q -n 0 tests/parity_vqgan_test.py
"""

import json
import math
import os
import pathlib

import jax
import numpy as np
import pytest

import margins  # tests/ is on the path (pytest's default import mode)
from procap_jax.convert import common
from procap_jax.convert import taming
from procap_jax.convert import torch_files
from procap_jax.models import vqgan

FIXTURES = pathlib.Path(os.environ.get('PROCAP_PARITY_DIR')
                        or pathlib.Path(__file__).parent / 'parity' / 'fixtures')
TOLERANCE = 1e-4  # max |ours - original| / max |original|


@pytest.fixture(scope='module')
def fixture():
  """(state dict read without torch, VQGAN kwargs, the original's inputs and outputs)."""
  state = torch_files.state_dict(str(FIXTURES / 'vqgan.ckpt'))
  with np.load(FIXTURES / 'vqgan_io.npz') as io:
    arrays = {k: io[k] for k in io.files}
  config = json.loads(str(arrays.pop('config')))
  return state, config, arrays


@pytest.fixture(scope='module')
def converted(fixture):
  """(model, variables, images in [0, 1]) with the checkpoint converted by `convert.taming`."""
  state, config, io = fixture
  params = taming.convert(state, config)
  model = vqgan.frozen(config).model
  images = io['pixels'].astype(np.float32) / np.float32(255)  # as the generator divides
  return model, {'params': common.as_jax(params)}, images


def _relative_error(ours, reference) -> float:
  ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
  assert ours.shape == reference.shape
  return float(np.abs(ours - reference).max() / np.abs(reference).max())


def _decoder_out(module: vqgan.VQGAN, ids: jax.Array) -> jax.Array:
  """The decoder's unclipped [-1, 1]-space output for code ids [B, h*w] (taming's decode)."""
  b, n = ids.shape
  side = math.isqrt(n)
  q = module.quantize.lookup(ids).reshape(b, side, side, module.embed_dim)  # [B, h, w, D]
  return module.decoder(module.post_quant_conv(q), False)


def test_converted_params_are_float32_with_the_model_tree(fixture, converted):
  state, config, _ = fixture
  _, variables, _ = converted
  assert any(k.startswith('loss.') for k in state)  # ignored, not an error
  # The torch-side table derived from our model lists the file's keys in the file's order.
  expected = taming.expected_shapes(taming.target_tree(config))
  assert list(expected) == [k for k in state if not k.startswith('loss.')]
  leaves = jax.tree.leaves(variables)
  assert all(leaf.dtype == np.float32 for leaf in leaves)
  assert sum(leaf.size for leaf in leaves) == sum(
      v.size for k, v in state.items() if not k.startswith('loss.'))


def test_codes_equal_the_original(fixture, converted):
  _, _, io = fixture
  model, variables, images = converted
  codes = np.asarray(jax.jit(lambda v, x: model.apply(v, x, method='encode_tokens'))(
      variables, images))
  assert codes.shape == io['codes'].shape
  # Two implementations: codes are equal where the nearest code wins by more than the
  # encoder's float error can move the distances. That relative error, 16 ulps x sqrt(the
  # longest sum, a 3x3 conv over the widest level) (tests/margins.py), is checked on the
  # features (2e-6 measured on the committed fixture, whose codes all have such margins).
  width = model.ch * max(model.ch_mult)
  rel = margins.sum_tolerance(1.0, 9 * width, ulps=16)
  features = jax.jit(lambda v, x: model.apply(v, x, method='encode_features'))(variables, images)
  assert _relative_error(features, io['features']) <= rel
  clear = margins.clear_codes(model, variables['params'], images, rel)
  assert clear.mean() > 0.9, f'only {clear.mean():.1%} of the codes win by a margin'
  differ = int((codes != io['codes'])[clear].sum())
  assert differ == 0, f'{differ} of {clear.sum()} codes with margins differ from the original'


def test_encoder_features_match_the_original(fixture, converted):
  _, _, io = fixture
  model, variables, images = converted
  features = jax.jit(lambda v, x: model.apply(v, x, method='encode_features'))(variables, images)
  assert _relative_error(features, io['features']) <= TOLERANCE


def test_decoded_images_match_the_original(fixture, converted):
  _, _, io = fixture
  model, variables, _ = converted
  codes = io['codes']
  decoded = jax.jit(lambda v, c: model.apply(v, c, method='decode_tokens'))(variables, codes)
  assert _relative_error(decoded, io['decoded']) <= TOLERANCE
  raw = jax.jit(lambda v, c: model.apply(v, c, method=_decoder_out))(variables, codes)
  assert _relative_error(raw, io['decoder_out']) <= TOLERANCE


def _attention_levels(config: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """taming's rule: encoder level i at resolution // 2**i, decoder level i at the token grid
  times 2**(L-1-i); a level has attention when that is in attn_resolutions."""
  n, res, attn = len(config['ch_mult']), config['resolution'], config['attn_resolutions']
  grid = res // 2 ** (n - 1)
  return (tuple(i for i in range(n) if res // 2 ** i in attn),
          tuple(i for i in range(n) if grid * 2 ** (n - 1 - i) in attn))


def test_infer_config_reads_the_fixture(fixture):
  state, config, _ = fixture
  down, up = _attention_levels(config)
  expected = {k: config[k] for k in ('ch', 'num_res_blocks', 'z_channels', 'embed_dim',
                                     'n_embed')}
  expected.update(ch_mult=tuple(config['ch_mult']), attn_down_levels=down, attn_up_levels=up)
  assert taming.infer_config(state) == expected


def test_other_codebook_size_names_the_key_and_both_shapes(fixture):
  state, config, _ = fixture
  k, d = config['n_embed'], config['embed_dim']
  with pytest.raises(common.ConversionError,
                     match=rf"'quantize.embedding.weight' has shape \({k}, {d}\), .* expects "
                           rf'\({k + 1}, {d}\)'):
    taming.convert(state, dict(config, n_embed=k + 1))


def test_attention_the_file_lacks_names_the_key_and_both_shapes(fixture):
  state, config, _ = fixture
  width, side = config['ch'] * config['ch_mult'][0], config['resolution']
  # Attention also at the full resolution: encoder level 0 needs blocks the file does not have.
  wrong = dict(config, attn_resolutions=tuple(config['attn_resolutions']) + (side,))
  with pytest.raises(common.ConversionError,
                     match=rf"no parameter 'encoder.down.0.attn.0.norm.weight', .* shape "
                           rf'\({width},\); there encoder level 0 runs at {side} px and has '
                           r'attention'):
    taming.convert(state, wrong)


def test_missing_key_is_named(fixture):
  state, config, _ = fixture
  key = f'decoder.up.0.block.{config["num_res_blocks"]}.conv2.bias'
  broken = {k: v for k, v in state.items() if k != key}
  with pytest.raises(common.ConversionError, match=rf"no parameter '{key}', .* shape \(\d+,\)"):
    taming.convert(broken, config)
  unknown = dict(state, **{'quantize.used': np.arange(3)})  # a remapped quantiser
  with pytest.raises(common.ConversionError, match=r"has 'quantize.used' with shape \(3,\)"):
    taming.convert(unknown, config)


def test_prefixed_or_foreign_files_are_refused(fixture):
  state, config, _ = fixture
  with pytest.raises(common.ConversionError, match=r"under the prefix 'vae.model.'"):
    taming.convert({f'vae.model.{k}': v for k, v in state.items()}, config)
  with pytest.raises(common.ConversionError, match=r"no parameter 'encoder.conv_in.weight'"):
    taming.infer_config({'visual.conv1.weight': np.zeros((2, 3, 4, 4), np.float32)})


def _shape_only_state(model_config: dict) -> dict[str, np.ndarray]:
  """A taming state dict of `model_config` with the right shapes and no memory (zero views)."""
  expected = taming.expected_shapes(taming.target_tree(model_config))
  return {k: np.broadcast_to(np.float32(0), shape) for k, (_, shape) in expected.items()}


def test_imagenet_256_layout_against_the_paper_224_config():
  """The f16 ImageNet VQGAN (256 px, attention at 16 px: encoder and decoder level 4) into the
  paper's 224 px config, whose levels never run at 16 px: the original's strict=False load drops
  those blocks; the converter names the first one unless told to drop them too."""
  paper = vqgan.paper_config()
  imagenet = _shape_only_state(dict(paper, resolution=256))
  info = taming.infer_config(imagenet)
  assert (info['attn_down_levels'], info['attn_up_levels']) == ((4,), (4,))
  assert (info['ch'], info['ch_mult'], info['num_res_blocks']) == (128, (1, 1, 2, 2, 4), 2)
  assert (info['z_channels'], info['embed_dim'], info['n_embed']) == (256, 256, 1024)
  at_224 = _shape_only_state(paper)
  assert not any(taming._LEVEL_ATTN.match(k) for k in at_224)  # pylint: disable=protected-access
  info = taming.infer_config(at_224)
  assert (info['attn_down_levels'], info['attn_up_levels']) == ((), ())

  with pytest.raises(common.ConversionError,
                     match=r"has 'encoder.down.4.attn.0.norm.weight' with shape \(512,\), the "
                           r'model \(resolution 224 .*\) has no such parameter; there encoder '
                           r'level 4 runs at 14 px and has no attention.*'
                           r'drop_unused_attention=True'):
    taming.check_compatible(imagenet, paper)
  taming.check_compatible(imagenet, paper, drop_unused_attention=True)
  with pytest.raises(common.ConversionError, match=r"no parameter 'encoder.down.4.attn.0.norm."
                                                   r"weight', .* shape \(512,\)"):
    taming.check_compatible(at_224, dict(paper, resolution=256))
