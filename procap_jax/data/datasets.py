"""The TFDS builders this project knows, and how to open their prepared splits.

An explicit table (no registry lookups by string import): dataset name -> builder package.

Opened splits decode image sequences lazily (`LazyImages`): a synthetic record holds 18 frames
(9 interpolated, 9 oracle) besides its before and after images, and a training example reads 2
to 4 of them, so decoding every PNG of a record was most of the input pipeline's time.
"""

import collections.abc
import importlib
import os

import ml_collections
import tensorflow_datasets as tfds

from procap_jax import errors

# name -> python module of the builder package (imported on first use only).
BUILDERS = {
    'synthetic_change': 'tfds_builders.synthetic_change',
    'clevr_change': 'tfds_builders.clevr_change',
    'spot_the_diff': 'tfds_builders.spot_the_diff',
    'image_editing_request': 'tfds_builders.image_editing_request',
    'levir_cc': 'tfds_builders.levir_cc',
}


def builder_module(name: str):
  if name not in BUILDERS:
    raise errors.UserError(f'unknown dataset {name!r}; choose one of {", ".join(BUILDERS)}')
  return importlib.import_module(BUILDERS[name])


def get_builder(name: str, builder_config: str, data_dir: str) -> tfds.core.DatasetBuilder:
  """The builder object (not prepared) for `name/builder_config` under `data_dir`."""
  module = builder_module(name)
  cls = module.Builder
  names = [c.name for c in cls.BUILDER_CONFIGS]
  if builder_config not in names:
    raise errors.UserError(f'unknown builder config {builder_config!r} for {name}; choose one of '
                           f'{", ".join(names)}')
  return cls(config=builder_config, data_dir=data_dir, file_format='array_record')


def dataset_dir(name: str, builder_config: str, data_dir: str) -> str:
  return str(get_builder(name, builder_config, data_dir).data_dir)


def is_prepared(name: str, builder_config: str, data_dir: str) -> bool:
  d = dataset_dir(name, builder_config, data_dir)
  return os.path.exists(os.path.join(d, 'dataset_info.json'))


def check_built(config: ml_collections.ConfigDict, workdir: str) -> None:
  """UserError when the dataset `config` reads is not built (evaluation scores one of its
  splits, and builds nothing: generating the synthetic `small` benchmark takes 40-60 minutes)."""
  name, bc = config.data.name, config.data.builder_config
  ddir = config.data.data_dir or os.path.join(workdir, 'data')
  if is_prepared(name, bc, ddir):
    return
  how = ('with --mode build (the same --config and --workdir)' if name == 'synthetic_change'
         else f'with --mode build --config.data.manual_dir=<folder> (see tfds_builders/{name}/'
         'README.md)')
  raise errors.UserError(f'the {name}/{bc} dataset this run is evaluated on is not built in '
                         f'{ddir}; build it first {how}, then evaluate')


def data_source(name: str, builder_config: str, data_dir: str, split: str):
  builder = get_builder(name, builder_config, data_dir)
  if not os.path.exists(os.path.join(str(builder.data_dir), 'dataset_info.json')):
    raise errors.UserError(
        f'dataset {name}/{builder_config} is not built in {data_dir}; build it first '
        f'(python -m procap_jax.main builds the synthetic default; see README for the others)')
  if split not in builder.info.splits:
    raise errors.UserError(f'dataset {name}/{builder_config} has no split {split!r}; it has '
                           f'{", ".join(builder.info.splits)}')
  features = builder.info.features
  lazy = {key: LazyImageSequence() for key, feature in features.items()
          if isinstance(feature, tfds.features.Sequence)
          and isinstance(feature.feature, tfds.features.Image)}
  return builder.as_data_source(split=split, decoders=lazy or None)


class LazyImages(collections.abc.Sequence):
  """The images of one record's image sequence, each decoded when it is indexed.

  A read-only sequence of uint8 [H, W, C] arrays (len, indexing, slicing, iteration, np.stack
  all work as on the list of decoded images it stands for); an image read twice is decoded twice.
  """

  def __init__(self, feature: tfds.features.Image, encoded):
    self._feature, self._encoded = feature, encoded

  def __len__(self) -> int:
    return len(self._encoded)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    return self._feature.decode_example_np(self._encoded[i])


class LazyImageSequence(tfds.decode.Decoder):
  """TFDS decoder of a `Sequence(Image)` feature into `LazyImages` (the NumPy path only)."""

  def decode_example(self, serialized_example):
    raise NotImplementedError('LazyImageSequence decodes NumPy records only')

  def decode_batch_example_np(self, serialized_example):
    return LazyImages(self.feature, serialized_example)
