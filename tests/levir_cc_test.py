"""The LEVIR-CC builder and preset on a manual-download folder the test writes itself.

The folder follows the official layout (LevirCCcaptions.json in the official schema, images
images/<split>/{A,B}/<filename>) with small generated image pairs: a house appears in B for the
change pairs, B is A with a little noise for the others. One build is shared by the record
tests, the Beam comparison and the `cpu` preset run; nothing is downloaded.
"""

import json
import os
import pathlib

import numpy as np
import PIL.Image
import pytest

import beam_build_test
import built_records

from procap_jax import errors
from procap_jax.data import images
from procap_jax.data import vocab as vocab_lib
from tfds_builders import build as build_cli
from tfds_builders import common
from tfds_builders import levir_cc

_records, _text = built_records.records, built_records.text

SIZE = 32  # the tiny32 builder config
# (split, changeflag) of each entry, in file order: 8 train, 4 val, 4 test pairs, half changed.
LAYOUT = [('train', f) for f in (1, 0) * 4] + [('val', f) for f in (1, 0) * 2] + [
    ('test', f) for f in (0, 1) * 2]
CHANGE = ['a house is built at the {} corner', 'a new building appears on the {} side',
          'some bareland is replaced by a house', 'one building is constructed near the road',
          'a house has been built in the {} of the scene']
NO_CHANGE = ['the scene is the same as before', 'there is no difference',
             'no change has occurred', 'the two scenes seem identical', 'nothing has changed']


def _sentence(text: str, imgid: int, sentid: int) -> dict:
  return {'tokens': text.split(), 'raw': f' {text} .', 'imgid': imgid, 'sentid': sentid}


def _entries() -> list[dict]:
  out, counts = [], {}
  for imgid, (split, flag) in enumerate(LAYOUT):
    counts[split] = counts.get(split, 0) + 1
    where = ('top left', 'right', 'middle')[imgid % 3]
    texts = [t.format(where) for t in CHANGE] if flag else list(NO_CHANGE)
    sentences = [_sentence(t, imgid, 5 * imgid + k) for k, t in enumerate(texts)]
    out.append({'filepath': split, 'filename': f'{split}_{counts[split]:06d}.png',
                'imgid': imgid, 'split': split, 'sentences': sentences, 'changeflag': flag,
                'sentids': [s['sentid'] for s in sentences]})
  # The official file's quirks the builder must handle: a sentence with only its raw text, and
  # an empty one.
  out[2]['sentences'][1]['tokens'] = []
  out[3]['sentences'][4] = {'tokens': [], 'raw': ' ', 'imgid': 3, 'sentid': 19}
  return out


def _image_pair(seed: int, changed: bool) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  before = np.clip(rng.normal(120, 25, (64, 64, 3)), 0, 255).astype(np.uint8)  # bare land
  after = np.clip(before.astype(int) + rng.integers(-6, 7, before.shape), 0, 255).astype(np.uint8)
  if changed:
    y, x = rng.integers(4, 40, 2)
    after[y:y + 20, x:x + 20] = rng.integers(150, 256, 3)  # a roof
  return before, after


def levir_manual(root: pathlib.Path, entries: list[dict]) -> pathlib.Path:
  """Writes `root/levir_manual` in the official layout for `entries`; returns it."""
  man = root / 'levir_manual'
  for n, e in enumerate(entries):
    for folder, pixels in zip('AB', _image_pair(n, e.get('changeflag') == 1)):
      path = man / 'images' / e['split'] / folder / e['filename']
      path.parent.mkdir(parents=True, exist_ok=True)
      PIL.Image.fromarray(pixels).save(path)
  (man / levir_cc.levir_cc_dataset_builder.ANNOTATIONS).write_text(
      json.dumps({'images': entries}), encoding='utf-8')
  return man


@pytest.fixture(scope='module')
def levir(tmp_path_factory):
  root = tmp_path_factory.mktemp('levir')
  entries = _entries()
  man = levir_manual(root, entries)
  builder = levir_cc.prepare('tiny32', os.fspath(root / 'data'), os.fspath(man), num_workers=1)
  return builder, man, entries


