"""Config loading and validation: unknown keys and inconsistent values get one sentence."""

import json
import subprocess
import sys

import pytest

from configs import synthetic
from procap_jax import config_lib
from procap_jax import errors


@pytest.mark.parametrize('arg', ['tiny', 'quick', 'default', 'default,static', 'quick,k4',
                                 'tiny,oracle', 'default,no_stage1', 'default,no_queries',
                                 'ablation', 'ablation,faithful', 'ablation,static', 'large',
                                 'large,k4'])
def test_presets_validate(arg):
  config_lib.validate(synthetic.get_config(arg))


def test_default_is_large_with_a_smaller_shorter_stage1_and_ablation_is_default_trained():
  default, large = synthetic.get_config('default'), synthetic.get_config('large')
  ablation = synthetic.get_config('ablation')
  assert (default.preset, large.preset, ablation.preset) == ('default', 'large', 'ablation')
  assert default.data == large.data
  # The default's tokens also see the pixels (docs/fidelity.md); the tokenizer is large's.
  assert (default.tokenizer.model.feature_pixels, default.pretrain.model.pixel_stem) == (4, 16)
  assert (large.tokenizer.model.feature_pixels, large.pretrain.model.pixel_stem) == (0, 0)
  assert (default.caption.model.change_head, default.caption.train.change_loss) == (128, 1.0)
  assert (large.caption.model.change_head, large.caption.train.change_loss) == (0, 0.0)
  duda = synthetic.get_config('duda_patches')  # DUDA has no change head
  assert (duda.caption.model.change_head, duda.caption.train.change_loss) == (0, 0.0)
  config_lib.validate(duda)
  without_pixels = lambda c: {k: v for k, v in c.tokenizer.model.items() if k != 'feature_pixels'}
  assert without_pixels(default) == without_pixels(large)
  assert default.tokenizer.train == large.tokenizer.train
  assert default.pretrain.model.width < large.pretrain.model.width
  assert default.pretrain.train.steps < large.pretrain.train.steps
  # The default's stage-2 recipe (docs/fidelity.md) departs from the original's settings,
  # which large keeps; the captioner's size is the same.
  recipe = lambda c: (c.caption.model.attention_scale, c.caption.train.scene_pairs,
                      c.caption.train.label_smoothing, c.caption.train.loss_reduction)
  assert recipe(default) == ('head_dim', True, 0.0, 'mean')
  assert recipe(large) == ('d_model', False, 0.1, 'sum')
  size = lambda c: (c.caption.model.hidden, c.caption.model.heads, c.caption.model.ffn)
  assert size(default) == size(large)
  # The ablation runs train exactly the default config (its full k = 2 row); only the report
  # is smaller.
  assert ablation.report.gallery_per_type < default.report.gallery_per_type
  for key in ('seed', 'stages', 'data', 'tokenizer', 'pretrain', 'caption', 'mesh',
              'compute_dtype'):
    assert ablation[key] == default[key], key
  # The variants apply on top, and 'faithful' keeps its constant learning rate.
  assert synthetic.get_config('ablation,faithful').pretrain.train.decay_steps == 0
  assert synthetic.get_config('ablation,k4').data.num_keyframes == 4
  assert synthetic.get_config('ablation,static').variant == 'static'


def test_unknown_variant_is_rejected():
  with pytest.raises(ValueError, match='unknown config variant'):
    synthetic.get_config('default,bogus')


@pytest.mark.parametrize('key,value,match', [
    ('data.frame_source', 'magic', 'frame_source'),
    ('caption.model.text_slot', 'x', 'text_slot'),
    ('data.image_size', 48, 'image_size'),
    ('pretrain.train.decay_steps', 21, 'decay_steps'),   # the tiny preset trains 20 steps
    ('pretrain.train.decay_steps', -1, 'decay_steps'),
    ('pretrain.train.micro_batches', 3, 'micro_batches'),  # does not divide the tiny batch 8
    ('pretrain.train.micro_batches', 0, 'micro_batches'),
    ('caption.train.micro_batches', 5, 'micro_batches'),
    ('caption.decoding.encode_rows', -1, 'encode_rows'),
    ('data.encoder_text', 'bpe', 'encoder_text'),
    # pooled pixels widen the features: 32 + 3 x 2 x 2 channels, not the preset's 32
    ('tokenizer.model.feature_pixels', 2, 'feature_dim is 32 but the other settings need 44'),
    ('pretrain.model.pixel_stem', 8, 'feature_pixels; set that above 0'),
    ('caption.train.change_loss', 0.5, 'change_head above 0'),  # the tiny preset has no head
    ('caption.train.change_loss', -1.0, 'must not be negative'),
    ('caption.model.change_head', -4, 'must not be negative'),
])
def test_bad_values(key, value, match):
  config = synthetic.get_config('tiny')
  section, _, name = key.rpartition('.')
  node = config
  for part in section.split('.'):
    node = node[part]
  node[name] = value
  with pytest.raises(errors.UserError, match=match):
    config_lib.validate(config)


