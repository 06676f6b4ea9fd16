"""The caption grammar's reader, the truth, the semantic scores and the reference rows."""

import json

import pytest

from procap_jax import errors
from procap_jax import semantic_scores as ss
from procap_jax.data import pipeline
from tfds_builders.synthetic_change import captions as captions_lib

RED_SPHERE = {'size': 'small', 'color': 'red', 'material': 'rubber', 'shape': 'sphere'}


def _truth(kind, new=None, **changed):
  return ss.Truth(kind, dict(RED_SPHERE, **changed) if kind != 'none' else {}, new)


def test_every_reference_of_the_test_split_reads_back_as_its_truth(tiny_config, tmp_path):
  info = pipeline.load_split_info(tiny_config, 'test', str(tmp_path))
  truths = ss.split_truths(info)
  kinds = {t.type for t in truths.values()}
  assert kinds == {'none', 'color', 'material', 'add', 'drop', 'move'}
  checked = 0
  for rec in info:
    truth = truths[rec['pair_id']]
    for caption in rec['captions']:
      reading = ss.parse(caption)
      assert reading is not None, caption
      assert reading.type == truth.type, caption
      assert dict(reading.object) == dict(truth.object), caption
      assert reading.new == truth.new, caption
      assert ss.error_class(reading, truth) == 'right'
      checked += 1
  assert checked == sum(len(r['captions']) for r in info)
  metrics, _ = ss.score({r['pair_id']: r['captions'][-1] for r in info}, truths)
  assert metrics['semantic/decision'] == metrics['semantic/type'] == 1.0
  assert metrics['semantic/attributes'] == metrics['semantic/new_value'] == 1.0


@pytest.mark.parametrize('kind', ['color', 'material', 'add', 'drop', 'move'])
def test_every_template_reads_back(kind):
  new = {'color': 'blue', 'material': 'metal'}.get(kind)
  truth = _truth(kind, new)
  what = 'small red rubber sphere'
  for template in captions_lib.TEMPLATES[kind]:
    caption = template.format(obj=f'the {what}', what=what, new=new or '')
    assert ss.parse(caption) == ss.Reading(kind, RED_SPHERE, new), caption
  assert ss.parse(ss.write(truth)) == ss.Reading(kind, RED_SPHERE, new)


def test_lenient_object_phrases_and_unread_captions():
  assert ss.parse('The red sphere moved.') == ss.Reading('move', {'color': 'red',
                                                                  'shape': 'sphere'})
  assert ss.parse('the sphere red small moved').object == {'size': 'small', 'color': 'red',
                                                           'shape': 'sphere'}
  # Shared colour / material templates: the new value decides the type.
  assert ss.parse('the small red rubber sphere turned metal').type == 'material'
  assert ss.parse('the small red rubber sphere turned blue').type == 'color'
  assert ss.parse('the small red rubber sphere turned cube').type is None
  # A colour-only template with a material value: type colour, the value wrong.
  assert ss.parse('the red sphere changed its color to metal') == ss.Reading(
      'color', {'color': 'red', 'shape': 'sphere'}, 'metal')
  for caption in ('', 'the the moved', 'the red red sphere moved', 'a red sphere moved',
                  'the sphere is gone away'):
    assert ss.parse(caption) is None, caption
  assert ss.parse('Nothing has changed!') == ss.Reading('none')


def test_error_classes():
  moved = _truth('move')
  painted = _truth('color', 'blue')
  none = _truth('none')
  cls = lambda caption, truth: ss.error_class(ss.parse(caption), truth)
  assert cls('there is no change', none) == 'right'
  assert cls('the red sphere moved', none) == 'invented_change'
  assert cls('garbage words', none) == 'invented_change'
  assert cls('nothing has changed', moved) == 'missed_change'
  assert cls('the red sphere is gone', moved) == 'wrong_type'
  assert cls('garbage words', moved) == 'wrong_type'
  assert cls('the blue sphere moved', moved) == 'wrong_object'
  assert cls('the red sphere turned green', painted) == 'wrong_value'
  assert cls('the red sphere turned blue', painted) == 'right'
  assert cls('the sphere turned blue', painted) == 'right'


