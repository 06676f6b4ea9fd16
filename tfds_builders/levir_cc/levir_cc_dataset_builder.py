"""LEVIR-CC (Liu et al., TGRS 2022): bi-temporal remote-sensing image pairs, 5 sentences each.

One example per entry of `LevirCCcaptions.json` `{"images": [...]}`: images
images/<split>/A/<filename> (before) -> images/<split>/B/<filename> (after), split = the entry's
`split`. Captions = its `sentences`, each the official `tokens` joined by spaces (the text the
dataset's authors score with), or the stripped `raw` sentence when it has no tokens; empty
sentences are dropped and an entry left without one is skipped. `changeflag` 1 / 0 becomes the
change type `other` / `none`, so evaluation scores the change and no-change pairs apart.
pair_id = filename (e.g. 'test_000001.png', unique in the file), scene_id = the entry's `imgid`
(the index in the file when some entry has none). No `*_h5` configs: the ProCap authors
released no LEVIR-CC pseudo-sequences; frames are interpolated at build time.
"""

from procap_jax import errors
from tfds_builders import beam_build
from tfds_builders import common

ANNOTATIONS = 'LevirCCcaptions.json'
_FIELDS = {'filename': str, 'split': str, 'sentences': list, 'changeflag': int}
CHANGE_TYPE = {1: 'other', 0: 'none'}  # changeflag -> change type

MANUAL_DOWNLOAD_INSTRUCTIONS = """\
Download the LEVIR-CC dataset (README of github.com/Chen-Yang-Liu/RSICC, "LEVIR-CC Dataset") and
pass the folder that holds these as the manual directory:
  LevirCCcaptions.json
  images/train/A/*.png  images/train/B/*.png    (A: before, B: after; same file names)
  images/val/A/*.png    images/val/B/*.png
  images/test/A/*.png   images/test/B/*.png
Optional: one `*word2idx*.json` vocabulary (else it is built from the train captions).
"""

CONFIGS = (
    common.PairsConfig(name='paper', image_size=256, method='flow',
                       description='256 px (the images\' own size), flow interpolation.'),
    common.PairsConfig(name='cpu64', image_size=64, method='flow',
                       description='64 px for CPU runs, flow interpolation.'),
    common.PairsConfig(name='tiny32', image_size=32, method='crossfade',
                       description='32 px crossfade: tests and smoke runs only.'),
)


def official_key(pair_id: str) -> str:
  """The entry's `filename` in LevirCCcaptions.json for a pair id (they are the same)."""
  return pair_id


def sentence_text(sentence, where: str) -> str:
  """One official sentence as caption text: its tokens joined by spaces, else its raw text."""
  if not isinstance(sentence, dict):
    raise errors.UserError(f'{ANNOTATIONS} {where} has a sentence that is not an object; it is '
                           'not the original annotation file')
  tokens = sentence.get('tokens')
  if isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens):
    return ' '.join(t.strip() for t in tokens if t.strip())
  raw = sentence.get('raw')
  return raw.strip() if isinstance(raw, str) else ''


def _entries(data) -> list[dict]:
  images = data.get('images') if isinstance(data, dict) else None
  if not isinstance(images, list):
    raise errors.UserError(f'{ANNOTATIONS} should hold {{"images": [...]}} (the official '
                           'annotation file); download it again')
  return common.entries(images, f'{ANNOTATIONS} "images"', _FIELDS)


class Builder(common.PairsBuilder):
  """LEVIR-CC as pair examples (see the module docstring)."""

  MANUAL_DOWNLOAD_INSTRUCTIONS = MANUAL_DOWNLOAD_INSTRUCTIONS
  BUILDER_CONFIGS = list(CONFIGS)

  def _read(self, manual_dir: str, use_h5: bool):
    del use_h5  # no h5 configs
    missing = common.missing_files(manual_dir, [ANNOTATIONS])
    if missing:
      return {}, missing
    items = _entries(common.read_json(manual_dir, ANNOTATIONS))
    with_ids = all(isinstance(e.get('imgid'), int) for e in items)
    seen = set()
    splits = {s: [] for s in common.SPLITS}
    for n, e in enumerate(items):
      name, split, flag = e['filename'], e['split'], e['changeflag']
      where = f'entry {n} ({name})'
      if split not in splits:
        raise errors.UserError(f'{ANNOTATIONS} {where} has split {split!r}; expected one of '
                               f'{", ".join(common.SPLITS)}')
      if flag not in CHANGE_TYPE or isinstance(flag, bool):
        raise errors.UserError(f'{ANNOTATIONS} {where} has changeflag {flag!r}; expected 0 (no '
                               'change) or 1 (change)')
      if name in seen:
        raise errors.UserError(f'{ANNOTATIONS} lists {name} twice; each image pair must appear '
                               'once')
      seen.add(name)
      captions = common.clean_captions(sentence_text(s, where) for s in e['sentences'])
      if not captions:
        continue
      splits[split].append(common.Pair(
          pair_id=name, scene_id=e['imgid'] if with_ids else n, change_type=CHANGE_TYPE[flag],
          captions=captions, before=f'images/{split}/A/{name}', after=f'images/{split}/B/{name}'))
    return splits, []


def build(builder_config: str, data_dir: str, manual_dir: str, *,
          num_workers: int | None = None, beam_options: beam_build.BeamOptions = None
          ) -> Builder:
  """Builds LEVIR-CC; see `tfds_builders.common.build` (configs paper, cpu64, tiny32)."""
  return common.build(Builder, builder_config, data_dir, manual_dir, num_workers=num_workers,
                      beam_options=beam_options)
