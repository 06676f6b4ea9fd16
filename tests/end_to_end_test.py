"""End to end on the tiny preset: every stage through `main.run`, skipping, evaluation, captioning.

Kill and resume: tests/reliability_test.py (real SIGKILLs of `python -m procap_jax.main`).
"""

import json
import os

import numpy as np
import pytest

from procap_jax import main
from procap_jax import train


@pytest.fixture(scope='module')
def finished_run(short_tiny_config, tmp_path_factory):
  # 8 steps a stage instead of the preset's 20: checkpoints at 4 and 8, the evaluation at 8. The
  # tests read what the run wrote and restore, decode and score it; none needs a better model.
  config = short_tiny_config(8, 4)
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
  # The synthetic benchmark's semantic scores, reference rows and error-class gallery.
  assert 0.0 <= saved['metrics']['semantic/decision'] <= 1.0
  assert 'change/CIDEr' in saved['metrics'] and 'semantic/move/type' in saved['metrics']
  rows = saved['reference_rows']
  assert rows['template_oracle']['metrics']['semantic/right'] == 1.0
  assert rows['no_change_constant']['metrics']['semantic/decision'] == 0.5
  assert 'Semantic scores' in html and 'Reference rows' in html and 'error class' in html
  with open(os.path.join(workdir, 'caption', 'predictions_test.json')) as f:
    preds = json.load(f)
  assert preds and {'image_id', 'caption'} <= set(preds[0])
  # The tokenizer's validation metrics reached the stage summary.
  with open(train.stage_done_path(workdir, 'tokenizer')) as f:
    assert 'psnr' in json.load(f)['val']
  # Stage 1 is reported on test from the checkpoint val chose.
  s1 = saved['pretrain_test']
  assert s1['split'] == 'test' and s1['selected_on'] == 'val loss'
  assert 0.0 <= s1['metrics']['match_acc'] <= 1.0 and np.isfinite(s1['metrics']['loss_msm'])


def test_rerun_skips_finished_stages(finished_run, capsys):
  config, workdir, results = finished_run
  again = main.run(config, workdir)
  out = capsys.readouterr().out
  assert f'using the dataset synthetic_change/tiny already built in {config.data.data_dir}' in out
  assert out.count('already finished') == 3
  # Nothing changed, so results.json is returned as it is rather than evaluated again.
  assert 'not evaluating again' in out
  # ... and says its headline scores again (README: "a finished run prints its results again").
  m = results['metrics']
  assert (f'BLEU-4 {100 * m["Bleu_4"]:.1f}, METEOR {100 * m["METEOR"]:.1f}, ROUGE-L '
          f'{100 * m["ROUGE_L"]:.1f}, CIDEr {100 * m["CIDEr"]:.1f}') in out
  assert again['metrics'] == pytest.approx(results['metrics'])
  # Other decoding or report settings make the results stale: evaluated again, and back.
  other = config.copy_and_resolve_references()
  other.report.gallery_per_type = 1
  assert main.run(other, workdir)['report'] == {'gallery_per_type': 1}
  assert 'not evaluating again' not in capsys.readouterr().out
  assert main.run(config, workdir)['report'] == config.report.to_dict()
  assert 'not evaluating again' not in capsys.readouterr().out


def test_evaluate_mode_restores_a_checkpoint(finished_run):
  config, workdir, results = finished_run
  again = main.run(config, workdir, mode='evaluate', split='test', which='best')
  assert again['metrics']['CIDEr'] == pytest.approx(results['metrics']['CIDEr'])
  latest = main.run(config, workdir, mode='evaluate', split='val', which='latest')
  assert latest['split'] == 'val'


def test_semantic_scores_command_rescores_the_saved_predictions(finished_run, capsys):
  from procap_jax import semantic_scores
  config, workdir, results = finished_run
  out = semantic_scores.main(['--workdir', workdir, '--split', 'test'])
  assert json.loads(capsys.readouterr().out) == out
  m = results['metrics']
  for name in ('CIDEr', 'change/CIDEr', 'semantic/decision', 'semantic/type', 'semantic/right'):
    assert out['metrics'][name] == pytest.approx(m[name])
  assert sum(out['error_classes'].values()) == out['pairs']


def test_stage2_without_stage1_checkpoint_is_a_user_error(tiny_config, tmp_path):
  tiny_config.stages = ('caption',)
  with pytest.raises(SystemExit) as e:
    main.run(tiny_config, str(tmp_path))
  assert e.value.code == 2


def _write_png(path, arr):
  from PIL import Image
  Image.fromarray(arr).save(path)


