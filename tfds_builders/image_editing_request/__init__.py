"""Image Editing Request TFDS builder (manual download); `Builder`, `prepare`, `official_key`."""

from tfds_builders.image_editing_request import image_editing_request_dataset_builder

Builder = image_editing_request_dataset_builder.Builder
prepare = image_editing_request_dataset_builder.build
official_key = image_editing_request_dataset_builder.official_key
