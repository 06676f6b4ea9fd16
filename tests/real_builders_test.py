"""The CLEVR-Change, Spot-the-Diff and IER builders on the real files of ../shared/fixtures.

CLEVR-Change uses the ten real fixture scenes; Spot-the-Diff and IER use reduced copies of the
real annotation files with small generated stand-in images. Everything is written to tmp.
"""

import collections
import io
import json
import os
import pathlib
import re

import h5py
import numpy as np
import PIL.Image
import pytest

import built_records
import clevr_manual

from procap_jax import errors
from procap_jax.data import images
from procap_jax.data import vocab as vocab_lib
from tfds_builders import common
from tfds_builders import clevr_change
from tfds_builders import image_editing_request
from tfds_builders import spot_the_diff

_records, _text = built_records.records, built_records.text

CLEVR_SPLITS = {'train': [0, 1, 3, 4, 5], 'val': [19, 35], 'test': [2, 6, 13]}
SIZE = 32


def _load(path) -> dict:
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _dump(path: pathlib.Path, obj) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(obj), encoding='utf-8')


def _stand_in(path: pathlib.Path, seed: int) -> None:
  """A random 32 px image in the format the file name says."""
  path.parent.mkdir(parents=True, exist_ok=True)
  pixels = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE + 8, 3), dtype=np.uint8)
  fmt = {'.png': 'PNG', '.gif': 'GIF'}.get(path.suffix.lower(), 'JPEG')
  buf = io.BytesIO()
  PIL.Image.fromarray(pixels).save(buf, format=fmt)
  path.write_bytes(buf.getvalue())


def _refs_by_id(coco: dict, normalise=lambda c: c) -> dict[str, list[str]]:
  out = collections.defaultdict(list)
  for ann in coco['annotations']:
    if ann['caption'].strip():
      out[ann['image_id']].append(normalise(ann['caption']))
  return dict(out)


# ------------------------------------------------------------------------------------ CLEVR


@pytest.fixture(scope='module')
def clevr(tmp_path_factory, fixtures_dir):
  root = tmp_path_factory.mktemp('clevr')
  man = clevr_manual.clevr_manual(root, fixtures_dir, CLEVR_SPLITS)
  stale = root / 'data' / 'clevr_change' / 'tiny32' / 'incomplete.ABC123_1.0.0'
  stale.mkdir(parents=True)
  (stale / 'half-written.array_record').write_bytes(b'x')
  builder = clevr_change.prepare('tiny32', os.fspath(root / 'data'), os.fspath(man), num_workers=2)
  return builder, man, stale


def test_clevr_records(clevr):
  builder, man, _ = clevr
  for split, ids in CLEVR_SPLITS.items():
    recs = _records(builder, split)
    assert [_text(r['pair_id']) for r in recs] == [f'{i:06d}{s}' for i in ids for s in ('c', 'nc')]
    assert [r['scene_id'] for r in recs] == [i for i in ids for _ in range(2)]
    # The README says every fixture scene is a colour change.
    assert [common.CHANGE_TYPES[r['change_type']] for r in recs] == ['color', 'none'] * len(ids)
  rec = _records(builder, 'test')[1]  # 000002nc
  assert sorted(rec) == sorted(['pair_id', 'scene_id', 'change_type', 'before', 'after', 'frames',
                                'oracle_frames', 'captions', 'change_params'])
  before = images.load_image(man / 'images' / 'CLEVR_default_000002.png', SIZE)
  after = images.load_image(man / 'nsc_images' / 'CLEVR_nonsemantic_000002.png', SIZE)
  np.testing.assert_array_equal(rec['before'], before)
  np.testing.assert_array_equal(rec['after'], after)
  assert len(rec['frames']) == 9 and all(f.shape == (SIZE, SIZE, 3) for f in rec['frames'])
  np.testing.assert_array_equal(rec['frames'][0], before)
  np.testing.assert_array_equal(rec['frames'][8], after)
  assert len(rec['oracle_frames']) == 0 and _text(rec['change_params']) == '{}'
  assert [_text(c) for c in rec['captions']] == ['no change was made',
                                                 'the scene is the same as before']