def test_caption_command_on_user_pairs(finished_run, tmp_path, capsys):
  from procap_jax import caption
  _, workdir, _ = finished_run
  rng = np.random.default_rng(0)
  (tmp_path / 'A').mkdir()
  (tmp_path / 'B').mkdir()
  for name, size in (('x.png', 50), ('y.jpg', 123)):
    img = rng.integers(0, 255, (size, size + 7, 3), dtype=np.uint8)
    _write_png(tmp_path / 'A' / name, img)
    _write_png(tmp_path / 'B' / name, img[..., 0])  # grayscale after image, other size
  out = caption.main(['--workdir', workdir, str(tmp_path / 'A' / 'x.png'),
                      str(tmp_path / 'B' / 'y.jpg')])
  assert len(out) == 1 and isinstance(out[0], str)
  both = caption.main(['--workdir', workdir, '--before_dir', str(tmp_path / 'A'),
                       '--after_dir', str(tmp_path / 'B'), '--out', str(tmp_path / 'c.json')])
  assert len(both) == 2
  (tmp_path / 'pairs.csv').write_text('before,after\nA/x.png,B/x.png\nA/y.jpg,B/y.jpg\n')
  assert caption.main(['--workdir', workdir, '--csv', str(tmp_path / 'pairs.csv')]) == both
  printed = capsys.readouterr().out.strip().splitlines()
  assert len(printed) == 5 and all(len(l.split('\t')) == 3 for l in printed)


@pytest.mark.parametrize('argv_tail,match', [
    (['missing.png', 'other.png'], 'does not exist'),
    (['only_one.png'], 'exactly two images'),
])
def test_caption_command_bad_input(finished_run, tmp_path, capsys, argv_tail, match):
  from procap_jax import caption
  _, workdir, _ = finished_run
  with pytest.raises(SystemExit) as e:
    caption.main(['--workdir', workdir] + [str(tmp_path / a) for a in argv_tail])
  assert e.value.code == 2
  assert match in capsys.readouterr().err


def test_caption_command_corrupt_image(finished_run, tmp_path, capsys):
  from procap_jax import caption
  _, workdir, _ = finished_run
  (tmp_path / 'bad.png').write_bytes(b'\x89PNG\r\n\x1a\n' + b'garbage' * 10)
  _write_png(tmp_path / 'ok.png', np.zeros((8, 8, 3), np.uint8))
  with pytest.raises(SystemExit) as e:
    caption.main(['--workdir', workdir, str(tmp_path / 'ok.png'), str(tmp_path / 'bad.png')])
  assert e.value.code == 2
  assert 'bad.png' in capsys.readouterr().err


def test_captioner_api_matches_the_evaluation_path(finished_run, tmp_path):
  """`caption.Captioner` builds the same model as the caption task and decodes the same ids
  (it does so without importing the task, see the next test)."""
  from PIL import Image
  from procap_jax import caption
  from procap_jax import stages
  from procap_jax.tasks import caption as caption_task
  _, workdir, _ = finished_run
  run_config = caption.load_run_config(workdir)
  build_model = caption._build_model  # pylint: disable=protected-access
  assert build_model(run_config) == caption_task.build_model(run_config)
  captioner = caption.Captioner(workdir, batch_size=4)
  rng = np.random.default_rng(1)
  size = captioner.image_size
  before = rng.integers(0, 256, (5, size, size, 3), dtype=np.uint8)
  after = rng.integers(0, 256, (5, size, size, 3), dtype=np.uint8)
  _, model, state, constants, _ = stages.restore_for_eval(run_config, workdir, 'caption', 'best')
  ids = caption_task.generate(state.params, constants, run_config, model, before, after)
  expected = [captioner.vocab.decode(row) for row in ids]
  # The command decodes in calls of 4 and 1 pairs, another program than one call of 5: the same
  # words where each has a top-2 logit gap above twice the logits' float error, 64 ulps x
  # sqrt(ffn) of their scale (tests/margins.py), checked on teacher-forced logits split alike.
  import jax  # pylint: disable=import-outside-toplevel
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import margins  # pylint: disable=import-outside-toplevel
  from procap_jax.data import vocab as vocab_lib  # pylint: disable=import-outside-toplevel
  from procap_jax.models import encodings  # pylint: disable=import-outside-toplevel
  params, tokenizer = nn.meta.unbox(state.params), caption_task.vqgan_tokenizer(run_config)

  @jax.jit
  def logits(before, after, tokens):
    fb, fa = encodings.pair_features(tokenizer, constants['tokenizer'],
                                     {'before': before, 'after': after})
    return model.apply({'params': params}, fb, fa, tokens)  # [B, L-1, V]

  whole = np.asarray(logits(before, after, ids[:, :-1]))
  split = np.concatenate([logits(before[:4], after[:4], ids[:4, :-1]),
                          logits(before[4:], after[4:], ids[4:, :-1])])
  error = margins.sum_tolerance(np.abs(whole).max(), run_config.caption.model.ffn, ulps=64)
  assert np.abs(split - whole).max() <= error
  gaps = margins.greedy_gaps(whole, ids, vocab_lib.EOS, banned=(vocab_lib.UNK,))
  assert np.all(gaps > 2 * error), gaps.min(axis=1)
  assert captioner.caption_batch(list(before), list(after)) == expected  # calls of 4 and 1
  _write_png(tmp_path / 'b.png', before[0])
  assert captioner(str(tmp_path / 'b.png'), Image.fromarray(after[0])) == expected[0]
  assert captioner(before[2], after[2]) == expected[2]


