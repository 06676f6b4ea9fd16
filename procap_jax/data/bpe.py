"""CLIP's byte-level BPE, the original stage-1 text tokeniser (spec 1.6).

Dimension legend: L encoder text length (24 in every original config).

ProCap feeds the stage-1 encoder the caption as CLIP `SimpleTokenizer` ids
(`src/mmvid_pytorch/tokenizer.py`, `which_tokenizer='simple'`, `truncate_captions=True`,
`text_seq_len=24`): no start/end tokens, cut to 24 ids, padded with 0. This module is our own
implementation of that algorithm; `tests/bpe_test.py` checks it against the original's ids.

The algorithm, step by step (`Bpe.encode`):

1. Clean: `ftfy.fix_text`, HTML entities unescaped twice, outer whitespace stripped, every run of
   whitespace made one space, lower-cased. ftfy also straightens curly quotes (`it’s` -> `it's`)
   and repairs mojibake; its output can change between ftfy releases (we require ftfy 6.x; the
   parity fixtures were made with 6.3.1).
2. Split into words: `'s 't 're 've 'm 'll 'd`, runs of letters, single digits, runs of anything
   else that is not a space (CLIP's pattern, with the `regex` module's Unicode classes). Those
   classes follow the installed `regex` release's Unicode tables, as in the original: a recently
   assigned letter (U+0558, U+209D, U+209E) is a letter for regex 2026.11 but not for 2026.5.
   `<|startoftext|>` and `<|endoftext|>` written in the text are words too (their special ids).
3. Each word's UTF-8 bytes become printable characters (`bytes_to_unicode`), the last one marked
   with `</w>`, and the lowest-ranked adjacent pair is merged until no ranked pair is left.
4. Each resulting symbol is looked up in the vocabulary: 256 byte characters, the same 256 with
   `</w>`, one entry per merge, then `<|startoftext|>` and `<|endoftext|>`.

Merges file quirks kept from the original: the first line (a version header) is skipped and at
most 48,894 merges are read (lines 1..48894, the original's `merges[1:49152 - 256 - 2 + 1]`), so
the real file gives 256 + 256 + 48,894 + 2 = 49,408 ids. A shorter file keeps every line after
the header, a final empty line included: it becomes an empty merge (a vocabulary entry `''` that
no text produces) and shifts the two special ids by one. When two merges produce the same string
the later id wins, as with the original's `dict(zip(vocab, ids))`.

In the model every 0 is replaced by a per-position padding id, so `!` (id 0) cannot be told apart
from padding, as in the original.
"""

import functools
import gzip
import html
import importlib.util
import io
import os

import ftfy
import numpy as np
import regex

from procap_jax import errors

