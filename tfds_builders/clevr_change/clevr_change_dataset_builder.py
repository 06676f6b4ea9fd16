"""CLEVR-Change (Park et al., ICCV 2019): change pairs and distractor pairs per scene.

Every scene id of `splits.json` gives two examples:
  `%06d` + 'c'   images/CLEVR_default_%06d.png -> sc_images/CLEVR_semantic_%06d.png,
                 captions change_captions.json['CLEVR_default_%06d.png'], change type from
                 type_mapping.json (type -> list of '%06d.png' names)
  `%06d` + 'nc'  images/CLEVR_default_%06d.png -> nsc_images/CLEVR_nonsemantic_%06d.png,
                 captions no_change_captions.json['CLEVR_default_%06d.png'], type 'none'
scene_id is the integer scene id. With method 'h5' the frames come from sc_videos.h5 /
nsc_videos.h5 keyed '%06d.png'.
"""

import os

from procap_jax import errors
from tfds_builders import beam_build
from tfds_builders import common

MANUAL_DOWNLOAD_INSTRUCTIONS = """\
Download clevr_change.tar.gz from the CLEVR-Change release (README section "Data" of
github.com/Seth-Park/RobustChangeCaptioning), extract it, and pass its `data/` folder as the
manual directory. It must hold:
  images/CLEVR_default_NNNNNN.png        before views
  sc_images/CLEVR_semantic_NNNNNN.png    after views with a change
  nsc_images/CLEVR_nonsemantic_NNNNNN.png  after views with a distractor change only
  splits.json  change_captions.json  no_change_captions.json  type_mapping.json
Optional: sc_videos.h5 and nsc_videos.h5 (the ProCap authors' pseudo-sequences, used by the
`*_h5` configs, which then need no image folders), one `*_similarity_scores.json` (their filter
file, also accepted in filter_files/), one `*word2idx*.json` (e.g. ProCap's clevr_word2idx.json).
"""

ANNOTATIONS = ('splits.json', 'type_mapping.json', 'change_captions.json',
               'no_change_captions.json')


def official_key(pair_id: str) -> tuple[str, str]:
  """(key of the authors' h5 / similarity files, 'sc' or 'nsc') for a pair id."""
  return pair_id[:6] + '.png', 'nsc' if pair_id.endswith('nc') else 'sc'


def _scene_types(type_mapping, manual_dir: str) -> dict[str, str]:
  if not isinstance(type_mapping, dict):
    raise errors.UserError(f'{os.path.join(manual_dir, "type_mapping.json")} should map change '
                           'types to lists of image names; download it again')
  out = {}
  for change_type, names in type_mapping.items():
    if change_type not in common.CHANGE_TYPES or not isinstance(names, list):
      raise errors.UserError(f'type_mapping.json has an unknown change type {change_type!r}; '
                             f'expected some of {", ".join(common.CHANGE_TYPES[1:6])}')
    out.update((str(n), change_type) for n in names)
  return out


def _captions(table, name: str, key: str) -> tuple[str, ...]:
  if not isinstance(table, dict):
    raise errors.UserError(f'{name} should map image names to caption lists; download it again')
  value = table.get(key)
  return common.clean_captions(value) if isinstance(value, list) else ()


class Builder(common.PairsBuilder):
  """CLEVR-Change as pair examples (see the module docstring)."""

  MANUAL_DOWNLOAD_INSTRUCTIONS = MANUAL_DOWNLOAD_INSTRUCTIONS

  def _read(self, manual_dir: str, use_h5: bool):
    missing = common.missing_files(manual_dir, ANNOTATIONS)
    if missing:
      return {}, missing
    splits_json = common.read_json(manual_dir, 'splits.json')
    types = _scene_types(common.read_json(manual_dir, 'type_mapping.json'), manual_dir)
    change = common.read_json(manual_dir, 'change_captions.json')
    no_change = common.read_json(manual_dir, 'no_change_captions.json')
    problems, no_caption, no_type = [], [], []
    splits = {}
    for split in common.SPLITS:
      ids = splits_json.get(split) if isinstance(splits_json, dict) else None
      if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise errors.UserError(f'splits.json should hold integer id lists under "train", "val" '
                               f'and "test"; {split!r} is missing or malformed')
      pairs = splits[split] = []
      for sid in ids:
        key = f'CLEVR_default_{sid:06d}.png'
        sc_caps = _captions(change, 'change_captions.json', key)
        nsc_caps = _captions(no_change, 'no_change_captions.json', key)
        change_type = types.get(f'{sid:06d}.png')
        if not sc_caps or not nsc_caps:
          no_caption.append(key)
        if change_type is None:
          no_type.append(f'{sid:06d}.png')
        for suffix, caps, kind, folder, prefix in (
            ('c', sc_caps, change_type, 'sc_images', 'CLEVR_semantic'),
            ('nc', nsc_caps, 'none', 'nsc_images', 'CLEVR_nonsemantic')):
          pairs.append(common.Pair(
              pair_id=f'{sid:06d}{suffix}', scene_id=sid, change_type=kind or 'other',
              captions=caps, before='' if use_h5 else f'images/{key}',
              after='' if use_h5 else f'{folder}/{prefix}_{sid:06d}.png',
              h5_file=f'{"sc" if suffix == "c" else "nsc"}_videos.h5' if use_h5 else '',
              h5_key=f'{sid:06d}.png'))
    if no_caption:
      problems.append(f'captions (change or no-change) for {len(no_caption):,} scenes '
                      f'(e.g. {", ".join(no_caption[:3])})')
    if no_type:
      problems.append(f'type_mapping.json entries for {len(no_type):,} scenes '
                      f'(e.g. {", ".join(no_type[:3])})')
    return splits, problems


def build(builder_config: str, data_dir: str, manual_dir: str, *,
          num_workers: int | None = None, beam_options: beam_build.BeamOptions = None
          ) -> Builder:
  """Builds CLEVR-Change; see `tfds_builders.common.build`."""
  return common.build(Builder, builder_config, data_dir, manual_dir, num_workers=num_workers,
                      beam_options=beam_options)