def test_records_follow_the_official_file(levir):
  builder, man, entries = levir
  for split in common.SPLITS:
    recs = _records(builder, split)
    mine = [e for e in entries if e['split'] == split]
    assert [_text(r['pair_id']) for r in recs] == [e['filename'] for e in mine]
    assert [r['scene_id'] for r in recs] == [e['imgid'] for e in mine]
    assert [common.CHANGE_TYPES[r['change_type']] for r in recs] == [
        'other' if e['changeflag'] else 'none' for e in mine]
  train = _records(builder, 'train')
  assert [_text(c) for c in train[0]['captions']] == [
      ' '.join(s['tokens']) for s in entries[0]['sentences']]  # tokens joined, no ' .'
  assert _text(train[2]['captions'][1]) == entries[2]['sentences'][1]['raw'].strip()  # raw
  assert len(train[3]['captions']) == 4  # the empty sentence dropped
  rec = _records(builder, 'test')[1]
  assert _text(rec['pair_id']) == 'test_000002.png'
  before = images.load_image(man / 'images' / 'test' / 'A' / 'test_000002.png', SIZE)
  after = images.load_image(man / 'images' / 'test' / 'B' / 'test_000002.png', SIZE)
  assert not np.array_equal(before, after)
  np.testing.assert_array_equal(rec['before'], before)
  np.testing.assert_array_equal(rec['after'], after)
  assert len(rec['frames']) == 9 and all(f.shape == (SIZE, SIZE, 3) for f in rec['frames'])
  np.testing.assert_array_equal(rec['frames'][0], before)
  np.testing.assert_array_equal(rec['frames'][8], after)


def test_side_files(levir):
  builder, _, entries = levir
  with open(os.path.join(builder.data_dir, 'references_test.json'), encoding='utf-8') as f:
    refs = json.load(f)
  test = [e for e in entries if e['split'] == 'test']
  assert [im['id'] for im in refs['images']] == [e['filename'] for e in test]
  assert [a['caption'] for a in refs['annotations'] if a['image_id'] == 'test_000001.png'] == (
      NO_CHANGE)
  train_caps = [_text(c) for r in _records(builder, 'train') for c in r['captions']]
  built = vocab_lib.Vocab.load(os.path.join(builder.data_dir, 'word2idx.json'))
  assert built == vocab_lib.Vocab.build(train_caps, min_word_count=3)
  assert 'house' in built.word2idx and 'middle' not in built.word2idx  # 12 times vs 3


def test_change_and_no_change_pairs_are_scored_apart(levir):
  """The stored changeflag picks the pairs of the change / no-change scores: a captioner that
  says "no change" everywhere is perfect on the no-change pairs only."""
  from procap_jax import evaluation
  from procap_jax.data import pipeline
  builder, _, entries = levir
  info = [{'pair_id': _text(r['pair_id']), 'change_type': int(r['change_type']),
           'captions': [_text(c) for c in r['captions']]} for r in _records(builder, 'test')]
  references = {r['pair_id']: r['captions'] for r in info}
  predictions = {i: NO_CHANGE[0] for i in references}
  groups = pipeline.change_groups(info, predictions)
  flags = {e['filename']: e['changeflag'] for e in entries}
  assert groups['change'] == [i for i in references if flags[i] == 1] == groups['other']
  assert groups['no_change'] == [i for i in references if flags[i] == 0] == groups['none']
  scores = evaluation.score_captions(predictions, references, groups=groups, use_meteor=False,
                                     use_spice=False)
  assert scores['no_change']['Bleu_4'] == pytest.approx(1.0)
  assert scores['change']['Bleu_4'] < 0.1 and scores['change']['CIDEr'] < 0.1
  assert scores['all']['change_decision'] == 0.5  # right on the 2 no-change pairs of 4


def _broken(tmp_path, change) -> str:
  entries = _entries()[:6] + _entries()[8:10] + _entries()[12:14]  # every split, 10 pairs
  change(entries)
  return os.fspath(levir_manual(tmp_path, entries))


@pytest.mark.parametrize('change, message', [
    (lambda e: e[0].update(changeflag=2), r'entry 0 \(train_000001.png\) has changeflag 2; '
     r'expected 0 \(no change\) or 1'),
    (lambda e: e[7].update(split='restval'), r"has split 'restval'; expected one of train"),
    (lambda e: e[1].update(filename='train_000001.png'), 'lists train_000001.png twice'),
    (lambda e: e[4].pop('changeflag'), r'entry 4 has no int field .changeflag.'),
    (lambda e: [x.update(split='train') for x in e if x['split'] == 'val'], 'pairs for split val'),
], ids=['changeflag 2', 'unknown split', 'repeated file', 'no changeflag', 'empty split'])
def test_bad_annotation_files_are_user_errors(tmp_path, change, message):
  man = _broken(tmp_path, change)
  with pytest.raises(errors.UserError, match=message) as info:
    levir_cc.prepare('tiny32', os.fspath(tmp_path / 'data'), man, num_workers=1)
  assert '\n' not in str(info.value)
  assert not (tmp_path / 'data' / 'levir_cc' / 'tiny32' / '1.0.0').exists()


