"""Builds on Apache Beam (tfds_builders/beam_build.py) give the records of the build without it.

The Beam builds need the optional extra (`pip install -e ".[beam]"`) and skip without it; the
option checks that need no Beam always run. Records are compared as parsed tf.Example feature
maps: the serialized bytes of two builds differ even without Beam (protobuf writes the feature
map in no fixed order), the features themselves (PNG bytes included) must not.
"""

import glob
import os
import sys

from array_record.python import array_record_module
import pytest

import clevr_manual
from tensorflow_datasets.proto import tf_example_pb2
from tensorflow_datasets.proto import tf_feature_pb2

from procap_jax import errors
from tfds_builders import beam_build
from tfds_builders import build as build_cli
from tfds_builders import clevr_change
from tfds_builders.synthetic_change import synthetic_change_dataset_builder as synthetic_lib

# 4 scenes = 8 pairs at 32 px: the smallest build with every split.
_SYNTHETIC = synthetic_lib.SyntheticChangeConfig(
    name='beam_test', description='Beam test', image_size=32, train_scenes=2, val_scenes=1,
    test_scenes=1)
_CLEVR_SPLITS = {'train': [0, 1, 3], 'val': [19], 'test': [2]}


def _records(builder, split: str) -> list[dict[str, bytes]]:
  """The split's records in order, each {feature name: serialized feature proto}."""
  pattern = os.path.join(os.fspath(builder.data_dir), f'*-{split}.array_record-*')
  out = []
  for path in sorted(glob.glob(pattern)):
    reader = array_record_module.ArrayRecordReader(path)
    for raw in reader.read_all():
      features = tf_example_pb2.Example.FromString(raw).features.feature
      out.append({k: v.SerializeToString(deterministic=True) for k, v in features.items()})
    reader.close()
  return out


def _assert_same_dataset(local, beam) -> None:
  splits = list(local.info.splits)
  assert splits and splits == list(beam.info.splits)
  for split in splits:
    a, b = _records(local, split), _records(beam, split)
    assert len(a) == local.info.splits[split].num_examples > 0
    assert a == b, split
  assert local.info.features.to_json() == beam.info.features.to_json()


def _synthetic(data_dir, beam_options):
  builder = synthetic_lib.Builder(config=_SYNTHETIC, data_dir=os.fspath(data_dir),
                                  file_format='array_record', num_workers=1)
  builder.download_and_prepare(file_format='array_record',
                               download_config=beam_build.download_config(beam_options))
  return builder


def test_without_beam_options_the_build_does_not_use_beam():
  assert beam_build.flags('') == [] and beam_build.flags(None) == []
  assert not beam_build.uses_beam(beam_build.download_config(''))
  assert not beam_build.uses_beam(None)
  assert beam_build.flags("--runner=DirectRunner --environment_config='{\"a\": 1}'") == [
      '--runner=DirectRunner', '--environment_config={"a": 1}']


def test_beam_options_are_flags():
  with pytest.raises(errors.UserError, match="flags such as --runner.*'runner=DirectRunner'"):
    beam_build.pipeline_options('runner=DirectRunner')


def test_beam_options_without_beam_name_the_extra(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, 'apache_beam', None)  # `import apache_beam` fails
  with pytest.raises(errors.UserError, match=r'pip install -e "\.\[beam\]"'):
    synthetic_lib.build('tiny', os.fspath(tmp_path), beam_options='--runner=DirectRunner')
  assert not os.listdir(tmp_path)  # checked before anything is written


def test_a_user_error_in_a_worker_stops_the_build_with_its_sentence():
  remote = ('Traceback (most recent call last):\n  File "images.py", line 249\n'
            'procap_jax.errors.UserError: m/a.png is not an image; check the file '
            "[while running 'train/FlatMap(_run)']\n")
  with pytest.raises(errors.UserError, match=r'^m/a.png is not an image; check the file$'):
    with beam_build.user_errors_from_workers():
      raise RuntimeError(remote)
  with pytest.raises(RuntimeError, match='a bug'):  # anything else keeps its traceback
    with beam_build.user_errors_from_workers():
      raise RuntimeError('a bug')


def test_bad_beam_options_are_user_errors():
  pytest.importorskip('apache_beam')
  with pytest.raises(errors.UserError, match='unknown Beam option.*--direct_num_wokers'):
    beam_build.pipeline_options('--runner=DirectRunner --direct_num_wokers=2')
  with pytest.raises(errors.UserError, match="invalid Beam option.*'two'"):
    beam_build.pipeline_options(['--direct_num_workers=two'])
  options = beam_build.pipeline_options('--direct_num_workers=2')
  assert options.get_all_options()['direct_num_workers'] == 2


def test_synthetic_beam_build_equals_local_build(tmp_path):
  pytest.importorskip('apache_beam')
  local = _synthetic(tmp_path / 'local', '')
  beam = _synthetic(tmp_path / 'beam', '--runner=DirectRunner')
  _assert_same_dataset(local, beam)
  ids = [tf_feature_pb2.Feature.FromString(r['pair_id']).bytes_list.value[0]
         for r in _records(beam, 'train')]
  assert ids == [b'000000c', b'000000nc', b'000001c', b'000001nc']  # scene order


def test_clevr_beam_build_in_two_processes_equals_local_build(tmp_path, fixtures_dir):
  pytest.importorskip('apache_beam')
  man = os.fspath(clevr_manual.clevr_manual(tmp_path, fixtures_dir, _CLEVR_SPLITS))
  local = clevr_change.prepare('tiny32', os.fspath(tmp_path / 'local'), man, num_workers=1)
  line = build_cli.build(
      'clevr_change/tiny32', os.fspath(tmp_path / 'beam'), manual_dir=man,
      beam_options='--runner=DirectRunner --direct_num_workers=2 '
                   '--direct_running_mode=multi_processing')
  assert line['pairs'] == {'train': 6, 'val': 2, 'test': 2} and line['build_s'] > 0
  beam = clevr_change.Builder(config='tiny32', data_dir=os.fspath(tmp_path / 'beam'))
  _assert_same_dataset(local, beam)
  for name in ('references_train.json', 'references_test.json', 'word2idx.json'):
    with open(os.path.join(local.data_dir, name), 'rb') as a, \
         open(os.path.join(beam.data_dir, name), 'rb') as b:
      assert a.read() == b.read(), name


def test_main_passes_the_configs_beam_options_to_the_builder(tiny_config, tmp_path, monkeypatch):
  """`--config.data.beam_options` reaches the builder's prepare (and '' means no Beam)."""
  from procap_jax import stages
  from procap_jax.data import datasets
  calls = []

  class FakeBuilderModule:
    @staticmethod
    def prepare(config_name, data_dir, **kwargs):
      calls.append(kwargs)

  monkeypatch.setattr(datasets, 'is_prepared', lambda *args: False)
  monkeypatch.setattr(datasets, 'builder_module', lambda name: FakeBuilderModule)
  tiny_config.data.sampler = 'uniform'  # no confidence scores to compute afterwards
  stages._prepare_data(tiny_config, str(tmp_path))  # pylint: disable=protected-access
  tiny_config.data.beam_options = '--runner=DirectRunner'
  stages._prepare_data(tiny_config, str(tmp_path))  # pylint: disable=protected-access
  assert calls == [{'beam_options': None}, {'beam_options': '--runner=DirectRunner'}]
