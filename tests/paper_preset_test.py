"""The paper preset end to end on real images, at a reduced width.

`python -m procap_jax.main --config configs/clevr_change.py:paper` on the CLEVR-Change fixture
scenes (../shared/fixtures, via tests/clevr_manual.py), through the dataset build, the three
stages, the test evaluation, results.json and report.html. The overrides shrink only sizes:
64 px images (builder config `cpu64`, flow interpolation like `paper`), a narrow VQGAN with the
paper's f16 layout, a 2-block encoder and a narrow decoder, 1 step per stage at batch 2 in
micro-batches of 1 (116 CPU-seconds, user + sys, on an AMD EPYC family 25 model 17 with
AVX-512, shared with other jobs: `/usr/bin/time python -m pytest -q -n 0
tests/paper_preset_test.py`). Every switch of
the preset (CLIP BPE encoder text with its 49,408 ids, unrolled blocks, attention in pair
groups, the original's embeddings, frame tokens and binary-head inputs, the constant stage-1
lr) stays as `paper` sets it. The full-size run and its figures:
docs/performance.md, "The paper presets on real images".
"""

import json
import os
import subprocess
import sys

import clevr_manual
import reliability_helpers as helpers

SPLITS = {'train': [0, 1, 3, 4, 5], 'val': [19, 35], 'test': [2, 6, 13]}
# The fixture merges file of tests/bpe_test.py: CLIP's byte-level BPE with a few hundred merges
# (CLIP's own file is not shipped with this repository).
MERGES = os.path.join('tests', 'parity', 'fixtures', 'bpe_merges.txt')


def _overrides() -> list[str]:
  out = ['--config.data.builder_config=cpu64', '--config.data.image_size=64',
         f'--config.data.bpe_merges_file={MERGES}',
         # The paper's f16 VQGAN layout (5 levels), narrow: a 4 x 4 token grid at 64 px. No
         # level has attention, as at 224 px (its 16 px attention level never occurs there).
         '--config.tokenizer.model.ch=8', '--config.tokenizer.model.num_res_blocks=1',
         '--config.tokenizer.model.attn_resolutions=()',
         '--config.tokenizer.model.resolution=64', '--config.tokenizer.model.z_channels=16',
         '--config.tokenizer.model.embed_dim=16', '--config.tokenizer.model.n_embed=64',
         '--config.pretrain.model.width=32', '--config.pretrain.model.depth=2',
         '--config.pretrain.model.heads=2', '--config.pretrain.model.grid=(4,4)',
         '--config.pretrain.model.feature_dim=16', '--config.pretrain.model.codebook_size=64',
         # The presets' attention, 2 (batch, head) pairs at a time: 2 x 2 pairs, two steps.
         '--config.caption.model.hidden=32', '--config.caption.model.heads=2',
         '--config.caption.model.ffn=64']
  for stage in ('tokenizer', 'pretrain', 'caption'):
    t = f'--config.{stage}.train.'
    out += [f'{t}steps=1', f'{t}batch_size=2', f'{t}log_every=1', f'{t}eval_every=1',
            f'{t}checkpoint_every=1', f'{t}eval_batches=1']
  # The presets' micro-batches (stage 1: one row each, stage 2: two), as 2 of 1 row here.
  out += ['--config.pretrain.train.micro_batches=2', '--config.caption.train.micro_batches=2']
  return out


def test_paper_preset_runs_every_stage_on_real_images(tmp_path, fixtures_dir):
  manual = clevr_manual.clevr_manual(tmp_path, fixtures_dir, SPLITS)
  workdir = tmp_path / 'run'
  env = helpers.subprocess_env(os.environ.get('JAX_COMPILATION_CACHE_DIR',
                                              str(tmp_path / 'jax_cache')))
  args = [sys.executable, '-m', 'procap_jax.main', '--config', 'configs/clevr_change.py:paper',
          '--workdir', str(workdir), f'--config.data.manual_dir={manual}'] + _overrides()
  proc = subprocess.run(args, cwd=helpers.REPO, env=env, capture_output=True, text=True,
                        timeout=3600, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

  config = json.loads((workdir / 'config.json').read_text(encoding='utf-8'))
  assert config['preset'] == 'paper' and config['data']['encoder_text'] == 'clip_bpe'
  assert config['pretrain']['model']['text_vocab_size'] == 49408
  assert (workdir / 'data' / 'clevr_change' / 'cpu64').is_dir()
  for stage in ('tokenizer', 'pretrain', 'caption'):
    assert (workdir / stage / 'DONE').exists(), stage

  results = json.loads((workdir / 'results.json').read_text(encoding='utf-8'))
  assert results['dataset'] == 'clevr_change/cpu64'
  assert results['split'] == 'test' and results['selected_on'] == 'val'
  assert {'Bleu_4', 'METEOR', 'ROUGE_L', 'CIDEr'} <= set(results['metrics'])
  assert all(v >= 0 for k, v in results['metrics'].items() if '/' not in k)
  stage1 = results['pretrain_test']
  assert stage1['split'] == 'test' and {'match_acc', 'loss_msm'} <= set(stage1['metrics'])

  predictions = json.loads((workdir / 'caption' / 'predictions_test.json').read_text(
      encoding='utf-8'))
  test_pairs = {f'{i:06d}{s}' for i in SPLITS['test'] for s in ('c', 'nc')}
  assert {p['image_id'] for p in predictions} == test_pairs
  html = (workdir / 'report.html').read_text(encoding='utf-8')
  assert 'Gallery' in html and 'title="imagined"' in html
  shown = {p for p in test_pairs if f'<b>{p}</b>' in html}
  assert shown and '000002nc' in shown  # a distractor pair ('none') is always in the gallery
