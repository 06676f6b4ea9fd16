"""Reading back what a TFDS builder of the project wrote (shared by the builders' tests)."""

import os

import tensorflow_datasets as tfds


def records(builder, split: str) -> list[dict]:
  """Every record of `split` of a built `builder`, in record order."""
  src = tfds.data_source(f'{builder.name}/{builder.builder_config.name}',
                         data_dir=os.fspath(builder.data_dir_root), split=split)
  return [src[i] for i in range(len(src))]


def text(x) -> str:
  """A stored string feature as str (TFDS gives bytes)."""
  return x.decode('utf-8') if isinstance(x, bytes) else x
