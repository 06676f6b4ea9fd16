"""Input pipeline: grain over `tfds.data_source`, the same batch contract for every dataset.

Batch contract (host numpy; B batch, S = config.data.image_size, T = config.data.num_keyframes + 2,
L = config.data.max_caption_len):

  before          uint8  [B, S, S, 3]     the before image
  after           uint8  [B, S, S, 3]     the after image
  keyframes       uint8  [B, T, S, S, 3]  sampled keyframes; [:, 0] = before, [:, -1] = after
  keyframe_index  int32  [B, T]           indices into the 9-frame sequence, e.g. [0, a, b, 8]
  caption_in      int32  [B, L]           decoder tokens [BOS] w1..wn [EOS] [PAD]...
  encoder_text    int32  [B, L]           stage-1 encoder text, 0 = padding: caption word ids
                                          (data.encoder_text 'words') or CLIP BPE ids ('clip_bpe')
  change_type     int32  [B]              none,color,material,add,drop,move,other
  example_index   int32  [B]              index of the record in its split
  valid           bool   [B]              False on padding rows of the last eval batch

With the tokenizer feature cache (`data.feature_cache`, stages 1 and 2: `feature_cache.py`) the
batch also carries the frozen tokenizer's encodings of `keyframes`, gathered by keyframe_index
(h x w token grid, C feature channels, N = h*w):

  keyframe_features  float  [B, T, h, w, C]  features (float32 or float16: the cache's dtype)
  keyframe_codes     int32  [B, T, N]        codes

Randomness (caption choice, keyframe draw) is seeded per (seed, example index, epoch) inside a
grain `random_map`, and the training iterator is a grain dataset whose state (`get_state`) is
saved with every checkpoint, so a resumed run sees exactly the batches it would have seen.
The training process never imports TensorFlow.
"""

import functools
import json
import os
from typing import Any, Iterable, Iterator

import cv2
import grain
import ml_collections
import numpy as np

from procap_jax import config_lib
from procap_jax import errors
from procap_jax.data import bpe
from procap_jax.data import datasets
from procap_jax.data import vocab as vocab_lib
from procap_jax.procedure import interpolation
from procap_jax.procedure import sampling
from procap_jax.procedure import scores as scores_lib

CHANGE_TYPES = ('none', 'color', 'material', 'add', 'drop', 'move', 'other')
NUM_SOURCE_FRAMES = 9


def data_dir(config, workdir: str) -> str:
  """`config.data.data_dir`, or `<workdir>/data` when empty."""
  return config.data.data_dir or os.path.join(workdir, 'data')


def dataset_dir(config, workdir: str) -> str:
  """The prepared dataset's version directory (vocabulary and scores files live there)."""
  return datasets.dataset_dir(config.data.name, config.data.builder_config,
                              data_dir(config, workdir))


@functools.lru_cache(maxsize=16)
def _source(name: str, builder_config: str, directory: str, split: str):
  return datasets.data_source(name, builder_config, directory, split)


def open_source(config, workdir: str, split: str):
  """Random-access records of a prepared split (UserError when the dataset is not built)."""
  return _source(config.data.name, config.data.builder_config, data_dir(config, workdir), split)


def load_vocab(config, workdir: str) -> vocab_lib.Vocab:
  """The decoder vocabulary: `config.data.word2idx_file`, else `word2idx.json` next to the
  dataset, else built from the train captions and saved there."""
  if config.data.word2idx_file:
    return _load_vocab_file(config.data.word2idx_file)
  path = os.path.join(dataset_dir(config, workdir), 'word2idx.json')
  if not os.path.exists(path):
    src = open_source(config, workdir, 'train')
    captions = [_text(c) for i in range(len(src)) for c in src[i]['captions']]
    vocab_lib.Vocab.build(captions, min_word_count=config.data.min_word_count).save(path)
  return _load_vocab_file(path)


def resolve(config: ml_collections.ConfigDict, workdir: str) -> ml_collections.FrozenConfigDict:
  """The config a run trains or evaluates with, resolved once by the entry point that builds the
  run (main, the convert command): the vocabulary sizes filled (`resolve_vocab_sizes`, in place
  in `config` too, so its config.json records them), then frozen. The library code below reads
  what it is given and changes nothing; T is `config_lib.frame_slots` and the 'auto' compute
  path is resolved before (`config_lib.resolve_compute_path`, it needs no dataset)."""
  resolve_vocab_sizes(config, workdir)
  return ml_collections.FrozenConfigDict(config)


