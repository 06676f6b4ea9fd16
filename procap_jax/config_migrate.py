"""Configs saved by older runs, read in today's schema: one function, `migrate`.

A run's config.json holds the config it was made with. Keys added to the schema since get the
value that reproduces what such a run did, so library code reads every key as it is
(`config.a.b`, never `config.a.get('b', default)`; tests/layers_test.py checks that).
"""

import ml_collections


# Config keys added to the schema after runs were saved, with the value that reproduces what a
# run saved without the key did. `migrate` fills them; the table in its docstring says why.
ADDED_LATER = {
    'data.encoder_text': 'words',
    'data.bpe_merges_file': '',
    'data.beam_options': '',
    'data.feature_cache': False,
    'data.feature_cache_dtype': 'float32',
    'tokenizer.init_from': '',
    'tokenizer.init_drop_unused_attention': False,
    'tokenizer.frozen_dtype': 'float32',
    'tokenizer.model.feature_pixels': 0,
    'tokenizer.train.clip': 1.0,
    'tokenizer.train.codebook_decay': 0.99,
    'tokenizer.train.dead_code_threshold': 0.03,
    'tokenizer.train.frames_per_example': 1,
    'tokenizer.train.frames_chunk': 0,
    'pretrain.init_from': '',
    'pretrain.clip_fp16_round_trip': False,
    'pretrain.csy_normalisation': 'code',
    'pretrain.fused_forwards': True,
    'pretrain.binary_inputs': 'masked',
    'pretrain.model.embedding_std': 1.0,
    'pretrain.model.frame_difference': 'none',
    'pretrain.model.remat': False,
    'pretrain.model.scan_blocks': False,
    'pretrain.model.scan_keep_dense': False,
    'pretrain.model.attention_chunk': 0,
    'pretrain.model.attention_group': 0,
    'pretrain.model.pixel_stem': 0,
    'pretrain.train.decay_steps': 0,
    'pretrain.train.micro_batches': 1,
    'caption.init_from': '',
    'caption.model.kind': 'procap',
    'caption.model.duda': {'input': 'pixels', 'stem_patch': 8, 'stem_channels': (128, 128),
                           'stem_convs': 0, 'coords': False, 'attention_hidden': 128,
                           'feature_dim': 128, 'embed': 64, 'hidden': 128,
                           'attention_norm': 'softmax'},
    'caption.train.loss_reduction': 'sum',
    'caption.train.t_total_factor': 1.0,
    'caption.train.micro_batches': 1,
    'caption.train.scene_pairs': False,
    'caption.model.change_head': 0,
    'caption.model.memory_frames': 'all',
    'caption.train.change_loss': 0.0,
    'caption.decoding.alpha': 0.0,
    'caption.decoding.encode_rows': 0,
    'mesh.cpu_devices': 1,
    'weight_files': {'strict': False, 'max_expansion': 4.0},
}
# Keys that left the schema: pretrain.model.num_frames is derived, T = data.num_keyframes + 2.
REMOVED_LATER = ('pretrain.model.num_frames',)


