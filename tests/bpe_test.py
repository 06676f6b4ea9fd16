"""Tests for procap_jax.data.bpe: parity with the original CLIP tokenizer, ProCap's fixed length,
the merges file's quirks and where the file is found.

The parity fixtures (tests/parity/fixtures/bpe_*) hold ids the ORIGINAL `SimpleTokenizer`
produced with a small merges file of ours; `tests/parity/gen_bpe.py` regenerates them.
"""

import gzip
import json
import os
import pathlib
import sys

import numpy as np
import pytest

from procap_jax import errors
from procap_jax.data import bpe

PARITY = pathlib.Path(__file__).parent / 'parity' / 'fixtures'
MERGES = str(PARITY / 'bpe_merges.txt')
FIXTURE = json.loads((PARITY / 'bpe_cases.json').read_text(encoding='utf-8'))


@pytest.fixture(scope='module')
def tok() -> bpe.Bpe:
  return bpe.Bpe.from_file(MERGES)


@pytest.mark.parametrize('case', FIXTURE['cases'], ids=lambda c: repr(c['text'][:30]))
def test_ids_equal_the_originals(tok, case):
  assert tok.encode(case['text']) == case['ids']
  fixed = tok.encode_fixed(case['text'])
  assert fixed.dtype == np.int32
  assert fixed.tolist() == case['fixed24']


def test_fixtures_cover_the_hard_cases():
  """The fixture strings exercise truncation, id 0 ('!'), the empty text and repeated merges."""
  cases = FIXTURE['cases']
  assert len(cases) >= 60
  assert sum(len(c['ids']) > 24 for c in cases) >= 3
  assert any(0 in c['ids'] for c in cases)
  assert any(c['text'] == '' for c in cases)
  repeated = set(FIXTURE['duplicate_ids'].values())
  assert any(repeated & set(c['ids']) for c in cases)


def test_vocabulary_of_a_short_merges_file(tok):
  """The original's layout: 512 byte symbols, the merges, the final empty line, two specials;
  a string two merges produce keeps the later id."""
  n = FIXTURE['num_merges']
  assert tok.vocab_size == FIXTURE['num_ids'] == 512 + n + 1 + 2
  assert tok.encoder[''] == FIXTURE['empty_merge_id'] == 512 + n
  assert [tok.encoder[s] for s in bpe.SPECIAL_TOKENS] == FIXTURE['special_ids']
  for text, i in FIXTURE['duplicate_ids'].items():
    assert tok.encoder[text] == i
  assert tok.encode('<|startoftext|>') == [FIXTURE['special_ids'][0]]


def test_bytes_to_unicode_table():
  table = bpe.bytes_to_unicode()
  assert len(table) == 256 and len(set(table.values())) == 256
  assert table[ord('!')] == '!' and table[ord(' ')] == chr(256 + 32)
  assert list(table)[:3] == [ord('!'), ord('"'), ord('#')]
  assert list(table)[-1] == 173  # the soft hyphen, the last non-printable byte


def test_encode_fixed_truncates_and_pads(tok):
  text = ' '.join(['the small red metal cube changed to yellow'] * 4)
  ids = tok.encode(text)
  assert len(ids) > 24
  np.testing.assert_array_equal(tok.encode_fixed(text), ids[:24])
  short = tok.encode('the cube')
  fixed = tok.encode_fixed('the cube', length=7)
  assert fixed.tolist() == short + [0] * (7 - len(short))
  assert tok.encode_fixed('').tolist() == [0] * 24
  with pytest.raises(ValueError, match='length'):
    tok.encode_fixed('the cube', length=0)


def test_decode_inverts_encode(tok):
  assert tok.decode(tok.encode('The Small red cube, moved!')) == 'the small red cube , moved ! '