def test_clevr_side_files(clevr):
  builder, _, stale = clevr
  assert not stale.exists()  # the interrupted build's leftovers were removed
  refs = _load(os.path.join(builder.data_dir, 'references_val.json'))
  assert set(refs) == {'images', 'annotations', 'type', 'info', 'licenses'}
  assert refs['type'] == 'captions'
  assert [im['id'] for im in refs['images']] == ['000019c', '000019nc', '000035c', '000035nc']
  assert [a['id'] for a in refs['annotations']] == list(range(8))
  assert _refs_by_id(refs)['000035c'] == ['the small cube changed its color',
                                          'the object number 35 became a different color']
  train_caps = [c for r in _records(builder, 'train') for c in map(_text, r['captions'])]
  built = vocab_lib.Vocab.load(os.path.join(builder.data_dir, 'word2idx.json'))
  assert built == vocab_lib.Vocab.build(train_caps, min_word_count=3)
  assert 'color' in built.word2idx and '3' not in built.word2idx  # 5 occurrences vs 1


def test_clevr_incomplete_manual_dir(tmp_path, fixtures_dir):
  man = clevr_manual.clevr_manual(tmp_path, fixtures_dir, CLEVR_SPLITS)
  (man / 'sc_images' / 'CLEVR_semantic_000013.png').unlink()
  (man / 'nsc_images' / 'CLEVR_nonsemantic_000035.png').unlink()
  with pytest.raises(errors.UserError) as info:
    clevr_change.prepare('tiny32', os.fspath(tmp_path / 'data'), os.fspath(man), num_workers=1)
  msg = str(info.value)
  assert 'CLEVR_semantic_000013.png' in msg and 'CLEVR_nonsemantic_000035.png' in msg
  assert 'README.md' in msg and '\n' not in msg
  for name in ('no_change_captions.json', 'splits.json'):
    (man / name).unlink()
  with pytest.raises(errors.UserError, match='no_change_captions.json.*splits.json|splits.json.*'
                     'no_change_captions.json'):
    clevr_change.prepare('tiny32', os.fspath(tmp_path / 'data'), os.fspath(man), num_workers=1)
  assert not (tmp_path / 'data' / 'clevr_change' / 'tiny32' / '1.0.0').exists()


def test_missing_or_unnamed_manual_dir(tmp_path):
  with pytest.raises(errors.UserError, match='does-not-exist'):
    spot_the_diff.prepare('tiny32', os.fspath(tmp_path), os.fspath(tmp_path / 'does-not-exist'))
  with pytest.raises(errors.UserError, match='manual directory'):
    spot_the_diff.prepare('tiny32', os.fspath(tmp_path), '')
  with pytest.raises(errors.UserError, match='paper, cpu64'):
    spot_the_diff.prepare('huge', os.fspath(tmp_path), os.fspath(tmp_path))


# ------------------------------------------------------------------------------ Spot-the-Diff

SPOT_EXTRA = {'test': ['138', '224', '9420'], 'val': ['13426', '13818'], 'train': ['3', '126']}


def _spot_subset(fixtures: pathlib.Path) -> dict[str, list[dict]]:
  """~20 real entries per split, with every entry of ids that repeat or have empty captions."""
  out = {}
  for split in common.SPLITS:
    data = _load(fixtures / 'spot_the_diff' / 'annotations' / f'{split}.json')
    keep = {e['img_id'] for e in data[:18]} | set(SPOT_EXTRA[split])
    out[split] = [e for e in data if e['img_id'] in keep]
  return out


@pytest.fixture(scope='module')
def spot(tmp_path_factory, fixtures_dir):
  man = tmp_path_factory.mktemp('spot_manual')
  subset = _spot_subset(fixtures_dir)
  for split, data in subset.items():
    _dump(man / 'annotations' / f'{split}.json', data)
    for e in data:
      _stand_in(man / 'resized_images' / f'{e["img_id"]}.png', int(e['img_id']))
      _stand_in(man / 'resized_images' / f'{e["img_id"]}_2.png', int(e['img_id']) + 1)
  (man / 'spot_word2idx2.json').symlink_to(fixtures_dir / 'procap_vocab' / 'spot_word2idx2.json')
  data_dir = tmp_path_factory.mktemp('spot_data')
  return spot_the_diff.prepare('tiny32', os.fspath(data_dir), os.fspath(man), num_workers=1), subset


