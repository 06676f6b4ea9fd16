"""A released ProCap stage-2 checkpoint -> the parameters of our `ProCapModel`.

train_stage2.py saves `{'model': MMVID_IDC.state_dict(), 'model_cfg', 'opt', 'epoch',
'optimizer'}`; `torch_files.state_dict` returns its `model` entry flat. Its parts (spec 5.1-5.3):

  torch key                                        flax path                          note
  intermediate_generator.<stage-1 BERT key>        encoder/...                        stage 1
  intermediate_generator.vae.*                     (none)                             the VQGAN
  intermediate_generator.transformer.transformer.
    resblocks.{i}.attn_mask                        (none)                             buffer
  mlp.0.{weight,bias}                              memory_mlp/dense_0/{kernel,bias}   transpose
  mlp.2.{weight,bias}                              memory_mlp/dense_1/{kernel,bias}   transpose
  mlp.3.{weight,bias}                              memory_mlp/norm/{scale,bias}
  text_decoder.decoder.out.{weight [V, H],bias}    decoder/output/{kernel [H, V],bias} (also
                                                   the tied token embedding)          transpose
  text_decoder.decoder.layers.{i}.
    selfattn.layer.w{q,k,v,o}.weight               decoder/blocks_{i}/self_attn/
                                                   {query,key,value,out}/kernel       transpose
    selfattn.layernorm.{gamma,beta}                .../norm_self/{scale,bias}
    attention.layer.w{q,k,v,o}.weight              .../cross_attn/...                 transpose
    attention.layernorm.{gamma,beta}               .../norm_cross/{scale,bias}
    feedforward.layer.linear{1,2}.{weight,bias}    .../ffn_{in,out}/{kernel,bias}     transpose
    feedforward.layernorm.{gamma,beta}             .../norm_ffn/{scale,bias}
  text_decoder.loss_func.one_hot                   (none)                             buffer

The stage-1 part is `convert.procap_stage1.encoder_params` with the key prefix
`intermediate_generator.`; the frozen VQGAN converts from its own taming checkpoint
(`convert.taming`). Every other key must be read: an unknown one is an error.

The converted weights reproduce the original's numbers with the paper presets' code paths
(`attention_scale='d_model'`, `qkv_bias=False`, `layernorm='unbiased_std'`, `text_slot='code'`,
`stage2_mask='code'`, `frame_difference='none'`); `tests/parity_stage2_test.py` checks logits,
loss, greedy captions and one optimiser step against the original's own code.
"""

from typing import Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from procap_jax import config_lib
from procap_jax.convert import common
from procap_jax.convert import procap_stage1
from procap_jax.data import vocab as vocab_lib
from procap_jax.models import captioner as captioner_lib

ENCODER_PREFIX = procap_stage1.STAGE2_PREFIX  # 'intermediate_generator.'
VQGAN_PREFIX = 'intermediate_generator.vae.'  # the frozen tokenizer, converted from its own file
OUTPUT = 'text_decoder.decoder.out'
_LAYER = 'text_decoder.decoder.layers.{}.'
_ATTENTION = (('selfattn', 'self_attn', 'norm_self'), ('attention', 'cross_attn', 'norm_cross'))
_PROJECTIONS = (('wq', 'query'), ('wk', 'key'), ('wv', 'value'), ('wo', 'out'))


def is_buffer(key: str) -> bool:
  """Buffers of the original model (no parameters): the encoder's attention-mask copies and the
  label-smoothing target row."""
  return key == 'text_decoder.loss_func.one_hot' or (
      key.startswith(ENCODER_PREFIX + 'transformer.') and key.endswith('.attn_mask'))


class _Recorder(Mapping):
  """A read-only view of a state dict that remembers which keys were read."""

  def __init__(self, state: Mapping[str, np.ndarray]):
    self._state, self.used = state, set()

  def __getitem__(self, key: str) -> np.ndarray:
    value = self._state[key]
    self.used.add(key)
    return value

  def __iter__(self) -> Iterator[str]:
    return iter(self._state)

  def __len__(self) -> int:
    return len(self._state)


