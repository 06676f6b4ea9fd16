"""The original stage-1 `BERT` (dalle_beit.py) -> `ProcedureEncoder` parameters.

Dimension legend: V text vocabulary (BPE ids), L text_len, D width, T frames, h x w token grid,
C feature channels, K codebook, F MLP width.

train_stage1.py saves `{'weights': BERT.state_dict(), 'optimizer', 'iter', 'hparams',
'vae_params'}`; `torch_files.state_dict` finds `weights`. Key mapping (torch -> flax):

  text_emb.weight [V + L + 1, D]                text_emb
  text_pos_emb.weight [L, D]                    text_pos_emb
  special_emb.weight, special_pos_emb.weight    special_emb, special_pos_emb   [5, D]
  image_emb.weight [K + 2, D]                   image_emb (unused in the forward, kept)
  image_mask [D]                                image_mask
  conv_to_embedding.{0,1}                       conv_to_embedding/{norm,dense}   (LayerNorm(C),
                                                Linear(C, D): weight transposed)
  target_pos_emb.weights.{0,1,2} or             target_pos_emb/weights_{0,1,2}: [T,1,1,D],
    .weights_{0,1,2}: (1,T,1,1,D) ...           [1,h,1,D], [1,1,w,D] (the leading 1 dropped;
                                                the name depends on axial_positional_embedding's
                                                version)
  transformer.transformer.resblocks.{i}.*       resblocks_{i} (clip.block_params)
  to_logits{,_rel,_vid}.{0,1}                   to_logits{,_rel,_vid}/{norm,dense}

Ignored on purpose (IGNORED): `vae.*` and `cvae.*`, the frozen VQGAN the BERT holds as a
submodule (convert.taming converts it from its own checkpoint), and the blocks' `attn_mask`
buffers, the additive [S, S] mask that `procedure_encoder.attention_mask` rebuilds (checked to
agree with it). Any other key is an error: the file is for another model or config.

Stage 2: `MMVID_IDC` (src/mmvid_idc.py) holds the same BERT as `self.intermediate_generator`, so a
train_stage2.py checkpoint (`{'model': MMVID_IDC.state_dict(), ...}`) has these keys under
STAGE2_PREFIX = 'intermediate_generator.' (beside `mlp.*` and `text_decoder.*`); its text table
has 0 + L + 1 rows (num_text_tokens 0, spec 5.1), so pass text_vocab_size=0 for it.
"""

import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from procap_jax.convert import clip
from procap_jax.convert import common
from procap_jax.models import procedure_encoder

SOURCE = 'the ProCap stage-1 checkpoint'
STAGE2_PREFIX = 'intermediate_generator.'
BLOCKS = 'transformer.transformer.resblocks.'
IGNORED = ('vae.', 'cvae.')
_MASK_BUFFER = re.compile(r'transformer\.transformer\.resblocks\.\d+\.attn_mask$')
_HEADS = ('to_logits', 'to_logits_rel', 'to_logits_vid')


def _axial_name(state: Mapping[str, np.ndarray], prefix: str, i: int) -> str:
  """`target_pos_emb.weights.i` (axial_positional_embedding >= 0.3) or `.weights_i` (older)."""
  dotted = f'{prefix}target_pos_emb.weights.{i}'
  return dotted if dotted in state else f'{prefix}target_pos_emb.weights_{i}'


def model_kwargs(state: Mapping[str, np.ndarray], prefix: str = '',
                 heads: int | None = None) -> dict:
  """The `ProcedureEncoder` sizes a stage-1 state dict was built with (read off its shapes).

  Args:
    state: flat state dict.
    prefix: '' or STAGE2_PREFIX.
    heads: attention heads; None = width // 64 (the original's CLIP rule; not in the file).
  """
  p = prefix
  width = common.take(state, f'{p}image_mask', source=SOURCE).shape[0]
  text_len = common.take(state, f'{p}text_pos_emb.weight', source=SOURCE).shape[0]
  rows = common.take(state, f'{p}text_emb.weight', source=SOURCE).shape[0]
  t, h, w = (common.take(state, _axial_name(state, p, i), source=SOURCE).shape[1 + i]
             for i in range(3))
  fc = common.take(state, f'{p}{BLOCKS}0.mlp.c_fc.weight', source=SOURCE).shape[0]
  return dict(width=width, depth=clip.file_depth(state, p + BLOCKS), heads=heads or width // 64,
              mlp_ratio=fc // width, text_len=text_len, text_vocab_size=rows - text_len - 1,
              num_frames=t, grid=(h, w),
              feature_dim=common.take(state, f'{p}conv_to_embedding.0.weight',
                                      source=SOURCE).shape[0],
              codebook_size=common.take(state, f'{p}to_logits.1.weight', source=SOURCE).shape[0])


def _expected_tree(kwargs: Mapping[str, Any]) -> Any:
  """The parameter shapes of ProcedureEncoder(**kwargs), without allocating them."""
  model = procedure_encoder.ProcedureEncoder(**kwargs)
  t, (h, w), c = kwargs['num_frames'], tuple(kwargs['grid']), kwargs['feature_dim']
  return jax.eval_shape(lambda: model.init(
      jax.random.PRNGKey(0), jnp.zeros((1, kwargs['text_len']), jnp.int32),
      jnp.zeros((1, t, h, w, c)), jnp.zeros((1, t, h * w), bool), use_rel=True))['params']


