"""Which before image goes with which after image, for `python -m procap_jax.caption`.

`--before_dir A --after_dir B` (`pair_folders`), in this order:

1. The same file names in both folders: pairs by name.
2. Otherwise by the number in each name: the last run of digits, leading zeros ignored, after
   dropping a final `_<digit>` / `-<digit>` when digits remain before it, so Spot-the-Diff's
   after image `12_2.png` is number 12 (not 2) and pairs with `12.png`, and CLEVR-Change's
   `images/CLEVR_default_000123.png` pairs with `sc_images/CLEVR_semantic_000123.png`. When
   that leaves a number shared by two files of a folder, the last run of digits as it stands is
   tried (`a_1.png`, `a_2.png` are numbers 1 and 2). Every file must pair: a file without a
   number, a number shared by two files of a folder, or a file without a partner stops the
   command with one sentence naming a few of them.
3. `A` and `B` the same folder (Spot-the-Diff's `resized_images/`): `<name>.<ext>` pairs with
   `<name>_2.<ext'>`; the folder's other files (e.g. `12_diff.jpg`) are left out and counted.

`--csv F` (`pairs_from_csv`) names the pairs explicitly, columns `before,after` (a header row
with those names is optional), paths relative to the CSV file.
"""

import csv
import os
import re

from procap_jax import errors

IMAGE_EXTS = ('.png', '.jpg', '.jpeg', '.bmp', '.gif', '.tif', '.tiff', '.webp')
_DIGITS = re.compile(r'\d+')
_SUFFIX = re.compile(r'[_-]\d$')  # Spot-the-Diff's `_2` in `12_2.png`
_SHOWN = 4  # files named in an error message


def image_names(folder: str, flag: str) -> list[str]:
  """The image files of `folder`, sorted (UserError when it is not a folder or has none)."""
  if not os.path.isdir(folder):
    raise errors.UserError(f'{flag} {folder} is not a directory')
  names = sorted(n for n in os.listdir(folder)
                 if n.lower().endswith(IMAGE_EXTS) and not n.startswith('.')
                 and os.path.isfile(os.path.join(folder, n)))
  if not names:
    raise errors.UserError(f'{flag} {folder} holds no images ({", ".join(IMAGE_EXTS)})')
  return names


def number(name: str, drop_suffix: bool = True) -> int | None:
  """The number a file name pairs by (see the module docstring), or None when it has none."""
  stem = os.path.splitext(name)[0]
  if drop_suffix and _SUFFIX.search(stem) and _DIGITS.search(stem[:-2]):
    stem = stem[:-2]
  runs = _DIGITS.findall(stem)
  return int(runs[-1]) if runs else None


def _shown(items: list[str]) -> str:
  more = f' and {len(items) - _SHOWN} more' if len(items) > _SHOWN else ''
  return ', '.join(items[:_SHOWN]) + more


def _by_number(folder: str, names: list[str], drop_suffix: bool) -> tuple[dict[int, str], str]:
  """{number: name} of one folder, and the problem ('' when every name has its own number)."""
  found: dict[int, list[str]] = {}
  missing = []
  for name in names:
    n = number(name, drop_suffix)
    if n is None:
      missing.append(os.path.join(folder, name))
    else:
      found.setdefault(n, []).append(name)
  if missing:
    return {}, f'{_shown(missing)} {"has" if len(missing) == 1 else "have"} no number in the name'
  shared = [f'{n} ({" and ".join(os.path.join(folder, x) for x in group[:2])})'
            for n, group in found.items() if len(group) > 1]
  if shared:
    return {}, f'number {_shown(shared)} names two files'
  return {n: group[0] for n, group in found.items()}, ''


def _pair_numbers(before_dir: str, after_dir: str, names_b: list[str], names_a: list[str],
                  drop_suffix: bool) -> tuple[list[tuple[str, str]], str]:
  """Pairs by number, or ([], the problem)."""
  nums_b, problem = _by_number(before_dir, names_b, drop_suffix)
  if not problem:
    nums_a, problem = _by_number(after_dir, names_a, drop_suffix)
  if problem:
    return [], problem
  alone = ([os.path.join(before_dir, nums_b[n]) for n in sorted(set(nums_b) - set(nums_a))] +
           [os.path.join(after_dir, nums_a[n]) for n in sorted(set(nums_a) - set(nums_b))])
  if alone:
    return [], f'{_shown(alone)} {"has" if len(alone) == 1 else "have"} no partner'
  return [(os.path.join(before_dir, nums_b[n]), os.path.join(after_dir, nums_a[n]))
          for n in sorted(nums_b)], ''


