"""Tests for procap_jax.evaluation: reference values, groups, errors, files, CLI, real references.

Only `test_toy_reference_values_with_meteor` starts METEOR (about 10 s of Java start-up).
"""

import json
import os
import pathlib
import random
import subprocess
import sys
import time

from pycocoevalcap.bleu import bleu
from pycocoevalcap.cider import cider
from pycocoevalcap.rouge import rouge
from pycocoevalcap.tokenizer import ptbtokenizer
from pycocotools import coco
import pytest

from procap_jax import errors
from procap_jax import evaluation
from procap_jax import java_scorers

REPO = pathlib.Path(__file__).resolve().parents[1]

# The toy case of env-notes.md (values measured with pycocoevalcap 1.2).
REFS = {
    '1': ['The small red cube has moved to the left.', 'A tiny red cube changed its location.'],
    '2': ['The big blue sphere has disappeared.', 'There is no longer a large blue ball.'],
    '3': ['The scene is the same as before.', 'Nothing has changed.'],
}
HYPS = {'1': 'The small red cube has been moved.', '2': 'The large blue sphere is missing.',
        '3': 'Nothing has changed.'}
EXPECTED = {'Bleu_4': 0.498066, 'METEOR': 0.498664, 'ROUGE_L': 0.744489, 'CIDEr': 2.878075}
METRICS = ['Bleu_1', 'Bleu_2', 'Bleu_3', 'Bleu_4', 'ROUGE_L', 'CIDEr']


def _score(predictions, references, groups=None):
  return evaluation.score_captions(predictions, references, groups, use_meteor=False,
                                   use_spice=False)


def test_toy_reference_values_with_meteor():
  result = evaluation.score_captions(HYPS, REFS, groups={'two': ['1', '3']})
  for name, value in EXPECTED.items():
    assert result['all'][name] == pytest.approx(value, abs=1e-4), name
  assert list(result['all']) == ['Bleu_1', 'Bleu_2', 'Bleu_3', 'Bleu_4', 'METEOR', 'ROUGE_L',
                                 'CIDEr', 'SPICE']
  # The METEOR process is shared by the groups: the group differs from the total.
  assert 0 < result['two']['METEOR'] < 1 and result['two']['METEOR'] != result['all']['METEOR']


def test_toy_reference_values_without_meteor():
  result = _score(HYPS, REFS)
  assert set(result) == {'all'}
  assert list(result['all']) == METRICS
  for name in ['Bleu_4', 'ROUGE_L', 'CIDEr']:
    assert result['all'][name] == pytest.approx(EXPECTED[name], abs=1e-4), name


def test_groups_are_rescored_on_their_own_ids():
  result = _score(HYPS, REFS, groups={'two': ['1', '3', 'not-predicted'], 'none': ['x']})
  alone = _score({i: HYPS[i] for i in ['1', '3']}, REFS)
  assert result['two'] == alone['all']  # CIDEr's document frequencies come from the group only
  assert result['two']['CIDEr'] != result['all']['CIDEr']
  assert 'none' not in result
  assert result['notes'] == ["group 'none' has no predicted ids and was not scored"]


def test_only_predicted_ids_are_scored():
  extra_refs = {**REFS, '4': ['A completely different caption about a dog.']}
  assert _score(HYPS, extra_refs) == _score(HYPS, REFS)


def test_change_decision_counts_no_change_templates():
  refs = {'1c': ['the red cube is now blue'], '2c': ['a sphere was added'],
          '3c': ['the cube moved'], '1nc': ['there is no change', 'Nothing has changed.'],
          '2nc': ['no change was made']}
  preds = {'1c': 'the red cube is now blue',      # right: a change
           '2c': 'nothing has changed',           # wrong: says no change
           '3c': 'no  change was made .',         # wrong (case, spacing, punctuation ignored)
           '1nc': 'There is no change',           # right
           '2nc': 'the cube moved'}               # wrong: invents a change
  groups = evaluation.clevr_groups(preds)
  assert evaluation.change_decision(preds, refs, groups['change'], groups['no_change']) == 2 / 5
  scores = _score(preds, refs, groups=groups)
  assert scores['all']['change_decision'] == 2 / 5 and 'change_decision' not in scores['change']
  always_none = {i: 'there is no change' for i in preds}
  assert evaluation.change_decision(always_none, refs, groups['change'],
                                    groups['no_change']) == 2 / 5
  assert 'change_decision' not in _score(HYPS, REFS)['all']  # no groups: not defined


