r"""Writes the stage-1 BPE parity fixtures from the ORIGINAL ProCap tokenizer (run by hand).

  python tests/parity/gen_bpe.py --original ORIG

Needs the original's dependencies (torch, ftfy, regex) and imports one function of ours
(`procap_jax.data.bpe.merge_pair`, numpy and ftfy only) for the learner's merge step.

1. Learns a small merges file of our own (`MERGES` rules, plain BPE over the caption corpus
   below; CLIP's merges file is NOT copied) and adds two rules that produce a string an earlier
   rule already produced (the original keeps the later id for it).
2. Runs the original `SimpleTokenizer` with that file on `CASES` and records `encode(text)` and
   ProCap's stage-1 input `tokenize(text, 24, truncate_text=True)[0]`.

Outputs, in tests/parity/fixtures/: `bpe_merges.txt` (header line, one merge per line, a final
newline, so the original reads one empty merge after them) and `bpe_cases.json` (ids per case,
the original's vocabulary facts, the ftfy and regex versions used).
"""

import argparse
import collections
import importlib.util
import json
import os
import sys

import regex  # the original's dependency

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
from procap_jax.data import bpe  # noqa: E402  (the repo's, for its merge step)

MERGES = 400
_WORDS = (r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|"""
          r"""[\p{N}]|[^\s\p{L}\p{N}]+""")  # CLIP's pre-tokenisation
HEADER = '#version: procap-jax test merges (learned by tests/parity/gen_bpe.py)'

_OBJECTS = ('the small red metal cube', 'the large gray rubber sphere', 'a tiny cyan cylinder',
            'the big purple matte ball', 'the brown shiny block', 'a yellow rubber cylinder',
            'the blue metallic thing', 'the green object')
_TEMPLATES = ('{o} changed to {c}', '{o} turned {c}', '{o} became {c}', '{o} is now {c}',
              '{o} was painted {c}', '{o} has been added', '{o} has disappeared',
              'someone moved {o}', '{o} was removed', '{o} changed its color to {c}',
              'there is no change', 'the scene remains the same', 'nothing has changed',
              "the person's car is gone", "it's moved to the left of {o}",
              "there isn't a {c} object anymore", 'remove the {c} tint from the photo',
              'make the sky {c}', 'the man in the white shirt is no longer there')
_COLOURS = ('red', 'green', 'blue', 'yellow', 'gray', 'cyan', 'purple', 'brown', 'metal',
            'rubber')
_EXTRA = ('12 people, 3 cars & 1 dog!', 'hello... world?!', '"quoted" (brackets) [square]',
          'café naïve résumé façade', 'straße über größer', 'ελληνικά κείμενα', 'русский текст',
          '日本語のテキスト', '中文字幕', 'emoji 😀🚗 ok', 'a-b_c/d\\e:f;g', '#1 @home $5 %20',
          '<b>bold</b> &amp; tags', 'the car in the parking lot is gone',
          'a person walking on the sidewalk appeared', 'change the background to white',
          'brighten the image and increase the contrast', 'crop the photo to the face',
          'people standing near the building', 'the truck drove away from the street',
          'a bicycle is leaning against the wall', 'remove the text from the picture',
          'replace the sky with a sunset', 'the woman with the umbrella is missing')

CASES = [
    # CLEVR-Change / Spot-the-Diff / IER style captions.
    'the small red metal cube changed to yellow',
    'The large gray rubber sphere has been added.',
    'someone moved the tiny cyan cylinder',
    'there is no change',
    'the scene remains the same',
    'the big purple matte ball has disappeared',
    'the man in the white shirt is no longer there',
    'remove the blue tint from the photo',
    'make the sky more vivid and brighter',
    'there are 3 cars in the parking lot instead of 2',
    'a person walking is now visible near the left side of the image',
    'the brown shiny block was painted green',
    # punctuation
    'hello, world!',
    '!',
    'wow!~ (an unmerged ! is id 0, the padding id)',
    '!!! ???',
    'Wait... what?!',
    'a-b_c/d\\e:f;g',
    '"quoted" (brackets) [square] {curly}',
    '#1 @home $5 %20 ^caret ~tilde `backtick`',
    '... --- ...',
    # numbers
    '12 people, 3 cars & 1 dog',
    '3.14159 2,000,000 1/2',
    'room 101 on floor 23',
    '2024-01-15T10:30:00',
    # apostrophes and contractions
    "it's the person's car",
    "they're here, we've gone, I'm sure, you'll see, he'd go",
    "don't can't won't isn't",
    "O'Neil's 'quoted' words'",
    'it\u2019s a curly apostrophe',
    '\u201csmart quotes\u201d and \u2018single\u2019',
    # case
    'UPPER CASE CAPTION',
    'MiXeD CaSe WoRdS',
    # Unicode
    'café naïve résumé façade',
    'straße über größer',
    'ελληνικά κείμενα',
    'русский текст',
    '日本語のテキスト',
    '中文字幕',
    'emoji 😀🚗 ok',
    'e\u0301 combining accent',
    'ﬁ ligature and \u00bd fraction',
    'İstanbul',
    'zero\u200bwidth space',
    'non\u00a0breaking space',
    'tab\tand\nnewline\r\nand  double  spaces',
    '   leading and trailing   ',
    'CafÃ© mojibake',
    '\u2460 circled \u00b2 superscript \u0663 arabic digit',
    # HTML entities
    '&amp; &lt;b&gt; &quot;x&quot;',
    '&amp;amp; double escaped',
    'fish &amp; chips &#39;n&#39; peas &#x41;',
    '<b>bold</b> &nbsp; tags',
    # the special tokens written out in text
    '<|startoftext|> hello <|endoftext|>',
    '<|endoftext|>',
    # long captions (more than 24 ids)
    ' '.join(['the small red metal cube changed to yellow'] * 4),
    'the large gray rubber sphere that was behind the small red metal cube on the left side of '
    'the scene has been moved to the front right corner next to the blue cylinder',
    'a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9',
    # empty and whitespace only
    '',
    '   ',
    '\n\t',
]


def _load_original(root: str):
  path = os.path.join(root, 'src', 'mmvid_pytorch', 'tokenizer.py')
  if not os.path.isfile(path):
    sys.exit(f'{path} not found: pass the root of the original ProCap source as --original')
  spec = importlib.util.spec_from_file_location('procap_original_tokenizer', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # imports torch, ftfy, regex
  return module


def _corpus() -> list[str]:
  texts = [t.format(o=o, c=c) for t in _TEMPLATES for o in _OBJECTS for c in _COLOURS]
  return texts + list(_EXTRA) * 20


def _learn_merges(original, texts: list[str], count: int) -> list[tuple[str, str]]:
  """Plain BPE: repeatedly merge the most frequent adjacent pair (ties: the smallest pair)."""
  byte_encoder = original.bytes_to_unicode()
  words = collections.Counter()
  for text in texts:
    text = original.whitespace_clean(original.basic_clean(text)).lower()
    for w in regex.findall(_WORDS, text):
      w = ''.join(byte_encoder[b] for b in w.encode('utf-8'))
      words[tuple(w[:-1]) + (w[-1] + '</w>',)] += 1
  merges = []
  for _ in range(count):
    pairs = collections.Counter()
    for symbols, n in words.items():
      for pair in zip(symbols[:-1], symbols[1:]):
        pairs[pair] += n
    if not pairs:
      break
    best = min(pairs, key=lambda p: (-pairs[p], p))
    merges.append(best)
    merged = collections.Counter()
    for symbols, n in words.items():
      merged[tuple(bpe.merge_pair(list(symbols), best))] += n
    words = merged
  return merges


def _duplicate_merges(original, merges: list[tuple[str, str]]) -> list[tuple[str, str]]:
  """Two extra rules `(s[0], s[1:])` for strings `s` an earlier rule `(x, y)` already makes."""
  chars = list(original.bytes_to_unicode().values())
  symbols = set(chars) | {c + '</w>' for c in chars} | {''.join(m) for m in merges}
  extra = []
  for x, y in merges:
    s = x + y
    alt = (s[0], s[1:])
    if alt != (x, y) and alt[1] in symbols and alt not in merges:
      extra.append(alt)
    if len(extra) == 2:
      return extra
  raise AssertionError('no merge can be duplicated; learn more merges')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--original', required=True, help='root of the original ProCap source')
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'fixtures'))
  args = parser.parse_args()
  original = _load_original(args.original)
  import ftfy  # the original's dependency, recorded with the fixtures

  merges = _learn_merges(original, _corpus(), MERGES)
  learned = len(merges)
  merges += _duplicate_merges(original, merges)
  merges_path = os.path.join(args.out, 'bpe_merges.txt')
  with open(merges_path, 'w', encoding='utf-8', newline='\n') as f:
    f.write(HEADER + '\n' + ''.join(f'{a} {b}\n' for a, b in merges))

  tok = original.SimpleTokenizer(merges_path)
  cases = []
  for text in CASES:
    ids = tok.encode(text)
    fixed = tok.tokenize(text, 24, truncate_text=True).squeeze(0).tolist()
    cases.append({'text': text, 'ids': ids, 'fixed24': fixed})
  out = {
      'generated_by': 'tests/parity/gen_bpe.py with the original src/mmvid_pytorch/tokenizer.py',
      'ftfy_version': ftfy.__version__,
      'regex_version': regex.__version__,
      'num_merges': len(merges),
      'num_ids': max(tok.encoder.values()) + 1,  # ids 0..n-1 (a repeated string keeps one)
      'special_ids': [tok.encoder['<|startoftext|>'], tok.encoder['<|endoftext|>']],
      'empty_merge_id': tok.encoder.get(''),
      'duplicate_merges': [list(m) for m in merges[learned:]],
      'duplicate_ids': {''.join(m): tok.encoder[''.join(m)] for m in merges[learned:]},
      'cases': cases,
  }
  with open(os.path.join(args.out, 'bpe_cases.json'), 'w', encoding='utf-8') as f:
    json.dump(out, f, ensure_ascii=True, indent=0)
    f.write('\n')
  longest = max(len(c['ids']) for c in cases)
  print(f'{len(merges)} merges, {len(cases)} cases (longest {longest} ids) -> {args.out}')


if __name__ == '__main__':
  main()