def test_caption_command_imports_no_training_code(finished_run, tmp_path):
  import subprocess
  import sys
  _, workdir, _ = finished_run
  _write_png(tmp_path / 'b.png', np.zeros((40, 40, 3), np.uint8))
  _write_png(tmp_path / 'a.png', np.full((40, 40, 3), 200, np.uint8))
  training = ('optax', 'grain', 'tensorflow_datasets', 'tensorflow', 'pycocoevalcap', 'cv2',
              'procap_jax.train', 'procap_jax.stages', 'procap_jax.tasks',
              'procap_jax.data.pipeline', 'procap_jax.evaluation', 'procap_jax.convert')
  code = ('import sys\nfrom procap_jax import caption\n'
          'caption.main(["--workdir", sys.argv[1], sys.argv[2], sys.argv[3]])\n'
          f'print(sorted(m for m in sys.modules if m.split(".")[0] in {training!r} or '
          f'any(m.startswith(t) for t in {training!r})))\n')
  proc = subprocess.run([sys.executable, '-c', code, workdir, str(tmp_path / 'b.png'),
                         str(tmp_path / 'a.png')], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.strip().splitlines()
  assert len(lines) == 2 and lines[0].count('\t') == 2, proc.stdout
  assert lines[1] == '[]', lines[1]


def test_training_command_fills_the_inference_cache(finished_run, tmp_path, capsys):
  """After training, `main` runs `procap_jax.caption --warm_up` in a fresh process: the cached
  parameters are there before the user's first caption command."""
  import shutil
  _, workdir, _ = finished_run
  copy = tmp_path / 'run'
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns('inference_cache'))
  cache = copy / 'caption' / 'inference_cache' / 'params.npz'
  assert not cache.exists()
  assert main.warm_up_caption_command(str(copy))
  assert cache.is_file()
  assert 'ready' in capsys.readouterr().out
  # A folder that is not a run: a notice naming the reason, and no exception.
  assert not main.warm_up_caption_command(str(tmp_path / 'missing'))
  assert 'could not fill the inference cache' in capsys.readouterr().out


def test_caption_command_needs_a_run(tmp_path, capsys):
  from procap_jax import caption
  with pytest.raises(SystemExit):
    caption.main(['--workdir', str(tmp_path), 'a.png', 'b.png'])
  assert 'not a procap-jax run' in capsys.readouterr().err


def test_scores_from_the_trained_tokenizer(tiny_config, tmp_path):
  from procap_jax.data import pipeline
  from procap_jax.procedure import scores as scores_lib
  tiny_config.stages = ('tokenizer',)
  tiny_config.data.scores_feature = 'tokenizer'
  tiny_config.tokenizer.train.steps = 2
  tiny_config.tokenizer.train.eval_every = 2
  main.run(tiny_config, str(tmp_path))
  path = pipeline.scores_path(tiny_config, str(tmp_path))
  assert path.endswith('scores_frames_tokenizer.json')
  loaded = scores_lib.load_scores(path)
  info = pipeline.load_split_info(tiny_config, 'train', str(tmp_path))
  assert {r['pair_id'] for r in info} <= set(loaded)
  d_start, d_end = loaded[info[0]['pair_id']]
  assert d_start.shape == (9,) and d_start[0] == pytest.approx(1.0, abs=1e-4)
  assert d_end[-1] == pytest.approx(1.0, abs=1e-4)


def test_current_results_needs_matching_stages_settings_and_report(tmp_path):
  from configs import synthetic
  from procap_jax import stages
  config = synthetic.get_config('tiny')
  workdir = str(tmp_path)
  done = {}
  for stage in config.stages:
    os.makedirs(os.path.dirname(train.stage_done_path(workdir, stage)), exist_ok=True)
    done[stage] = {'stage': stage, 'steps': 3}
    with open(train.stage_done_path(workdir, stage), 'w') as f:
      json.dump(done[stage], f)
  results = {'split': 'test', 'metrics': {'CIDEr': 0.5}, 'stages': done,
             'decoding': config.caption.decoding.to_dict(), 'report': config.report.to_dict()}
  path = os.path.join(workdir, 'results.json')
  with open(path, 'w') as f:
    json.dump(results, f)
  open(os.path.join(workdir, 'report.html'), 'w').close()
  assert stages.current_results(config, workdir) is None           # no reference rows
  results['reference_rows'] = {}
  with open(path, 'w') as f:
    json.dump(results, f)
  os.remove(os.path.join(workdir, 'report.html'))
  assert stages.current_results(config, workdir) is None           # no report.html yet
  open(os.path.join(workdir, 'report.html'), 'w').close()
  assert stages.current_results(config, workdir) == results
  other = config.copy_and_resolve_references()
  other.caption.decoding.beam_size += 1
  assert stages.current_results(other, workdir) is None            # other decoding
  with open(train.stage_done_path(workdir, 'caption'), 'w') as f:
    json.dump({'stage': 'caption', 'steps': 4}, f)                  # retrained caption stage
  assert stages.current_results(config, workdir) is None
  with open(path, 'w') as f:
    f.write('{"split": "te')                                        # unreadable
  assert stages.current_results(config, workdir) is None