def resolve_vocab_sizes(config, workdir: str) -> None:
  """Fills the vocabulary sizes left at 0 in the config, in place. Idempotent; a saved run's
  config.json holds them filled (read again, nothing is loaded).

  The encoder text table gets CLIP BPE's 49408 ids with `data.encoder_text='clip_bpe'` (any
  other non-zero size is a UserError), else the caption vocabulary's size, as the decoder vocab.
  """
  config_lib.check_encoder_text(config)
  if config.data.encoder_text == 'clip_bpe':
    config.pretrain.model.text_vocab_size = bpe.VOCAB_SIZE
  size = None
  for section in (config.pretrain.model, config.caption.model):
    key = 'text_vocab_size' if 'text_vocab_size' in section else 'vocab_size'
    if not section[key]:
      size = size or load_vocab(config, workdir).size
      section[key] = size


@functools.lru_cache(maxsize=8)
def _load_vocab_file(path: str) -> vocab_lib.Vocab:
  return vocab_lib.Vocab.load(path)


def scores_path(config, workdir: str) -> str:
  """The confidence scores file: `config.data.scores_file`, else the authors' official file
  copied next to the dataset by a real-dataset builder, else ours computed next to it."""
  if config.data.scores_file:
    return config.data.scores_file
  official = os.path.join(dataset_dir(config, workdir), 'similarity_scores.json')
  if os.path.exists(official):
    return official
  return os.path.join(dataset_dir(config, workdir),
                      f'scores_{config.data.frame_source}_{config.data.scores_feature}.json')


@functools.lru_cache(maxsize=8)
def _load_scores(path: str):
  return scores_lib.load_scores(path)


def load_scores(config, workdir: str) -> dict | None:
  """Confidence scores by pair id, or None when the sampler does not use them."""
  if config.data.sampler != 'confidence':
    return None
  path = scores_path(config, workdir)
  if not os.path.exists(path):
    if config.data.scores_file:
      raise errors.UserError(f'scores file {path} does not exist; fix config.data.scores_file')
    return None
  return _load_scores(path)


def _text(x: Any) -> str:
  if isinstance(x, bytes):
    try:
      return x.decode('utf-8')
    except UnicodeDecodeError:
      raise errors.UserError('a caption in the dataset is not valid UTF-8; rebuild the dataset '
                             'from UTF-8 annotation files') from None
  return str(x)


def load_split_info(config, split: str, workdir: str) -> list[dict]:
  """Host-side facts per record: pair_id, scene_id, change_type (int), captions (list[str]),
  change_params (the decoded JSON truth of the synthetic benchmark; {} for real datasets)."""
  src = open_source(config, workdir, split)
  return [_record_info(src[i]) for i in range(len(src))]


def change_groups(info: list[dict], ids: Iterable[str]) -> dict[str, list[str]]:
  """'change' (type != none) and 'no_change' pair ids when the ids have both (any dataset whose
  records label some pairs `none`: CLEVR-Change, LEVIR-CC's changeflag, the synthetic set), then
  the ids by change type name (present types only)."""
  kept = set(ids)
  types: dict[str, list[str]] = {}
  for rec in info:
    if rec['pair_id'] in kept:
      types.setdefault(CHANGE_TYPES[rec['change_type']], []).append(rec['pair_id'])
  groups: dict[str, list[str]] = {}
  change = [i for name, members in types.items() if name != 'none' for i in members]
  if change and types.get('none'):  # otherwise one of them would just repeat 'all'
    groups['change'] = change
    groups['no_change'] = list(types['none'])
  return groups | types


def _record_info(record: dict) -> dict:
  return {'pair_id': _text(record['pair_id']), 'scene_id': int(record['scene_id']),
          'change_type': int(record['change_type']),
          'captions': [_text(c) for c in record['captions']],
          'change_params': change_params(record)}


