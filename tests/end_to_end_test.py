"""End to end on the tiny preset: every stage through `main.run`, skipping, kill and resume."""

import json
import os

import numpy as np
import pytest

from procap_jax import errors
from procap_jax import main
from procap_jax import stages
from procap_jax import train


@pytest.fixture(scope='module')
def finished_run(tiny_data_dir, tmp_path_factory):
  from configs import synthetic
  config = synthetic.get_config('tiny')
  config.data.data_dir = tiny_data_dir
  workdir = str(tmp_path_factory.mktemp('run'))
  results = main.run(config, workdir)
  return config, workdir, results


def test_all_stages_write_results_and_report(finished_run):
  config, workdir, results = finished_run
  for stage in ('tokenizer', 'pretrain', 'caption'):
    assert os.path.exists(train.stage_done_path(workdir, stage))
  with open(os.path.join(workdir, 'results.json')) as f:
    saved = json.load(f)
  assert saved['split'] == 'test' and saved['selected_on'] == 'val'
  for name in ('CIDEr', 'Bleu_4', 'METEOR', 'ROUGE_L'):
    assert np.isfinite(saved['metrics'][name])
  html = open(os.path.join(workdir, 'report.html'), encoding='utf-8').read()
  assert 'Gallery' in html and 'imagined' in html and 'data:image/png;base64' in html
  with open(os.path.join(workdir, 'caption', 'predictions_test.json')) as f:
    preds = json.load(f)
  assert preds and {'image_id', 'caption'} <= set(preds[0])
  # The tokenizer's validation metrics reached the stage summary.
  with open(train.stage_done_path(workdir, 'tokenizer')) as f:
    assert 'psnr' in json.load(f)['val']


def test_rerun_skips_finished_stages(finished_run, capsys):
  config, workdir, _ = finished_run
  main.run(config, workdir)
  out = capsys.readouterr().out
  assert out.count('already finished') == 3


def test_evaluate_mode_restores_a_checkpoint(finished_run):
  config, workdir, results = finished_run
  again = main.run(config, workdir, mode='evaluate', split='test', which='best')
  assert again['metrics']['CIDEr'] == pytest.approx(results['metrics']['CIDEr'])
  latest = main.run(config, workdir, mode='evaluate', split='val', which='latest')
  assert latest['split'] == 'val'


def test_stage2_without_stage1_checkpoint_is_a_user_error(tiny_config, tmp_path):
  tiny_config.stages = ('caption',)
  with pytest.raises(SystemExit) as e:
    main.run(tiny_config, str(tmp_path))
  assert e.value.code == 2


def _train_losses(workdir, stage):
  with open(os.path.join(workdir, stage, 'metrics.jsonl')) as f:
    recs = [json.loads(l) for l in f]
  return [(r['step'], r['loss']) for r in recs if r['split'] == 'train']


def test_killed_and_resumed_run_equals_uninterrupted(tiny_config, tmp_path):
  cfg = tiny_config
  cfg.tokenizer.train.steps = 8
  cfg.tokenizer.train.log_every = 1
  cfg.tokenizer.train.checkpoint_every = 3
  cfg.tokenizer.train.eval_every = 100
  task = stages.TASKS['tokenizer']
  straight = str(tmp_path / 'straight')
  train.run(task, cfg, straight)
  resumed = str(tmp_path / 'resumed')
  train.run(task, cfg, resumed, max_steps=5)   # "killed" after step 5 (checkpoint at 5)
  assert not os.path.exists(train.stage_done_path(resumed, 'tokenizer'))
  train.run(task, cfg, resumed)
  a, b = _train_losses(straight, 'tokenizer'), _train_losses(resumed, 'tokenizer')
  assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 9))
  np.testing.assert_allclose([l for _, l in a], [l for _, l in b], rtol=1e-5)
