"""synthetic_change: the embedded default dataset (procedural CLEVR-Change in 2D).

`Builder` is the TFDS builder; `build(config_name, data_dir, *, num_workers=None)` prepares a
config and returns the builder. The command line (`python -m tfds_builders.synthetic_change.build`)
lives in the `build` submodule: run it with `-m`; in Python, call the `build` function here.
"""

from tfds_builders.synthetic_change import synthetic_change_dataset_builder

Builder = synthetic_change_dataset_builder.Builder
build = synthetic_change_dataset_builder.build
