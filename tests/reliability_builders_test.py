"""Reliability of the dataset builders (issue 8): a build killed midway, bad manual downloads,
the synthetic builder command's bad flags. Rows of docs/reliability.md, as tests/conftest.py's
`fault` fixture records them.
"""

import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import PIL.Image
import pytest

from procap_jax import errors

import reliability_helpers as helpers


def test_sigkill_during_a_dataset_build_then_rebuild(tiny_data_dir, tmp_path, fault):
  from tfds_builders import synthetic_change
  data_dir = tmp_path / 'data'
  config_dir = data_dir / 'synthetic_change' / 'tiny'
  delay = random.Random(80).uniform(0.2, 1.5)
  proc = subprocess.Popen(
      [sys.executable, '-m', 'tfds_builders.synthetic_change.build', '--config', 'tiny',
       '--data_dir', str(data_dir), '--num_workers', '1'], cwd=helpers.REPO,
      env=helpers.subprocess_env(str(tmp_path / 'jax_cache')), stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL)
  deadline = time.time() + 120
  while not glob.glob(str(config_dir / 'incomplete.*')):
    assert proc.poll() is None and time.time() < deadline, 'the build ended before the kill'
    time.sleep(0.02)
  time.sleep(delay)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, 'the build finished before the kill'
  assert glob.glob(str(config_dir / 'incomplete.*')) and not (config_dir / '1.0.0').exists()

  builder = synthetic_change.prepare('tiny', str(data_dir), num_workers=1)
  reference = synthetic_change.prepare('tiny', tiny_data_dir)
  for split in ('train', 'val', 'test'):
    a, b = builder.as_data_source(split), reference.as_data_source(split)
    assert len(a) == len(b)
    for i in (0, len(a) - 1):
      assert a[i]['pair_id'] == b[i]['pair_id']
      np.testing.assert_array_equal(a[i]['frames'], b[i]['frames'])
  assert helpers.leftovers(str(data_dir)) == []
  fault('synthetic_change builder', f'SIGKILL {delay:.2f} s into writing the build (TFDS '
        'temporary directory present)', 'no dataset is visible (TFDS renames its temporary '
        'directory only when complete); the next build removes the leftover directory and '
        'builds records equal to an uninterrupted build')


def _spot_manual(man, problem: str = '') -> None:
  """A 2-pairs-per-split Spot-the-Diff manual directory with odd but valid inputs: after images
  of another size and mode than the before images, and empty captions."""
  rng = np.random.default_rng(0)
  (man / 'annotations').mkdir(parents=True)
  (man / 'resized_images').mkdir()
  n = 0
  for split in ('train', 'val', 'test'):
    data = []
    for _ in range(2):
      n += 1
      data.append({'img_id': str(n), 'sentences': ['the car is gone', '', '   ']})
      PIL.Image.fromarray(rng.integers(0, 255, (40, 50, 3), np.uint8)).save(
          man / 'resized_images' / f'{n}.png')
      after = rng.integers(0, 255, (70, 33), np.uint8)
      mode_image = PIL.Image.fromarray(after).convert('LA' if n % 2 else 'P')
      mode_image.save(man / 'resized_images' / f'{n}_2.png')
    (man / 'annotations' / f'{split}.json').write_text(json.dumps(data))
  bad = man / 'resized_images' / '3.png'
  if problem == 'non-UTF-8 annotation file':
    (man / 'annotations' / 'val.json').write_bytes(b'[{"img_id": "3", "sentences": ["\xff"]}]')
  elif problem == 'image of 20000 x 20000 px (header)':
    bad.write_bytes(helpers.huge_png())
  elif problem == 'zero-size image file':
    bad.write_bytes(b'')
  elif problem == 'truncated JPEG':
    bad.write_bytes(helpers.jpeg()[:300])
  elif problem == 'missing image file':
    bad.unlink()
  elif problem == 'a split whose captions are all empty':
    (man / 'annotations' / 'val.json').write_text(json.dumps(
        [{'img_id': '3', 'sentences': ['', ' ']}]))


def test_real_dataset_builders_bad_input(tmp_path, capsys, fault):
  from tfds_builders import spot_the_diff
  man = tmp_path / 'ok'
  _spot_manual(man)
  capsys.readouterr()
  builder = spot_the_diff.prepare('tiny32', str(tmp_path / 'data_ok'), str(man), num_workers=1)
  # stderr is not a terminal here (captured, as a log file is): plain progress lines, one per
  # split, and neither TFDS's nested bars nor escape codes.
  err = capsys.readouterr().err
  assert '\r' not in err and '\x1b' not in err and '%|' not in err, err
  lines = [line for line in err.splitlines() if line.startswith('spot_the_diff/tiny32 ')]
  assert sorted(line.split(':')[0] for line in lines) == [
      f'spot_the_diff/tiny32 {split}' for split in ('test', 'train', 'val')], err
  assert all(re.fullmatch(r'spot_the_diff/tiny32 \w+: 2/2 in \d+ s \([\d.e+]+ pair/s\)', line)
             for line in lines), lines
  fault('dataset builders (spot_the_diff shown)', 'output that is not a terminal (a log file): '
        'the progress of a build', 'one plain line per split, no TFDS bars or escape codes, e.g. '
        f'"{lines[0]}" (a loop that runs longer prints count, rate and ETA every 10 % or minute)')
  record = builder.as_data_source('train')[0]
  assert record['before'].shape == record['after'].shape == (32, 32, 3)
  assert [c.decode() for c in record['captions']] == ['the car is gone']
  fault('dataset builders (spot_the_diff shown)', 'before 50 x 40 RGB, after 33 x 70 LA / P '
        '(mismatched sizes, non-RGB), empty captions', 'built: both images converted to RGB '
        'and resized to the config size; empty captions dropped')
  for i, problem in enumerate(('non-UTF-8 annotation file', 'image of 20000 x 20000 px (header)',
                                'zero-size image file', 'truncated JPEG', 'missing image file',
                                'a split whose captions are all empty')):
    man = tmp_path / f'manual{i}'
    _spot_manual(man, problem)
    data_dir = tmp_path / f'data{i}'
    with pytest.raises(errors.UserError) as info:
      spot_the_diff.prepare('tiny32', str(data_dir), str(man), num_workers=1)
    config_dir = data_dir / 'spot_the_diff' / 'tiny32'
    assert not config_dir.exists() or not os.listdir(config_dir)  # nothing half-written
    fault('dataset builders (spot_the_diff shown)', problem, f'error: {info.value}')


def test_synthetic_builder_command_bad_input(tmp_path, capsys, fault):
  import importlib
  build = importlib.import_module('tfds_builders.synthetic_change.build')  # the command module
  err = helpers.exit_message(capsys, build.main, ['--config', 'huge', '--data_dir', str(tmp_path)])
  fault('synthetic_change builder command', 'unknown builder config', err)
  (tmp_path / 'file').write_text('x')
  err = helpers.exit_message(capsys, build.main, ['--config', 'tiny', '--data_dir',
                                                  str(tmp_path / 'file')])
  fault('synthetic_change builder command', '--data_dir is a file', err)