VOCAB_SIZE = 49408  # ids of the real CLIP merges file (the original's hard-coded vocab_size)
MAX_MERGES = 49152 - 256 - 2  # merges the original reads after the header line (48,894)
TEXT_LEN = 24  # text_seq_len of every original stage-1 config
MERGES_FILE_NAMES = ('bpe_simple_vocab_16e6.txt.gz', 'bpe_simple_vocab_16e6.txt')
# Installed packages that ship CLIP's merges file next to their code (open_clip_torch,
# clip-anytorch / openai clip); searched without importing them.
PACKAGES_WITH_MERGES = ('open_clip', 'clip')
SPECIAL_TOKENS = ('<|startoftext|>', '<|endoftext|>')
_END = '</w>'
_WORDS = regex.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|"""
    r"""[^\s\p{L}\p{N}]+""", regex.IGNORECASE)
_SPACES = regex.compile(r'\s+')


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
  """Byte value -> one printable character, as CLIP's table.

  The printable Latin-1 bytes (`!`..`~`, `¡`..`¬`, `®`..`ÿ`) map to themselves; the other 68
  bytes map, in increasing order, to the code points 256, 257, ...
  """
  printable = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1),
               *range(ord('®'), ord('ÿ') + 1)]
  table = {b: chr(b) for b in printable}
  for n, b in enumerate(b for b in range(256) if b not in table):
    table[b] = chr(256 + n)
  return table  # in CLIP's order: the printable bytes, then the others (the vocabulary's order)


def clean(text: str) -> str:
  """Step 1 of the module docstring: ftfy, HTML unescape, whitespace, lower case."""
  text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
  return _SPACES.sub(' ', text).strip().lower()


def read_merges(path: str) -> list[tuple[str, ...]]:
  """The merges the original reads from `path` (.txt or .txt.gz): lines 1..48894, split on spaces.

  Newlines are read as the original's `Path.read_text` reads them (`\\r\\n` and `\\r` count as
  `\\n`), for the gzipped file too.
  """
  try:
    if path.endswith('.gz'):
      with gzip.open(path, 'rb') as f:
        text = io.TextIOWrapper(f, encoding='utf-8', newline=None).read()
    else:
      with open(path, encoding='utf-8', newline=None) as f:
        text = f.read()
  except FileNotFoundError:
    raise errors.UserError(f'BPE merges file {path} does not exist; fix '
                           'config.data.bpe_merges_file') from None
  except (OSError, UnicodeDecodeError, EOFError) as e:
    raise errors.UserError(f'BPE merges file {path} is not readable UTF-8 text ({e}); point '
                           'config.data.bpe_merges_file at CLIP\'s bpe_simple_vocab_16e6.txt(.gz)'
                           ) from None
  return [tuple(line.split()) for line in text.split('\n')[1:1 + MAX_MERGES]]


def merge_pair(symbols: list[str], pair: tuple[str, str]) -> list[str]:
  """`symbols` with every non-overlapping occurrence of `pair` merged, left to right."""
  merged, i = [], 0
  while i < len(symbols):
    if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
      merged.append(symbols[i] + symbols[i + 1])
      i += 2
    else:
      merged.append(symbols[i])
      i += 1
  return merged


class Bpe:
  """CLIP byte-level BPE over one merges file (`encode` equals `SimpleTokenizer.encode`)."""

  def __init__(self, merges: list[tuple[str, ...]]):
    """Builds the vocabulary and merge ranks.

    Args:
      merges: the merge rules in rank order, as `read_merges` returns them.
    """
    self.byte_encoder = bytes_to_unicode()
    chars = list(self.byte_encoder.values())
    vocab = chars + [c + _END for c in chars] + [''.join(m) for m in merges] + list(SPECIAL_TOKENS)
    self.vocab_size = len(vocab)  # 49408 for the real file
    self.encoder = {token: i for i, token in enumerate(vocab)}  # a repeated token: the last id
    self.decoder = {i: token for token, i in self.encoder.items()}
    self.ranks = {m: r for r, m in enumerate(merges)}  # a repeated merge: the last rank
    self.cache = {t: t for t in SPECIAL_TOKENS}

  @classmethod
  def from_file(cls, path: str) -> 'Bpe':
    """The tokeniser of the merges file at `path` (.txt or .txt.gz)."""
    return cls(read_merges(path))

  def bpe(self, word: str) -> list[str]:
    """The symbols of one byte-encoded word after merging (the last carries `</w>`)."""
    if word in self.cache:
      return self.cache[word].split(' ')
    symbols = list(word[:-1]) + [word[-1] + _END]
    if len(symbols) == 1:
      return symbols
    while len(symbols) > 1:
      pairs = set(zip(symbols[:-1], symbols[1:]))
      best = min(pairs, key=lambda p: self.ranks.get(p, float('inf')))
      if best not in self.ranks:
        break
      symbols = merge_pair(symbols, best)
    self.cache[word] = ' '.join(symbols)
    return symbols

  def encode(self, text: str) -> list[int]:
    """BPE ids of `text`, without start/end tokens (the original `SimpleTokenizer.encode`)."""
    ids = []
    for word in _WORDS.findall(clean(text)):
      word = ''.join(self.byte_encoder[b] for b in word.encode('utf-8'))
      ids.extend(self.encoder[s] for s in self.bpe(word))
    return ids

  def encode_fixed(self, text: str, length: int = TEXT_LEN) -> np.ndarray:
    """ProCap's stage-1 text: `encode(text)` cut to `length` ids and padded with 0.

    The original `tokenize(text, 24, truncate_text=True)` (spec 1.6).

    Returns:
      int32 `[length]`.
    """
    if length < 1:
      raise ValueError(f'length must be >= 1, got {length}')
    ids = self.encode(text)[:length]
    out = np.zeros([length], np.int32)
    out[:len(ids)] = ids
    return out

  def decode(self, ids) -> str:
    """Text of `ids` (inverse of `encode` up to cleaning; `</w>` becomes a space)."""
    byte_decoder = {c: b for b, c in self.byte_encoder.items()}
    text = ''.join(self.decoder[int(i)] for i in ids)
    return bytes(byte_decoder[c] for c in text).decode('utf-8', errors='replace').replace(
        _END, ' ')


def find_merges_file(path: str = '') -> str:
  """`path` when given, else CLIP's merges file shipped by an installed open_clip or clip package.

  The packages are located with `importlib.util.find_spec`, which does not import them.

  Raises:
    UserError: `path` does not exist, or it is empty and no installed package ships the file.
  """
  if path:
    if not os.path.isfile(path):
      raise errors.UserError(f'BPE merges file {path} does not exist; fix '
                             'config.data.bpe_merges_file')
    return path
  for package in PACKAGES_WITH_MERGES:
    try:
      spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
      spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
      for name in MERGES_FILE_NAMES:
        candidate = os.path.join(folder, name)
        if os.path.isfile(candidate):
          return candidate
  raise errors.UserError(
      "CLIP's BPE merges file bpe_simple_vocab_16e6.txt(.gz) was not found in an installed "
      'open_clip or clip package; set config.data.bpe_merges_file to a copy of it (it ships with '
      'openai/CLIP, the ProCap source and the open_clip_torch package)')


@functools.lru_cache(maxsize=4)
def load(path: str = '') -> Bpe:
  """The tokeniser of `find_merges_file(path)`, built once per process and path."""
  return Bpe.from_file(find_merges_file(path))
