"""Word-level caption vocabulary and tokenisation of the original stage-2 code.

Dimension legend: L caption length (`max_len`, 24 in every original config).

Special ids are those of the original (`RecursiveCaptionDataset`, plus `[MASK]` at 7):
`[PAD]=0 [CLS]=1 [SEP]=2 [VID]=3 [BOS]=4 [EOS]=5 [UNK]=6 [MASK]=7`; words start at 8.

Tokenisation is nltk `word_tokenize` on the lower-cased caption, as in the original
(`clevr_dataset.py` `_tokenize_pad_sentence`, `build_vocab.py`). One difference: the original
calls `word_tokenize(text)`, which first splits sentences with nltk's trained Punkt model (data
that cannot be downloaded here); we call it with `preserve_line=True`, i.e. the whole caption is
one sentence. The two only differ on captions with a sentence end *inside* them: there the
original splits the inner period off the word (`gone.` -> `gone` `.`) while we keep `gone.` as
one token (-> `[UNK]`). Of the 28,788 Spot-the-Diff and IER captions only 2 (IER, quoting
"... again!" / "Donald J. Trump") have such a boundary, and both tokenisers give the same
vocabularies (see below).

Vocabulary recipe (`Vocab.build`): the words of the lower-cased, tokenised *train* captions
occurring more than `min_word_count` = 3 times (the original script's default of 5 does not
reproduce the shipped files). Measured against the official files:

* Spot-the-Diff `spot_word2idx2.json`: the same 826 words from all train annotations.
* IER `edit_word2idx2.json`: the same 516 words once duplicate requests are dropped: the train
  split repeats some image pairs under several uids, and the original counted each distinct
  (image pair, lower-cased request) once; counting every entry adds `paw`, `reflections`,
  `lightning` (4 occurrences each, 3 distinct).
* nltk splits "cannot" -> "can" "not" and "gonna" -> "gon" "na"; the files were built with nltk
  too and contain exactly those pieces, so these splits cause no difference.

Word *order* is not reproducible: the original iterates a Python `set` (hash-randomised per
process), so the shipped id order is arbitrary. We sort words alphabetically, which also matches
the CLEVR file (`clevr_word2idx.json`, re-indexed from the alphabetical RobustChangeCaptioning
vocabulary). Checkpoints trained with the official vocabularies must load those files
(`Vocab.load`), not rebuild them.
"""

import collections
import functools
import json
import os
from typing import Iterable, Mapping, Sequence

import numpy as np

from procap_jax import errors
from procap_jax import token_ids

# The special tokens and their ids live in token_ids.py (below models/, which needs them); the
# vocabulary's own names for them stay here.
SPECIAL_TOKENS = token_ids.SPECIAL_TOKENS
PAD, CLS, SEP, VID, BOS, EOS, UNK, MASK = (token_ids.PAD, token_ids.CLS, token_ids.SEP,
                                           token_ids.VID, token_ids.BOS, token_ids.EOS,
                                           token_ids.UNK, token_ids.MASK)
DECODING_IDS = token_ids.DECODING_IDS
IGNORE = token_ids.IGNORE
MAX_LEN = 24  # max_t_len of the original configs
MIN_WORD_COUNT = 3  # the threshold that reproduces the shipped Spot-the-Diff / IER files


def tokenize(caption: str) -> list[str]:
  """Lower-cases and word-tokenises a caption as the original (see the module docstring).

  Args:
    caption: a caption; an empty or whitespace-only one gives no tokens.

  Returns:
    The nltk word tokens, e.g. `'The cube is gone.'` -> `['the', 'cube', 'is', 'gone', '.']`.
  """
  if not isinstance(caption, str):
    raise errors.UserError(f'a caption must be a string, got {type(caption).__name__} '
                           f'{_short(caption)}')
  return list(_word_tokens(caption))


@functools.lru_cache(maxsize=1 << 16)
def _word_tokens(caption: str) -> tuple[str, ...]:
  # Cached: training encodes the same few thousand captions every epoch, in the input
  # pipeline's threads, and nltk's regular expressions were a fifth of an example's CPU time.
  import nltk.tokenize  # here, not at import: nltk (and the scipy it loads) costs the caption
  # command a second and a half of start-up, and decoding never tokenises
  return tuple(nltk.tokenize.word_tokenize(caption.lower(), preserve_line=True))