def test_probe_inputs_read_the_stage1_encoder_and_the_decoder_memory(finished_run):
  from procap_jax.diagnostics import probe_attributes as pa
  config, workdir, _ = finished_run
  data = {'test': pa.load_split(config, workdir, 'test', limit=3)}
  slots = config.data.num_keyframes + 2
  gh, gw = config.pretrain.model.grid
  stage1, patch = pa.probe_inputs(config, workdir, data, 'stage1')
  memory, _ = pa.probe_inputs(config, workdir, data, 'memory')
  assert patch == 1
  assert stage1['test'].shape == (3, gh, gw, slots * config.pretrain.model.width)
  assert memory['test'].shape == (3, gh, gw, slots * config.caption.model.hidden)
  assert np.isfinite(stage1['test']).all() and np.isfinite(memory['test']).all()
  # Different pairs give different outputs: the inputs reach the encoder.
  assert not np.allclose(stage1['test'][0], stage1['test'][1])


def test_memory_attention_reads_the_decoders_cross_attention(finished_run, capsys):
  from procap_jax.diagnostics import memory_attention
  config, workdir, _ = finished_run
  memory_attention.main(['--workdir', workdir, '--split', 'test', '--batch', '4'])
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r['layer'] for r in lines] == list(range(config.caption.model.layers)) + ['mean']
  frames = ['before'] + [f'query_{i + 1}' for i in range(config.data.num_keyframes)] + ['after']
  for r in lines:
    assert list(r['frames']) == frames and abs(sum(r['frames'].values()) - 1) < 1e-3
    assert 0 < r['object_uniform'] < 1 and 0 <= r['object'] <= 1 and r['object_pairs'] > 0
    assert 0 <= r['object'] + r['object_in_queries'] <= 1 + 1e-3


def test_ablation_runner_with_two_jobs_fills_the_table(finished_run, tiny_data_dir, tmp_path,
                                                       capsys):
  """`python -m procap_jax.ablations --jobs 2` on the tiny preset: the first run in the parent,
  the rest in child processes (at most two at a time, one run each), every run's results read
  back into the table."""
  from procap_jax import ablations
  _, workdir, _ = finished_run
  root, out = tmp_path / 'abl', tmp_path / 'results.md'
  # 2 caption steps a run, through --override, which the children get too.
  short = [f'caption.train.{k}={v}' for k, v in
           (('steps', 2), ('checkpoint_every', 2), ('eval_every', 2), ('log_every', 1))]
  ablations.main(['--root', str(root), '--preset', 'tiny', '--seeds', '0', '--variants',
                  'static,no_stage1', '--jobs', '2', '--data_dir', tiny_data_dir,
                  '--tokenizer_from', os.path.join(workdir, 'tokenizer'), '--out', str(out)]
                 + [a for o in short for a in ('--override', o)])
  printed = capsys.readouterr().out
  assert 'job 0:' in printed and 'job 1:' in printed
  for variant in ('static', 'no_stage1'):
    with open(root / f'{variant}_s0' / 'results.json', encoding='utf-8') as f:
      assert 'CIDEr' in json.load(f)['metrics']
    with open(root / f'{variant}_s0' / 'caption' / 'DONE', encoding='utf-8') as f:
      assert json.load(f)['steps'] == 2  # the override reached the child process
  assert (root / 'static_s0.log').exists() and (root / 'no_stage1_s0.log').exists()
  with open(root / 'wall_clock.json', encoding='utf-8') as f:
    clock = json.load(f)  # one call, counted by the parent alone; both runs' time in it
  assert clock['calls'] == 1 and set(clock['runs']) == {'static_s0', 'no_stage1_s0'}
  assert 0 < clock['runs']['static_s0'] <= clock['seconds']
  text = out.read_text()
  for label in ('static baseline', 'queries without stage 1'):
    assert any(line.startswith(f'| {label}') and '| 1 |' in line for line in text.splitlines())
