"""TFDS builder of the synthetic change benchmark (the embedded default dataset).

Configs: `tiny` (tests), `small` (the default main job) and `full` (CLEVR-Change sized); see
README.md in this folder for the statistics and build times. Build with `build(...)` or
`python -m tfds_builders.synthetic_change.build --config tiny --data_dir D`; read with
`tfds.data_source('synthetic_change/tiny', data_dir=D, split='train')`. With Beam options the
same scenes are made in a Beam pipeline (`tfds_builders/beam_build.py`), giving the same records.
"""

import dataclasses
import glob
import multiprocessing
import os
import shutil

from absl import logging
import numpy as np
import tensorflow_datasets as tfds

from procap_jax import errors
from procap_jax import progress
from tfds_builders import beam_build
from tfds_builders.synthetic_change import generate
from tfds_builders.synthetic_change import scene

CHANGE_TYPE_NAMES = ('none', 'color', 'material', 'add', 'drop', 'move', 'other')
_SCENES_PER_WORKER = 32  # fewer scenes per worker: render in this process (start-up dominates)

_DESCRIPTION = """\
A procedural 2D mirror of CLEVR-Change (Park et al., 2019) small enough for a CPU. Every scene
has 3 to 6 CLEVR objects (cube, sphere, cylinder; 8 colours; rubber or metal; small or large)
on a floor and gives two pairs sharing the before image: a semantic change pair (exactly one
color, material, add, drop or move change) and a distractor pair (no semantic change), both
with a viewpoint and/or illumination nuisance. For each pair the renderer draws the 9 true
frames of the change happening (`oracle_frames`); `frames` holds the interpolated sequence
made from before and after by the config's interpolation method.
"""

_CITATION = """\
@inproceedings{park2019robust,
  title={Robust Change Captioning},
  author={Park, Dong Huk and Darrell, Trevor and Rohrbach, Anna},
  booktitle={ICCV},
  year={2019}
}
"""


@dataclasses.dataclass
class SyntheticChangeConfig(tfds.core.BuilderConfig):
  """What a config changes: image size, scenes per split, interpolation method, seed.

  Each scene gives two records (its change pair and its distractor pair).
  """
  image_size: int = 64
  train_scenes: int = 0
  val_scenes: int = 0
  test_scenes: int = 0
  interpolation: str = 'flow'
  seed: int = 0

  def num_scenes(self, split: str) -> int:
    return {'train': self.train_scenes, 'val': self.val_scenes, 'test': self.test_scenes}[split]

  def first_scene_id(self, split: str) -> int:
    """Scene ids are global: train first, then val, then test (splits never share a scene)."""
    return sum(self.num_scenes(s) for s in scene.SPLITS[:scene.SPLITS.index(split)])


CONFIGS = (
    SyntheticChangeConfig(
        name='tiny', description='Tests: 40 scenes at 32 px (builds in seconds).',
        image_size=32, train_scenes=24, val_scenes=8, test_scenes=8),
    SyntheticChangeConfig(
        name='small', description='The default main job: 3,600 scenes at 64 px.',
        image_size=64, train_scenes=3000, val_scenes=200, test_scenes=400),
    SyntheticChangeConfig(
        name='full', description='CLEVR-Change sized: 39,803 scenes at 64 px, its split sizes.',
        image_size=64, train_scenes=33830, val_scenes=1988, test_scenes=3985),
)


