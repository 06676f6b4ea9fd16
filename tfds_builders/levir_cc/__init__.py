"""LEVIR-CC TFDS builder (manual download); `Builder`, `prepare`, `official_key`."""

from tfds_builders.levir_cc import levir_cc_dataset_builder

Builder = levir_cc_dataset_builder.Builder
prepare = levir_cc_dataset_builder.build
official_key = levir_cc_dataset_builder.official_key