def test_clevr_and_type_groups():
  ids = ['000001c', '000001nc', '000002c', '000002nc']
  assert evaluation.clevr_groups(ids) == {'change': ['000001c', '000002c'],
                                          'no_change': ['000001nc', '000002nc']}
  mapping = {'color': ['000001.png', '000009.png'], 'move': ['000002nc']}
  assert evaluation.type_groups(mapping, ids) == {'color': ['000001c'], 'move': ['000002nc']}


@pytest.mark.parametrize('predictions, references, groups, message', [
    ({}, REFS, None, 'no predictions'),
    ({**HYPS, 'a7': 'x', 'b8': 'y'}, REFS, None, r"2 of 5 predicted ids have no references "
                                                 r"\(e.g. 'a7', 'b8'\)"),
    ({**HYPS, '1': None}, REFS, None, "prediction for id '1' is NoneType"),
    ({**HYPS, '1': ['a']}, REFS, None, "prediction for id '1' is list"),
    (HYPS, {**REFS, '2': 'a caption'}, None, "references of id '2' are 'a caption'"),
    (HYPS, {**REFS, '2': []}, None, "references of id '2' are list"),
    (HYPS, {**REFS, '3': ['ok', 5]}, None, "a reference of id '3' is int 5"),
    (HYPS, REFS, {'all': ['1']}, "'all' cannot name a group"),
    (HYPS, REFS, {'g': '1'}, "group 'g' must be a list"),
])
def test_bad_inputs(predictions, references, groups, message):
  with pytest.raises(errors.UserError, match=message) as info:
    _score(predictions, references, groups)
  assert '\n' not in str(info.value)


def test_empty_captions_are_scored_with_notes():
  # As the original: an empty prediction (decoder emitted [EOS] first) or an id whose only
  # reference is empty (the real Spot-the-Diff test file has 7) is scored, not rejected.
  result = _score({**HYPS, '1': '  ', '4': 'a caption'}, {**REFS, '4': ['']})
  assert result['notes'] == [
      '1 predictions are empty and were scored as empty captions',
      '1 scored ids have only empty reference captions (scored as the original does)']
  assert result['all']['CIDEr'] < _score(HYPS, REFS)['all']['CIDEr']


def test_line_breaks_inside_captions_do_not_shift_lines():
  refs = {'a': ['the cube\nmoved', 'it\r\nmoved'], 'b': ['nothing\u2028changed']}
  tokens = java_scorers.ptb_tokenize(['The cube\rmoved.', *refs['a'], *refs['b']])
  assert tokens == ['the cube moved', 'the cube moved', 'it moved', 'nothing changed']


def test_spice_unavailable_is_fast_and_cached(monkeypatch, tmp_path):
  monkeypatch.setattr(java_scorers, '_spice_verdict', [])
  monkeypatch.setattr(java_scorers, '_spice_jars', lambda: [str(tmp_path / 'corenlp.jar')])
  start = time.perf_counter()
  scores, note = java_scorers.spice_scores({'1': ['a b']}, {'1': ['a b']})
  assert time.perf_counter() - start < 0.5
  assert scores is None and 'Stanford CoreNLP' in note and 'corenlp.jar' in note
  monkeypatch.setattr(java_scorers, '_spice_jars', lambda: pytest.fail('checked twice'))
  result = evaluation.score_captions(HYPS, REFS, use_meteor=False)
  assert result['all']['SPICE'] is None and result['notes'] == [note]


class _FakeSpice:
  """Stands in for pycocoevalcap's Spice (its CoreNLP models are not installed here)."""

  def compute_score(self, gts, res):
    os.write(1, b'java noise on stdout\n')  # what the real jar's child process may do
    per_id = [{'All': {'f': 0.1 * int(i)}} for i in sorted(gts)]
    return 0.0, per_id


def test_spice_available_path(monkeypatch, capfd):
  monkeypatch.setattr(java_scorers, '_spice_verdict', [None])
  monkeypatch.setattr(java_scorers.spice, 'Spice', _FakeSpice)
  result = evaluation.score_captions(HYPS, REFS, groups={'two': ['1', '3']}, use_meteor=False)
  assert result['all']['SPICE'] == pytest.approx(0.2)
  assert result['two']['SPICE'] == pytest.approx(0.2)
  assert 'notes' not in result
  out, err = capfd.readouterr()
  assert 'java noise' not in out and 'java noise' in err


