"""Tests of the synthetic_change builder (tiny config, built once per module)."""

import json
import os
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import tensorflow_datasets as tfds

from procap_jax import errors
from tfds_builders import synthetic_change
from tfds_builders.synthetic_change import captions as captions_lib
from tfds_builders.synthetic_change import contact_sheet
from tfds_builders.synthetic_change import generate
from tfds_builders.synthetic_change import scene
from tfds_builders.synthetic_change import synthetic_change_dataset_builder as builder_lib

CHANGE_TYPES = ['none', 'color', 'material', 'add', 'drop', 'move', 'other']
TINY = builder_lib.CONFIGS[0]


@pytest.fixture(scope='module')
def tiny_dir(tmp_path_factory) -> str:
  d = str(tmp_path_factory.mktemp('synthetic'))
  synthetic_change.prepare('tiny', d, num_workers=1)
  return d


def _source(data_dir: str, split: str):
  return tfds.data_source('synthetic_change/tiny', data_dir=data_dir, split=split)


def _records(data_dir: str, split: str) -> list[dict]:
  src = _source(data_dir, split)
  return [src[i] for i in range(len(src))]


def _text(x) -> str:
  return x.decode('utf-8') if isinstance(x, bytes) else x


def test_features_and_dtypes(tiny_dir):
  builder = synthetic_change.prepare('tiny', tiny_dir)  # already prepared: reused
  assert builder.info.features['change_type'].names == CHANGE_TYPES
  r = _source(tiny_dir, 'train')[0]
  assert set(r) == {'pair_id', 'scene_id', 'change_type', 'before', 'after', 'frames',
                    'oracle_frames', 'captions', 'change_params'}
  s = TINY.image_size
  for key in ('before', 'after'):
    assert r[key].dtype == np.uint8 and r[key].shape == (s, s, 3)
  for key in ('frames', 'oracle_frames'):
    frames = np.asarray(r[key])
    assert frames.dtype == np.uint8 and frames.shape == (9, s, s, 3)
  assert isinstance(r['pair_id'], bytes) and isinstance(r['change_params'], bytes)
  assert int(r['scene_id']) == 0 and _text(r['pair_id']) == '000000c'
  assert all(isinstance(c, bytes) for c in r['captions'])
  json.loads(r['change_params'])


def test_record_counts_and_pair_ids(tiny_dir):
  for split in scene.SPLITS:
    records = _records(tiny_dir, split)
    n = TINY.num_scenes(split)
    assert len(records) == 2 * n
    first = TINY.first_scene_id(split)
    expected = [f'{first + i:06d}{suffix}' for i in range(n) for suffix in ('c', 'nc')]
    assert [_text(r['pair_id']) for r in records] == expected
    for r in records:
      is_distractor = _text(r['pair_id']).endswith('nc')
      assert (CHANGE_TYPES[r['change_type']] == 'none') == is_distractor


def test_splits_are_disjoint_by_scene(tiny_dir):
  scenes = {split: {int(r['scene_id']) for r in _records(tiny_dir, split)}
            for split in scene.SPLITS}
  assert scenes['train'].isdisjoint(scenes['val'])
  assert scenes['train'].isdisjoint(scenes['test'])
  assert scenes['val'].isdisjoint(scenes['test'])


def test_every_change_type_in_train(tiny_dir):
  types = {CHANGE_TYPES[r['change_type']] for r in _records(tiny_dir, 'train')}
  assert types == {'none', 'color', 'material', 'add', 'drop', 'move'}


def test_oracle_endpoints_are_before_and_after(tiny_dir):
  for r in _records(tiny_dir, 'val'):
    np.testing.assert_array_equal(r['oracle_frames'][0], r['before'])
    np.testing.assert_array_equal(r['oracle_frames'][-1], r['after'])
    assert not np.array_equal(r['before'], r['after'])  # every pair shows something


def test_pairs_of_a_scene_share_the_before_image(tiny_dir):
  records = _records(tiny_dir, 'test')
  for change, distractor in zip(records[0::2], records[1::2]):
    np.testing.assert_array_equal(change['before'], distractor['before'])


def test_captions(tiny_dir):
  for r in _records(tiny_dir, 'train'):
    caps = [_text(c) for c in r['captions']]
    t = CHANGE_TYPES[r['change_type']]
    assert len(caps) == len(captions_lib.TEMPLATES[t]) >= 5
    assert all(c and c == c.strip() and c.islower() for c in caps)
    params = json.loads(r['change_params'])
    assert params['type'] == t
    if t != 'none':
      o = params['object']
      assert all(f"{o['size']} {o['color']} {o['material']} {o['shape']}" in c for c in caps)


def test_templates_have_five_paraphrases_per_type():
  for t in ['none'] + list(scene.CHANGE_TYPES):
    assert len(set(captions_lib.TEMPLATES[t])) >= 5, t