def test_missing_files_are_listed_in_one_error(tmp_path):
  man = pathlib.Path(_broken(tmp_path, lambda e: None))
  (man / 'images' / 'test' / 'B' / 'test_000002.png').unlink()
  (man / 'images' / 'val' / 'A' / 'val_000001.png').unlink()
  with pytest.raises(errors.UserError) as info:
    levir_cc.prepare('tiny32', os.fspath(tmp_path / 'data'), os.fspath(man), num_workers=1)
  msg = str(info.value)
  assert 'images/test/B/test_000002.png' in msg and 'images/val/A/val_000001.png' in msg
  assert 'tfds_builders/levir_cc/README.md' in msg
  (man / 'LevirCCcaptions.json').write_text('{"images": [', encoding='utf-8')
  with pytest.raises(errors.UserError, match='LevirCCcaptions.json is not a valid UTF-8 JSON'):
    levir_cc.prepare('tiny32', os.fspath(tmp_path / 'data'), os.fspath(man), num_workers=1)
  (man / 'LevirCCcaptions.json').unlink()
  with pytest.raises(errors.UserError, match='missing: LevirCCcaptions.json; see'):
    levir_cc.prepare('tiny32', os.fspath(tmp_path / 'data'), os.fspath(man), num_workers=1)


def test_beam_build_equals_the_default_build(levir, tmp_path):
  pytest.importorskip('apache_beam')
  local, man, _ = levir
  line = build_cli.build('levir_cc/tiny32', os.fspath(tmp_path), manual_dir=os.fspath(man),
                         beam_options='--runner=DirectRunner')
  assert line['pairs'] == {'train': 8, 'val': 4, 'test': 4} and line['build_s'] > 0
  beam = levir_cc.Builder(config='tiny32', data_dir=os.fspath(tmp_path))
  beam_build_test._assert_same_dataset(local, beam)  # pylint: disable=protected-access
  for name in ('references_train.json', 'references_test.json', 'word2idx.json'):
    assert (pathlib.Path(local.data_dir, name).read_bytes() ==
            pathlib.Path(beam.data_dir, name).read_bytes()), name


def test_cpu_preset_runs_every_stage_and_scores_change_and_no_change_apart(levir, tmp_path):
  from configs import levir_cc as levir_config
  from procap_jax import main
  builder, man, _ = levir
  config = levir_config.get_config('cpu')
  config.data.data_dir = os.fspath(builder.data_dir_root)  # the shared build is reused
  config.data.manual_dir = os.fspath(man)
  for stage in ('tokenizer', 'pretrain', 'caption'):  # the preset's 4 steps, halved for CI
    train = config[stage].train
    train.steps = train.log_every = train.eval_every = train.checkpoint_every = 2
  config.report.gallery_per_type = 1
  config.pretrain.model.depth = config.caption.model.layers = 1  # less to compile
  results = main.run(config, os.fspath(tmp_path))
  assert results['split'] == 'test' and results['dataset'] == 'levir_cc/tiny32'
  metrics = results['metrics']
  for group in ('', 'change/', 'no_change/'):
    assert {f'{group}{m}' for m in ('Bleu_4', 'METEOR', 'ROUGE_L', 'CIDEr')} <= set(metrics)
  with open(tmp_path / 'results.json', encoding='utf-8') as f:
    assert json.load(f)['metrics'] == pytest.approx(metrics)
  report = (tmp_path / 'report.html').read_text(encoding='utf-8')
  assert '<td>change</td>' in report and '<td>no_change</td>' in report


def test_paper_preset_is_the_paper_model_at_256_px(monkeypatch):
  """`paper`: the builder's 256 px, a 16 x 16 token grid, the original's switches and CLIP BPE
  text (validates without a merges file on the machine); `cpu`: the smoke switches and words."""
  from configs import levir_cc as levir_config
  from procap_jax import config_lib
  from procap_jax.data import bpe
  monkeypatch.setattr(bpe, 'PACKAGES_WITH_MERGES', ('procap_missing_pkg',))
  paper, cpu = levir_config.get_config('paper'), levir_config.get_config('cpu')
  config_lib.validate(paper)
  config_lib.validate(cpu)
  sizes = {c.name: c.image_size for c in levir_cc.Builder.BUILDER_CONFIGS}
  assert sizes[paper.data.builder_config] == paper.data.image_size == 256
  assert sizes[cpu.data.builder_config] == cpu.data.image_size == 32
  assert paper.tokenizer.model.resolution == 256 and tuple(paper.pretrain.model.grid) == (16, 16)
  assert not paper.tokenizer.init_drop_unused_attention  # 256 px has the 16 px attention level
  p, c = paper.pretrain.model, paper.caption.model
  assert (p.width, p.depth, p.heads, c.hidden, c.layers) == (768, 12, 12, 512, 2)
  assert paper.caption.train.steps == 40 * 213 and paper.data.encoder_text == 'clip_bpe'
  switches = lambda c: (c.pretrain.model.frame_difference, c.pretrain.model.embedding_std,
                        c.pretrain.binary_inputs)
  assert switches(paper) == ('none', 1.0, 'masked')
  assert switches(cpu) == ('before', 0.02, 'visible') and cpu.data.encoder_text == 'words'