def test_spice_failure_becomes_a_note(monkeypatch):
  class Broken:
    def compute_score(self, gts, res):
      raise subprocess.CalledProcessError(1, ['java'])

  monkeypatch.setattr(java_scorers, '_spice_verdict', [None])
  monkeypatch.setattr(java_scorers.spice, 'Spice', Broken)
  result = evaluation.score_captions(HYPS, REFS, use_meteor=False)
  assert result['all']['SPICE'] is None
  assert result['notes'][0].startswith('SPICE not computed: it failed (CalledProcessError')


# ---------------------------------------------------------------------------------------------
# Files and CLI.


def test_results_and_references_round_trip(tmp_path):
  evaluation.write_results(str(tmp_path / 'r.json'), HYPS)
  assert json.loads((tmp_path / 'r.json').read_text())[0] == {
      'image_id': '1', 'caption': HYPS['1']}
  assert evaluation.read_results(str(tmp_path / 'r.json')) == HYPS
  evaluation.write_references(str(tmp_path / 'g.json'), REFS)
  assert evaluation.read_references(str(tmp_path / 'g.json')) == REFS
  assert sorted(os.listdir(tmp_path)) == ['g.json', 'r.json']  # no temporary files left


def test_written_files_load_in_pycocotools(tmp_path):
  evaluation.write_references(str(tmp_path / 'g.json'), REFS)
  evaluation.write_results(str(tmp_path / 'r.json'), HYPS)
  gt = coco.COCO(str(tmp_path / 'g.json'))
  res = gt.loadRes(str(tmp_path / 'r.json'))
  assert sorted(res.getImgIds()) == ['1', '2', '3']
  assert [a['caption'] for a in gt.imgToAnns['2']] == REFS['2']


def test_read_results_accepts_the_original_format(tmp_path):
  path = tmp_path / 'pred.json'
  path.write_text(json.dumps({'results': {'7c': [{'sentence': 'a cube moved'}]}}))
  assert evaluation.read_results(str(path)) == {'7c': 'a cube moved'}


@pytest.mark.parametrize('reader, content, message', [
    (evaluation.read_results, '[{"image_id": 1, "caption": "a"}', 'not valid JSON'),
    (evaluation.read_results, '{"a": 1}', 'not a list'),
    (evaluation.read_results, '[{"image_id": 1}]', 'entry 0 .* lacks'),
    (evaluation.read_results, '[{"image_id": 1, "caption": "a"}, {"image_id": "1", '
     '"caption": "b"}]', "two captions for id '1'"),
    (evaluation.read_references, '[]', 'no "annotations" list'),
    (evaluation.read_references, '{"annotations": []}', 'has no annotations'),
    (evaluation.read_references, '{"annotations": [{"image_id": 1, "caption": 3}]}',
     'annotation 0 .* string "caption"'),
])
def test_corrupt_files(tmp_path, reader, content, message):
  path = tmp_path / 'f.json'
  path.write_text(content)
  with pytest.raises(errors.UserError, match=message):
    reader(str(path))


def test_missing_files(tmp_path):
  for reader in [evaluation.read_results, evaluation.read_references]:
    with pytest.raises(errors.UserError, match='does not exist'):
      reader(str(tmp_path / 'missing.json'))


def _cli(*args, cwd=REPO):
  return subprocess.run([sys.executable, '-m', 'procap_jax.evaluation', *args], cwd=cwd,
                        capture_output=True, text=True, check=False)


def test_cli_scores_and_writes(tmp_path):
  ids = {'000001c': HYPS['1'], '000002c': HYPS['2'], '000001nc': HYPS['3']}
  refs = {'000001c': REFS['1'], '000002c': REFS['2'], '000001nc': REFS['3']}
  evaluation.write_results(str(tmp_path / 'r.json'), ids)
  evaluation.write_references(str(tmp_path / 'g.json'), refs)
  (tmp_path / 't.json').write_text(json.dumps({'color': ['000001.png'], 'drop': ['000002.png']}))
  proc = _cli('--results', str(tmp_path / 'r.json'), '--references', str(tmp_path / 'g.json'),
              '--out', str(tmp_path / 'm.json'), '--no-meteor', '--types', str(tmp_path / 't.json'),
              '--clevr')
  assert proc.returncode == 0, proc.stderr
  printed = json.loads(proc.stdout)  # stdout holds the JSON only
  assert printed == json.loads((tmp_path / 'm.json').read_text())
  assert set(printed) == {'all', 'change', 'no_change', 'color', 'drop', 'notes'}
  assert printed['all']['CIDEr'] == pytest.approx(EXPECTED['CIDEr'], abs=1e-4)
  assert printed['all']['SPICE'] is None and 'METEOR' not in printed['all']
  assert printed['color'] == _score({'1': HYPS['1']}, REFS)['all'] | {'SPICE': None}