def change_params(record: dict) -> dict:
  """A record's `change_params`, decoded from JSON ({} when it has none)."""
  raw = record.get('change_params', b'{}')
  try:
    params = json.loads(_text(raw) or '{}')
  except json.JSONDecodeError:
    raise errors.UserError(f'the change_params of record {_text(record["pair_id"])} are not '
                           'valid JSON; rebuild the dataset') from None
  return params if isinstance(params, dict) else {}


def resize(img: np.ndarray, size: int) -> np.ndarray:
  """Any HxW(x1|3|4) uint8 image -> RGB [size, size, 3] (area downsampling, bilinear up)."""
  img = np.asarray(img)
  if img.ndim == 2:
    img = np.stack([img] * 3, -1)
  img = img[..., :3]
  if img.shape[0] == size and img.shape[1] == size:
    return img.astype(np.uint8)
  interp = cv2.INTER_AREA if img.shape[0] > size else cv2.INTER_LINEAR
  return cv2.resize(img, (size, size), interpolation=interp).astype(np.uint8)


def _interpolated(record: dict, before: np.ndarray, after: np.ndarray, source: str):
  """The 9 frames of `data.frame_source` (any size; frame 0 = before, 8 = after)."""
  if source == 'crossfade':
    return interpolation.interpolate(before, after, NUM_SOURCE_FRAMES, method='crossfade')
  key = {'frames': 'frames', 'oracle': 'oracle_frames'}[source]
  frames = record[key]
  if len(frames) == 0:
    raise errors.UserError(f'this dataset has no {key!r}; set config.data.frame_source to '
                           "'frames' or 'crossfade' (oracle frames exist for synthetic data "
                           'only)')
  return frames


def source_frames(config, record: dict) -> np.ndarray:
  """uint8 [9, S, S, 3]: every image `keyframes` can hold for this record, by keyframe_index.

  Index 0 is the resized before image and 8 the after image (what the transform puts at the
  ends), 1..7 the resized interior frames of `data.frame_source` (the sampler draws only those).
  """
  size = config.data.image_size
  before, after = resize(record['before'], size), resize(record['after'], size)
  frames = _interpolated(record, before, after, config.data.frame_source)
  if len(frames) != NUM_SOURCE_FRAMES:
    raise errors.UserError(f'a record has {len(frames)} frames instead of {NUM_SOURCE_FRAMES}; '
                           'rebuild the dataset with this version of its builder')
  inner = [resize(frames[i], size) for i in range(1, NUM_SOURCE_FRAMES - 1)]
  return np.stack([before] + inner + [after]).astype(np.uint8)  # [9, S, S, 3]


