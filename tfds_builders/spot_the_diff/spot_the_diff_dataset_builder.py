"""Spot-the-Diff (Jhamtani & Berg-Kirkpatrick, EMNLP 2018): surveillance frame pairs.

One example per distinct `img_id` of annotations/<split>.json: images resized_images/<id>.png
-> resized_images/<id>_2.png; captions = the entry's non-empty sentences, entries repeating an id
merged (captions concatenated in file order); ids left without a caption are skipped.
pair_id = '<img_id>.png' (the image ids of the COCO references CLIP4IDC / ProCap evaluate with),
scene_id = int(img_id), change_type 'other'. With method 'h5' the frames come from
spot_videos.h5 keyed img_id.
"""

from tfds_builders import beam_build
from tfds_builders import common

MANUAL_DOWNLOAD_INSTRUCTIONS = """\
Put into the manual directory (the layout of github.com/harsh19/spot-the-diff `data/`):
  annotations/train.json  annotations/val.json  annotations/test.json   (from that repository)
  resized_images/<id>.png and resized_images/<id>_2.png   (the "resized_images" archive linked
                                                           in its data/get_images.txt)
Optional: spot_videos.h5 (the ProCap authors' pseudo-sequences, used by the `*_h5` configs,
which then need no images), one `*_similarity_scores.json` (their filter file, also accepted in
filter_files/), one `*word2idx*.json` (e.g. ProCap's spot_word2idx2.json).
"""


def official_key(pair_id: str) -> str:
  """The key of the authors' h5 / similarity files (the img_id) for a pair id."""
  return pair_id[:-len('.png')] if pair_id.endswith('.png') else pair_id


class Builder(common.PairsBuilder):
  """Spot-the-Diff as pair examples (see the module docstring)."""

  MANUAL_DOWNLOAD_INSTRUCTIONS = MANUAL_DOWNLOAD_INSTRUCTIONS

  def _read(self, manual_dir: str, use_h5: bool):
    files = {s: f'annotations/{s}.json' for s in common.SPLITS}
    missing = common.missing_files(manual_dir, files.values())
    if missing:
      return {}, missing
    merged = {}
    for split, rel in files.items():
      data = common.entries(common.read_json(manual_dir, rel), rel,
                            {'img_id': (str, int), 'sentences': list})
      merged[split] = common.merge_by_id(
          (str(e['img_id']), common.clean_captions(e['sentences'])) for e in data)
    scene = common.stable_scene_ids(i for m in merged.values() for i in m)
    splits = {}
    for split, by_id in merged.items():
      splits[split] = [common.Pair(
          pair_id=f'{img_id}.png', scene_id=scene[img_id], change_type='other', captions=caps,
          before='' if use_h5 else f'resized_images/{img_id}.png',
          after='' if use_h5 else f'resized_images/{img_id}_2.png',
          h5_file='spot_videos.h5' if use_h5 else '', h5_key=img_id)
          for img_id, caps in by_id.items()]
    return splits, []


def build(builder_config: str, data_dir: str, manual_dir: str, *,
          num_workers: int | None = None, beam_options: beam_build.BeamOptions = None
          ) -> Builder:
  """Builds Spot-the-Diff; see `tfds_builders.common.build`."""
  return common.build(Builder, builder_config, data_dir, manual_dir, num_workers=num_workers,
                      beam_options=beam_options)