def test_cli_user_error_exits_2_with_one_line(tmp_path):
  evaluation.write_references(str(tmp_path / 'g.json'), REFS)
  proc = _cli('--results', str(tmp_path / 'nope.json'), '--references', str(tmp_path / 'g.json'))
  assert proc.returncode == 2
  assert proc.stdout == ''
  assert proc.stderr.startswith('error: results file ') and 'does not exist' in proc.stderr
  assert proc.stderr.count('\n') == 1
  evaluation.write_results(str(tmp_path / 'r.json'), {'zz': 'a caption'})
  proc = _cli('--results', str(tmp_path / 'r.json'), '--references', str(tmp_path / 'g.json'),
              '--no-meteor')
  assert proc.returncode == 2 and "(e.g. 'zz')" in proc.stderr


# ---------------------------------------------------------------------------------------------
# The real reference files (../shared/fixtures).

REAL_REFS = [('spot_the_diff', 'spot_test_change_captions_reformat.json', 1270, 2107),
             ('image_editing_request', 'IER_test_change_captions_reformat.json', 495, 1485)]


@pytest.mark.parametrize('dataset, name, num_ids, num_captions', REAL_REFS)
def test_read_real_reference_files(fixtures_dir, dataset, name, num_ids, num_captions):
  refs = evaluation.read_references(str(fixtures_dir / dataset / 'eval_refs' / name))
  assert len(refs) == num_ids and sum(map(len, refs.values())) == num_captions


def test_same_numbers_as_pycocoevalcaps_own_pipeline(fixtures_dir):
  """The original path (COCO objects, PTBTokenizer, scorers) on the real Spot-the-Diff refs."""
  ref_file = fixtures_dir / 'spot_the_diff' / 'eval_refs' / REAL_REFS[0][1]
  refs = evaluation.read_references(str(ref_file))
  rng = random.Random(0)
  ids = sorted(refs)
  hyps = {i: refs[ids[(n + rng.randrange(3)) % len(ids)]][-1] + ', Maybe.'
          for n, i in enumerate(ids) if n % 3}  # a subset, partly right, with punctuation
  gt = coco.COCO(str(ref_file))
  res = gt.loadRes([{'image_id': i, 'caption': c} for i, c in hyps.items()])
  img_ids = res.getImgIds()
  tokenizer = ptbtokenizer.PTBTokenizer()
  g = tokenizer.tokenize({i: gt.imgToAnns[i] for i in img_ids})
  r = tokenizer.tokenize({i: res.imgToAnns[i] for i in img_ids})
  expected = dict(zip(METRICS[:4], bleu.Bleu(4).compute_score(g, r, verbose=0)[0]))
  expected['ROUGE_L'] = rouge.Rouge().compute_score(g, r)[0]
  expected['CIDEr'] = cider.Cider().compute_score(g, r)[0]
  ours = _score(hyps, refs)['all']
  for name in METRICS:
    assert ours[name] == pytest.approx(expected[name], rel=1e-12, abs=1e-15), name


def _shuffle_words(caption, rng):
  words = caption.split()
  rng.shuffle(words)
  return ' '.join(words)


@pytest.mark.parametrize('dataset, name, num_ids, num_captions', REAL_REFS)
def test_real_references_rank_the_truth_highest(fixtures_dir, dataset, name, num_ids,
                                                num_captions):
  refs = evaluation.read_references(str(fixtures_dir / dataset / 'eval_refs' / name))
  ids = list(refs)
  truth = {i: refs[i][0] for i in ids}
  rng = random.Random(0)
  shuffled = {i: _shuffle_words(c, rng) for i, c in truth.items()}
  rotated = {i: truth[ids[(n + 7) % len(ids)]] for n, i in enumerate(ids)}
  best = _score(truth, refs)['all']
  worse_order = _score(shuffled, refs)['all']
  wrong_pairs = _score(rotated, refs)['all']
  assert best['Bleu_1'] > 0.9 and best['CIDEr'] > 2.0
  for metric in METRICS:
    assert best[metric] > wrong_pairs[metric], metric
    if metric == 'Bleu_1':  # unigram precision cannot see word order
      assert best[metric] == pytest.approx(worse_order[metric])
    else:
      assert best[metric] > worse_order[metric], metric