def migrate(config) -> ml_collections.ConfigDict:
  """A config saved by an older run (a ConfigDict or its JSON dict) in today's schema.

  Every key of ADDED_LATER it lacks gets the value that reproduces what the run did (a dict
  value fills the missing entries of that section); keys of REMOVED_LATER are dropped. A key is
  filled only where its parent section is a dict, so a damaged file stays as damaged (and is
  refused by whoever reads the missing section). A current config comes back equal (migrate is
  idempotent); the argument is not changed.

  | key                                  | value     | what runs saved without it did        |
  |--------------------------------------|-----------|----------------------------------------|
  | data.encoder_text                    | 'words'   | stage-1 text in caption-vocabulary ids |
  | data.bpe_merges_file                 | ''        | (read only with 'clip_bpe')            |
  | data.beam_options                    | ''        | built missing datasets locally         |
  | data.feature_cache                   | False     | encoded the frames every step          |
  | data.feature_cache_dtype             | 'float32' | (read only with the cache)             |
  | tokenizer.init_from, pretrain.init_from, caption.init_from | '' | started from random init |
  | tokenizer.init_drop_unused_attention | False     | (read only with init_from)             |
  | tokenizer.frozen_dtype               | 'float32' | the frozen tokenizer in float32        |
  | tokenizer.train.clip                 | 1.0       | the values the first schema hard-coded |
  | tokenizer.train.codebook_decay       | 0.99      |   "                                    |
  | tokenizer.train.dead_code_threshold  | 0.03      |   "                                    |
  | tokenizer.train.frames_per_example   | 1         |   "                                    |
  | tokenizer.train.frames_chunk         | 0         | all frames of a step at once           |
  | pretrain.clip_fp16_round_trip        | False     | (read only with a CLIP init_from)      |
  | pretrain.csy_normalisation           | 'code'    | the original's normalisation           |
  | pretrain.fused_forwards              | True      | one batch-3B forward (same losses)     |
  | pretrain.binary_inputs               | 'masked'  | the original's binary-head inputs      |
  | pretrain.model.embedding_std         | 1.0       | the original's N(0, 1) tables          |
  | pretrain.model.frame_difference      | 'none'    | the original's frame tokens            |
  | pretrain.model.remat, scan_blocks, scan_keep_dense | False | blocks unrolled (same values) |
  | pretrain.model.attention_chunk, attention_group | 0 | attention all at once (same values)  |
  | pretrain.train.decay_steps           | 0         | the original's constant lr             |
  | pretrain.train.micro_batches, caption.train.micro_batches | 1 | one batch per step        |
  | caption.model.kind                   | 'procap'  | ProCap's captioner (no DUDA then)      |
  | caption.model.duda                   | the first | DUDA (runs before coords, stem_convs: |
  |   (each entry missing)               | DUDA's    |   no convolutions, no coordinates,     |
  |                                      |           |   softmax attention maps)              |
  | caption.train.loss_reduction         | 'sum'     | the original's summed KL               |
  | caption.train.t_total_factor         | 1.0       | schedule length = steps                |
  | caption.train.scene_pairs            | False     | batches of independent pairs           |
  | caption.model.change_head            | 0         | no change head                         |
  | caption.train.change_loss            | 0.0       |   "                                    |
  | caption.model.memory_frames          | 'all'     | the decoder read every frame slot      |
  | caption.decoding.alpha               | 0.0       | beam scores = sum of log-probs         |
  | caption.decoding.encode_rows         | 0         | the whole batch encoded at once        |
  | mesh.cpu_devices                     | 1         | a CPU host ran as one device           |
  | weight_files.strict                  | False     | weight files read for their tensors    |
  | weight_files.max_expansion           | 4.0       |   "                                    |
  | pretrain.model.num_frames (dropped)  |           | T = data.num_keyframes + 2, derived    |

  Args:
    config: a run's config.json as a dict, or a ConfigDict.

  Returns:
    A new ConfigDict (JSON lists as tuples).
  """
  raw = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else config
  return ml_collections.ConfigDict(migrated_json(raw))


def migrated_json(saved: dict) -> dict:
  """`migrate` on a config as JSON, as a new dict (JSON lists as tuples), for the comparisons of
  a saved config with the current one (`config_lib.workdir_differences`)."""
  tree = _tuples(saved)
  for dotted, value in ADDED_LATER.items():
    *parents, leaf = dotted.split('.')
    node = _section(tree, parents)
    if node is None:
      continue
    if isinstance(value, dict):
      if leaf not in node:
        node[leaf] = dict(value)
      elif isinstance(node[leaf], dict):
        for k, v in value.items():
          node[leaf].setdefault(k, v)
    else:
      node.setdefault(leaf, value)
  for dotted in REMOVED_LATER:
    *parents, leaf = dotted.split('.')
    node = _section(tree, parents)
    if node is not None:
      node.pop(leaf, None)
  return tree


def _section(tree, path: list[str]) -> dict | None:
  """The dict at `path` in `tree`, or None when a part is missing or not a dict."""
  node = tree
  for part in path:
    node = node.get(part) if isinstance(node, dict) else None
  return node if isinstance(node, dict) else None


def _tuples(x):
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  return x
