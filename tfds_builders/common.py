"""Shared code of the real-dataset builders: CLEVR-Change, Spot-the-Diff, Image Editing Request,
LEVIR-CC.

Each builder reads the original files from a manual directory (layout: the builder's README.md)
and writes the features of docs/architecture.md. The version directory (`builder.data_dir`, =
`procap_jax.data.pipeline.dataset_dir`) also receives, inside TFDS's temporary build directory
(so they appear with the dataset or not at all):

  references_<split>.json  COCO caption references, `image_id` == `pair_id`
  word2idx.json            a copy of the manual dir's `*word2idx*.json` (official checkpoints),
                           else `Vocab.build(train captions, min_word_count)`
  similarity_scores.json   a copy of the authors' `*_similarity_scores.json` filter file (manual
                           dir or `filter_files/`) if any; point `config.data.scores_file` at it

Pair ids are the original evaluation ids (CLEVR-Change `%06d` + `c`/`nc`, Spot-the-Diff
`<img_id>.png`, IER `uid`, LEVIR-CC the image file name); each builder module's
`official_key(pair_id)` gives the key of the authors' h5 / similarity files. Frames: methods
`flow` / `crossfade` interpolate at build time; `h5` reads the authors' pseudo-sequences (uint8
[T, 3, H0, W0] per key), before / after being their first / last frame (no image folders
needed). Everything is resized to `image_size`.

Builds run `num_workers` spawned processes (ordered `imap`), or a Beam pipeline when given
Beam options (`tfds_builders/beam_build.py`: same records, on one machine or a cluster). A killed
build leaves `<data_dir>/<name>/<config>/incomplete.*_<version>/`; the next build deletes it with
a warning (so never build the same dataset into the same data_dir twice at once).
"""

import dataclasses
import glob
import json
import multiprocessing
import os
import shutil
from typing import Any, Iterable, Iterator

from absl import logging
import h5py
import numpy as np
import tensorflow_datasets as tfds

from procap_jax import errors
from procap_jax import progress
from procap_jax.data import vocab as vocab_lib
from tfds_builders import beam_build
from tfds_builders import pair_examples

CHANGE_TYPES = ('none', 'color', 'material', 'add', 'drop', 'move', 'other')
SPLITS = ('train', 'val', 'test')
METHODS = ('flow', 'crossfade', 'h5')
_INCOMPLETE_PREFIX = 'incomplete.'  # tensorflow_datasets' temporary build directory prefix


@dataclasses.dataclass(eq=False)
class PairsConfig(tfds.core.BuilderConfig):
  """Builder config: image size and where the 9-frame pseudo-sequence comes from."""
  image_size: int = 224
  method: str = 'flow'  # one of METHODS
  num_frames: int = 9
  min_word_count: int = 3  # vocabulary: keep words seen more than this often


CONFIGS = (
    PairsConfig(name='paper', image_size=224, method='flow',
                description='224 px (the paper), flow interpolation at build time.'),
    PairsConfig(name='cpu64', image_size=64, method='flow',
                description='64 px for CPU runs, flow interpolation at build time.'),
    PairsConfig(name='paper_h5', image_size=224, method='h5',
                description="224 px, the authors' pseudo-sequence h5 files."),
    PairsConfig(name='cpu64_h5', image_size=64, method='h5',
                description="64 px, the authors' pseudo-sequence h5 files."),
    PairsConfig(name='tiny32', image_size=32, method='crossfade',
                description='32 px crossfade: tests and smoke runs only.'),
)


@dataclasses.dataclass(frozen=True)
class Pair:
  """One example before image loading; paths are relative to the manual directory."""
  pair_id: str
  scene_id: int
  change_type: str
  captions: tuple[str, ...]
  before: str = ''
  after: str = ''
  h5_file: str = ''
  h5_key: str = ''


def features(image_size: int, num_frames: int) -> tfds.features.FeaturesDict:
  """The dataset features of docs/architecture.md."""
  image = tfds.features.Image(shape=(image_size, image_size, 3), encoding_format='png')
  return tfds.features.FeaturesDict({
      'pair_id': tfds.features.Text(),
      'scene_id': tfds.features.Scalar(dtype=np.int64),
      'change_type': tfds.features.ClassLabel(names=CHANGE_TYPES),
      'before': image,
      'after': image,
      'frames': tfds.features.Sequence(image, length=num_frames),
      'oracle_frames': tfds.features.Sequence(image),
      'captions': tfds.features.Sequence(tfds.features.Text()),
      'change_params': tfds.features.Text(),
  })