def test_the_number_of_frames_has_one_key():
  """k lives in data.num_keyframes alone: the encoder's T = k + 2 follows it (a variant or an
  override changes one key), and the encoder section has no second copy to disagree with."""
  config = synthetic.get_config('tiny,k4')
  assert config.data.num_keyframes == 4 and 'num_frames' not in config.pretrain.model
  config_lib.validate(config)
  assert config_lib.encoder_kwargs(config)['num_frames'] == 6
  config.data.num_keyframes = 1
  assert config_lib.encoder_kwargs(config)['num_frames'] == 3


def test_workdir_from_another_config(tmp_path):
  config_lib.check_workdir(synthetic.get_config('tiny'), str(tmp_path))
  other = synthetic.get_config('tiny')
  other.pretrain.model.width = 96
  with pytest.raises(errors.UserError, match='another config'):
    config_lib.check_workdir(other, str(tmp_path))
  # Training-length changes are fine: the same model, resumed.
  longer = synthetic.get_config('tiny')
  longer.caption.train.steps = 99
  config_lib.check_workdir(longer, str(tmp_path))
  # So are the memory and speed switches (the paper presets changed scan_blocks).
  scheduled = synthetic.get_config('tiny')
  scheduled.pretrain.model.scan_blocks = not scheduled.pretrain.model.scan_blocks
  scheduled.pretrain.model.scan_keep_dense = True
  scheduled.pretrain.model.attention_group = 3
  scheduled.pretrain.model.attention_chunk = 5
  scheduled.pretrain.model.remat = True
  config_lib.check_workdir(scheduled, str(tmp_path))
  other.pretrain.model.scan_blocks = True  # and do not hide a real difference
  with pytest.raises(errors.UserError, match='another config'):
    config_lib.check_workdir(other, str(tmp_path))


def test_unknown_override_key_exits_nonzero(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 'procap_jax.main', '--config', 'configs/synthetic.py:tiny',
       '--workdir', str(tmp_path), '--config.data.no_such_key=3'],
      capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert 'no_such_key' in (proc.stderr + proc.stdout)
  assert 'Traceback' not in proc.stderr


def test_apply_override_parses_values_by_the_entrys_type():
  config = synthetic.get_config('tiny')
  for item in ('caption.train.steps=7', 'caption.train.change_loss=2', 'data.data_dir=a/b',
               'compute_dtype=bfloat16', 'pretrain.model.grid=[8, 8]',
               'caption.train.scene_pairs=true'):
    config_lib.apply_override(config, item)
  assert config.caption.train.steps == 7
  assert config.caption.train.change_loss == 2.0
  assert isinstance(config.caption.train.change_loss, float)
  assert config.data.data_dir == 'a/b' and config.compute_dtype == 'bfloat16'
  assert tuple(config.pretrain.model.grid) == (8, 8) and config.caption.train.scene_pairs is True


@pytest.mark.parametrize('item, match', [
    ('caption.train.stepz=3', "no key 'caption.train.stepz' \\(did you mean 'steps'"),
    ('caption.trian.steps=3', "did you mean 'train'"),
    ('caption.train.steps.x=1', "no key 'caption.train.steps.x'"),
    ('caption.train.steps', 'no key'),
    ('caption.train.steps=x', 'must be of type int'),
    ('caption.train.steps=2.5', 'must be of type int'),
])
def test_apply_override_rejects_unknown_keys_and_wrong_types(item, match, fault):
  config = synthetic.get_config('tiny')
  with pytest.raises(errors.UserError, match=match) as e:
    config_lib.apply_override(config, item)
  fault('config overrides (ablations, benches)', f'override {item}', f'error: {e.value}')
  assert config.caption.train.steps == synthetic.get_config('tiny').caption.train.steps