def decoder_labels(ids: np.ndarray) -> np.ndarray:
  """Decoder targets: the input shifted left by one, `-1` where nothing is to be predicted.

  As `clevr_dataset.py:L163`: position i predicts token i+1 unless token i+1 is `[PAD]`; the last
  position is always `-1`. So `[BOS]` predicts w1, ..., wn predicts `[EOS]`.

  Args:
    ids: int array `[..., L]` of `encode_decoder` outputs.

  Returns:
    int32 `[..., L]`.
  """
  ids = np.asarray(ids)
  labels = np.full(ids.shape, IGNORE, np.int32)
  following = ids[..., 1:]
  labels[..., :-1] = np.where(following != PAD, following, IGNORE)
  return labels


class Vocab:
  """Word <-> id mapping with the original special tokens at ids 0-7.

  Attributes:
    word2idx: word -> id (ids are 0..size-1, specials first).
    idx2word: list indexed by id.
    size: number of entries (the decoder's output vocabulary size V).
  """

  def __init__(self, word2idx: Mapping[str, int]):
    problem = _problem(word2idx)
    if problem:
      raise errors.UserError(f'the vocabulary {problem}')
    self.word2idx = dict(word2idx)
    self.idx2word = [''] * len(self.word2idx)
    for word, idx in self.word2idx.items():
      self.idx2word[idx] = word
    self.size = len(self.idx2word)

  def __len__(self) -> int:
    return self.size

  def __eq__(self, other) -> bool:
    return isinstance(other, Vocab) and self.word2idx == other.word2idx

  def __repr__(self) -> str:
    return f'Vocab(size={self.size})'

  @classmethod
  def build(cls, captions: Iterable[str], min_word_count: int = MIN_WORD_COUNT) -> 'Vocab':
    """Builds the vocabulary from training captions (the original recipe, sorted order).

    Args:
      captions: the train captions, each counted once per occurrence (drop duplicate requests of
        the same pair first to match the official IER file, see the module docstring). Empty
        captions are skipped (Spot-the-Diff has some).
      min_word_count: keep words occurring strictly more than this many times.

    Returns:
      The 8 special tokens, then the kept words in alphabetical order.
    """
    if (isinstance(min_word_count, bool) or not isinstance(min_word_count, int) or
        min_word_count < 0):
      raise errors.UserError(
          f'min_word_count must be a non-negative integer, got {min_word_count!r}')
    if isinstance(captions, str):
      raise errors.UserError('Vocab.build takes a list of captions, not a single string')
    counts = collections.Counter()
    for i, caption in enumerate(captions):
      if not isinstance(caption, str):
        raise errors.UserError(f'caption {i} is not a string ({type(caption).__name__} '
                               f'{_short(caption)}); pass caption strings to Vocab.build')
      counts.update(tokenize(caption))
    words = sorted(w for w, n in counts.items() if n > min_word_count and w not in SPECIAL_TOKENS)
    return cls({w: i for i, w in enumerate(SPECIAL_TOKENS + tuple(words))})

  @classmethod
  def load(cls, path: str) -> 'Vocab':
    """Loads a word2idx JSON file (ours or an original `cache/*_word2idx*.json`)."""
    path = os.fspath(path)
    try:
      with open(path, encoding='utf-8') as f:
        text = f.read()
    except FileNotFoundError:
      raise errors.UserError(f'vocabulary file {path} does not exist; check the path or build '
                             'one with Vocab.build') from None
    except (OSError, UnicodeDecodeError) as e:
      raise errors.UserError(f'cannot read vocabulary file {path} ({e}); check the file') from None
    duplicates = []

    def no_duplicate_keys(pairs):
      seen = {}
      for key, value in pairs:
        if key in seen:
          duplicates.append(key)
        seen[key] = value
      return seen

    try:
      word2idx = json.loads(text, object_pairs_hook=no_duplicate_keys)
    except json.JSONDecodeError as e:
      raise errors.UserError(f'vocabulary file {path} is not valid JSON ({e.msg} at line '
                             f'{e.lineno}); expected a word -> id object') from None
    if duplicates:
      raise errors.UserError(f'vocabulary file {path} lists the word {duplicates[0]!r} twice; '
                             'each word must appear once')
    problem = _problem(word2idx)
    if problem:
      raise errors.UserError(f'vocabulary file {path} {problem}')
    return cls(word2idx)

  def save(self, path: str) -> None:
    """Writes the word2idx JSON (same layout as the original files), atomically."""
    errors.write_text_atomic(os.fspath(path), json.dumps(self.word2idx, indent=4) + '\n')

  def ids(self, tokens: Sequence[str]) -> list[int]:
    """Maps tokens to ids; out-of-vocabulary tokens (and punctuation) become `[UNK]`."""
    return [self.word2idx.get(t, UNK) for t in tokens]

  def encode_decoder(self, caption: str, max_len: int = MAX_LEN) -> np.ndarray:
    """Decoder input `[BOS] w1..wn [EOS] [PAD]...` with at most `max_len - 2` words.

    Returns:
      int32 `[max_len]`.
    """
    if max_len < 2:
      raise ValueError(f'max_len must be >= 2, got {max_len}')
    words = self.ids(_checked_tokens(caption))[:max_len - 2]
    out = np.full([max_len], PAD, np.int32)
    out[:len(words) + 2] = [BOS] + words + [EOS]
    return out

  def encode_encoder_text(self, caption: str, max_len: int = MAX_LEN) -> np.ndarray:
    """Stage-1 encoder text: word ids without `[BOS]`/`[EOS]`, truncated, padded with 0.

    The model later replaces every 0 by a per-position padding id (original
    `dalle_beit.py:L1042-1044`); no word has id 0 here, so padding is unambiguous.

    Returns:
      int32 `[max_len]`.
    """
    if max_len < 1:
      raise ValueError(f'max_len must be >= 1, got {max_len}')
    words = self.ids(_checked_tokens(caption))[:max_len]
    out = np.zeros([max_len], np.int32)
    out[:len(words)] = words
    return out

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Detokenises like the original (`convert_ids_to_sentence`, spec 5.7).

    Drops `[PAD]` (and `-1`) anywhere, skips the first remaining token (the `[BOS]`), stops at
    the first `[EOS]` and joins the words with spaces.

    Args:
      ids: int `[L]`, e.g. a decoded row starting with `[BOS]`.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1:
      raise ValueError(f'decode takes one sequence [L], got shape {ids.shape}; use decode_batch')
    kept = [int(i) for i in ids if i != PAD and i != IGNORE]
    words = []
    for idx in kept[1:]:
      if idx == EOS:
        break
      if not 0 <= idx < self.size:
        raise ValueError(f'token id {idx} is outside the vocabulary (size {self.size})')
      words.append(self.idx2word[idx])
    return ' '.join(words)

  def decode_batch(self, ids: np.ndarray) -> list[str]:
    """`decode` on each row of an int `[B, L]` array."""
    return [self.decode(row) for row in np.asarray(ids)]


