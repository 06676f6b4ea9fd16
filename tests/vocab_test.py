"""Tests for procap_jax.data.vocab: special ids, encoding, labels, the original vocabularies."""

import json

import numpy as np
import pytest

from procap_jax import errors
from procap_jax.data import vocab as vocab_lib

CAPTIONS = [
    'The red cube has moved.',
    'the red cube is gone',
    'The blue sphere has moved!',
    'the red sphere is gone',
    'THE RED CUBE HAS MOVED',
]


@pytest.fixture
def vocab():
  return vocab_lib.Vocab.build(CAPTIONS, min_word_count=1)


def test_special_ids():
  assert vocab_lib.SPECIAL_TOKENS == ('[PAD]', '[CLS]', '[SEP]', '[VID]', '[BOS]', '[EOS]',
                                      '[UNK]', '[MASK]')
  assert (vocab_lib.PAD, vocab_lib.CLS, vocab_lib.SEP, vocab_lib.VID, vocab_lib.BOS,
          vocab_lib.EOS, vocab_lib.UNK, vocab_lib.MASK) == tuple(range(8))


def test_tokenize_lowercases_and_splits_like_nltk():
  assert vocab_lib.tokenize('The cube is GONE.') == ['the', 'cube', 'is', 'gone', '.']
  assert vocab_lib.tokenize("the man's car cannot move, gonna") == [
      'the', 'man', "'s", 'car', 'can', 'not', 'move', ',', 'gon', 'na']
  assert vocab_lib.tokenize('   ') == []
  # preserve_line=True: an inner sentence end stays attached (documented difference).
  assert vocab_lib.tokenize('it is gone. the cube moved.') == [
      'it', 'is', 'gone.', 'the', 'cube', 'moved', '.']


def test_build_counts_threshold_and_sorts(vocab):
  # counts: the 5, red 4, cube 3, has 3, moved 3, is 2, gone 2, sphere 2, blue 1, '.' 1, '!' 1
  words = vocab.idx2word[8:]
  assert words == ['cube', 'gone', 'has', 'is', 'moved', 'red', 'sphere', 'the']
  assert vocab.size == 16 and len(vocab) == 16
  assert vocab.idx2word[:8] == list(vocab_lib.SPECIAL_TOKENS)
  assert all(vocab.word2idx[w] == i for i, w in enumerate(vocab.idx2word))
  strict = vocab_lib.Vocab.build(CAPTIONS, min_word_count=3)
  assert strict.idx2word[8:] == ['red', 'the']  # count > 3, not >= 3
  # Order does not depend on caption order.
  assert vocab_lib.Vocab.build(CAPTIONS[::-1], min_word_count=1) == vocab


def test_build_skips_empty_and_rejects_non_strings():
  v = vocab_lib.Vocab.build(['a b', '', '  ', 'a b'], min_word_count=1)
  assert v.idx2word[8:] == ['a', 'b']
  with pytest.raises(errors.UserError, match='caption 1 is not a string'):
    vocab_lib.Vocab.build(['a', None])
  with pytest.raises(errors.UserError, match='not a single string'):
    vocab_lib.Vocab.build('a caption')
  with pytest.raises(errors.UserError, match='min_word_count'):
    vocab_lib.Vocab.build(['a'], min_word_count=-1)


def test_encode_decoder(vocab):
  ids = vocab.encode_decoder('The red cube has moved to the LEFT.', max_len=12)
  w = vocab.word2idx
  assert ids.dtype == np.int32 and ids.shape == (12,)
  assert ids.tolist() == [4, w['the'], w['red'], w['cube'], w['has'], w['moved'], 6, w['the'],
                          6, 6, 5, 0]  # 'to', 'left', '.' are OOV -> [UNK]
  # Truncation keeps max_len - 2 words, then [EOS]; no padding left.
  long = vocab.encode_decoder(' '.join(['red'] * 30))
  assert long.shape == (24,)
  assert long[0] == 4 and long[-1] == 5 and (long[1:-1] == w['red']).all()