def captioner_params(state: Mapping[str, np.ndarray], config: ml_collections.ConfigDict, *,
                     source: str = 'the ProCap stage-2 checkpoint') -> dict:
  """Nested numpy params of `models.captioner.from_config(config)` from a stage-2 state dict.

  Args:
    state: the flat `model` state dict (`torch_files.state_dict`).
    config: the run's config; `config.caption.model` and `config.pretrain.model` must describe
      the checkpoint's model (vocab_size = the official word2idx file's size).
    source: how the file is named in errors.

  Returns:
    {'encoder': ..., 'memory_mlp': ..., 'decoder': ...} (float32 numpy leaves).

  Raises:
    ConversionError: one sentence naming the first missing, unexpected or mis-shaped key, or a
      vocabulary that does not fit the checkpoint's output layer.
  """
  m = config.caption.model
  _check_vocabulary(state, config, source)
  reader = _Recorder(state)
  kwargs = config_lib.encoder_kwargs(config)
  params = {'encoder': procap_stage1.encoder_params(reader, kwargs, ENCODER_PREFIX, source=source),
            'memory_mlp': _memory_mlp(reader, kwargs['width'], m.hidden, source),
            'decoder': _decoder(reader, m, source)}
  # Keys under ENCODER_PREFIX are procap_stage1's to check (it ignores the VQGAN and buffers).
  unused = [k for k in common.unused_keys(state, reader.used, (ENCODER_PREFIX,))
            if not is_buffer(k)]
  if unused:
    raise common.ConversionError(
        f'{source} has {unused[0]!r} (shape {tuple(np.shape(state[unused[0]]))})'
        f'{f" and {len(unused) - 1} more unused keys" if len(unused) > 1 else ""}, which the '
        f'captioner does not use; the file is for another model size (config.caption.model / '
        'config.pretrain.model) or not a ProCap stage-2 checkpoint')
  model = captioner_lib.from_config(config)  # a ProCap checkpoint holds a ProCap captioner
  gh, gw = kwargs['grid']
  feats = jnp.zeros([1, gh, gw, kwargs['feature_dim']], jnp.float32)
  tokens = jnp.zeros([1, m.max_len], jnp.int32)
  expected = jax.eval_shape(lambda: model.init(jax.random.key(0), feats, feats, tokens))
  common.check_tree(params, expected['params'], what='the captioner')
  return params


def _check_vocabulary(state: Mapping[str, np.ndarray], config: ml_collections.ConfigDict,
                      source: str) -> None:
  """The output layer's rows are the vocabulary: config and word2idx file must agree."""
  weight = common.take(state, f'{OUTPUT}.weight', source=source)
  rows, hidden = weight.shape
  want = (config.caption.model.vocab_size, config.caption.model.hidden)
  path = config.data.word2idx_file
  if path:
    words = vocab_lib.Vocab.load(path).size
    if words != rows:
      raise common.ConversionError(
          f'{source}: {OUTPUT + ".weight"!r} has shape {(rows, hidden)}, but the vocabulary '
          f'{path} has {words} entries, so the captioner needs {(words, hidden)}; give the '
          'word2idx file the checkpoint was trained with (e.g. the official clevr_word2idx.json)')
  if (rows, hidden) != want:
    raise common.ConversionError(
        f'{source}: {OUTPUT + ".weight"!r} has shape {(rows, hidden)}, the captioner '
        f'(config.caption.model vocab_size, hidden) expects {want}; set them to the checkpoint\'s '
        'vocabulary size and decoder width')


def _memory_mlp(state: Mapping[str, np.ndarray], width: int, hidden: int, source: str) -> dict:
  return {'dense_0': common.linear(state, 'mlp.0', width, width, source=source),
          'dense_1': common.linear(state, 'mlp.2', width, hidden, source=source),
          'norm': common.layer_norm(state, 'mlp.3', hidden, source=source)}


def _decoder_norm(state: Mapping[str, np.ndarray], prefix: str, width: int, source: str) -> dict:
  """The densecap LayerNorm `gamma`/`beta` -> our DecoderLayerNorm `scale`/`bias`."""
  return {'scale': common.take(state, f'{prefix}.gamma', (width,), source=source),
          'bias': common.take(state, f'{prefix}.beta', (width,), source=source)}


def _decoder(state: Mapping[str, np.ndarray], m: ml_collections.ConfigDict, source: str) -> dict:
  h = m.hidden
  out = {'output': {'kernel': common.take(state, f'{OUTPUT}.weight', (m.vocab_size, h),
                                          source=source).T,
                    'bias': common.take(state, f'{OUTPUT}.bias', (m.vocab_size,), source=source)}}
  for i in range(m.layers):
    layer = _LAYER.format(i)
    block = {}
    for theirs, attn, norm in _ATTENTION:
      block[attn] = {ours: common.linear(state, f'{layer}{theirs}.layer.{w}', h, h, bias=False,
                                         source=source)
                     for w, ours in _PROJECTIONS}
      block[norm] = _decoder_norm(state, f'{layer}{theirs}.layernorm', h, source)
    ffn = f'{layer}feedforward.'
    block['ffn_in'] = common.linear(state, ffn + 'layer.linear1', h, m.ffn, source=source)
    block['ffn_out'] = common.linear(state, ffn + 'layer.linear2', m.ffn, h, source=source)
    block['norm_ffn'] = _decoder_norm(state, ffn + 'layernorm', h, source)
    out[f'blocks_{i}'] = block
  return out
