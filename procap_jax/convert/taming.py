"""A taming-transformers `VQModel` state dict -> the parameters of `models.vqgan.VQGAN`.

The key mapping is the one documented in `procap_jax/models/vqgan.py`; here it is derived from the
target model itself: every flax path of `jax.eval_shape(VQGAN(**model_config).init)` is renamed
to its torch name (`down_2/block_1` -> `down.2.block.1` except under `mid`, `kernel`/`scale` ->
`weight`) and its kernel shape HWIO -> OIHW, so the torch-side table can never drift from the
model. Loss keys (`loss.*`, LPIPS and discriminator) are ignored.

Attention layout. taming puts an AttnBlock after every ResnetBlock of a level whose resolution is
in `attn_resolutions`, the resolution being tracked from the config's `resolution`, not read from
the checkpoint. The ImageNet f16-1024 VQGAN was trained at 256 px, and so, per their leftover
configs (`src/mmvid_pytorch/data/2025-03-*.yaml`: resolution 256), were ProCap's per-dataset
fine-tunes; at 256 px encoder level 4 and decoder level 4 run at 16 px and have attention. ProCap
builds the model at 224 px (those levels at 14 px, no attention) and loads with `strict=False`,
which silently drops those attention weights. `convert` refuses such a file
unless `drop_unused_attention=True`, which does what the original does.

  infer_config      sizes and attention levels read from the keys and shapes.
  check_compatible  one sentence naming the first key where a file and a config disagree.
  convert           the nested float32 parameter dict (pure: nothing is written).
"""

import re
from typing import Any, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from procap_jax.convert import common
from procap_jax.models import vqgan

SOURCE = 'the taming VQGAN checkpoint'
IGNORED_PREFIXES = ('loss.',)
MARK = 'encoder.conv_in.weight'
# A level's attention block in torch names: encoder.down.{i}.attn.{j}.* / decoder.up.{i}.attn.{j}.*
_LEVEL_ATTN = re.compile(r'^(encoder\.down|decoder\.up)\.(\d+)\.attn\.\d+\.')
_INDEXED = re.compile(r'^(down|up|block|attn)_(\d+)$')


def torch_name(path: tuple[str, ...]) -> str:
  """The taming state-dict key of a flax parameter path.

  E.g. ('encoder', 'down_1', 'attn_0', 'q', 'kernel') -> 'encoder.down.1.attn.0.q.weight',
  ('decoder', 'mid', 'block_1', 'norm1', 'scale') -> 'decoder.mid.block_1.norm1.weight',
  ('quantize', 'embedding') -> 'quantize.embedding.weight'.
  """
  parts = []
  for i, part in enumerate(path[:-1]):
    m = _INDEXED.match(part)
    parts.append(f'{m[1]}.{m[2]}' if m and (i == 0 or path[i - 1] != 'mid') else part)
  leaf = path[-1]
  parts.append('embedding.weight' if leaf == 'embedding' else
               'weight' if leaf in ('kernel', 'scale') else leaf)
  return '.'.join(parts)


def _torch_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
  """HWIO conv kernels are OIHW in torch; every other parameter has the same shape."""
  if path[-1] == 'kernel':
    h, w, i, o = shape
    return (o, i, h, w)
  return tuple(shape)


def _model(model_config: Any) -> vqgan.VQGAN:
  return vqgan.frozen(model_config).model


def target_tree(model_config: Any) -> Any:
  """The VQGAN's parameter tree as ShapeDtypeStructs (unboxed), without computing anything."""
  model = _model(model_config)
  s = model.resolution
  abstract = jax.eval_shape(model.init, jax.random.key(0),
                            jax.ShapeDtypeStruct((1, s, s, 3), jnp.float32))
  return nn.meta.unbox(abstract['params'])


# taming's module registration order (VQModel, Encoder, Decoder, ResnetBlock, AttnBlock), which is
# the order of a checkpoint's keys; a name's rank decides among siblings, indices go numerically.
_ORDER = ('encoder', 'decoder', 'quantize', 'quant_conv', 'post_quant_conv', 'conv_in', 'down',
          'mid', 'up', 'norm_out', 'conv_out', 'block', 'attn', 'downsample', 'upsample',
          'block_1', 'attn_1', 'block_2', 'norm1', 'conv1', 'norm2', 'conv2', 'nin_shortcut',
          'norm', 'q', 'k', 'v', 'proj_out', 'conv', 'embedding', 'weight', 'bias')
_RANK = {name: i for i, name in enumerate(_ORDER)}


def _taming_order(key: str) -> tuple[int, ...]:
  return tuple(int(p) if p.isdigit() else _RANK.get(p, len(_ORDER)) for p in key.split('.'))


