"""Reliability properties (issue 8): decoding images, captions and files never crashes. Each
test checks its property on hypothesis' examples, then records its row of docs/reliability.md
(tests/conftest.py's `fault` fixture).
"""

import io
import json
import os

import hypothesis
from hypothesis import strategies as st
import numpy as np
import PIL.Image

from procap_jax import errors


_PROPERTY = hypothesis.settings(max_examples=60, deadline=None, derandomize=True,
                                suppress_health_check=list(hypothesis.HealthCheck))


_MODES_BY_FORMAT = {
    'PNG': ('1', 'L', 'LA', 'P', 'RGB', 'RGBA', 'I;16', 'I'),
    'JPEG': ('L', 'RGB', 'CMYK'),
    'BMP': ('1', 'L', 'P', 'RGB'),
    'GIF': ('L', 'P'),
    'TIFF': ('1', 'L', 'LA', 'P', 'RGB', 'RGBA', 'CMYK', 'I;16', 'I', 'F'),
    'WEBP': ('RGB', 'RGBA'),
}


@_PROPERTY
@hypothesis.given(st.data(), st.integers(1, 48), st.integers(1, 48),
                  st.sampled_from([None, 1, 7, 32]), st.integers(0, 2**32 - 1))


def _images_decode_to_rgb(data, width, height, size, seed):
  from procap_jax.data import images
  fmt = data.draw(st.sampled_from(sorted(_MODES_BY_FORMAT)))
  mode = data.draw(st.sampled_from(_MODES_BY_FORMAT[fmt]))
  rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
  img = PIL.Image.fromarray(rgb).convert('RGBA').convert(mode) if mode not in (
      'I;16', 'I', 'F') else PIL.Image.fromarray(rgb[..., 0]).convert(mode)
  buf = io.BytesIO()
  try:
    img.save(buf, format=fmt)
  except (OSError, ValueError, KeyError):
    hypothesis.assume(False)  # PIL cannot write this combination
  out = images.load_image(buf.getvalue(), size=size)
  assert out.dtype == np.uint8 and out.shape == ((size, size, 3) if size else (height, width, 3))


def test_property_images_of_any_format_mode_and_size_decode_to_rgb(fault):
  _images_decode_to_rgb()  # pylint: disable=no-value-for-parameter
  fault('image decoding (builders, caption command)', 'hypothesis: any format (PNG, JPEG, BMP, '
        'GIF, TIFF, WebP) x mode (1, L, LA, P, RGB, RGBA, CMYK, I;16, I, F) x size 1-48 px, '
        'resized or not; plus random bytes, truncations, byte flips and header sizes up to '
        '2^31 (tests/images_test.py)', 'always RGB uint8 of the right shape, or one UserError '
        'sentence; never another exception')


def _valid_or_user_error(fn, *args):
  """Calls fn; a UserError (one line) is fine, any other exception fails the property."""
  try:
    return fn(*args)
  except errors.UserError as e:
    assert str(e) and '\n' not in str(e)
    return None


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(['image_id', 'caption', 'results', 'sentence', '[PAD]', 'a', 'sentences']),
        children, max_size=4),
    max_leaves=12)
_FILE_BYTES = st.one_of(st.binary(max_size=200),
                        _JSONISH.map(lambda v: json.dumps(v).encode()),
                        st.text(max_size=60).map(lambda t: t.encode('utf-8', 'surrogatepass')))


def _make_vocab():
  from procap_jax.data import vocab as vocab_lib
  return vocab_lib.Vocab.build(['the red cube moved', 'a blue ball is gone'], min_word_count=0)


_VOCAB = _make_vocab()


@_PROPERTY
@hypothesis.given(st.text(max_size=80))
def _caption_tokenises_or_is_a_user_error(caption):
  from procap_jax.data import vocab as vocab_lib
  vocab = _VOCAB
  tokens = vocab_lib.tokenize(caption)
  assert all(isinstance(t, str) for t in tokens)
  for encode in (vocab.encode_decoder, vocab.encode_encoder_text):
    ids = _valid_or_user_error(encode, caption, 12)
    if not caption.strip():
      assert ids is None  # empty captions are refused with one sentence
      continue
    assert ids.shape == (12,) and ids.dtype == np.int32 and (0 <= ids).all()
    assert (ids < vocab.size).all()
  if caption.strip():
    assert isinstance(vocab.decode(vocab.encode_decoder(caption, 12)), str)


def test_property_any_unicode_caption_tokenises_or_is_a_user_error(fault):
  _caption_tokenises_or_is_a_user_error()  # pylint: disable=no-value-for-parameter
  fault('caption decoding', 'hypothesis: any unicode caption (empty, whitespace, control '
        'characters, surrogates) through tokenize / encode_decoder / encode_encoder_text',
        'token ids of the right shape and range; empty captions give one UserError sentence; '
        'never another exception')


@_PROPERTY
@hypothesis.given(st.binary(max_size=80))
def _caption_bytes_decode_or_are_a_user_error(raw):
  from procap_jax.data import pipeline
  text = _valid_or_user_error(pipeline._text, raw)  # pylint: disable=protected-access
  try:
    assert text == raw.decode('utf-8')
  except UnicodeDecodeError:
    assert text is None


def test_property_caption_bytes_decode_or_are_a_user_error(fault):
  _caption_bytes_decode_or_are_a_user_error()  # pylint: disable=no-value-for-parameter
  fault('caption decoding', 'hypothesis: any bytes as a stored caption', 'the UTF-8 text; '
        'non-UTF-8 bytes give one UserError sentence; never another exception')


@_PROPERTY
@hypothesis.given(content=_FILE_BYTES)
def _file_content_reads_or_is_a_user_error(d: str, content: bytes):
  from procap_jax import caption
  from procap_jax import evaluation
  from procap_jax.data import vocab as vocab_lib
  from procap_jax.procedure import scores as scores_lib
  from tfds_builders import common
  import argparse
  path = os.path.join(d, 'file.json')
  with open(path, 'wb') as f:
    f.write(content)
  _valid_or_user_error(evaluation.read_results, path)
  _valid_or_user_error(evaluation.read_references, path)
  _valid_or_user_error(vocab_lib.Vocab.load, path)
  _valid_or_user_error(scores_lib.load_scores, path)
  _valid_or_user_error(common.read_json, d, 'file.json')
  os.replace(path, os.path.join(d, 'config.json'))
  _valid_or_user_error(caption.load_run_config, d)
  os.replace(os.path.join(d, 'config.json'), os.path.join(d, 'pairs.csv'))
  args = argparse.Namespace(csv=os.path.join(d, 'pairs.csv'), before_dir=None, after_dir=None,
                            images=[])
  _valid_or_user_error(caption.pairs_from_args, args)


def test_property_any_file_content_reads_or_is_a_user_error(tmp_path, fault):
  _file_content_reads_or_is_a_user_error(str(tmp_path))  # pylint: disable=no-value-for-parameter
  fault('file readers', 'hypothesis: random bytes, random JSON and random text as a results, '
        'references, vocabulary, scores, annotation, run config or pairs CSV file',
        'parsed, or one UserError sentence naming the file; never another exception')