# ----------------------------------------------------------------- reading the manual directory


def read_json(manual_dir: str, rel: str) -> Any:
  """Parses `<manual_dir>/<rel>`; UserError naming the file when it is not valid JSON."""
  path = os.path.join(manual_dir, rel)
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise errors.UserError(f'{path} is not a valid UTF-8 JSON file ({e}); download it '
                           'again') from None
  except OSError as e:
    raise errors.UserError(f'cannot read {path}: {e.strerror}') from None


def entries(data: Any, rel: str, fields: dict[str, type | tuple[type, ...]]) -> list[dict]:
  """Checks an annotation file is a list of objects with the given typed fields."""
  if not isinstance(data, list):
    raise errors.UserError(f'{rel} should hold a JSON list of objects; download it again')
  for i, entry in enumerate(data):
    for key, kind in fields.items():
      if not isinstance(entry, dict) or not isinstance(entry.get(key), kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise errors.UserError(f'{rel} entry {i} has no {"/".join(k.__name__ for k in kinds)} '
                               f'field {key!r}; it is not the original annotation file')
  return data


def clean_captions(captions: Iterable[str]) -> tuple[str, ...]:
  """Strips whitespace and drops empty captions."""
  return tuple(c.strip() for c in captions if isinstance(c, str) and c.strip())


def merge_by_id(items: Iterable[tuple[str, tuple[str, ...]]]) -> dict[str, tuple[str, ...]]:
  """Merges repeated ids (captions concatenated, first-seen order) and drops caption-less ids."""
  merged: dict[str, tuple[str, ...]] = {}
  for key, captions in items:
    merged[key] = merged.get(key, ()) + tuple(captions)
  return {k: v for k, v in merged.items() if v}


def stable_scene_ids(ids: Iterable[str]) -> dict[str, int]:
  """int(id) when every id is a decimal number, else the index in the sorted id list."""
  ids = sorted(set(ids))
  if all(i.isdecimal() for i in ids):
    return {i: int(i) for i in ids}
  return {i: n for n, i in enumerate(ids)}


def missing_files(manual_dir: str, rels: Iterable[str]) -> list[str]:
  """The relative paths among `rels` that do not exist in `manual_dir`."""
  return [r for r in rels if not os.path.exists(os.path.join(manual_dir, r))]


def _count_missing(label: str, missing: list[str], total: int) -> str:
  return f'{label}: {len(missing):,} of {total:,} missing (e.g. {", ".join(missing[:3])})'


def missing_pair_files(manual_dir: str, splits: dict[str, list[Pair]]) -> list[str]:
  """Describes the image files / h5 keys the pairs need but the manual dir lacks."""
  needed: dict[str, list[str]] = {}
  h5_keys: dict[str, list[str]] = {}
  for pairs in splits.values():
    for p in pairs:
      if p.h5_file:
        h5_keys.setdefault(p.h5_file, []).append(p.h5_key)
      else:
        for rel in (p.before, p.after):
          needed.setdefault(os.path.dirname(rel), []).append(rel)
  problems = []
  for folder, rels in sorted(needed.items()):
    full = os.path.join(manual_dir, folder)
    if not os.path.isdir(full):
      problems.append(f'the folder {folder}/')
      continue
    present = set(os.listdir(full))  # one listing instead of a stat per file
    absent = [r for r in dict.fromkeys(rels) if os.path.basename(r) not in present]
    if absent:
      problems.append(_count_missing(f'files in {folder}/', absent, len(set(rels))))
  for rel, keys in sorted(h5_keys.items()):
    path = os.path.join(manual_dir, rel)
    if not os.path.isfile(path):
      problems.append(rel)
      continue
    try:
      with h5py.File(path, 'r') as f:
        present = set(f.keys())
    except OSError as e:
      raise errors.UserError(f'{path} is not a readable HDF5 file ({e}); download it '
                             'again') from None
    absent = [k for k in dict.fromkeys(keys) if k not in present]
    if absent:
      problems.append(_count_missing(f'keys in {rel}', absent, len(set(keys))))
  return problems


def _optional_file(manual_dir: str, patterns: tuple[str, ...], what: str) -> str | None:
  found = sorted({p for pattern in patterns for p in glob.glob(os.path.join(manual_dir, pattern))})
  if len(found) > 1:
    raise errors.UserError(f'the manual directory {manual_dir} holds several {what} files '
                           f'({", ".join(os.path.basename(f) for f in found)}); keep only one')
  return found[0] if found else None


# ------------------------------------------------------------------------- writing side files


def write_references(path: str, pairs: Iterable[Pair]) -> None:
  """Writes COCO-format caption references (image_id == pair_id), atomically."""
  imgs, anns = [], []
  for p in pairs:
    imgs.append({'id': p.pair_id, 'file_name': p.pair_id})
    anns.extend({'image_id': p.pair_id, 'id': len(anns), 'caption': c} for c in p.captions)
  coco = {'info': {}, 'licenses': [], 'type': 'captions', 'images': imgs, 'annotations': anns}
  errors.write_text_atomic(path, json.dumps(coco, ensure_ascii=False))


def _copy_atomic(src: str, dst: str) -> None:
  with errors.atomic_path(dst) as tmp:
    shutil.copyfile(src, tmp)




def _worker_count(requested: int | None, num_tasks: int) -> int:
  available = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  n = requested if requested else (available or 1)
  return max(1, min(n, num_tasks // 4 or 1))


# ------------------------------------------------------------------------------------- builder


class PairsBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Base of the real-dataset builders; subclasses implement `_read`."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}
  BUILDER_CONFIGS = list(CONFIGS)
  DEFAULT_CONFIG_NAME = 'paper'

  def __init__(self, *, num_workers: int | None = None, **kwargs):
    """Args: num_workers: build processes (None: every available core; 1: this process);
    kwargs: as `tfds.core.GeneratorBasedBuilder`."""
    super().__init__(**kwargs)
    self._num_workers = num_workers
    self._use_beam = False

  def _read(self, manual_dir: str, use_h5: bool) -> tuple[dict[str, list[Pair]], list[str]]:
    """Returns (pairs per split, descriptions of missing files); raises UserError on bad data."""
    raise NotImplementedError

  def _vocab_captions(self, manual_dir: str, splits: dict[str, list[Pair]]) -> list[str]:
    """The captions the vocabulary is counted over (default: every train caption)."""
    del manual_dir
    return [c for p in splits['train'] for c in p.captions]

  def _info(self) -> tfds.core.DatasetInfo:
    cfg = self.builder_config
    return self.dataset_info_from_configs(
        features=features(cfg.image_size, cfg.num_frames), disable_shuffling=True)

  def _check_manual_dir(self, manual_dir: str) -> dict[str, list[Pair]]:
    """Reads the manual dir; ONE UserError listing everything that is missing."""
    use_h5 = self.builder_config.method == 'h5'
    if not os.path.isdir(manual_dir):
      problems = [f'the directory itself ({manual_dir})']
      splits = {}
    else:
      splits, problems = self._read(manual_dir, use_h5)
      if splits:
        problems += missing_pair_files(manual_dir, splits)
        problems += [f'pairs for split {s}' for s in SPLITS if not splits.get(s)]
    if problems:
      readme = f'tfds_builders/{self.name}/README.md'
      raise errors.UserError(
          f'the manual directory {manual_dir} for {self.name}/{self.builder_config.name} is '
          f'incomplete, missing: {"; ".join(problems)}; see {readme} for what to download '
          'and where to put it')
    return splits

  def _remove_incomplete_builds(self) -> None:
    parent = os.path.dirname(os.fspath(self.data_path))
    for d in glob.glob(os.path.join(parent, f'{_INCOMPLETE_PREFIX}*_{self.version}')):
      logging.warning('removing %s, left by an interrupted build of %s/%s', d, self.name,
                      self.builder_config.name)
      shutil.rmtree(d, ignore_errors=True)

  def download_and_prepare(self, *, download_dir=None, download_config=None, **kwargs) -> None:
    """As TFDS, but checks the manual directory first and clears interrupted builds; a
    `download_config` with Beam options or a runner builds on Beam (`num_workers` unused)."""
    self._use_beam = beam_build.uses_beam(download_config)
    if not os.path.exists(os.path.join(os.fspath(self.data_path), 'dataset_info.json')):
      manual = download_config.manual_dir if download_config else None
      if not manual:
        manual = os.path.join(os.fspath(download_dir or self.data_dir_root / 'downloads'),
                              'manual')
      self._check_manual_dir(os.fspath(manual))  # before TFDS's own (less helpful) assertion
      self._remove_incomplete_builds()
    progress.quiet_library_bars()  # their bars nest around ours: a log gets lines, not bars
    with beam_build.user_errors_from_workers():
      super().download_and_prepare(download_dir=download_dir, download_config=download_config,
                                   **kwargs)

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    manual_dir = os.fspath(dl_manager.manual_dir)
    splits = self._check_manual_dir(manual_dir)
    out_dir = os.fspath(self.data_dir)  # TFDS's temporary directory during the build
    for split in SPLITS:
      write_references(os.path.join(out_dir, f'references_{split}.json'), splits[split])
    word2idx = _optional_file(manual_dir, ('*word2idx*.json',), 'word2idx')
    if word2idx:
      vocab_lib.Vocab.load(word2idx)  # validates the file
      _copy_atomic(word2idx, os.path.join(out_dir, 'word2idx.json'))
    else:
      vocab_lib.Vocab.build(self._vocab_captions(manual_dir, splits),
                            min_word_count=self.builder_config.min_word_count).save(
                                os.path.join(out_dir, 'word2idx.json'))
    scores = _optional_file(manual_dir, ('*_similarity_scores.json',
                                         os.path.join('filter_files', '*_similarity_scores.json')),
                            'similarity scores')
    if scores:
      _copy_atomic(scores, os.path.join(out_dir, 'similarity_scores.json'))
    for name in os.listdir(out_dir):  # atomic writes make 0600 files; TFDS's own are 0644
      if name.endswith('.json'):
        os.chmod(os.path.join(out_dir, name), 0o644)
    return {split: self._generate_examples(manual_dir, split, splits[split]) for split in SPLITS}

  def _generate_examples(self, manual_dir: str, split: str, pairs: list[Pair]):
    cfg = self.builder_config
    tasks = [(manual_dir, p, cfg.image_size, cfg.method, cfg.num_frames) for p in pairs]
    if self._use_beam:
      return beam_build.examples(list(enumerate(tasks)), pair_examples.indexed_example)
    return self._local_examples(split, tasks)

  def _local_examples(self, split: str, tasks: list[tuple]) -> Iterator[tuple[str, dict]]:
    cfg = self.builder_config
    workers = _worker_count(self._num_workers, len(tasks))
    bar = progress.bar(total=len(tasks), desc=f'{self.name}/{cfg.name} {split}', unit='pair')
    try:
      if workers == 1:
        for task in tasks:
          yield pair_examples.make_example(task)
          bar.update()
      else:
        chunk = max(1, min(16, len(tasks) // (workers * 8)))
        with multiprocessing.get_context('spawn').Pool(workers) as pool:
          for result in pool.imap(pair_examples.make_example, tasks, chunksize=chunk):
            yield result
            bar.update()
    finally:
      bar.close()
      while pair_examples._H5_FILES:
        pair_examples._H5_FILES.popitem()[1].close()


def build(builder_cls: type[PairsBuilder], builder_config: str, data_dir: str, manual_dir: str,
          *, num_workers: int | None = None,
          beam_options: beam_build.BeamOptions = None) -> PairsBuilder:
  """Prepares `<name>/<builder_config>` in `data_dir` from `manual_dir`; reuses a prepared one.

  Args:
    builder_cls: one of the three `Builder` classes.
    builder_config: a name from `CONFIGS` ('paper', 'cpu64', 'paper_h5', 'cpu64_h5', 'tiny32').
    data_dir: TFDS data directory (the dataset lands in `<data_dir>/<name>/<config>/1.0.0`).
    manual_dir: the folder with the original files (see the builder's README.md).
    num_workers: build processes; None = every available core, 1 = this process.
    beam_options: Beam flags (see `tfds_builders/beam_build.py`); build with Beam instead of
      `num_workers` processes. None / '' = without Beam.

  Returns:
    The prepared builder (`builder.data_dir` is the dataset's version directory).

  Raises:
    errors.UserError: unknown config, no or an incomplete manual directory, an unwritable
      data directory, a corrupt image or annotation file, Beam options that are invalid or
      given without Apache Beam installed.
  """
  names = [c.name for c in builder_cls.BUILDER_CONFIGS]
  if builder_config not in names:
    raise errors.UserError(f'unknown builder config {builder_config!r} for {builder_cls.name}; '
                           f'choose one of {", ".join(names)}')
  if not manual_dir:
    raise errors.UserError(f'{builder_cls.name} needs a manual directory with the original files; '
                           f'see tfds_builders/{builder_cls.name}/README.md')
  data_dir = os.fspath(data_dir)
  builder = builder_cls(config=builder_config, data_dir=data_dir, file_format='array_record',
                        num_workers=num_workers)
  if builder.is_prepared():
    return builder
  download_config = beam_build.download_config(beam_options, manual_dir=os.fspath(manual_dir))
  errors.check_writable_dir(data_dir)
  builder.download_and_prepare(file_format='array_record', download_config=download_config)
  return builder
