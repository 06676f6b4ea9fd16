r"""Caption your own image pairs with a trained run.

  python -m procap_jax.caption --workdir W before.png after.png
  python -m procap_jax.caption --workdir W --csv pairs.csv            # columns before,after
  python -m procap_jax.caption --workdir W --before_dir A --after_dir B   # same file names

Images may be any size, format or mode PIL reads (grayscale, RGBA, palette, JPEG ...); they are
converted to RGB at the run's image size. Prints one line per pair: `<before>\t<after>\t<caption>`.
Stage 2 needs no interpolation: only the before and after images reach the model.
`--out F.json` also writes the captions (atomically) as a JSON list.
"""

import argparse
import csv
import json
import os
import sys

import ml_collections
import numpy as np

from procap_jax import errors

_IMAGE_EXTS = ('.png', '.jpg', '.jpeg', '.bmp', '.gif', '.tif', '.tiff', '.webp')


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The resolved config a run saved in `workdir/config.json`."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise errors.UserError(f'{workdir} is not a procap-jax run (no config.json); pass the '
                           '--workdir of a finished training run')
  raw = errors.read_json(path, 'run config', 'pass the --workdir of a finished training run',
                         'the run directory is damaged')
  if not isinstance(raw, dict) or not isinstance(raw.get('data'), dict):
    raise errors.UserError(f'{path} is not a procap-jax run config (no "data" section); pass the '
                           '--workdir of a finished training run')
  return ml_collections.ConfigDict(_tuples(raw))


def _tuples(x):
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  return x


def pairs_from_args(args) -> list[tuple[str, str]]:
  """The (before, after) paths the command line names, checked to exist."""
  pairs: list[tuple[str, str]] = []
  if args.csv:
    if not os.path.isfile(args.csv):
      raise errors.UserError(f'CSV file {args.csv} does not exist or is not a file')
    try:
      with open(args.csv, newline='', encoding='utf-8') as f:
        rows = [r for r in csv.reader(f) if r and any(c.strip() for c in r)]
    except UnicodeDecodeError as e:
      raise errors.UserError(f'CSV file {args.csv} is not UTF-8 text (bad byte at offset '
                             f'{e.start}); save it as UTF-8') from None
    except (OSError, csv.Error) as e:
      raise errors.UserError(f'cannot read CSV file {args.csv} ({e}); check the file') from None
    if rows and [c.strip().lower() for c in rows[0][:2]] == ['before', 'after']:
      rows = rows[1:]
    base = os.path.dirname(os.path.abspath(args.csv))
    for n, row in enumerate(rows, 1):
      if len(row) < 2:
        raise errors.UserError(f'{args.csv} row {n} has {len(row)} column(s); each row needs '
                               'before,after')
      b, a = (c.strip() for c in row[:2])
      pairs.append((os.path.join(base, b), os.path.join(base, a)))
  elif args.before_dir or args.after_dir:
    if not (args.before_dir and args.after_dir):
      raise errors.UserError('--before_dir and --after_dir go together')
    for d in (args.before_dir, args.after_dir):
      if not os.path.isdir(d):
        raise errors.UserError(f'{d} is not a directory')
    names_b = {n for n in os.listdir(args.before_dir) if n.lower().endswith(_IMAGE_EXTS)}
    names_a = {n for n in os.listdir(args.after_dir) if n.lower().endswith(_IMAGE_EXTS)}
    if names_b != names_a:
      only = sorted(names_b ^ names_a)[:5]
      raise errors.UserError(f'the two folders must hold the same file names; unmatched: '
                             f'{", ".join(only)}')
    pairs = [(os.path.join(args.before_dir, n), os.path.join(args.after_dir, n))
             for n in sorted(names_b)]
  else:
    if len(args.images) != 2:
      raise errors.UserError('give exactly two images (before after), or --csv, or '
                             '--before_dir/--after_dir')
    pairs = [(args.images[0], args.images[1])]
  if not pairs:
    raise errors.UserError('no image pairs found')
  return pairs


class Captioner:
  """A trained run's caption checkpoint, ready to caption uint8 pairs."""

  def __init__(self, workdir: str, which: str = 'best'):
    from procap_jax import stages
    from procap_jax.data import pipeline
    self.config = load_run_config(workdir)
    self.vocab = pipeline.load_vocab(self.config, workdir)
    _, self.model, self.state, self.constants, self.step = stages.restore_for_eval(
        self.config, workdir, 'caption', which)

  def __call__(self, befores: list[np.ndarray], afters: list[np.ndarray],
               batch_size: int = 32) -> list[str]:
    from procap_jax.tasks import caption as caption_task
    from procap_jax.data import pipeline
    size = self.config.data.image_size
    out = []
    for i in range(0, len(befores), batch_size):
      b = np.stack([pipeline.resize(x, size) for x in befores[i:i + batch_size]])
      a = np.stack([pipeline.resize(x, size) for x in afters[i:i + batch_size]])
      n = len(b)
      if n < batch_size and len(befores) > batch_size:  # keep one compiled shape
        b = np.concatenate([b, np.repeat(b[:1], batch_size - n, 0)])
        a = np.concatenate([a, np.repeat(a[:1], batch_size - n, 0)])
      ids = caption_task.generate(self.state.params, self.constants, self.config, self.model, b, a)
      out += [self.vocab.decode(row) for row in np.asarray(ids)[:n]]
    return out


@errors.exit_on_user_error
def main(argv: list[str] | None = None) -> list[str]:
  parser = argparse.ArgumentParser(prog='python -m procap_jax.caption',
                                   description='Caption your own before/after image pairs.')
  parser.add_argument('images', nargs='*', help='before.png after.png')
  parser.add_argument('--workdir', required=True, help='a finished training run')
  parser.add_argument('--csv', help='CSV with columns before,after (paths relative to the CSV)')
  parser.add_argument('--before_dir')
  parser.add_argument('--after_dir')
  parser.add_argument('--which', default='best', choices=('best', 'latest'))
  parser.add_argument('--out', help='also write the captions as JSON here')
  args = parser.parse_args(argv)
  from procap_jax.data import images
  pairs = pairs_from_args(args)
  load_run_config(args.workdir)  # a wrong --workdir fails before any image is read
  befores, afters = [], []
  for b, a in pairs:  # every bad image fails before the (slower) checkpoint restore
    befores.append(images.load_image(b))
    afters.append(images.load_image(a))
  captioner = Captioner(args.workdir, args.which)
  captions = captioner(befores, afters)
  for (b, a), c in zip(pairs, captions):
    print(f'{b}\t{a}\t{c}', flush=True)
  if args.out:
    errors.write_text_atomic(args.out, json.dumps(
        [{'before': b, 'after': a, 'caption': c} for (b, a), c in zip(pairs, captions)], indent=1))
  return captions


if __name__ == '__main__':
  main(sys.argv[1:])
