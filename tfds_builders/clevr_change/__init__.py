"""CLEVR-Change TFDS builder (manual download); `Builder`, `prepare`, `official_key`."""

from tfds_builders.clevr_change import clevr_change_dataset_builder

Builder = clevr_change_dataset_builder.Builder
prepare = clevr_change_dataset_builder.build
official_key = clevr_change_dataset_builder.official_key
