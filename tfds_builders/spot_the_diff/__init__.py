"""Spot-the-Diff TFDS builder (manual download); `Builder`, `prepare`, `official_key`."""

from tfds_builders.spot_the_diff import spot_the_diff_dataset_builder

Builder = spot_the_diff_dataset_builder.Builder
prepare = spot_the_diff_dataset_builder.build
official_key = spot_the_diff_dataset_builder.official_key
