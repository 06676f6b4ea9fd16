"""Reliability of the caption and evaluation commands (issue 8): bad images, CSVs, run
directories, results and reference files, each refused with one sentence; images of any mode
and size converted. Rows of docs/reliability.md, as tests/conftest.py's `fault` fixture records
them.
"""

import io

import numpy as np
import PIL.Image
import pytest

import reliability_helpers as helpers


@pytest.fixture()
def run_dir(tiny_config, tmp_path):
  """A workdir with a run's config.json, vocabulary and caption and tokenizer checkpoint folders
  (empty: the caption command's checks of the run, the pairs and the images all come before any
  checkpoint is read)."""
  from procap_jax import config_lib
  from procap_jax.data import pipeline
  workdir = tmp_path / 'run'
  pipeline.resolve_vocab_sizes(tiny_config, str(workdir))
  config_lib.check_workdir(tiny_config, str(workdir))
  for stage in ('caption', 'tokenizer'):
    (workdir / stage / 'best' / '1').mkdir(parents=True)
  return workdir


def test_caption_command_bad_input(run_dir, tmp_path, capsys, fault):
  from procap_jax import caption
  ok = tmp_path / 'ok.png'
  ok.write_bytes(helpers.png(40, 40))  # large enough for no notice: stderr holds the error only
  files = {
      'missing image file': None,
      'zero-size image file': b'',
      'truncated PNG': helpers.png(40, 40)[:60],
      'truncated JPEG': helpers.jpeg()[:300],
      'image of 20000 x 20000 px (header)': helpers.huge_png(),
      'not an image (text file)': b'hello, world\n',
  }
  for (what, data), name in zip(files.items(), ('missing.png', 'empty.png', 'cut.png',
                                                 'cut.jpg', 'huge.png', 'text.png')):
    path = tmp_path / name
    if data is not None:
      path.write_bytes(data)
    err = helpers.exit_message(capsys, caption.main,
                               ['--workdir', str(run_dir), str(ok), str(path)])
    assert path.name in err
    fault('caption command', what, err)
  err = helpers.exit_message(capsys, caption.main,
                             ['--workdir', str(run_dir), str(ok), str(tmp_path)])
  fault('caption command', 'a directory given as an image', err)

  csv_cases = {
      'non-UTF-8 CSV': b'before,after\n\xff\xfe.png,b.png\n',
      'CSV row with one column': b'before,after\nonly.png\n',
      'CSV naming images that do not exist': b'before,after\na.png,b.png\n',
  }
  for what, data in csv_cases.items():
    (tmp_path / 'pairs.csv').write_bytes(data)
    err = helpers.exit_message(capsys, caption.main, ['--workdir', str(run_dir), '--csv',
                                                      str(tmp_path / 'pairs.csv')])
    fault('caption command', what, err)
  err = helpers.exit_message(capsys, caption.main,
                             ['--workdir', str(run_dir), '--csv', str(tmp_path)])
  fault('caption command', 'CSV path is a directory', err)
  (tmp_path / 'A').mkdir()
  (tmp_path / 'B').mkdir()
  (tmp_path / 'A' / 'x.png').write_bytes(helpers.png())
  (tmp_path / 'B' / 'y.png').write_bytes(helpers.png())
  err = helpers.exit_message(capsys, caption.main, ['--workdir', str(run_dir), '--before_dir',
                                                    str(tmp_path / 'A'), '--after_dir',
                                                    str(tmp_path / 'B')])
  fault('caption command', 'before/after folders with different file names', err)
  err = helpers.exit_message(capsys, caption.main,
                             ['--workdir', str(tmp_path / 'A'), str(ok), str(ok)])
  fault('caption command', '--workdir that is not a training run', err)
  (run_dir / 'config.json').write_bytes(b'{"data": {"name": ')
  err = helpers.exit_message(capsys, caption.main, ['--workdir', str(run_dir), str(ok), str(ok)])
  fault('caption command', "truncated config.json in the run's workdir", err)


@pytest.mark.parametrize('mode,fmt', [('L', 'PNG'), ('RGBA', 'PNG'), ('P', 'GIF'),
                                      ('I;16', 'PNG'), ('CMYK', 'JPEG'), ('1', 'BMP')])


def test_caption_inputs_of_any_mode_and_size_are_converted(tiny_config, mode, fmt, fault):
  from procap_jax.data import images
  from procap_jax.data import pipeline
  buf = io.BytesIO()
  PIL.Image.new(mode, (51, 17), 1).save(buf, format=fmt)
  before = images.load_image(helpers.png(300, 200))
  after = images.load_image(buf.getvalue())
  size = tiny_config.data.image_size
  for x in (before, after):
    out = pipeline.resize(x, size)
    assert out.shape == (size, size, 3) and out.dtype == np.uint8
  fault('caption command', f'{mode} {fmt} after image (51 x 17) with an RGB before image '
        '(300 x 200)', f'converted to RGB, both resized to the run\'s {size} x {size}')


def test_evaluation_command_bad_input(tmp_path, capsys, fault):
  from procap_jax import evaluation
  refs = tmp_path / 'refs.json'
  evaluation.write_references(str(refs), {'a': ['a cube'], 'b': ['a ball']})
  cases = {
      'results with unknown ids': b'[{"image_id": "zzz", "caption": "a cube"}]',
      'non-UTF-8 results file': b'[{"image_id": "a", "caption": "\xff"}]',
      'truncated results file': b'[{"image_id": "a", "capt',
      'empty results list': b'[]',
      'caption that is not a string': b'[{"image_id": "a", "caption": 3}]',
      'entry without "caption"': b'[{"image_id": "a"}]',
      'missing results file': None,
  }
  for what, data in cases.items():
    results = tmp_path / 'results.json'
    if results.exists():
      results.unlink()
    if data is not None:
      results.write_bytes(data)
    err = helpers.exit_message(capsys, evaluation.main, ['--results', str(results),
                                                         '--references', str(refs), '--no-meteor',
                                                         '--no-spice'])
    fault('evaluation command', what, err)
  (tmp_path / 'ok.json').write_bytes(b'[{"image_id": "a", "caption": "a cube"}]')
  refs.write_bytes(refs.read_bytes()[:30])
  err = helpers.exit_message(capsys, evaluation.main, ['--results', str(tmp_path / 'ok.json'),
                                                       '--references', str(refs), '--no-meteor',
                                                       '--no-spice'])
  fault('evaluation command', 'truncated reference file', err)
  (tmp_path / 'empty.json').write_bytes(b'[{"image_id": "a", "caption": ""}]')
  evaluation.write_references(str(refs), {'a': ['a cube'], 'b': ['a ball']})
  capsys.readouterr()
  metrics = evaluation.main(['--results', str(tmp_path / 'empty.json'), '--references',
                             str(refs), '--no-meteor', '--no-spice'])
  assert metrics['all']['CIDEr'] == 0.0 and len(metrics['notes']) == 2, metrics
  assert "1 of the 2 reference ids have no prediction (e.g. 'b')" in metrics['notes'][1]
  fault('evaluation command', 'an empty caption, for one of the two reference ids',
        'scored (0 for it), with the notes: ' + '; '.join(metrics['notes']))
