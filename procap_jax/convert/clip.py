"""OpenAI CLIP ViT visual blocks -> the stage-1 encoder's `resblocks_{i}` (spec 4.1 and 10).

Dimension legend: D width, F MLP width (4 D), L encoder depth.

What the original does with `ViT-B-32.pt` (`OpenAICLIPTransformer` and `build_model` in
src/mmvid_pytorch/transformers/clip_model.py): `torch.jit.load(path).state_dict()` goes to
`build_model(sd, vision_layers=L)`, which builds a CLIP with L visual blocks and
heads = width // 64, casts the fresh model's Linear, Conv and attention projection tensors to
float16 (`convert_weights`), then REPLACES every parameter's `.data` by the file's tensor of that
name (`param.data = sd[name]`), and keeps `visual.transformer`, cast with `.float()`. So:
  - blocks 0..L-1 are read: the first L when the file has more (Spot-the-Diff uses 4 of 12);
  - the heads follow the width (the file does not record them);
  - the values are the file's own, exactly. The float16 cast hits the fresh tensors, which are
    then replaced: OpenAI's float16 release widens exactly, and a float32 file keeps its float32
    values (tests/parity/gen_stage1.py runs the original loader on a float32 archive and prints
    max |loaded - file| = 0, max |loaded - fp16(file)| = 4.9e-4).
`fp16_round_trip=True` rounds the tensors that `convert_weights` casts (attention in_proj and
out_proj, mlp c_fc and c_proj, weights and biases; not the LayerNorms) through float16 instead:
what OpenAI's own `clip.load(jit=False)` gives for a float32 file, whose `load_state_dict` copies
into the cast model. The default, False, is the original's; on OpenAI's float16 release both give
the same values.

Key layout of one block (layers.py): `visual.transformer.resblocks.{i}.` + ln_1, attn.in_proj_weight
[3D, D] / in_proj_bias, attn.out_proj, ln_2, mlp.c_fc [F, D], mlp.c_proj [D, F]; Linear weights
are transposed into Dense kernels. `block_params` also serves the stage-1 converter, whose blocks
sit under `transformer.transformer.resblocks.{i}.`.
"""

from typing import Any, Mapping

import numpy as np

from procap_jax.convert import common

PREFIX = 'visual.transformer.resblocks.'
SOURCE = 'the CLIP file'
# The tensors OpenAI's convert_weights casts to float16, inside one block.
_HALF_IN_CLIP = ('attn.in_proj_weight', 'attn.in_proj_bias', 'attn.out_proj.weight',
                 'attn.out_proj.bias', 'mlp.c_fc.weight', 'mlp.c_fc.bias', 'mlp.c_proj.weight',
                 'mlp.c_proj.bias')


def file_depth(state: Mapping[str, np.ndarray], prefix: str = PREFIX) -> int:
  """Number of consecutive blocks 0, 1, ... under `prefix`."""
  depth = 0
  while f'{prefix}{depth}.attn.in_proj_weight' in state:
    depth += 1
  return depth


def check_vit(state: Mapping[str, np.ndarray], source: str = SOURCE) -> None:
  """Raises ConversionError (one sentence) unless `state` holds a CLIP ViT's visual blocks."""
  if f'{PREFIX}0.attn.in_proj_weight' in state:
    return
  if any(k.startswith('visual.layer1.') for k in state):
    raise common.ConversionError(
        f'{source} is a ResNet CLIP (it has visual.layer1.*); the stage-1 encoder takes the '
        'blocks of a ViT CLIP such as ViT-B-32.pt')
  raise common.ConversionError(
      f'{source} has no {PREFIX}0.attn.in_proj_weight, so it is not an OpenAI CLIP ViT file '
      '(e.g. ViT-B-32.pt)')


def _round_half(value: np.ndarray) -> np.ndarray:
  return value.astype(np.float16).astype(np.float32)