def test_spot_merges_and_drops(spot):
  builder, subset = spot
  test = {_text(r['pair_id']): r for r in _records(builder, 'test')}
  assert '9420.png' not in test  # its only sentence is empty
  entries_138 = [e['sentences'] for e in subset['test'] if e['img_id'] == '138']
  assert len(entries_138) == 3  # a repeated id ...
  assert [_text(c) for c in test['138.png']['captions']] == sum(entries_138, [])  # ... merged
  assert test['138.png']['scene_id'] == 138
  assert {common.CHANGE_TYPES[r['change_type']] for r in test.values()} == {'other'}
  val = {_text(r['pair_id']): r for r in _records(builder, 'val')}
  assert '13818.png' not in val and '' not in map(_text, val['13426.png']['captions'])
  assert len(test) == len({e['img_id'] for e in subset['test']}) - 1


def test_spot_references_match_the_official_file(spot, fixtures_dir):
  builder, _ = spot
  ours = _load(os.path.join(builder.data_dir, 'references_test.json'))
  official = _refs_by_id(_load(fixtures_dir / 'spot_the_diff' / 'eval_refs' /
                               'spot_total_change_captions_reformat.json'))
  mine = _refs_by_id(ours)
  assert len(mine) > 15 and {'138.png', '224.png'} <= set(mine)
  assert mine == {k: official[k] for k in mine}  # same ids, same captions, same order
  raw = _load(fixtures_dir / 'spot_the_diff' / 'eval_refs' /
              'spot_total_change_captions_reformat.json')
  assert {'image_id': '9420.png', 'caption': ''} in [  # the official file keeps empty captions
      {k: a[k] for k in ('image_id', 'caption')} for a in raw['annotations']]
  assert '9420.png' not in mine
  assert spot_the_diff.official_key('138.png') == '138'


def test_spot_copies_the_official_vocabulary(spot, fixtures_dir):
  builder, _ = spot
  built = pathlib.Path(builder.data_dir, 'word2idx.json').read_bytes()
  assert built == (fixtures_dir / 'procap_vocab' / 'spot_word2idx2.json').read_bytes()


def test_corrupt_image_is_a_user_error(tmp_path, fixtures_dir):
  man = tmp_path / 'man'
  subset = {s: d[:6] for s, d in _spot_subset(fixtures_dir).items()}
  for split, data in subset.items():
    _dump(man / 'annotations' / f'{split}.json', data)
    for e in data:
      _stand_in(man / 'resized_images' / f'{e["img_id"]}.png', 1)
      _stand_in(man / 'resized_images' / f'{e["img_id"]}_2.png', 2)
  bad = man / 'resized_images' / f'{subset["val"][2]["img_id"]}_2.png'
  bad.write_bytes(bad.read_bytes()[:100])
  with pytest.raises(errors.UserError, match=bad.name):
    spot_the_diff.prepare('tiny32', os.fspath(tmp_path / 'data'), os.fspath(man), num_workers=1)
  config_dir = tmp_path / 'data' / 'spot_the_diff' / 'tiny32'
  assert not config_dir.exists() or os.listdir(config_dir) == []  # nothing half-written


# ------------------------------------------------------------------------------------- IER


def _ier_normalise(caption: str) -> str:
  """The normalisation of the FINER-MLLM val file: lower case, no '"', '.', '!', single spaces."""
  return ' '.join(re.sub(r'["!.]', ' ', caption.lower()).split())


def _ier_manual(man: pathlib.Path, fixtures: pathlib.Path, with_images: bool) -> dict:
  subset = {}
  for split, name in image_editing_request.image_editing_request_dataset_builder.FILES.items():
    data = _load(fixtures / 'image_editing_request' / name)[:12]
    _dump(man / name, data)
    subset[split] = data
    for i, e in enumerate(data if with_images else []):
      _stand_in(man / 'images' / e['img0'], i)
      _stand_in(man / 'images' / e['img1'], i + 100)
  return subset


@pytest.fixture(scope='module')
def ier(tmp_path_factory, fixtures_dir):
  man = tmp_path_factory.mktemp('ier_manual')
  subset = _ier_manual(man, fixtures_dir, with_images=True)
  data_dir = tmp_path_factory.mktemp('ier_data')
  builder = image_editing_request.prepare('tiny32', os.fspath(data_dir), os.fspath(man),
                                        num_workers=1)
  return builder, subset


