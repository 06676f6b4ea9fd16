"""pycocoevalcap's Java tools, run quietly: the PTB tokenizer, METEOR and SPICE.

What `evaluation.score_captions` runs them with, and how that differs from pycocoevalcap's own
wrappers without changing a score, is in the `evaluation` module docstring.
"""

import contextlib
import os
import subprocess
import sys
import tempfile

from pycocoevalcap.meteor import meteor
from pycocoevalcap.spice import get_stanford_models
from pycocoevalcap.spice import spice
from pycocoevalcap.tokenizer import ptbtokenizer

from procap_jax import errors

_JAVA_HINT = 'install a Java runtime (java on PATH); pycocoevalcap needs it'
_LINE_BREAKS = str.maketrans({c: ' ' for c in '\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029'})
_spice_verdict: list[str | None] = []  # [] = not checked yet; [None] = usable; [reason]



def ptb_tokenize(captions: list[str]) -> list[str]:
  """pycocoevalcap's PTBTokenizer (same jar, flags and punctuation removal), one caption a line."""
  jar = os.path.join(os.path.dirname(os.path.abspath(ptbtokenizer.__file__)),
                     ptbtokenizer.STANFORD_CORENLP_3_4_1_JAR)
  text = '\n'.join(c.translate(_LINE_BREAKS) for c in captions)
  with tempfile.TemporaryDirectory(prefix='procap_ptb_') as tmp:
    path = os.path.join(tmp, 'captions.txt')
    with open(path, 'wb') as f:
      f.write(text.encode())
    cmd = ['java', '-cp', jar, 'edu.stanford.nlp.process.PTBTokenizer', '-preserveLines',
           '-lowerCase', path]
    try:
      proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False)
    except FileNotFoundError:
      raise errors.UserError(f'java was not found; {_JAVA_HINT}') from None
  if proc.returncode != 0:
    raise RuntimeError(f'PTBTokenizer failed ({proc.returncode}): '
                       f'{proc.stderr.decode(errors="replace")[-500:]}')
  lines = proc.stdout.decode().split('\n')
  if len(lines) < len(captions) or any(line.strip() for line in lines[len(captions):]):
    raise RuntimeError(f'PTBTokenizer returned {len(lines)} lines for {len(captions)} captions')
  punctuation = set(ptbtokenizer.PUNCTUATIONS)
  return [' '.join(w for w in line.rstrip().split(' ') if w not in punctuation)
          for line in lines[:len(captions)]]


def start_meteor() -> meteor.Meteor:
  try:
    return meteor.Meteor()
  except FileNotFoundError:
    raise errors.UserError(f'java was not found; {_JAVA_HINT}') from None


def stop_meteor(scorer: meteor.Meteor) -> None:
  """Ends the METEOR Java process now (its own __del__ would wait for garbage collection)."""
  with scorer.lock:
    proc = scorer.meteor_p
    for stream in (proc.stdin, proc.stdout, proc.stderr):
      stream.close()
    proc.kill()
    proc.wait()


def _spice_jars() -> list[str]:
  base = os.path.join(get_stanford_models.SPICEDIR, get_stanford_models.SPICELIB,
                      get_stanford_models.JAR)
  return [base + '.jar', base + '-models.jar']


def spice_scores(gts, res) -> tuple[dict | None, str | None]:
  """Per-id SPICE F-scores, or (None, note) when SPICE cannot run; the verdict is cached."""
  if not _spice_verdict:
    missing = [p for p in _spice_jars() if not os.path.exists(p)]
    _spice_verdict.append(
        f'SPICE not computed: Stanford CoreNLP 3.6.0 is not installed ({missing[0]}); run '
        '"python -m pycocoevalcap.spice.get_stanford_models" with internet access to enable it'
        if missing else None)
  if _spice_verdict[0]:
    return None, _spice_verdict[0]
  try:
    with _stdout_to_stderr():
      _, per_id = spice.Spice().compute_score(gts, res)
    scores = {i: float(s['All']['f']) for i, s in zip(sorted(gts), per_id)}
  except Exception as e:  # noqa: BLE001 -- SPICE is optional: any failure disables it.
    _spice_verdict[0] = f'SPICE not computed: it failed ({type(e).__name__}: {e})'[:300]
    return None, _spice_verdict[0]
  return scores, None


@contextlib.contextmanager
def _stdout_to_stderr():
  """Sends file descriptor 1 (e.g. a Java child's output) to stderr for the duration."""
  sys.stdout.flush()
  saved = os.dup(1)
  try:
    os.dup2(2, 1)
    yield
  finally:
    sys.stdout.flush()
    os.dup2(saved, 1)
    os.close(saved)
