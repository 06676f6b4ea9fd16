r"""A picture of interpolated pseudo-sequences: before / frames / after, one row per method.

Synthetic pairs (one per change type, from the val split of a built dataset) get an extra first row with the
renderer's true procedure (`oracle`); real CLEVR-Change pairs (before from `images/`, after from
`sc_images/` and `nsc_images/`) are resized to --size first.

Command:

  python -m procap_jax.procedure.visualize --out interp.png \
      [--data_dir D --config tiny] [--clevr_dir DIR] [--size 128] [--methods flow,crossfade]
"""

import argparse
import os

import numpy as np
import PIL.Image
import PIL.ImageDraw

from procap_jax import errors
from procap_jax.data import datasets
from procap_jax.data import images
from procap_jax.procedure import interpolation

_LABEL_WIDTH = 150
_GAP = 6


def _text(x) -> str:
  return x.decode('utf-8') if isinstance(x, bytes) else str(x)


def synthetic_pairs(data_dir: str, config: str, split: str = 'val', per_type: int = 1):
  """[(title, before, after, oracle frames [T, S, S, 3])], one pair per change type, move first."""
  builder = datasets.get_builder('synthetic_change', config, data_dir)
  source = datasets.data_source('synthetic_change', config, data_dir, split)  # built, or one error
  names = builder.info.features['change_type'].names
  chosen = {}
  for i in range(len(source)):
    r = source[i]
    kind = names[r['change_type']]
    if len(chosen.setdefault(kind, [])) < per_type:
      chosen[kind].append((f'{_text(r["pair_id"])} {kind}', r['before'], r['after'],
                           np.stack(r['oracle_frames'])))
  order = ['move'] + [k for k in names if k != 'move']
  return [p for k in order for p in chosen.get(k, [])]


def clevr_pairs(clevr_dir: str, size: int, limit: int = 3):
  """[(title, before, after, None)] from a CLEVR-Change folder (semantic and distractor)."""
  folder = os.path.join(clevr_dir, 'images')
  if not os.path.isdir(folder):
    raise errors.UserError(f'{folder} does not exist; --clevr_dir must hold images/, '
                           'sc_images/ and nsc_images/')
  out = []
  for name in sorted(os.listdir(folder))[:limit]:
    number = name.rsplit('_', 1)[-1]
    before = images.load_image(os.path.join(folder, name), size=size)
    for sub, prefix, tag in (('sc_images', 'CLEVR_semantic_', 'c'),
                             ('nsc_images', 'CLEVR_nonsemantic_', 'nc')):
      path = os.path.join(clevr_dir, sub, prefix + number)
      if os.path.exists(path):
        title = f'{number.split(".")[0]}{tag} CLEVR'
        out.append((title, before, images.load_image(path, size=size), None))
  return out


def contact_sheet(pairs, methods: list[str], num_frames: int = 9, tile: int = 96) -> np.ndarray:
  """Draws the rows: for each pair, the oracle row (when known) and one row per method.

  Args:
    pairs: [(title, before [S, S, 3], after, oracle [T, S, S, 3] or None)].
    methods: interpolation methods (keys of `interpolation.METHODS`).
    num_frames: T.
    tile: displayed side of a frame, pixels.

  Returns:
    uint8 [H, W, 3], the picture.
  """
  rows = []   # (label, frames [T, S, S, 3])
  for title, before, after, oracle in pairs:
    if oracle is not None:
      rows.append((f'{title}\noracle', oracle))
    for method in methods:
      rows.append((f'{title}\n{method}', interpolation.interpolate(before, after, num_frames,
                                                                   method=method)))
    rows.append((None, None))
  width = _LABEL_WIDTH + num_frames * (tile + 2)
  height = 20 + sum(tile + 2 if f is not None else _GAP for _, f in rows)
  sheet = PIL.Image.new('RGB', (width, height), 'white')
  draw = PIL.ImageDraw.Draw(sheet)
  for t in range(num_frames):
    draw.text((_LABEL_WIDTH + t * (tile + 2) + 4, 4), f't={t}/{num_frames - 1}', fill='black')
  y = 20
  for label, frames in rows:
    if frames is None:
      y += _GAP
      continue
    draw.text((4, y + 4), label, fill='black')
    for t, frame in enumerate(frames):
      im = PIL.Image.fromarray(np.asarray(frame)).resize((tile, tile), PIL.Image.Resampling.NEAREST)
      sheet.paste(im, (_LABEL_WIDTH + t * (tile + 2), y))
    y += tile + 2
  return np.asarray(sheet)


@errors.exit_on_user_error
def main(argv: list[str] | None = None) -> None:
  """Writes the PNG."""
  parser = argparse.ArgumentParser(prog='python -m procap_jax.procedure.visualize',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('--out', required=True, help='the PNG to write')
  parser.add_argument('--data_dir', help='TFDS data directory of the synthetic dataset')
  parser.add_argument('--config', default='tiny', help='synthetic_change config')
  parser.add_argument('--clevr_dir', help='a CLEVR-Change folder (images/, sc_images/, ...)')
  parser.add_argument('--size', type=int, default=128, help='CLEVR pairs are resized to this')
  parser.add_argument('--clevr_pairs', type=int, default=3, help='CLEVR scenes to draw')
  parser.add_argument('--methods', default='flow,crossfade')
  args = parser.parse_args(argv)
  methods = args.methods.split(',')
  for m in methods:
    if m not in interpolation.METHODS or m == 'oracle':
      raise errors.UserError(f'unknown method {m!r} in --methods; choose from '
                             f'{", ".join(k for k in interpolation.METHODS if k != "oracle")}')
  if not args.data_dir and not args.clevr_dir:
    raise errors.UserError('nothing to draw: give --data_dir (synthetic pairs) and/or --clevr_dir')
  pairs = []
  if args.data_dir:
    pairs += synthetic_pairs(args.data_dir, args.config)
  if args.clevr_dir:
    pairs += clevr_pairs(args.clevr_dir, args.size, args.clevr_pairs)
  sheet = contact_sheet(pairs, methods)
  with errors.atomic_path(args.out, '.png') as tmp:
    PIL.Image.fromarray(sheet).save(tmp, format='PNG')
  print(f'wrote {args.out} ({len(pairs)} pairs x {len(methods)} methods)')


if __name__ == '__main__':
  main()
