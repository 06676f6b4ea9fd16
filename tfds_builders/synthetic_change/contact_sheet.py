r"""Contact sheet: a PNG grid to check the synthetic data by eye.

  python -m tfds_builders.synthetic_change.contact_sheet --data_dir D --config tiny \
      --out sheet.png [--split train] [--per_type 2]

One block per example, a few examples per change type: a caption line (pair id, change type,
first caption), then a row with before, the 9 oracle frames, the 9 interpolated frames and
after.
"""

import argparse

import numpy as np
import PIL.Image
import PIL.ImageDraw
import PIL.ImageFont

from procap_jax import errors
from tfds_builders.synthetic_change import scene
from tfds_builders.synthetic_change import synthetic_change_dataset_builder as builder_lib

_GAP, _GROUP_GAP, _TEXT_H, _BG = 2, 10, 14, (255, 255, 255)


def _text(x) -> str:
  return x.decode('utf-8') if isinstance(x, bytes) else str(x)


def pick_examples(src, names: list[str], per_type: int) -> list[dict]:
  """The first `per_type` records of each change type present, grouped by type."""
  wanted = ['none'] + list(scene.CHANGE_TYPES)
  found = {t: [] for t in wanted}
  for i in range(len(src)):
    r = src[i]
    t = names[int(r['change_type'])]
    if t in found and len(found[t]) < per_type:
      found[t].append(r)
    if all(len(v) == per_type for v in found.values()):
      break
  return [r for t in wanted for r in found[t]]


def _tile(image: np.ndarray, scale: int) -> PIL.Image.Image:
  img = PIL.Image.fromarray(np.asarray(image, np.uint8))
  return img.resize((img.width * scale, img.height * scale), PIL.Image.Resampling.NEAREST)


def make_sheet(records: list[dict], names: list[str], image_size: int, scale: int,
               interpolation: str) -> PIL.Image.Image:
  """Lays out the records; returns the sheet image."""
  t = image_size * scale
  groups = [1, 9, 9, 1]  # before | oracle frames | interpolated frames | after
  width = sum(g * (t + _GAP) for g in groups) + _GROUP_GAP * (len(groups) - 1) + _GAP
  row_h = _TEXT_H + t + _GAP * 2
  sheet = PIL.Image.new('RGB', (width, _TEXT_H + len(records) * row_h), _BG)
  draw = PIL.ImageDraw.Draw(sheet)
  font = PIL.ImageFont.load_default()
  headers = ['before', 'oracle frames t = 0 ... 1', f'interpolated ({interpolation})', 'after']
  x = _GAP
  for g, h in zip(groups, headers):
    draw.text((x, 1), h, fill=(0, 0, 0), font=font)
    x += g * (t + _GAP) + _GROUP_GAP
  for k, r in enumerate(records):
    y = _TEXT_H + k * row_h
    caption = _text(r['captions'][0]) if len(r['captions']) else ''
    label = f"{_text(r['pair_id'])}  [{names[int(r['change_type'])]}]  {caption}"
    draw.text((_GAP, y + 1), label, fill=(0, 0, 0), font=font)
    tiles = [[r['before']], list(r['oracle_frames']), list(r['frames']), [r['after']]]
    x = _GAP
    for group in tiles:
      for img in group:
        sheet.paste(_tile(img, scale), (x, y + _TEXT_H))
        x += t + _GAP
      x += _GROUP_GAP
  return sheet


@errors.exit_on_user_error
def main(argv: list[str] | None = None) -> None:
  """Reads a prepared config and writes the contact sheet PNG."""
  parser = argparse.ArgumentParser(prog='python -m tfds_builders.synthetic_change.contact_sheet',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('--data_dir', required=True, help='TFDS data directory')
  parser.add_argument('--config', default='tiny', help='builder config')
  parser.add_argument('--split', default='train', choices=scene.SPLITS)
  parser.add_argument('--per_type', type=int, default=2, help='examples per change type')
  parser.add_argument('--scale', type=int, default=0, help='pixel zoom (0: tiles of ~96 px)')
  parser.add_argument('--out', required=True, help='output PNG path')
  args = parser.parse_args(argv)

  builder_lib.check_config_name(args.config)
  builder = builder_lib.Builder(config=args.config, data_dir=args.data_dir)
  if not builder_lib.is_prepared(builder):
    raise errors.UserError(
        f'synthetic_change/{args.config} is not built in {args.data_dir}; build it with python -m '
        f'tfds_builders.synthetic_change.build --config {args.config} --data_dir {args.data_dir}')
  if args.per_type < 1:
    raise errors.UserError(f'--per_type must be at least 1, got {args.per_type}')
  cfg = builder.builder_config
  names = builder.info.features['change_type'].names
  records = pick_examples(builder.as_data_source(split=args.split), names, args.per_type)
  scale = args.scale if args.scale > 0 else max(1, round(96 / cfg.image_size))
  sheet = make_sheet(records, names, cfg.image_size, scale, cfg.interpolation)
  with errors.atomic_path(args.out, mode_suffix='.png') as tmp:
    sheet.save(tmp, format='PNG')
  print(f'wrote {args.out}: {len(records)} examples, {sheet.width}x{sheet.height} px')


if __name__ == '__main__':
  main()