def pair_folders(before_dir: str, after_dir: str) -> tuple[list[tuple[str, str]], str]:
  """The (before, after) paths of two folders by the module docstring's rules.

  Returns:
    The pairs, and the rule that paired them (for the caption command to say), e.g.
    'by the number in the file names'.

  Raises:
    UserError: a folder is missing or empty, or a file has no partner, no number or a number
      another file of its folder has.
  """
  names_b = image_names(before_dir, '--before_dir')
  names_a = image_names(after_dir, '--after_dir')
  if os.path.samefile(before_dir, after_dir):
    return _pair_in_one_folder(before_dir, names_b)
  if names_b == names_a:
    return [(os.path.join(before_dir, n), os.path.join(after_dir, n)) for n in names_b], (
        'by identical file names')
  pairs, problem = _pair_numbers(before_dir, after_dir, names_b, names_a, drop_suffix=True)
  if not pairs:
    plain, _ = _pair_numbers(before_dir, after_dir, names_b, names_a, drop_suffix=False)
    if plain:
      return plain, 'by the last number in the file names'
    if set(names_b) & set(names_a):  # mostly the same names: say which lack a partner
      alone = ([os.path.join(before_dir, n) for n in names_b if n not in names_a] +
               [os.path.join(after_dir, n) for n in names_a if n not in names_b])
      problem = f'{_shown(alone)} {"has" if len(alone) == 1 else "have"} no partner'
    raise errors.UserError(
        f'cannot pair the images of {before_dir} and {after_dir} by file name (the names '
        f'differ) nor by the number in the names ({problem}); rename them or list the pairs in '
        'a CSV file (--csv, columns before,after)')
  return pairs, 'by the number in the file names'


def _pair_in_one_folder(folder: str, names: list[str]) -> tuple[list[tuple[str, str]], str]:
  """Spot-the-Diff's layout: `<name>.<ext>` and `<name>_2.<ext>` side by side in `folder`."""
  stems = {}
  for name in names:
    stems.setdefault(os.path.splitext(name)[0], name)
  pairs, used = [], set()
  for stem, name in sorted(stems.items(), key=lambda kv: (number(kv[0]) or -1, kv[0])):
    partner = stems.get(stem + '_2')
    if partner is not None and not stem.endswith('_2'):
      pairs.append((os.path.join(folder, name), os.path.join(folder, partner)))
      used.update((name, partner))
  if not pairs:
    raise errors.UserError(
        f'--before_dir and --after_dir are the same folder {folder}, and none of its images has '
        'a partner named <name>_2 (Spot-the-Diff\'s layout); give two folders or list the '
        'pairs in a CSV file (--csv, columns before,after)')
  left = [n for n in names if n not in used]
  rule = 'as <name> and <name>_2 in one folder'
  if left:
    rule += f' ({len(left)} other image(s) left out: {_shown(left)})'
  return pairs, rule


def pairs_from_csv(path: str) -> list[tuple[str, str]]:
  """The (before, after) paths a CSV file lists (relative to the file's folder)."""
  if not os.path.isfile(path):
    raise errors.UserError(f'CSV file {path} does not exist or is not a file')
  try:
    with open(path, newline='', encoding='utf-8') as f:
      rows = [r for r in csv.reader(f) if r and any(c.strip() for c in r)]
  except UnicodeDecodeError as e:
    raise errors.UserError(f'CSV file {path} is not UTF-8 text (bad byte at offset '
                           f'{e.start}); save it as UTF-8') from None
  except (OSError, csv.Error) as e:
    raise errors.UserError(f'cannot read CSV file {path} ({e}); check the file') from None
  if rows and [c.strip().lower() for c in rows[0][:2]] == ['before', 'after']:
    rows = rows[1:]
  base = os.path.dirname(os.path.abspath(path))
  pairs = []
  for n, row in enumerate(rows, 1):
    if len(row) < 2:
      raise errors.UserError(f'{path} row {n} has {len(row)} column(s); each row needs '
                             'before,after')
    b, a = (c.strip() for c in row[:2])
    pairs.append((os.path.join(base, b), os.path.join(base, a)))
  return pairs
