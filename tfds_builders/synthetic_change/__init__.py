"""synthetic_change: the embedded default dataset (procedural CLEVR-Change in 2D).

`Builder` is the TFDS builder; `prepare(config_name, data_dir, *, num_workers=None)` builds a
config (or reuses a finished build) and returns the builder. The command line is the `build`
submodule (`python -m tfds_builders.synthetic_change.build`); the function has another name so
that importing the submodule, which binds the package attribute `build`, shadows nothing.
"""

from tfds_builders.synthetic_change import synthetic_change_dataset_builder

Builder = synthetic_change_dataset_builder.Builder
prepare = synthetic_change_dataset_builder.build