def _checked_tokens(caption) -> list[str]:
  if not isinstance(caption, str):
    raise errors.UserError(f'a caption must be a string, got {type(caption).__name__} '
                           f'{_short(caption)}')
  if not caption.strip():
    raise errors.UserError(f'caption {caption!r} is empty; every caption needs at least one word')
  return tokenize(caption)


def _problem(word2idx) -> str | None:
  """What is wrong with a word2idx mapping (completes 'the vocabulary ...'), or None."""
  if not isinstance(word2idx, Mapping):
    return f'must be a JSON object word -> id, got {type(word2idx).__name__}'
  for word, idx in word2idx.items():
    if not isinstance(word, str) or isinstance(idx, bool) or not isinstance(idx, int):
      return f'maps {word!r} to {idx!r}; every entry must be a word -> integer id'
  missing = [t for t in SPECIAL_TOKENS if t not in word2idx]
  if missing:
    return (f'lacks the special tokens {" ".join(missing)}; ids 0-7 must be '
            f'{" ".join(SPECIAL_TOKENS)}')
  wrong = [f'{t}={word2idx[t]}' for i, t in enumerate(SPECIAL_TOKENS) if word2idx[t] != i]
  if wrong:
    return (f'has special tokens at the wrong ids ({", ".join(wrong)}); ids 0-7 must be '
            f'{" ".join(SPECIAL_TOKENS)}')
  by_id = collections.defaultdict(list)
  for word, idx in word2idx.items():
    by_id[idx].append(word)
  shared = [(i, ws) for i, ws in sorted(by_id.items()) if len(ws) > 1]
  if shared:
    i, ws = shared[0]
    return f'gives id {i} to several words ({", ".join(map(repr, ws[:3]))}); ids must be unique'
  if sorted(by_id) != list(range(len(word2idx))):
    gap = min(set(range(len(word2idx))) - set(by_id))
    return f'has no word with id {gap}; ids must be 0..{len(word2idx) - 1} without gaps'
  return None


def _short(value, limit: int = 40) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + '...'