def test_ier_records_and_references(ier, fixtures_dir):
  builder, subset = ier
  assert set(builder.info.splits) == {'train', 'val', 'test'}
  for split, official_name in (('val', 'IER_val'), ('test', 'IER_test')):
    recs = _records(builder, split)
    assert [_text(r['pair_id']) for r in recs] == [e['uid'] for e in subset[split]]
    assert all(len(r['captions']) == 3 for r in recs)
    ours = _load(os.path.join(builder.data_dir, f'references_{split}.json'))
    official = _refs_by_id(_load(fixtures_dir / 'image_editing_request' / 'eval_refs' /
                                 f'{official_name}_change_captions_reformat.json'),
                           _ier_normalise)
    mine = _refs_by_id(ours, _ier_normalise)
    assert mine == {k: official[k] for k in mine} and len(mine) == 12
  train = _records(builder, 'train')
  assert all(len(r['captions']) == 1 for r in train)
  scene_ids = [r['scene_id'] for s in common.SPLITS for r in _records(builder, s)]
  assert len(set(scene_ids)) == len(scene_ids) == 36


def test_ier_vocabulary_reproduces_the_official_file(tmp_path, fixtures_dir):
  builder = image_editing_request.Builder(config='tiny32', data_dir=os.fspath(tmp_path))
  captions = builder._vocab_captions(os.fspath(fixtures_dir / 'image_editing_request'), {})
  official = vocab_lib.Vocab.load(fixtures_dir / 'procap_vocab' / 'edit_word2idx2.json')
  assert set(vocab_lib.Vocab.build(captions, 3).word2idx) == set(official.word2idx)


def test_ier_from_the_authors_h5_files(tmp_path, fixtures_dir):
  man = tmp_path / 'man'
  subset = _ier_manual(man, fixtures_dir, with_images=False)  # h5 configs need no images
  rng = np.random.default_rng(0)
  sequences = {}
  with h5py.File(man / 'edit_videos.h5', 'w') as f:
    for e in (e for data in subset.values() for e in data):
      sequences[e['uid']] = f[e['uid']] = rng.integers(0, 256, (9, 3, 40, 48), dtype=np.uint8)
  _dump(man / 'filter_files' / 'edit_similarity_scores.json', {'Reddit_1012': {}})
  builder = image_editing_request.prepare('cpu64_h5', os.fspath(tmp_path / 'data'), os.fspath(man),
                                        num_workers=1)
  rec = _records(builder, 'test')[3]
  seq = sequences[_text(rec['pair_id'])]
  want = np.stack([np.asarray(PIL.Image.fromarray(fr.transpose(1, 2, 0)).resize(
      (64, 64), PIL.Image.Resampling.BILINEAR)) for fr in seq])
  np.testing.assert_array_equal(np.stack(rec['frames']), want)
  np.testing.assert_array_equal(rec['before'], want[0])
  np.testing.assert_array_equal(rec['after'], want[-1])
  assert _load(os.path.join(builder.data_dir, 'similarity_scores.json')) == {'Reddit_1012': {}}

  del_uid = subset['val'][0]['uid']
  with h5py.File(man / 'edit_videos.h5', 'a') as f:
    del f[del_uid]
  with pytest.raises(errors.UserError, match=f'edit_videos.h5.*{del_uid}'):
    image_editing_request.prepare('cpu64_h5', os.fspath(tmp_path / 'data2'), os.fspath(man))


def _data_root(builder) -> str:
  # <root>/<name>/<config>/<version>
  return os.fspath(pathlib.Path(os.fspath(builder.data_dir)).parents[2])


@pytest.mark.parametrize('name', ['clevr', 'spot', 'ier'])
def test_cpu_config_trains_every_stage_on_fixture_data(name, request, tmp_path):
  """The CPU variant of each real dataset's configs runs every stage (2 steps each here, not
  the preset's 4: the suite's unoptimised XLA code makes each step cost seconds; a checkpoint
  after each step, the evaluation after the second)."""
  import importlib
  from procap_jax import main
  builder = request.getfixturevalue(name)[0]
  module = {'clevr': 'clevr_change', 'spot': 'spot_the_diff', 'ier': 'image_editing_request'}
  config = importlib.import_module(f'configs.{module[name]}').get_config('cpu')
  config.data.data_dir = _data_root(builder)
  for stage in ('tokenizer', 'pretrain', 'caption'):
    t = config[stage].train
    t.steps, t.checkpoint_every, t.eval_every, t.log_every = 2, 1, 2, 1
  results = main.run(config, os.fspath(tmp_path))
  assert results['split'] == 'test'
  assert set(results['metrics']) >= {'CIDEr', 'Bleu_4', 'ROUGE_L'}
  assert os.path.exists(tmp_path / 'report.html')
  for stage in ('tokenizer', 'pretrain', 'caption'):
    with open(tmp_path / stage / 'DONE', encoding='utf-8') as f:
      assert json.load(f)['steps'] == 2, stage
