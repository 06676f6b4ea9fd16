"""The checks `main --mode evaluate` and `procap_jax.caption` make before anything slow, and the
caption command's pairing rules. No model is trained here: the runs are config.json files and
checkpoint folders (the checks read names only); tests/end_to_end_test.py captions with a real
run.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest

import reliability_helpers

from procap_jax import config_lib
from procap_jax import errors
from procap_jax import main
from procap_jax.data import pairing

REPO = pathlib.Path(__file__).resolve().parents[1]


def _config(preset: str = 'tiny'):
  from configs import synthetic
  return synthetic.get_config(preset)


def _fake_run(workdir: pathlib.Path, preset: str = 'tiny', stages=('caption', 'tokenizer'),
              vocab_size: int = 37) -> pathlib.Path:
  """config.json of a `preset` run with resolved vocabulary sizes and a checkpoint folder per
  stage in `stages` (what `config_lib.check_run` looks at)."""
  config = _config(preset)
  config.pretrain.model.text_vocab_size = vocab_size
  config.caption.model.vocab_size = vocab_size
  config_lib.check_workdir(config, str(workdir))
  for stage in stages:
    (workdir / stage / 'best' / '20').mkdir(parents=True)
  return workdir


_error = reliability_helpers.exit_message


def _tree(path: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(path)) for p in path.rglob('*'))


# ----------------------------------------------------------------------- main --mode evaluate


def test_evaluate_a_missing_workdir_builds_nothing(tmp_path):
  """The command of the issue, verbatim: one sentence, exit 2, no folder made."""
  workdir = tmp_path / 'W'
  proc = subprocess.run(
      [sys.executable, '-m', 'procap_jax.main', '--config', 'configs/synthetic.py', '--workdir',
       str(workdir), '--mode', 'evaluate'], cwd=REPO, capture_output=True, text=True,
      timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 2, proc.stderr
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert lines == [f'error: workdir {workdir} does not exist; pass the --workdir of a finished '
                   'training run'], proc.stderr
  assert not workdir.exists() and _tree(tmp_path) == []


def test_evaluate_a_run_of_another_preset_says_so_and_builds_nothing(tmp_path, capsys):
  workdir = _fake_run(tmp_path / 'quick_run', 'quick')
  before = _tree(tmp_path)
  err = _error(capsys, main.run, _config('default'), str(workdir), mode='evaluate')
  assert 'holds a run made with another config (differs in data.builder_config' in err
  assert 'config.json says preset :quick' in err and '--config' in err
  assert _tree(tmp_path) == before  # no data folder, no incomplete.* build, config.json kept


def test_evaluate_checks_in_order(tmp_path, capsys):
  config = _config('tiny')
  config.data.data_dir = str(tmp_path / 'data')  # never built
  err = _error(capsys, main.run, config, str(tmp_path), mode='evaluate', split='tset')
  assert '--split tset is not a split' in err
  (tmp_path / 'file').write_text('x')
  err = _error(capsys, main.run, config, str(tmp_path / 'file'), mode='evaluate')
  assert 'is a file, not a directory' in err
  err = _error(capsys, main.run, config, str(tmp_path), mode='evaluate')
  assert 'is not a procap-jax run (no config.json)' in err

  run = _fake_run(tmp_path / 'run', stages=('tokenizer',))
  err = _error(capsys, main.run, config, str(run), mode='evaluate')
  assert f'no caption checkpoint in {run / "caption"}' in err
  (run / 'caption' / 'best' / '20').mkdir(parents=True)
  err = _error(capsys, main.run, config, str(run), mode='evaluate', which='latest')
  assert 'no latest caption checkpoint' in err and '--which best' in err
  (run / 'caption' / 'checkpoints' / '20').mkdir(parents=True)
  # Vocabulary sizes the given config leaves at 0 are not a difference; the dataset is checked
  # last and is not built by evaluation.
  before = _tree(tmp_path)
  err = _error(capsys, main.run, config, str(run), mode='evaluate')
  assert 'synthetic_change/tiny dataset this run is evaluated on is not built' in err
  assert '--mode build' in err
  assert _tree(tmp_path) == before
  (run / 'tokenizer' / 'best' / '20').rmdir()
  err = _error(capsys, main.run, config, str(run), mode='evaluate')
  assert 'no tokenizer checkpoint' in err


def test_checkpoint_dir_follows_checkpointing(tmp_path):
  from procap_jax import checkpointing
  stage = tmp_path / 'caption'
  layouts = [[], ['checkpoints/7.orbax-checkpoint-tmp-12'], ['checkpoints/7'],
             ['checkpoints/7', 'best/5'], ['best/5']]
  for layout in layouts:
    for sub in layout:
      (stage / sub).mkdir(parents=True, exist_ok=True)
    for which in ('best', 'latest'):
      got = config_lib.checkpoint_dir(str(tmp_path), 'caption', which)
      pick = checkpointing._pick_dir  # pylint: disable=protected-access
      assert got == pick(str(tmp_path), 'caption', which), (layout, which)


def test_bad_preset_lists_presets_and_variants():
  from configs import synthetic
  with pytest.raises(ValueError) as info:
    synthetic.get_config('qick')
  assert 'the presets are tiny, quick, default' in str(info.value)
  assert 'static, no_queries' in str(info.value)


# ------------------------------------------------------------------------ caption command


def test_caption_checks_the_run_first_and_imports_no_jax_to_refuse(tmp_path):
  """A wrong --workdir is refused before the images are looked at, without importing JAX."""
  code = ('import sys\nfrom procap_jax import caption\n'
          'try:\n  caption.main(["--workdir", sys.argv[1], "missing.png", "other.png"])\n'
          'except SystemExit as e:\n  print(e.code, sorted(m for m in ("jax", "flax", "orbax", '
          '"optax", "grain", "tensorflow_datasets") if m in sys.modules))\n')
  run = _fake_run(tmp_path / 'run', stages=('tokenizer',))
  proc = subprocess.run([sys.executable, '-c', code, str(run)], cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.stdout.split('\n')[0] == '2 []', proc.stdout + proc.stderr
  assert 'no caption checkpoint' in proc.stderr and 'missing.png' not in proc.stderr


def _png(path: pathlib.Path, value: int = 0) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  PIL.Image.fromarray(np.full((4, 4, 3), value, np.uint8)).save(path)


def _names(pairs) -> list[tuple[str, str]]:
  return [(os.path.basename(b), os.path.basename(a)) for b, a in pairs]


def test_warm_up_takes_no_images_and_needs_a_run(tmp_path, capsys):
  from procap_jax import caption
  with pytest.raises(SystemExit) as e:
    caption.main(['--workdir', str(tmp_path), '--warm_up', 'a.png', 'b.png'])
  assert e.value.code == 2 and '--warm_up takes no images' in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    caption.main(['--workdir', str(tmp_path), '--warm_up'])
  assert e.value.code == 2 and 'not a procap-jax run' in capsys.readouterr().err


@pytest.mark.parametrize('before,after,expected', [
    (['x.png', 'y.png'], ['x.png', 'y.png'], [('x.png', 'x.png'), ('y.png', 'y.png')]),
    (['CLEVR_default_000123.png', 'CLEVR_default_000002.png'],
     ['CLEVR_semantic_000002.png', 'CLEVR_semantic_000123.png'],
     [('CLEVR_default_000002.png', 'CLEVR_semantic_000002.png'),
      ('CLEVR_default_000123.png', 'CLEVR_semantic_000123.png')]),
    # Spot-the-Diff: 12_2.png is number 12, so it pairs with 12.png and never with 2.png.
    (['2.png', '12.png'], ['12_2.png', '2_2.png'], [('2.png', '2_2.png'), ('12.png', '12_2.png')]),
    (['12.png'], ['12_2.png'], [('12.png', '12_2.png')]),
    # A shared suffix number alone is the number: a_1 / a_2 are 1 and 2.
    (['a_1.png', 'a_2.png'], ['b_1.jpg', 'b_2.jpg'], [('a_1.png', 'b_1.jpg'),
                                                      ('a_2.png', 'b_2.jpg')]),
    (['img7.png', 'img08.png'], ['after8.png', 'after007.png'],
     [('img7.png', 'after007.png'), ('img08.png', 'after8.png')]),
])
def test_folders_pair_by_name_then_number(tmp_path, before, after, expected):
  for name in before:
    _png(tmp_path / 'A' / name)
  for name in after:
    _png(tmp_path / 'B' / name)
  (tmp_path / 'B' / 'notes.txt').write_text('not an image')
  pairs, _ = pairing.pair_folders(str(tmp_path / 'A'), str(tmp_path / 'B'))
  assert _names(pairs) == expected


@pytest.mark.parametrize('before,after,words', [
    (['1.png', '2.png'], ['1.png', '3.png'], ['A/2.png', 'B/3.png', 'no partner']),
    (['x.png'], ['y.png'], ['A/x.png has no number']),
    (['5.png', '6.png'], ['5_2.png', '05_2.png', '6_2.png'], ['number 5', 'names two files']),
    (['1.png', '2.png', '3.png'], ['2.png', '3.png', '4.png'], ['A/1.png', 'B/4.png']),
])
def test_folders_that_do_not_pair_are_one_sentence(tmp_path, before, after, words):
  for name in before:
    _png(tmp_path / 'A' / name)
  for name in after:
    _png(tmp_path / 'B' / name)
  with pytest.raises(errors.UserError) as info:
    pairing.pair_folders(str(tmp_path / 'A'), str(tmp_path / 'B'))
  message = str(info.value).replace(str(tmp_path) + os.sep, '')
  assert '\n' not in message and '--csv' in message, message
  for word in words:
    assert word in message, message


def test_spot_the_diff_folder_pairs_with_itself(tmp_path):
  for name in ('1.png', '1_2.png', '10.png', '10_2.png', '1_diff.jpg'):
    _png(tmp_path / 'resized_images' / name)
  folder = str(tmp_path / 'resized_images')
  pairs, rule = pairing.pair_folders(folder, folder)
  assert _names(pairs) == [('1.png', '1_2.png'), ('10.png', '10_2.png')]
  assert '1_diff.jpg' in rule
  _png(tmp_path / 'plain' / 'a.png')
  with pytest.raises(errors.UserError, match='same folder'):
    pairing.pair_folders(str(tmp_path / 'plain'), str(tmp_path / 'plain'))


def test_real_clevr_change_folders_pair_by_number(fixtures_dir):
  clevr = fixtures_dir / 'clevr_change'
  for after_dir, prefix in (('sc_images', 'CLEVR_semantic_'),
                            ('nsc_images', 'CLEVR_nonsemantic_')):
    pairs, rule = pairing.pair_folders(str(clevr / 'images'), str(clevr / after_dir))
    assert rule == 'by the number in the file names' and len(pairs) >= 5
    for b, a in pairs:
      assert os.path.basename(a) == os.path.basename(b).replace('CLEVR_default_', prefix)


def test_headline_gives_the_readme_metrics_x100():
  from procap_jax import stages
  line = stages.headline({'split': 'test', 'checkpoint': 'best', 'checkpoint_step': 20,
                          'metrics': {'Bleu_4': 0.1234, 'METEOR': 0.2, 'ROUGE_L': 0.3,
                                      'CIDEr': 0.412, 'Bleu_1': 0.9}})
  assert line == ('test (best checkpoint, step 20): BLEU-4 12.3, METEOR 20.0, ROUGE-L 30.0, '
                  'CIDEr 41.2')


def test_vocab_path_without_tfds(tmp_path):
  from procap_jax import caption
  config = caption.load_run_config(str(_fake_run(tmp_path / 'run')))
  with pytest.raises(errors.UserError, match="caption vocabulary .* does not exist"):
    caption.vocab_path(config, str(tmp_path / 'run'))
  version = tmp_path / 'run' / 'data' / 'synthetic_change' / 'tiny' / '1.0.0'
  version.mkdir(parents=True)
  (version / 'word2idx.json').write_text(json.dumps({'[PAD]': 0}))
  assert caption.vocab_path(config, str(tmp_path / 'run')) == str(version / 'word2idx.json')


def test_a_run_saved_before_newer_config_keys_loads_with_their_old_behaviour(tmp_path):
  """config.json of a run made before data.encoder_text existed: the loaded config has the value
  that reproduces the run, and the vocabulary sizes resolve without an AttributeError."""
  from procap_jax import caption
  from procap_jax.data import pipeline
  run = _fake_run(tmp_path / 'run')
  saved = json.loads((run / 'config.json').read_text())
  for key in ('encoder_text', 'bpe_merges_file'):
    del saved['data'][key]
  (run / 'config.json').write_text(json.dumps(saved))
  config = caption.load_run_config(str(run))
  assert config.data.encoder_text == 'words' and config.data.bpe_merges_file == ''
  pipeline.resolve_vocab_sizes(config, str(run))  # sizes saved: no vocabulary file is read
  assert config.pretrain.model.text_vocab_size == 37


def test_parameters_cache_follows_the_checkpoints(tmp_path, monkeypatch):
  """The caption command's second start reads W/caption/inference_cache/params.npz instead of
  the orbax checkpoints, until a checkpoint (or config.json) changes."""
  from procap_jax import caption
  from procap_jax import checkpointing
  run = _fake_run(tmp_path / 'run', stages=())

  def save(stage: str, step: int, value: float) -> None:
    ckpts = checkpointing.StageCheckpoints(str(run / stage))
    state = {'params': {'enc': {'w': np.full((2, 3), value, np.float32)}}, 'model_state': {},
             'opt_state': {'mu': np.zeros(3, np.float32)}}
    ckpts.save(step, state, {}, {}, best=True)
    ckpts.close()

  save('caption', 5, 1.0)
  save('tokenizer', 3, 2.0)
  params, tokenizer, step = caption.load_parameters(str(run))
  assert step == 5 and params['enc']['w'][0, 0] == 1.0 and tokenizer['enc']['w'][1, 2] == 2.0
  assert (run / 'caption' / 'inference_cache' / 'params.npz').is_file()

  def no_restore(*args, **kwargs):
    raise AssertionError('restored although the cache is current')

  with monkeypatch.context() as m:
    m.setattr(checkpointing, 'load_stage_variables', no_restore)
    cached, cached_tokenizer, cached_step = caption.load_parameters(str(run))
  assert cached_step == 5
  np.testing.assert_array_equal(cached['enc']['w'], params['enc']['w'])
  np.testing.assert_array_equal(cached_tokenizer['enc']['w'], tokenizer['enc']['w'])
  save('caption', 6, 7.0)  # a newer best checkpoint: the cache is made again
  params, _, step = caption.load_parameters(str(run))
  assert step == 6 and params['enc']['w'][0, 0] == 7.0
  assert caption.load_parameters(str(run), cache=False)[2] == 6