def block_params(state: Mapping[str, np.ndarray], prefix: str, width: int, hidden: int, *,
                 fp16_round_trip: bool = False, source: str = SOURCE) -> dict:
  """One CLIP `ResidualAttentionBlock` under `prefix` (ending in '.') -> its flax params.

  Args:
    state: flat state dict.
    prefix: e.g. 'visual.transformer.resblocks.3.'.
    width: D.
    hidden: F, the MLP width.
    fp16_round_trip: round the tensors OpenAI's convert_weights casts through float16.
    source: how the file is named in errors.

  Returns:
    {'ln_1', 'attn': {'in_proj', 'out_proj'}, 'ln_2', 'mlp': {'c_fc', 'c_proj'}} of float32
    numpy arrays, the layout of `layers.ResidualAttentionBlock`.
  """
  if fp16_round_trip:
    state = {**state, **{prefix + k: _round_half(common.take(state, prefix + k, source=source))
                         for k in _HALF_IN_CLIP}}
  attn = {'in_proj': {'kernel': common.take(state, f'{prefix}attn.in_proj_weight',
                                            (3 * width, width), source=source).T,
                      'bias': common.take(state, f'{prefix}attn.in_proj_bias', (3 * width,),
                                          source=source)},
          'out_proj': common.linear(state, f'{prefix}attn.out_proj', width, width, source=source)}
  return {'ln_1': common.layer_norm(state, f'{prefix}ln_1', width, source=source),
          'attn': attn,
          'ln_2': common.layer_norm(state, f'{prefix}ln_2', width, source=source),
          'mlp': {'c_fc': common.linear(state, f'{prefix}mlp.c_fc', width, hidden, source=source),
                  'c_proj': common.linear(state, f'{prefix}mlp.c_proj', hidden, width,
                                          source=source)}}


def block_keys(prefix: str) -> list[str]:
  """The torch names `block_params` reads under `prefix`."""
  return [prefix + k for k in ('ln_1.weight', 'ln_1.bias', 'ln_2.weight', 'ln_2.bias')
          + _HALF_IN_CLIP]


def encoder_blocks(state: Mapping[str, np.ndarray], model_kwargs: Mapping[str, Any], *,
                   fp16_round_trip: bool = False, file_heads: int | None = None,
                   source: str = SOURCE) -> dict:
  """The first `depth` visual blocks of a CLIP ViT file as the encoder's `resblocks_{i}`.

  Args:
    state: flat state dict of the CLIP file (`torch_files.state_dict`).
    model_kwargs: the `ProcedureEncoder` kwargs (config.pretrain.model); uses width, depth,
      heads and mlp_ratio.
    fp16_round_trip: see the module docstring (default False = the original).
    file_heads: the heads the file's blocks were trained with; None = width // 64, the rule of
      OpenAI's build_model and of the original (the file does not record them).
    source: how the file is named in errors.

  Returns:
    {'resblocks_0': {...}, ..., 'resblocks_{depth-1}': {...}} (float32 numpy), to merge into a
    fresh encoder tree (`init_encoder`).

  Raises:
    ConversionError: not a ViT CLIP file, fewer blocks than depth, or another width, MLP
      width or number of heads (one sentence naming the key and both shapes).
  """
  check_vit(state, source)
  width, depth = int(model_kwargs['width']), int(model_kwargs['depth'])
  key = f'{PREFIX}0.ln_1.weight'
  got = tuple(np.shape(common.take(state, key, source=source)))
  if got != (width,):
    raise common.ConversionError(
        f'{source}: {key!r} has shape {got}, the encoder expects ({width},) (pretrain.model.width'
        f'={width}); the CLIP blocks are {got[0] if got else "?"} wide')
  heads = file_heads or width // 64
  if int(model_kwargs['heads']) != heads:
    raise common.ConversionError(
        f'{source} has {width}-wide blocks with {heads} heads (width // 64, as the original '
        f'builds them), the encoder has {model_kwargs["heads"]}; set pretrain.model.heads={heads}')
  available = file_depth(state)
  if available < depth:
    raise common.ConversionError(
        f'{source} has {available} visual blocks, the encoder needs {depth} (pretrain.model.'
        f'depth); use a file with at least {depth} blocks or a smaller depth')
  hidden = int(model_kwargs['mlp_ratio']) * width
  return {f'resblocks_{i}': block_params(state, f'{PREFIX}{i}.', width, hidden,
                                         fp16_round_trip=fp16_round_trip, source=source)
          for i in range(depth)}


def init_encoder(params: Any, state: Mapping[str, np.ndarray], model_kwargs: Mapping[str, Any],
                 **kwargs) -> Any:
  """A freshly initialised encoder tree (boxed or not) with its blocks from the CLIP file.

  Every other parameter (embeddings, heads, conv_to_embedding) keeps its init, as in the
  original, whose BERT takes only the transformer from CLIP. kwargs go to `encoder_blocks`.
  """
  return common.merge_into(params, encoder_blocks(state, model_kwargs, **kwargs),
                           what='the stage-1 encoder')