def test_encode_encoder_text(vocab):
  w = vocab.word2idx
  ids = vocab.encode_encoder_text('the cube is blue', max_len=6)
  assert ids.dtype == np.int32
  assert ids.tolist() == [w['the'], w['cube'], w['is'], 6, 0, 0]
  assert vocab.encode_encoder_text(' '.join(['red'] * 30)).tolist() == [w['red']] * 24


@pytest.mark.parametrize('bad, message', [('', 'empty'), ('  \n', 'empty'),
                                          (None, 'must be a string'), (3, 'must be a string')])
def test_encode_rejects_bad_captions(vocab, bad, message):
  with pytest.raises(errors.UserError, match=message):
    vocab.encode_decoder(bad)
  with pytest.raises(errors.UserError, match=message):
    vocab.encode_encoder_text(bad)


def test_decoder_labels_hand_example():
  ids = np.array([4, 10, 11, 5, 0, 0], np.int32)
  assert vocab_lib.decoder_labels(ids).tolist() == [10, 11, 5, -1, -1, -1]
  # A full row: the last position is ignored even though nothing follows it.
  full = np.array([4, 10, 11, 12, 5], np.int32)
  assert vocab_lib.decoder_labels(full).tolist() == [10, 11, 12, 5, -1]
  batch = np.stack([ids, np.array([4, 5, 0, 0, 0, 0])])
  labels = vocab_lib.decoder_labels(batch)
  assert labels.dtype == np.int32 and labels.shape == (2, 6)
  assert labels[1].tolist() == [5, -1, -1, -1, -1, -1]


def test_decoder_labels_match_original_formula(vocab):
  # clevr_dataset.py: [IGNORE if m == 0 else tid for tid, m in zip(ids, mask)][1:] + [IGNORE]
  for caption in CAPTIONS + ['red ' * 40]:
    ids = vocab.encode_decoder(caption).tolist()
    mask = [int(i != 0) for i in ids]
    expected = [-1 if m == 0 else t for t, m in zip(ids, mask)][1:] + [-1]
    assert vocab_lib.decoder_labels(np.array(ids)).tolist() == expected


def test_decode_round_trip(vocab):
  for caption in ['the red cube has moved', 'the sphere is gone']:
    assert vocab.decode(vocab.encode_decoder(caption)) == caption
  assert vocab.decode(vocab.encode_decoder('the cube went left')) == 'the cube [UNK] [UNK]'
  w = vocab.word2idx
  # Greedy output: PAD dropped anywhere, first token skipped, stop at the first [EOS].
  generated = [4, w['red'], 0, w['cube'], 5, w['the'], 5, 0]
  assert vocab.decode(np.array(generated)) == 'red cube'
  assert vocab.decode([4, 5, w['red']]) == ''
  assert vocab.decode_batch(np.array([[4, w['red'], 5], [4, w['cube'], 5]])) == ['red', 'cube']


def test_save_load_round_trip(vocab, tmp_path):
  path = tmp_path / 'sub' / 'word2idx.json'
  vocab.save(str(path))
  assert json.loads(path.read_text()) == vocab.word2idx
  assert vocab_lib.Vocab.load(str(path)) == vocab
  assert [p.name for p in path.parent.iterdir()] == ['word2idx.json']  # no temp files left


def _write(tmp_path, text):
  path = tmp_path / 'w.json'
  path.write_text(text)
  return str(path)


SPECIALS = {t: i for i, t in enumerate(vocab_lib.SPECIAL_TOKENS)}