def test_scores_by_hand():
  truths = {'n1': _truth('none'), 'n2': _truth('none'), 'm': _truth('move'),
            'c': _truth('color', 'blue'), 'a': _truth('add', shape='cube')}
  predictions = {
      'n1': 'there is no change',               # right
      'n2': 'the red sphere moved',             # invented change
      'm': 'the large red sphere moved',        # wrong object (size); colour, shape right
      'c': 'the small red rubber sphere turned blue',  # right, names all four
      'a': 'nothing has changed',               # missed change
  }
  metrics, classes = ss.score(predictions, truths)
  assert classes == {'n1': 'right', 'n2': 'invented_change', 'm': 'wrong_object', 'c': 'right',
                     'a': 'missed_change'}
  assert metrics['semantic/decision'] == pytest.approx(3 / 5)
  assert metrics['semantic/type'] == pytest.approx(2 / 3)
  assert metrics['semantic/attributes'] == pytest.approx(1 / 3)
  assert metrics['semantic/size'] == pytest.approx(1 / 2)
  assert metrics['semantic/color'] == metrics['semantic/shape'] == 1.0
  assert metrics['semantic/material'] == 1.0  # only 'c' names it
  assert metrics['semantic/names_all'] == pytest.approx(1 / 3)
  assert metrics['semantic/new_value'] == 1.0
  assert metrics['semantic/right'] == pytest.approx(2 / 5)
  assert metrics['semantic/parsed'] == 1.0
  assert metrics['semantic/none/decision'] == 0.5
  assert metrics['semantic/move/attributes'] == 0.0
  assert metrics['semantic/add/decision'] == 0.0
  assert 'semantic/drop/decision' not in metrics  # no drop pair
  assert 'semantic/none/type' not in metrics
  with pytest.raises(errors.UserError, match='no truth'):
    ss.score({'zz': 'there is no change'}, truths)


def test_truth_from_change_params():
  params = {'type': 'material', 'object': dict(RED_SPHERE, position=[0.1, 0.2]),
            'from': 'rubber', 'to': 'metal'}
  assert ss.truth_of(json.loads(json.dumps(params))) == _truth('material', 'metal')
  with pytest.raises(errors.UserError, match='synthetic_change benchmark only'):
    ss.truth_of({})  # what the real datasets store


def test_reference_rows_command(tiny_config, tiny_data_dir, tmp_path, capsys):
  info = pipeline.load_split_info(tiny_config, 'test', str(tmp_path))
  out = ss.main(['--data_dir', tiny_data_dir, '--dataset_config', 'tiny', '--split', 'test'])
  assert json.loads(capsys.readouterr().out) == out
  assert out['pairs'] == len(info)
  assert out['read_back'] == out['references'] == sum(len(r['captions']) for r in info)
  rows = out['reference_rows']
  fixed = ss.most_frequent_change_sentence(info)
  assert fixed in rows['change_constant']['captioner']
  constant = rows['no_change_constant']['metrics']
  assert constant['semantic/decision'] == 0.5  # half the pairs of a split are no-change
  assert constant['semantic/missed_change'] == 0.5
  # CIDEr-D on the no-change pairs alone is 0 for any captioner: their references are the
  # same sentences for every pair, so every n-gram's idf is 0.
  assert constant['no_change/CIDEr'] == 0.0
  assert constant['CIDEr'] > constant['change/CIDEr']
  perfect = rows['decision_and_change_constant']['metrics']
  assert perfect['semantic/decision'] == 1.0 and perfect['CIDEr'] > constant['CIDEr']
  oracle = rows['template_oracle']['metrics']
  assert oracle['semantic/right'] == oracle['semantic/attributes'] == 1.0
  assert oracle['change/CIDEr'] > perfect['change/CIDEr']


@pytest.mark.parametrize('argv, match', [
    ([], 'give --workdir W'),
    (['--data_dir', 'D', '--split', 'dev'], 'is not a split'),
    (['--data_dir', 'D', '--dataset_config', 'huge'], 'unknown synthetic_change config'),
    (['--workdir', 'no/such/run'], 'does not exist'),
])
def test_command_bad_input_is_one_sentence(argv, match, tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit) as exit_info:
    ss.main(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith('error: ') and match in err and err.count('\n') == 1