@pytest.mark.parametrize('command', [
    ['procap_jax.ablations', '--root', '{tmp}', '--variants', 'static', '--seeds', '0',
     '--preset', 'tiny', '--override', 'caption.train.no_such_key=3', '--out', '{tmp}/t.md'],
    ['bench.train_step', '--config', 'configs/synthetic.py:tiny', '--stage', 'caption',
     '--set', 'caption.train.no_such_key=3'],
])
def test_commands_with_overrides_reject_an_unknown_key_in_one_sentence(tmp_path, command,
                                                                        fault):
  proc = subprocess.run([sys.executable, '-m'] + [a.format(tmp=tmp_path) for a in command],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert 'no_such_key' in proc.stderr and 'Traceback' not in proc.stderr
  fault(command[0], 'an unknown key in a config override', proc.stderr.strip())
  assert not (tmp_path / 'static_s0').exists() and not (tmp_path / 't.md').exists()


def test_checkpoint_config_check_names_differences_and_accepts_newer_entries():
  """A checkpoint saved before an entry was added to the schema still restores; a changed model
  entry is named; memory-only entries (remat, scan_blocks, scan_keep_dense, attention_chunk,
  attention_group) are not compared."""
  from procap_jax import checkpointing
  config = synthetic.get_config('tiny')
  saved = config.to_dict()
  assert checkpointing.config_differences(saved, config, 'pretrain') == []
  del saved['pretrain']['model']['embedding_std']  # an older checkpoint
  assert checkpointing.config_differences(saved, config, 'pretrain') == []
  saved['pretrain']['model']['width'] = 96
  config.pretrain.model.remat = True
  config.pretrain.model.scan_blocks = True
  config.pretrain.model.scan_keep_dense = True
  config.pretrain.model.attention_chunk = 64
  config.pretrain.model.attention_group = 4
  diffs = checkpointing.config_differences(saved, config, 'pretrain')
  assert len(diffs) == 1 and 'pretrain.model.width' in diffs[0], diffs
  del saved['pretrain']['model']
  assert checkpointing.config_differences(saved, config, 'pretrain')


def test_a_checkpoint_from_before_frame_difference_differs_from_a_config_that_turns_it_on():
  """A checkpoint saved before `pretrain.model.frame_difference` existed was trained without it
  ('none'), so the synthetic default (which turns it on) must not resume or load it, while the
  tiny preset (off) still does."""
  from procap_jax import checkpointing
  for preset, expected in (('default', 1), ('tiny', 0)):
    config = synthetic.get_config(preset)
    saved = config.to_dict()
    del saved['pretrain']['model']['frame_difference']
    for stage in ('pretrain', 'caption'):
      diffs = checkpointing.config_differences(saved, config, stage)
      assert len(diffs) == expected, diffs
      assert all('frame_difference' in d for d in diffs)


def test_paper_configs_keep_the_original_switches_and_cpu_smoke_configs_do_not():
  """The paper-size configs build and train the original's encoder (no difference input, so
  original checkpoints load; N(0, 1) tables; binary heads on masked frames); the CPU smoke
  presets take the synthetic presets' three switches (docs/fidelity.md)."""
  from configs import clevr_change, image_editing_request, spot_the_diff
  switches = lambda c: (c.pretrain.model.frame_difference, c.pretrain.model.embedding_std,
                        c.pretrain.binary_inputs)
  for module in (clevr_change, spot_the_diff, image_editing_request):
    assert switches(module.get_config('paper')) == ('none', 1.0, 'masked')
    assert module.get_config('paper').tokenizer.model.feature_pixels == 0
    assert module.get_config('paper').pretrain.model.pixel_stem == 0
    caption = module.get_config('paper').caption
    assert (caption.model.attention_scale, caption.train.label_smoothing,
            caption.train.loss_reduction) == ('d_model', 0.1, 'sum')
    assert (caption.model.change_head, caption.train.change_loss) == (0, 0.0)
    assert switches(module.get_config('cpu')) == ('before', 0.02, 'visible')


def test_stage1_text_is_clip_bpe_in_the_paper_configs_only(monkeypatch):
  """Paper presets read the original's CLIP BPE ids and still construct and validate when no
  merges file is on the machine; the synthetic and CPU smoke presets keep caption words."""
  from configs import clevr_change, image_editing_request, spot_the_diff
  from procap_jax.data import bpe
  monkeypatch.setattr(bpe, 'PACKAGES_WITH_MERGES', ('procap_missing_pkg',))
  assert config_lib.CLIP_BPE_VOCAB_SIZE == bpe.VOCAB_SIZE
  for module in (clevr_change, spot_the_diff, image_editing_request):
    paper = module.get_config('paper')
    config_lib.validate(paper)
    assert paper.data.encoder_text == 'clip_bpe' and paper.data.bpe_merges_file == ''
    assert paper.pretrain.model.text_vocab_size == bpe.VOCAB_SIZE
    assert module.get_config('cpu').data.encoder_text == 'words'
  assert synthetic.get_config('default').data.encoder_text == 'words'


def test_clip_bpe_with_another_text_table_is_rejected():
  config = synthetic.get_config('tiny')
  config.data.encoder_text = 'clip_bpe'
  config_lib.validate(config)  # text_vocab_size 0: filled with 49408 at build time
  config.pretrain.model.text_vocab_size = 57
  with pytest.raises(errors.UserError, match='text_vocab_size is 57'):
    config_lib.validate(config)


def test_switching_the_stage1_text_needs_a_new_workdir(tmp_path):
  """A workdir or stage-1 checkpoint from before data.encoder_text existed was made with words."""
  from procap_jax import checkpointing
  old = synthetic.get_config('tiny')
  config_lib.check_workdir(old, str(tmp_path))
  path = tmp_path / 'config.json'
  saved = json.loads(path.read_text())
  del saved['data']['encoder_text']
  path.write_text(json.dumps(saved))
  config_lib.check_workdir(old, str(tmp_path))  # an older workdir: words, as configured
  bpe_config = synthetic.get_config('tiny')
  bpe_config.data.encoder_text = 'clip_bpe'
  with pytest.raises(errors.UserError, match='data.encoder_text'):
    config_lib.check_workdir(bpe_config, str(tmp_path))
  saved = old.to_dict()
  del saved['data']['encoder_text']
  assert checkpointing.config_differences(saved, old, 'pretrain') == []
  diffs = checkpointing.config_differences(saved, bpe_config, 'pretrain')
  assert len(diffs) == 1 and 'data.encoder_text' in diffs[0], diffs