@pytest.mark.parametrize('content, message', [
    ('{"[PAD]": 0,', 'not valid JSON'),
    ('["a", "b"]', 'JSON object'),
    (json.dumps({'[PAD]': 0, 'a': 1}), r'lacks the special tokens \[CLS\]'),
    (json.dumps({**SPECIALS, '[UNK]': 8, 'a': 6}), r'wrong ids \(\[UNK\]=8\)'),
    (json.dumps({**SPECIALS, 'a': 8, 'b': 8}), 'gives id 8 to several words'),
    (json.dumps({**SPECIALS, 'a': 9}), 'no word with id 8'),
    (json.dumps({**SPECIALS, 'a': '8'}), 'integer id'),
    (json.dumps(SPECIALS)[:-1] + ', "a": 8, "a": 9}', "word 'a' twice"),
])
def test_load_errors(tmp_path, content, message):
  with pytest.raises(errors.UserError, match=message):
    vocab_lib.Vocab.load(_write(tmp_path, content))


def test_load_missing_file(tmp_path):
  with pytest.raises(errors.UserError, match='does not exist'):
    vocab_lib.Vocab.load(str(tmp_path / 'nope.json'))


def test_error_messages_are_one_sentence(tmp_path):
  with pytest.raises(errors.UserError) as info:
    vocab_lib.Vocab.load(_write(tmp_path, json.dumps({'[PAD]': 0})))
  assert '\n' not in str(info.value) and str(info.value).count('; ') == 1


# ---------------------------------------------------------------------------------------------
# The original vocabularies (real files, ../shared/fixtures).


def _words(path):
  return {w for w in json.loads(path.read_text()) if w not in vocab_lib.SPECIAL_TOKENS}


def test_loads_the_original_files(fixtures_dir):
  for name, size in [('clevr_word2idx.json', 80), ('spot_word2idx2.json', 834),
                     ('edit_word2idx2.json', 524)]:
    path = fixtures_dir / 'procap_vocab' / name
    v = vocab_lib.Vocab.load(str(path))
    assert v.size == size
    assert v.word2idx == json.loads(path.read_text())


def test_recipe_reproduces_spot_vocabulary(fixtures_dir):
  train = json.loads((fixtures_dir / 'spot_the_diff' / 'annotations' / 'train.json').read_text())
  built = vocab_lib.Vocab.build(s for e in train for s in e['sentences'])
  expected = _words(fixtures_dir / 'procap_vocab' / 'spot_word2idx2.json')
  assert set(built.idx2word[8:]) == expected  # exactly: 826 words
  assert len(expected) == 826
  # The file was built with nltk too: "cannot"/"gonna" appear only as their nltk pieces.
  assert {'can', 'not'} <= expected and 'cannot' not in expected
  # The original order is a hash-randomised set order: only the set is reproducible.
  assert built.idx2word[8:] == sorted(expected)


def test_recipe_reproduces_ier_vocabulary(fixtures_dir):
  train = json.loads((fixtures_dir / 'image_editing_request' / 'train.json').read_text())
  expected = _words(fixtures_dir / 'procap_vocab' / 'edit_word2idx2.json')
  assert len(expected) == 516
  assert {'gon', 'na'} <= expected and 'gonna' not in expected
  # Distinct (image pair, lower-cased request) -> exactly the file's words.
  distinct = {(e['img0'], e['img1'], s.lower()): s for e in train for s in e['sents']}
  built = vocab_lib.Vocab.build(distinct.values())
  assert set(built.idx2word[8:]) == expected
  # Counting the repeated requests too adds three words seen 4 times (3 distinct).
  every = vocab_lib.Vocab.build(s for e in train for s in e['sents'])
  assert set(every.idx2word[8:]) - expected == {'paw', 'reflections', 'lightning'}
  assert expected <= set(every.idx2word[8:])


def test_sorted_order_matches_the_clevr_file(fixtures_dir):
  path = fixtures_dir / 'procap_vocab' / 'clevr_word2idx.json'
  original = json.loads(path.read_text())
  words = [w for w in original if w not in vocab_lib.SPECIAL_TOKENS]
  built = vocab_lib.Vocab.build([' '.join(words)] * 4)
  assert built.word2idx == original