def test_merges_list_is_cut_like_the_original(tmp_path):
  """Only lines 1..48894 are read: a long file gives 49,408 ids and later rules never fire."""
  chars = list(bpe.bytes_to_unicode().values())
  lines = ['#version: 0.2'] + [f'{a} {b}' for a in chars[:200] for b in chars[:250]][:49000]
  lines[1 + bpe.MAX_MERGES] = 'c at</w>'  # the first rule past the cut
  path = tmp_path / 'long.txt'
  path.write_text('\n'.join(lines) + '\n', encoding='utf-8')
  assert len(bpe.read_merges(str(path))) == bpe.MAX_MERGES == 48894
  long = bpe.Bpe.from_file(str(path))
  assert long.vocab_size == bpe.VOCAB_SIZE
  assert long.encoder['<|endoftext|>'] == bpe.VOCAB_SIZE - 1
  assert ('c', 'at</w>') not in long.ranks


def test_gzip_and_crlf_files_read_the_same(tmp_path, tok):
  text = pathlib.Path(MERGES).read_text(encoding='utf-8')
  gz = tmp_path / 'm.txt.gz'
  with gzip.open(gz, 'wt', encoding='utf-8', newline='') as f:
    f.write(text.replace('\n', '\r\n'))
  other = bpe.Bpe.from_file(str(gz))
  assert other.encoder == tok.encoder and other.ranks == tok.ranks


def test_unreadable_merges_file_is_a_user_error(tmp_path):
  bad = tmp_path / 'bad.txt.gz'
  bad.write_bytes(b'not gzip')
  with pytest.raises(errors.UserError, match='not readable'):
    bpe.read_merges(str(bad))
  with pytest.raises(errors.UserError, match='does not exist'):
    bpe.read_merges(str(tmp_path / 'missing.txt'))


def test_find_merges_file_uses_the_given_path(tmp_path):
  assert bpe.find_merges_file(MERGES) == MERGES
  with pytest.raises(errors.UserError, match='config.data.bpe_merges_file'):
    bpe.find_merges_file(str(tmp_path / 'missing.txt'))


def test_find_merges_file_searches_packages_without_importing_them(tmp_path, monkeypatch):
  package = tmp_path / 'procap_fake_clip'
  package.mkdir()
  (package / '__init__.py').write_text('raise RuntimeError("imported")\n')
  with gzip.open(package / 'bpe_simple_vocab_16e6.txt.gz', 'wb') as f:
    f.write(pathlib.Path(MERGES).read_bytes())
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(bpe, 'PACKAGES_WITH_MERGES', ('procap_missing_pkg', 'procap_fake_clip'))
  found = bpe.find_merges_file('')
  assert found == str(package / 'bpe_simple_vocab_16e6.txt.gz')
  assert 'procap_fake_clip' not in sys.modules


def test_find_merges_file_without_packages_is_a_user_error(monkeypatch):
  monkeypatch.setattr(bpe, 'PACKAGES_WITH_MERGES', ('procap_missing_pkg',))
  with pytest.raises(errors.UserError, match='config.data.bpe_merges_file') as e:
    bpe.find_merges_file('')
  assert 'bpe_simple_vocab_16e6' in str(e.value)


def _real_merges_file() -> str:
  """CLIP's own merges file: $PROCAP_CLIP_MERGES, else an installed open_clip / clip package."""
  try:
    return bpe.find_merges_file(os.environ.get('PROCAP_CLIP_MERGES', ''))
  except errors.UserError:
    pytest.skip("CLIP's merges file is not on this machine (set PROCAP_CLIP_MERGES to "
                'bpe_simple_vocab_16e6.txt[.gz] or install open_clip_torch)')


def test_real_clip_merges_file():
  tok = bpe.load(_real_merges_file())
  assert tok.vocab_size == bpe.VOCAB_SIZE == 49408
  assert [tok.encoder[s] for s in bpe.SPECIAL_TOKENS] == [49406, 49407]
  assert tok.encode('a photo of a cat') == [320, 1125, 539, 320, 2368]  # CLIP's well-known ids