class _Transform:
  """Record -> example of the batch contract (without the batch axis).

  With `cache` (a `feature_cache.SplitCache` of the transform's split) the example also
  carries the cached encodings of its keyframes (`keyframe_features`, `keyframe_codes`).
  """

  def __init__(self, config, vocab, scores, train: bool, seed: int,
               bpe_tokenizer: bpe.Bpe | None = None, cache=None):
    self.size = config.data.image_size
    self.k = config.data.num_keyframes
    self.source = config.data.frame_source
    self.sampler = config.data.sampler
    self.max_len = config.data.max_caption_len
    self.vocab = vocab
    self.bpe = bpe_tokenizer  # stage-1 text: CLIP BPE ids, or None: the vocabulary's words
    self.scores = scores
    self.train = train
    self.seed = seed
    self.cache = cache

  def frames(self, record: dict, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    return _interpolated(record, before, after, self.source)

  def __call__(self, record: dict, index: int, rng: np.random.Generator) -> dict:
    before = resize(record['before'], self.size)
    after = resize(record['after'], self.size)
    frames = self.frames(record, before, after)
    pair_id = _text(record['pair_id'])
    scores = None
    if self.scores is not None:  # official Spot-the-Diff files key pairs without '.png'
      scores = self.scores.get(pair_id, self.scores.get(pair_id.removesuffix('.png')))
    strategy = self.sampler if (scores is not None or self.sampler != 'confidence') else 'uniform'
    d_start, d_end = scores if scores is not None else (None, None)
    idx = sampling.sample_keyframes(d_start, d_end, self.k, rng, strategy=strategy,
                                    num_frames=len(frames))
    keyframes = np.stack([before] + [resize(frames[i], self.size) for i in idx[1:-1]] + [after])
    captions = [_text(c) for c in record['captions']]
    captions = [c for c in captions if c.strip()] or ['']
    caption = captions[int(rng.integers(len(captions)))] if self.train else captions[0]
    if caption:
      caption_in = self.vocab.encode_decoder(caption, self.max_len)
      encoder_text = (self.bpe.encode_fixed(caption, self.max_len) if self.bpe is not None
                      else self.vocab.encode_encoder_text(caption, self.max_len))
    else:  # a pair without any caption (user data at inference time): no text input
      caption_in = np.zeros([self.max_len], np.int32)
      encoder_text = np.zeros([self.max_len], np.int32)
    example = {
        'before': before, 'after': after, 'keyframes': keyframes.astype(np.uint8),
        'keyframe_index': np.asarray(idx, np.int32),
        'caption_in': np.asarray(caption_in, np.int32),
        'encoder_text': np.asarray(encoder_text, np.int32),
        'change_type': np.int32(record['change_type']),
        'example_index': np.int32(index), 'valid': np.bool_(True),
    }
    if self.cache is not None:
      example.update(self.cache.gather(index, example['keyframe_index']))
    return example


def make_transform(config, workdir: str, train: bool, cache=None) -> _Transform:
  """The record -> example transform of the batch contract for this config's dataset.

  With `data.encoder_text='clip_bpe'` it reads the BPE merges file (UserError when missing).
  `cache`: a `feature_cache.SplitCache` of the split read, or None (no cached encodings).
  """
  tokenizer = (bpe.load(config.data.bpe_merges_file)
               if config.data.encoder_text == 'clip_bpe' else None)
  return _Transform(config, load_vocab(config, workdir), load_scores(config, workdir),
                    train=train, seed=config.seed, bpe_tokenizer=tokenizer, cache=cache)


def _indexed(src):
  # (record index, record). Under a later shuffle and repeat, grain passes map_with_index the
  # index in the repeated stream (epoch * n + record), hence the modulo.
  n = len(src)
  return grain.MapDataset.source(src).map_with_index(lambda i, r: (i % n, r))


def make_train_dataset(config, workdir: str, batch_size: int, seed: int,
                       rows: tuple[int, int] | None = None, cache=None,
                       scene_pairs: bool = False) -> grain.MapDataset:
  """An endless, per-epoch reshuffled MapDataset of training batches for this process.

  Args:
    config: the run config.
    workdir: the run's workdir (finds the dataset).
    batch_size: the GLOBAL batch size B.
    seed: shuffling and per-example randomness.
    rows: [start, stop), the rows of every global batch this process reads
      (`sharding.process_batch_rows(mesh, B)`); None = all rows (one process).
    cache: a `feature_cache.FeatureCache`: the batches also carry the cached encodings.
    scene_pairs: shuffle whole scenes instead of examples: records 2g and 2g + 1 (a scene's
      change pair and its distractor, in the builders' record order) stay together as rows
      2i and 2i + 1 of a batch, so a batch of B rows holds B/2 scenes, as the original's CLEVR
      stage-2 step does (`caption.train.scene_pairs`; the trainer then encodes a before image
      the two share once: `encodings.share_before`). UserError when two such records are not
      one scene.

  Global batch i is examples [i B, (i + 1) B) of one shuffled stream whatever the number of
  processes; a process reads only its rows of it (lazily: it transforms no other example), so
  the assembled global batch equals a one-process run's batch, row for row.
  """
  src = open_source(config, workdir, 'train')
  if len(src) < batch_size:
    raise errors.UserError(f'the train split has {len(src)} examples, fewer than the batch size '
                           f'{batch_size}; lower the batch size or build a larger dataset')
  transform = make_transform(config, workdir, train=True,
                             cache=cache.split('train') if cache is not None else None)
  start, stop = rows if rows is not None else (0, batch_size)
  local = stop - start
  if local <= 0 or batch_size % local or start % local:
    raise errors.UserError(f'rows [{start}, {stop}) do not split a batch of {batch_size} evenly')
  if scene_pairs:
    if len(src) % 2 or local % 2:
      raise errors.UserError(
          f'scene pairs need an even number of train records and of batch rows per process '
          f'(records {len(src)}, rows {local}); set caption.train.scene_pairs=False or make '
          'the batch size even')
    ds = grain.MapDataset.range(len(src) // 2).seed(seed).shuffle().repeat(None)
    ds = ds.random_map(lambda g, rng: _scene_examples(src, transform, int(g), rng))
    per_chunk = local // 2  # scenes
  else:
    ds = _indexed(src).seed(seed).shuffle().repeat(None)
    ds = ds.random_map(lambda ir, rng: transform(ir[1], ir[0], rng))
    per_chunk = local
  # Chunks of `local` examples; chunk i * (B / local) + start / local is this process's part of
  # global batch i.
  ds = ds.batch(per_chunk, drop_remainder=True)
  if scene_pairs:  # [B/2, 2, ...] -> [B, ...]: scene g's two pairs in rows 2i and 2i + 1
    ds = ds.map(lambda b: {k: v.reshape((-1,) + v.shape[2:]) for k, v in b.items()})
  chunks = batch_size // local
  return ds[start // local::chunks] if chunks > 1 else ds


def _scene_examples(src, transform: '_Transform', scene: int, rng: np.random.Generator) -> dict:
  """The examples of records 2 scene and 2 scene + 1, stacked [2, ...] (one scene's pairs)."""
  i = 2 * scene
  first, second = src[i], src[i + 1]
  if int(first['scene_id']) != int(second['scene_id']):
    raise errors.UserError(
        f'train records {i} and {i + 1} are scenes {int(first["scene_id"])} and '
        f'{int(second["scene_id"])}: caption.train.scene_pairs needs a dataset whose records '
        "come as a scene's change pair then its distractor (CLEVR-Change, synthetic_change); "
        'set it to False for this dataset')
  a, b = transform(first, i, rng), transform(second, i + 1, rng)
  return {k: np.stack([a[k], b[k]]) for k in a}


class TrainIterator:
  """Iterator over training batches with `get_state()` / `set_state()` for checkpoints."""

  def __init__(self, dataset: grain.MapDataset, num_threads: int = 2):
    self._ds = dataset.to_iter_dataset(
        grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=4))
    self._it = iter(self._ds)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    return next(self._it)

  def get_state(self) -> dict:
    return dict(self._it.get_state())

  def set_state(self, state: dict) -> None:
    self._it.set_state(dict(state))


def make_train_iterator(config, workdir: str, batch_size: int, seed: int) -> TrainIterator:
  return TrainIterator(make_train_dataset(config, workdir, batch_size, seed))


def make_eval_iterator(config, split: str, workdir: str, batch_size: int,
                       num_batches: int = 0, shuffled: bool = False,
                       cache=None) -> Iterator[dict]:
  """Batches of `split`; deterministic keyframes, first caption.

  Records come in record order, or with `shuffled` in one fixed permutation (seeded by
  `config.seed`): stage 1 pairs each clip with the caption of the clip half a batch away, and
  in record order that partner is always of the same kind (the synthetic splits alternate a
  change pair and its no-change distractor), so every no-change clip would be judged against
  another no-change caption.

  The last batch is padded to `batch_size` with copies of its first row marked `valid=False`.
  `num_batches=0` means the whole split. With `cache` (a `feature_cache.FeatureCache`) the
  batches also carry the cached encodings of their keyframes.
  """
  src = open_source(config, workdir, split)
  transform = make_transform(config, workdir, train=False,
                             cache=cache.split(split) if cache is not None else None)
  n = len(src) if not num_batches else min(len(src), num_batches * batch_size)
  order = (np.random.default_rng(int(config.seed)).permutation(len(src)) if shuffled
           else np.arange(len(src)))[:n]
  for start in range(0, n, batch_size):
    rows = []
    for i in (int(j) for j in order[start:start + batch_size]):
      rng = sampling.keyframe_rng(config.seed, i, 0)
      rows.append(transform(src[i], i, rng))
    while len(rows) < batch_size:
      pad = dict(rows[0])
      pad['valid'] = np.bool_(False)
      rows.append(pad)
    yield {k: np.stack([r[k] for r in rows]) for k in rows[0]}
