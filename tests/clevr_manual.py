"""A CLEVR-Change manual-download folder made of the real fixture images (../shared/fixtures),
for the builder tests."""

import json
import pathlib


def clevr_manual(root: pathlib.Path, fixtures: pathlib.Path, splits: dict) -> pathlib.Path:
  """`root/clevr_manual`: the fixture images linked, `splits` as splits.json, and captions."""
  src = fixtures / 'clevr_change'
  man = root / 'clevr_manual'
  for folder in ('images', 'sc_images', 'nsc_images'):
    (man / folder).mkdir(parents=True)
    for f in (src / folder).iterdir():
      (man / folder / f.name).symlink_to(f)
  (man / 'type_mapping.json').symlink_to(src / 'type_mapping.json')
  (man / 'splits.json').write_text(json.dumps(splits))
  ids = [i for ids in splits.values() for i in ids]
  (man / 'change_captions.json').write_text(json.dumps({f'CLEVR_default_{i:06d}.png': [
      'the small cube changed its color', f'the object number {i} became a different color',
      ' '] for i in ids}))
  (man / 'no_change_captions.json').write_text(json.dumps({f'CLEVR_default_{i:06d}.png': [
      'no change was made', 'the scene is the same as before'] for i in ids}))
  return man
