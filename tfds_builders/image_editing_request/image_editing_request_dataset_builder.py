"""Image Editing Request (Tan et al., ACL 2019): photo -> edited photo with editing requests.

One example per entry of {train,valid,test}.json (split `valid` becomes `val`): images
images/<img0> -> images/<img1>, captions = `sents` (1 request per train pair, 3 per val / test
pair), pair_id = uid (the image ids of the COCO references), change_type 'other', scene_id = the
uid's index in the sorted list of all uids (uids are unique and split-disjoint). With method
'h5' the frames come from edit_videos.h5 keyed uid.

Vocabulary: each distinct (img0, img1, lower-cased request) of the train split counts once; the
train split repeats some pairs under several uids, and this reproduces ProCap's
edit_word2idx2.json (see procap_jax/data/vocab.py).
"""

from tfds_builders import beam_build
from tfds_builders import common

MANUAL_DOWNLOAD_INSTRUCTIONS = """\
Put into the manual directory:
  train.json  valid.json  test.json   (github.com/airsplay/VisualRelationships, data/ or
                                       dataset/adobe/)
  images/<img0> and images/<img1>     (the image pairs on the Google Drive linked in that README;
                                       JPEG, PNG and GIF files, names as in the json files)
Optional: edit_videos.h5 (the ProCap authors' pseudo-sequences, used by the `*_h5` configs, which
then need no images), one `*_similarity_scores.json` (their filter file, also accepted in
filter_files/), one `*word2idx*.json` (e.g. ProCap's edit_word2idx2.json).
"""

FILES = {'train': 'train.json', 'val': 'valid.json', 'test': 'test.json'}
_FIELDS = {'img0': str, 'img1': str, 'sents': list, 'uid': str}


def official_key(pair_id: str) -> str:
  """The key of the authors' h5 / similarity files (the uid) for a pair id."""
  return pair_id


class Builder(common.PairsBuilder):
  """Image Editing Request as pair examples (see the module docstring)."""

  MANUAL_DOWNLOAD_INSTRUCTIONS = MANUAL_DOWNLOAD_INSTRUCTIONS

  def _entries(self, manual_dir: str, split: str) -> list[dict]:
    rel = FILES[split]
    return common.entries(common.read_json(manual_dir, rel), rel, _FIELDS)

  def _read(self, manual_dir: str, use_h5: bool):
    missing = common.missing_files(manual_dir, FILES.values())
    if missing:
      return {}, missing
    data = {split: self._entries(manual_dir, split) for split in common.SPLITS}
    scene = common.stable_scene_ids(e['uid'] for d in data.values() for e in d)
    splits = {}
    for split, items in data.items():
      files = {e["uid"]: (e["img0"], e["img1"]) for e in items}
      merged = common.merge_by_id((e['uid'], common.clean_captions(e['sents'])) for e in items)
      splits[split] = [common.Pair(
          pair_id=uid, scene_id=scene[uid], change_type='other', captions=caps,
          before='' if use_h5 else f'images/{files[uid][0]}',
          after='' if use_h5 else f'images/{files[uid][1]}',
          h5_file='edit_videos.h5' if use_h5 else '', h5_key=uid)
          for uid, caps in merged.items()]
    return splits, []

  def _vocab_captions(self, manual_dir, splits):
    del splits
    seen = {}
    for e in self._entries(manual_dir, 'train'):
      for sent in e['sents']:
        if isinstance(sent, str) and sent.strip():
          seen.setdefault((e['img0'], e['img1'], sent.lower()), sent)
    return list(seen.values())


def build(builder_config: str, data_dir: str, manual_dir: str, *,
          num_workers: int | None = None, beam_options: beam_build.BeamOptions = None
          ) -> Builder:
  """Builds Image Editing Request; see `tfds_builders.common.build`."""
  return common.build(Builder, builder_config, data_dir, manual_dir, num_workers=num_workers,
                      beam_options=beam_options)
