"""Reliability of the output writers (issue 8): every file is replaced atomically, and an audit
of every write in the code. Rows of docs/reliability.md, as tests/conftest.py's `fault` fixture
records them.
"""

import glob
import os
import re

import numpy as np
import pytest

from procap_jax import errors

import reliability_helpers as helpers


def _writers(tmp_path) -> dict:
  from procap_jax import evaluation
  from procap_jax.data import vocab as vocab_lib
  from procap_jax.procedure import scores as scores_lib
  from procap_jax.tasks import tokenizer
  images = np.zeros((2, 4, 4, 3), np.float32)
  return {
      'results.json, report.html, DONE, config.json, --out files (write_text_atomic)':
          lambda p: errors.write_text_atomic(p, 'new'),
      'predictions (evaluation.write_results)':
          lambda p: evaluation.write_results(p, {'a': 'a cube'}),
      'references (evaluation.write_references)':
          lambda p: evaluation.write_references(p, {'a': ['a cube']}),
      'vocabulary word2idx.json (Vocab.save)':
          lambda p: vocab_lib.Vocab.build(['a cube'], 0).save(p),
      'confidence scores file (scores.write_scores)':
          lambda p: scores_lib.write_scores(p, {'x': (np.ones((1, 9)), np.ones((1, 9)))}, 'flat'),
      'PNG reconstructions (tokenizer.write_reconstructions)':
          lambda p: tokenizer.write_reconstructions(p, images, images),
  }


def test_writers_replace_files_atomically(tmp_path, monkeypatch, fault):
  for name, write in _writers(tmp_path).items():
    path = str(tmp_path / 'out')
    with open(path, 'w') as f:
      f.write('old')

    def crash(*args):
      raise OSError('simulated crash before the rename')

    with monkeypatch.context() as m:
      m.setattr(os, 'replace', crash)
      with pytest.raises(OSError, match='simulated'):
        write(path)
    with open(path) as f:
      assert f.read() == 'old', name
    assert sorted(os.listdir(tmp_path)) == ['out'], name
    write(path)
    assert os.path.getsize(path) > 0
    fault('output writers', f'{name}: crash between writing and renaming',
          'the previous file stays intact and the temporary file is removed')


_WRITE_CALL = re.compile(r"open\([^)]*['\"](w|a|x)b?['\"]|\.savefig\(|\.save\(|json\.dump\(|"
                         r"np\.save|\.write_bytes\(|\.write_text\(")
_EXPLAINED = (
    re.compile(r'\((tmp|buf)\b'),            # inside errors.atomic_path, or to memory
    re.compile(r'\.save\((step|0,)'),        # orbax (a temporary directory, then a rename)
    re.compile(r"^\s*'.*torch\.save\("),     # a message naming torch.save, not a write
    re.compile(r'[Vv]ocab.*\.save\(|^\s*min_word_count=.*\.save\('),  # Vocab.save is atomic
)
_DIRECT_WRITES = {  # the only writes that are not atomic, and why that is safe
    ('procap_jax/train_log.py', "open(path, 'a'"): 'metrics.jsonl is append-only; a line cut by a '
                                               'kill is dropped when the run resumes',
    ('procap_jax/java_scorers.py', "open(path, 'wb')"): "the Java tokenizer's input, in a "
                                                        'private temporary directory',
    ('procap_jax/data/feature_cache.py', "open(path, 'a'"): 'the build lock, opened for flock '
                                                            'only: nothing is written to it',
    ('procap_jax/ablations.py', "open(log, 'a'"): "a --jobs child's stdout log, append-only; "
                                                 'the runs it reports on write their own files '
                                                 'atomically',
}


def test_every_file_write_in_the_code_is_atomic(fault):
  unexplained = []
  for root in ('procap_jax', 'tfds_builders'):
    for path in glob.glob(os.path.join(helpers.REPO, root, '**', '*.py'), recursive=True):
      rel = os.path.relpath(path, helpers.REPO)
      if rel == 'procap_jax/errors.py':
        continue
      with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
          if not _WRITE_CALL.search(line) or any(p.search(line) for p in _EXPLAINED):
            continue
          if not any(rel == f_ and snippet in line for f_, snippet in _DIRECT_WRITES):
            unexplained.append(f'{rel}:{n}: {line.strip()}')
  assert not unexplained, unexplained
  fault('output writers', 'audit of every file write in procap_jax/ and tfds_builders/',
        'all go through errors.atomic_path (temporary file + rename) or orbax, except: '
        + '; '.join(f'{f} ({why})' for (f, _), why in _DIRECT_WRITES.items()))