def test_change_params_describe_the_change():
  for i in range(25):
    change, distractor = scene.sample_pairs(0, 'train', i)
    params = generate.change_params(change)
    old = change.objects[change.target] if change.target >= 0 else None
    if change.change_type == 'color':
      assert params['from'] != params['to']
    elif change.change_type == 'material':
      assert {params['from'], params['to']} == {'rubber', 'metal'}
    elif change.change_type == 'move':
      shift = np.hypot(change.changed.x - old.x, change.changed.y - old.y)
      assert shift >= scene.MIN_MOVE
    elif change.change_type == 'add':
      assert params['num_objects'][1] == params['num_objects'][0] + 1
    elif change.change_type == 'drop':
      assert params['num_objects'][1] == params['num_objects'][0] - 1
    assert scene.MIN_OBJECTS <= len(change.objects) <= scene.MAX_OBJECTS
    assert distractor.objects == change.objects and distractor.after_objects() == change.objects
    attrs = [o.attributes for o in change.after_objects()]
    assert len(set(attrs)) == len(attrs)  # a caption names exactly one object


def test_render_is_deterministic():
  spec = generate.Spec(seed=0, image_size=32, interpolation='crossfade', split='val',
                       first_scene_id=100)
  a = generate.scene_examples((spec, 3))
  b = generate.scene_examples((spec, 3))
  assert a == b
  other = generate.scene_examples((generate.Spec(1, 32, 'crossfade', 'val', 100), 3))
  assert other[0][1]['before'] != a[0][1]['before']  # another seed, another scene
  assert [k for k, _ in a] == [206, 207]
  assert a[0][1]['pair_id'] == '000103c' and a[1][1]['pair_id'] == '000103nc'


def test_same_seed_builds_equal_records(tiny_dir, tmp_path, monkeypatch):
  # The module fixture rendered in this process; this build renders train in 2 spawned workers.
  monkeypatch.setattr(builder_lib, '_SCENES_PER_WORKER', 12)  # train only: one pool
  other = str(tmp_path / 'again')
  synthetic_change.prepare('tiny', other, num_workers=2)
  for split in scene.SPLITS:
    for a, b in zip(_records(tiny_dir, split), _records(other, split), strict=True):
      assert a.keys() == b.keys()
      for key in a:
        if key in ('frames', 'oracle_frames'):
          np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
        elif key in ('before', 'after'):
          np.testing.assert_array_equal(a[key], b[key])
        else:
          assert a[key] == b[key], key


def test_unknown_config_is_a_user_error(tmp_path):
  with pytest.raises(errors.UserError, match='unknown synthetic_change config'):
    synthetic_change.prepare('medium', str(tmp_path))


def test_unwritable_data_dir_is_a_user_error(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  with pytest.raises(errors.UserError, match='not writable'):
    synthetic_change.prepare('tiny', str(blocker / 'data'))
  with pytest.raises(errors.UserError, match='is a file'):
    synthetic_change.prepare('tiny', str(blocker))
  if os.geteuid() != 0:  # root writes anywhere: only the path-under-a-file case applies
    locked = tmp_path / 'locked'
    locked.mkdir(mode=0o500)
    with pytest.raises(errors.UserError, match='not writable'):
      synthetic_change.prepare('tiny', str(locked))


def test_cli_prints_statistics_and_fails_with_one_sentence(tiny_dir):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))] +
      os.environ.get('PYTHONPATH', '').split(os.pathsep)))
  cmd = [sys.executable, '-m', 'tfds_builders.synthetic_change.build', '--data_dir', tiny_dir]
  ok = subprocess.run(cmd + ['--config', 'tiny', '--json'], env=env, capture_output=True,
                      text=True, check=False)
  assert ok.returncode == 0, ok.stderr
  stats = json.loads(ok.stdout.strip().splitlines()[-1])
  assert stats['image_size'] == TINY.image_size
  assert stats['splits']['train']['pairs'] == 2 * TINY.train_scenes
  assert stats['splits']['train']['change_types']['none'] == TINY.train_scenes
  bad = subprocess.run(cmd + ['--config', 'medium'], env=env, capture_output=True, text=True,
                       check=False)
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines()[-1].startswith('error: unknown synthetic_change config')


def test_contact_sheet(tiny_dir, tmp_path):
  out = tmp_path / 'sheet.png'
  contact_sheet.main(['--data_dir', tiny_dir, '--config', 'tiny', '--out', str(out),
                      '--per_type', '1'])
  with PIL.Image.open(out) as img:
    assert img.width > 20 * TINY.image_size and img.height > 6 * TINY.image_size


def test_prepare_survives_importing_the_command_module(tmp_path):
  """`import tfds_builders.synthetic_change.build` (the command) binds the package attribute
  `build` to the module; the package's `prepare(config, data_dir)` must not be affected."""
  import importlib
  importlib.import_module('tfds_builders.synthetic_change.build')
  with pytest.raises(errors.UserError, match='unknown synthetic_change config'):
    synthetic_change.prepare('medium', str(tmp_path))