class Builder(tfds.core.GeneratorBasedBuilder):
  """synthetic_change: procedural change-captioning pairs with their true procedures."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'First release.'}
  BUILDER_CONFIGS = list(CONFIGS)
  DEFAULT_CONFIG_NAME = 'small'

  def __init__(self, *, num_workers: int | None = None, **kwargs):
    """Args: num_workers: processes rendering scenes (None: every available core; <= 1: this
    process); kwargs: as `tfds.core.GeneratorBasedBuilder`."""
    super().__init__(**kwargs)
    self._num_workers = num_workers
    self._use_beam = False

  def download_and_prepare(self, *, download_config=None, **kwargs) -> None:
    """As TFDS; a `download_config` with Beam options or a runner builds on Beam (then
    `num_workers` is unused: Beam's workers render the scenes)."""
    self._use_beam = beam_build.uses_beam(download_config)
    progress.quiet_library_bars()  # their bars nest around ours: a log gets lines, not bars
    with beam_build.user_errors_from_workers():
      super().download_and_prepare(download_config=download_config, **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    size = self.builder_config.image_size
    image = tfds.features.Image(shape=(size, size, 3), encoding_format='png')
    return self.dataset_info_from_configs(
        description=_DESCRIPTION,
        features=tfds.features.FeaturesDict({
            'pair_id': tfds.features.Text(),
            'scene_id': tfds.features.Scalar(dtype=np.int64),
            'change_type': tfds.features.ClassLabel(names=CHANGE_TYPE_NAMES),
            'before': image,
            'after': image,
            'frames': tfds.features.Sequence(image, length=generate.NUM_FRAMES),
            'oracle_frames': tfds.features.Sequence(image, length=generate.NUM_FRAMES),
            'captions': tfds.features.Sequence(tfds.features.Text()),
            'change_params': tfds.features.Text(),
        }),
        supervised_keys=None,
        disable_shuffling=True,  # records in scene order: change pair, then distractor
        homepage='https://arxiv.org/abs/1901.02527',
        citation=_CITATION,
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # procedural: nothing to download
    return {split: self._generate_examples(split) for split in scene.SPLITS}

  def _generate_examples(self, split: str):
    cfg = self.builder_config
    spec = generate.Spec(cfg.seed, cfg.image_size, cfg.interpolation, split,
                         cfg.first_scene_id(split))
    tasks = [(spec, i) for i in range(cfg.num_scenes(split))]
    if self._use_beam:
      return beam_build.examples(tasks, generate.scene_examples, setup=generate.init_worker)
    return self._local_examples(split, tasks)

  def _local_examples(self, split: str, tasks: list[tuple[generate.Spec, int]]):
    cfg = self.builder_config
    n = len(tasks)
    workers = workers_for(n, self._num_workers)
    shown = dict(total=n, desc=f'synthetic_change/{cfg.name} {split}', unit='scene',
                 mininterval=2.0)
    if workers <= 1:
      generate.init_worker()
      for examples in progress.bar(map(generate.scene_examples, tasks), **shown):
        yield from examples
      return
    # spawn: safe even when the caller has threads (JAX, TFDS); ordered imap keeps keys sorted.
    ctx = multiprocessing.get_context('spawn')
    chunk = max(1, min(16, n // (workers * 8)))
    with ctx.Pool(workers, initializer=generate.init_worker) as pool:
      for examples in progress.bar(pool.imap(generate.scene_examples, tasks, chunksize=chunk),
                                   **shown):
        yield from examples


def resolve_workers(num_workers: int | None) -> int:
  """None -> the cores this process may use; otherwise at least 1."""
  if num_workers is None:
    try:
      return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
      return os.cpu_count() or 1
  return max(int(num_workers), 1)


def workers_for(num_scenes: int, num_workers: int | None) -> int:
  """Worker processes used for a split of `num_scenes` (1: render in this process)."""
  return min(resolve_workers(num_workers), -(-num_scenes // _SCENES_PER_WORKER))


def config_names() -> list[str]:
  return [c.name for c in CONFIGS]


def check_config_name(name: str) -> None:
  """Raises errors.UserError unless `name` is one of `config_names()`."""
  if name not in config_names():
    raise errors.UserError(f'unknown synthetic_change config {name!r}; choose one of '
                           f'{", ".join(config_names())}')


def build(config_name: str, data_dir: str, *, num_workers: int | None = None,
          beam_options: beam_build.BeamOptions = None) -> Builder:
  """Prepares `synthetic_change/<config_name>` in `data_dir` (array_record); skips it when
  already prepared. A build killed earlier leaves no complete dataset, only a temporary
  directory, which this call removes before building again.

  Args:
    config_name: 'tiny', 'small' or 'full'.
    data_dir: the TFDS data directory (created if missing).
    num_workers: rendering processes; None uses every available core.
    beam_options: Beam flags (see `tfds_builders/beam_build.py`), e.g. '--runner=DirectRunner
      --direct_num_workers=2 --direct_running_mode=multi_processing': build in a Beam pipeline
      instead of `num_workers` processes (same records). None / '' = without Beam.

  Returns:
    The prepared builder (`builder.as_data_source(split)` reads it).

  Raises:
    errors.UserError: unknown config name, a data directory that cannot be written, Beam
      options that are invalid or given without Apache Beam installed.
  """
  check_config_name(config_name)
  data_dir = os.fspath(data_dir)
  if os.path.exists(data_dir) and not os.path.isdir(data_dir):
    raise errors.UserError(f'data directory {data_dir} is a file; choose a directory')
  builder = Builder(config=config_name, data_dir=data_dir, file_format='array_record',
                    num_workers=num_workers)
  if is_prepared(builder):
    return builder
  download_config = beam_build.download_config(beam_options)
  _check_writable(data_dir)
  remove_incomplete_builds(builder)
  builder.download_and_prepare(file_format='array_record', download_config=download_config)
  return builder


def remove_incomplete_builds(builder: tfds.core.DatasetBuilder) -> list[str]:
  """Deletes the temporary directories of interrupted builds of `builder`'s config.

  TFDS builds into `<data_dir>/synthetic_change/<config>/incomplete.<random>_<version>/` and
  renames it when complete, so a killed build leaves only that directory; the next build removes
  it (so never build the same config into the same data_dir twice at once).

  Returns:
    The removed directories.
  """
  parent = os.path.dirname(os.fspath(builder.data_path))
  stale = glob.glob(os.path.join(parent, f'incomplete.*_{builder.version}'))
  for d in stale:
    logging.warning('removing %s, left by an interrupted build', d)
    shutil.rmtree(d, ignore_errors=True)
  return stale


def is_prepared(builder: tfds.core.DatasetBuilder) -> bool:
  """Whether the builder's version directory is complete (TFDS writes dataset_info.json last)."""
  return os.path.exists(os.path.join(os.fspath(builder.data_dir), 'dataset_info.json'))


def _check_writable(data_dir: str) -> None:
  errors.check_writable_dir(data_dir, 'choose a writable --data_dir')