def _check_mask_buffer(state: Mapping[str, np.ndarray], key: str, kwargs: Mapping[str, Any]):
  """The original's additive mask buffer must be our attention_mask (0 = visible, -inf not)."""
  buffer = np.asarray(state[key])
  h, w = tuple(kwargs['grid'])
  ours = procedure_encoder.attention_mask(kwargs['text_len'], kwargs['num_frames'] * h * w,
                                          use_rel=True)
  if buffer.shape != ours.shape or not np.array_equal(np.isfinite(buffer) & (buffer == 0), ours):
    raise common.ConversionError(
        f'{SOURCE}: the attention-mask buffer {key!r} (shape {buffer.shape}) is not the [REL] + '
        f'caption + [ST1][VID] + frames layout of shape {ours.shape}; the checkpoint was built '
        'with another sequence layout (e.g. num_visuals > 0)')


def encoder_params(state: Mapping[str, np.ndarray], model_kwargs: Mapping[str, Any],
                   prefix: str = '', *, source: str = SOURCE) -> dict:
  """The nested ProcedureEncoder(**model_kwargs) params of an original stage-1 BERT.

  Args:
    state: flat state dict (`torch_files.state_dict(path)`: the `weights` of a train_stage1.py
      checkpoint, or a stage-2 `model` with prefix=STAGE2_PREFIX).
    model_kwargs: the encoder's kwargs (config.pretrain.model); frame_difference must be 'none'
      (the original has no such input).
    prefix: where the BERT's keys start ('' for stage 1, STAGE2_PREFIX for stage 2); keys
      outside it are not looked at.
    source: how the file is named in errors.

  Returns:
    Nested dict of float32 numpy arrays with exactly the model's parameter tree.

  Raises:
    ConversionError: a missing or extra key, or a shape the model does not have (one sentence).
  """
  kw = dict(model_kwargs)
  if kw.get('frame_difference', 'none') != 'none':
    raise common.ConversionError(
        f"the original encoder has no frame-difference input; set "
        f"pretrain.model.frame_difference='none' (it is {kw['frame_difference']!r}) to load "
        f'{source}')
  d, p = int(kw['width']), prefix
  h, w = tuple(kw['grid'])
  t, c, k, length = (int(kw[n]) for n in ('num_frames', 'feature_dim', 'codebook_size',
                                          'text_len'))
  used = []

  def take(name, shape):
    used.append(p + name)
    return common.take(state, p + name, shape, source=source)

  def norm_dense(name, n_in, n_out):
    used.extend(f'{p}{name}.{i}.{x}' for i in (0, 1) for x in ('weight', 'bias'))
    return {'norm': common.layer_norm(state, f'{p}{name}.0', n_in, source=source),
            'dense': common.linear(state, f'{p}{name}.1', n_in, n_out, source=source)}

  out = {
      'text_emb': take('text_emb.weight', (int(kw['text_vocab_size']) + length + 1, d)),
      'text_pos_emb': take('text_pos_emb.weight', (length, d)),
      'special_emb': take('special_emb.weight', (procedure_encoder.NUM_SPECIAL, d)),
      'special_pos_emb': take('special_pos_emb.weight', (procedure_encoder.NUM_SPECIAL, d)),
      'image_emb': take('image_emb.weight', (k + 2, d)),
      'image_mask': take('image_mask', (d,)),
      'conv_to_embedding': norm_dense('conv_to_embedding', c, d),
  }
  axial = {}
  for i, shape in enumerate(((1, t, 1, 1, d), (1, 1, h, 1, d), (1, 1, 1, w, d))):
    name = _axial_name(state, p, i)[len(p):]
    axial[f'weights_{i}'] = take(name, shape)[0]
  out['target_pos_emb'] = axial
  hidden = int(kw['mlp_ratio']) * d
  for i in range(int(kw['depth'])):
    block = f'{p}{BLOCKS}{i}.'
    out[f'resblocks_{i}'] = clip.block_params(state, block, d, hidden, source=source)
    used.extend(clip.block_keys(block))
  for name, n_out in zip(_HEADS, (k, 1, 1)):
    out[name] = norm_dense(name, d, n_out)

  ignored = [key for key in state if key.startswith(p) and
             (key[len(p):].startswith(IGNORED) or _MASK_BUFFER.match(key[len(p):]))]
  for key in ignored:
    if key.endswith('attn_mask'):
      _check_mask_buffer(state, key, kw)
  extra = [key for key in common.unused_keys(state, used + ignored) if key.startswith(p)]
  if extra:
    raise common.ConversionError(
        f'{source} has {extra[0]!r}, which the stage-1 encoder does not use ({len(extra)} such '
        'keys); it is for another model or config (e.g. more blocks than pretrain.model.depth)')
  common.check_tree(out, _expected_tree(kw), what='the stage-1 encoder')
  return out
