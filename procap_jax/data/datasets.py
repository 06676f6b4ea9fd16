"""The TFDS builders this project knows, and how to open their prepared splits.

An explicit table (no registry lookups by string import): dataset name -> builder package.
"""

import importlib
import os

import tensorflow_datasets as tfds

from procap_jax import errors

# name -> python module of the builder package (imported on first use only).
BUILDERS = {
    'synthetic_change': 'tfds_builders.synthetic_change',
    'clevr_change': 'tfds_builders.clevr_change',
    'spot_the_diff': 'tfds_builders.spot_the_diff',
    'image_editing_request': 'tfds_builders.image_editing_request',
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


def data_source(name: str, builder_config: str, data_dir: str, split: str):
  builder = get_builder(name, builder_config, data_dir)
  if not os.path.exists(os.path.join(str(builder.data_dir), 'dataset_info.json')):
    raise errors.UserError(
        f'dataset {name}/{builder_config} is not built in {data_dir}; build it first '
        f'(python -m procap_jax.main builds the synthetic default; see README for the others)')
  if split not in builder.info.splits:
    raise errors.UserError(f'dataset {name}/{builder_config} has no split {split!r}; it has '
                           f'{", ".join(builder.info.splits)}')
  return builder.as_data_source(split=split)