def expected_shapes(tree: Any) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
  """{torch key: (flax path, torch shape)} for a target tree, in taming's state-dict order."""
  table = {torch_name(path): (path, _torch_shape(path, leaf.shape))
           for path, leaf in flax.traverse_util.flatten_dict(tree).items()}
  return {k: table[k] for k in sorted(table, key=_taming_order)}


def _shape(state: Mapping[str, np.ndarray], key: str) -> tuple[int, ...]:
  if key not in state:
    raise common.ConversionError(f'{SOURCE} has no parameter {key!r}; it is not a taming VQModel '
                                 'state dict, or it is truncated')
  return tuple(np.shape(state[key]))


def _require_vqmodel(state: Mapping[str, np.ndarray]) -> None:
  """One sentence when the file is not a bare taming VQModel state dict."""
  if MARK in state:
    return
  prefixed = sorted(k[:-len(MARK)] for k in state if k.endswith('.' + MARK))
  if prefixed:
    raise common.ConversionError(
        f'{SOURCE} holds the VQGAN under the prefix {prefixed[0]!r} (e.g. a ProCap stage '
        'checkpoint); give the taming VQGAN .ckpt itself, or strip that prefix from the keys')
  raise common.ConversionError(f'{SOURCE} has no parameter {MARK!r}, so it is not a taming '
                               'VQModel state dict; give the VQGAN .ckpt file')


def infer_config(state: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """The VQGAN sizes and attention levels a taming state dict was built with.

  The image resolution and `attn_resolutions` are not stored in a checkpoint; the attention
  levels say which ones fit: level i runs at resolution // 2**i in the encoder and at
  (resolution // 2**(L-1)) * 2**(L-1-i) in the decoder, and has attention when that is in
  attn_resolutions (the f16 ImageNet VQGAN at 256 px with attn_resolutions (16,): levels (4,)).

  Args:
    state: flat taming state dict (`loss.*` keys may be present).

  Returns:
    dict(ch, ch_mult, num_res_blocks, z_channels, embed_dim, n_embed, attn_down_levels (encoder
    levels with attention blocks), attn_up_levels (decoder levels with attention blocks)).

  Raises:
    ConversionError: a key these sizes are read from is missing, or the encoder is double_z.
  """
  _require_vqmodel(state)
  ch = _shape(state, MARK)[0]
  levels = 0
  while f'encoder.down.{levels}.block.0.conv1.weight' in state:
    levels += 1
  if not levels:
    _shape(state, 'encoder.down.0.block.0.conv1.weight')
  widths = [_shape(state, f'encoder.down.{i}.block.0.conv1.weight')[0] for i in range(levels)]
  if any(w % ch for w in widths):
    raise common.ConversionError(f'{SOURCE}: level widths {widths} are not multiples of ch={ch}, '
                                 'so it is not a taming VQModel')
  num_res_blocks = 0
  while f'encoder.down.0.block.{num_res_blocks}.conv1.weight' in state:
    num_res_blocks += 1
  z_out = _shape(state, 'encoder.conv_out.weight')[0]
  embed_dim, z_channels = _shape(state, 'quant_conv.weight')[:2]
  if z_out != z_channels:
    raise common.ConversionError(
        f"{SOURCE}: 'encoder.conv_out.weight' gives {z_out} channels but 'quant_conv.weight' "
        f'takes {z_channels}; a double_z encoder, which the VQGAN port does not have')
  return dict(ch=ch, ch_mult=tuple(w // ch for w in widths), num_res_blocks=num_res_blocks,
              z_channels=z_channels, embed_dim=embed_dim,
              n_embed=_shape(state, 'quantize.embedding.weight')[0],
              attn_down_levels=tuple(i for i in range(levels)
                                     if f'encoder.down.{i}.attn.0.norm.weight' in state),
              attn_up_levels=tuple(i for i in range(levels)
                                   if f'decoder.up.{i}.attn.0.norm.weight' in state))


def _sizes(state: Mapping[str, np.ndarray]) -> str:
  """' (it has ch=..., ...)' for a size mismatch's message, or '' when the sizes are unreadable."""
  try:
    info = infer_config(state)
  except common.ConversionError:
    return ''
  names = ('ch', 'ch_mult', 'num_res_blocks', 'z_channels', 'embed_dim', 'n_embed')
  return f' (it has {", ".join(f"{k}={info[k]}" for k in names)})'


def _layout(model_config: Any) -> str:
  model = _model(model_config)
  return (f'resolution {model.resolution} with attn_resolutions '
          f'{tuple(model.attn_resolutions)}')


def _attention_hint(key: str, model_config: Any, in_file: bool) -> str:
  """Why a level attention key is in one side only, and the two ways out."""
  m = _LEVEL_ATTN.match(key)
  model = _model(model_config)
  i, n = int(m[2]), len(model.ch_mult)
  res = (model.resolution // 2 ** i if m[1] == 'encoder.down'
         else model.grid * 2 ** (n - 1 - i))
  part = 'encoder level' if m[1] == 'encoder.down' else 'decoder level'
  has = 'has no' if in_file else 'has'
  hint = (f'; there {part} {i} runs at {res} px and {has} attention, so the file was built at '
          "another resolution or attn_resolutions: set them so the checkpoint's attention levels "
          'match')
  if in_file:
    hint += (', or convert with drop_unused_attention=True to drop these weights as the '
             "original's strict=False load does")
  return hint


def _unused(state: Mapping[str, np.ndarray], expected: Mapping[str, Any],
            drop_unused_attention: bool) -> list[str]:
  """Keys of the file the model does not read, in the file's order (loss.* not counted)."""
  return [k for k in state if k not in expected and not k.startswith(IGNORED_PREFIXES)
          and not (drop_unused_attention and _LEVEL_ATTN.match(k))]


def _check(state: Mapping[str, np.ndarray], expected: Mapping[str, Any], model_config: Any,
           drop_unused_attention: bool) -> None:
  _require_vqmodel(state)
  for key, (_, shape) in expected.items():  # 1. sizes
    if key in state and tuple(np.shape(state[key])) != shape:
      raise common.ConversionError(
          f'{SOURCE}: {key!r} has shape {tuple(np.shape(state[key]))}, the model '
          f'({_layout(model_config)}) expects {shape}; the file is for another model size'
          f"{_sizes(state)}, set the tokenizer's model config to match")
  for key in _unused(state, expected, drop_unused_attention):  # 2. keys only the file has
    hint = (_attention_hint(key, model_config, True) if _LEVEL_ATTN.match(key)
            else '; it is not the VQGAN this config describes')
    raise common.ConversionError(
        f'{SOURCE} has {key!r} with shape {tuple(np.shape(state[key]))}, the model '
        f'({_layout(model_config)}) has no such parameter{hint}')
  for key, (_, shape) in expected.items():  # 3. keys only the model has
    if key not in state:
      hint = (_attention_hint(key, model_config, False) if _LEVEL_ATTN.match(key)
              else '; the file is truncated or for another model')
      raise common.ConversionError(
          f'{SOURCE} has no parameter {key!r}, which the model ({_layout(model_config)}) needs '
          f'with shape {shape}{hint}')


def check_compatible(state: Mapping[str, np.ndarray], model_config: Any, *,
                     drop_unused_attention: bool = False) -> None:
  """Raises one ConversionError naming the first key where `state` and the model disagree.

  Checked in this order: a shape that differs, a key only the file has (`loss.*` is ignored), a
  key only the model has; each in taming's state-dict order (the file's, for its own keys). Both
  shapes are named; a level attention block on one side only also names the level's resolution.

  Args:
    state: flat taming state dict.
    model_config: the `VQGAN` kwargs (`config.tokenizer.model`, dict or ConfigDict).
    drop_unused_attention: accept level attention blocks the model does not have (ignored, as the
      original's `load_state_dict(strict=False)` ignores them).
  """
  _check(state, expected_shapes(target_tree(model_config)), model_config, drop_unused_attention)


def convert(state: Mapping[str, np.ndarray], model_config: Any, *,
            drop_unused_attention: bool = False) -> dict[str, Any]:
  """The `VQGAN(**model_config)` parameters (nested dict of float32 numpy) of a taming state dict.

  Args:
    state: flat taming `VQModel` state dict (e.g. `torch_files.state_dict(path)`), any float
      dtype; `loss.*` keys are ignored.
    model_config: the `VQGAN` kwargs (`config.tokenizer.model`, dict or ConfigDict).
    drop_unused_attention: see `check_compatible`.

  Returns:
    {'encoder': ..., 'quant_conv': ..., 'quantize': {'embedding': [K, D]}, ...}, the tree of
    `VQGAN.init(...)['params']` unboxed.

  Raises:
    ConversionError: the first key where the file and the model disagree, in one sentence.
  """
  tree = target_tree(model_config)
  expected = expected_shapes(tree)
  _check(state, expected, model_config, drop_unused_attention)
  flat = {}
  for key, (path, shape) in expected.items():
    value = common.take(state, key, shape, source=SOURCE)
    flat[path] = value.transpose(2, 3, 1, 0) if path[-1] == 'kernel' else value  # OIHW -> HWIO
  params = flax.traverse_util.unflatten_dict(flat)
  common.check_tree(params, tree, what='the VQGAN')
  return params
