"""Reliability of `procap_jax.main` (issue 8): bad configs, flags and workdirs, missing stages,
each refused with one sentence. Rows of docs/reliability.md, as tests/conftest.py's `fault`
fixture records them.
"""

import os
import subprocess
import sys

import numpy as np

from procap_jax import checkpointing
from procap_jax import main

import reliability_helpers as helpers


_MAIN_CASES = [
    (['--config', 'configs/nope.py'], 'missing config file', 'config file configs/nope.py does '
     'not exist'),
    (['--config', 'configs/synthetic.py:tiny,bogus'], 'unknown preset/variant',
     "unknown config variant 'bogus'"),
    (['--config', 'configs/synthetic.py:tiny', '--config.tokenizer.train.stepz=3'],
     'misspelt config key', "unknown key 'stepz' (Did you mean \"steps\""),
    (['--config', 'configs/synthetic.py:tiny', '--config.data.nokey.x=3'], 'unknown config '
     'section', "unknown key 'nokey'"),
    (['--config', 'configs/synthetic.py:tiny', '--config.seed=abc'], 'mistyped config value',
     "--config.seed=abc: invalid literal for int()"),
    (['--config', 'configs/synthetic.py:tiny', '--config.data.frame_source=magic'],
     'config value outside its choices', 'config.data.frame_source is'),
    (['--config', 'configs/synthetic.py:tiny', '--which', 'bestest'], 'bad --which',
     'value should be one of'),
    (['--config', '{bad_syntax}'], 'config file with a syntax error', 'has a syntax error at '
     'line 1'),
    (['--config', '{no_get_config}'], 'config file without get_config()',
     'has no get_config() function'),
]


def test_main_rejects_bad_configs_and_flags_with_one_sentence(tmp_path, fault):
  (tmp_path / 'bad_syntax.py').write_text('def get_config(:\n')
  (tmp_path / 'no_get_config.py').write_text('x = 1\n')
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  for args, what, expected in _MAIN_CASES:
    args = [a.format(bad_syntax=tmp_path / 'bad_syntax.py',
                     no_get_config=tmp_path / 'no_get_config.py') for a in args]
    proc = subprocess.run([sys.executable, '-m', 'procap_jax.main', *args, '--workdir',
                           str(tmp_path / 'w')], cwd=helpers.REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [l for l in proc.stderr.splitlines() if l.startswith('error: ')]
    assert proc.returncode == 2, (what, proc.stderr)
    assert 'Traceback' not in proc.stderr and len(lines) == 1, (what, proc.stderr)
    assert expected in lines[0], (what, lines[0])
    fault('main (config loading)', what, lines[0])


def test_main_bad_workdirs_and_missing_stages(tiny_config, tmp_path, capsys, fault):
  import copy
  workdir = str(tmp_path / 'w')
  os.makedirs(workdir)
  from procap_jax import config_lib
  other = copy.deepcopy(tiny_config)
  other.caption.model.hidden = 32
  from procap_jax.data import pipeline
  pipeline.resolve_vocab_sizes(other, workdir)  # as main.run does before saving config.json
  config_lib.check_workdir(other, workdir)
  err = helpers.exit_message(capsys, main.run, tiny_config, workdir, mode='build')
  assert 'another config (differs in caption.model)' in err
  fault('main', 'a workdir made with another model config', err)

  fresh = str(tmp_path / 'fresh')
  from procap_jax import stages
  # The confidence scores of the session's dataset, made now if no test made them yet: their
  # progress bar on stderr would otherwise precede the error line of the first run below.
  stages.prepare_data(tiny_config, fresh)
  stage2 = copy.deepcopy(tiny_config)
  stage2.stages = ('caption',)
  err = helpers.exit_message(capsys, main.run, stage2, fresh)
  assert 'starts from the tokenizer checkpoint' in err
  fault('main', "a stage-2 run in a workdir without any checkpoint", err)
  tokenizer = checkpointing.StageCheckpoints(os.path.join(fresh, 'tokenizer'))
  tokenizer.save(1, {'params': {'w': np.zeros(2)}, 'model_state': {}}, {}, {})
  tokenizer.close()
  err = helpers.exit_message(capsys, main.run, stage2, fresh)
  assert 'starts from the pretrain checkpoint' in err and 'init_from_pretrain' in err
  fault('main', 'a stage-2 run pointed at a missing stage-1 (pretrain) checkpoint', err)

  err = helpers.exit_message(capsys, main.run, tiny_config, fresh, mode='evaluate')
  assert 'no caption checkpoint' in err
  fault('main --mode evaluate', 'no caption checkpoint in the workdir', err)

  (tmp_path / 'file').write_text('x')
  not_dir = copy.deepcopy(tiny_config)
  not_dir.data.data_dir = str(tmp_path / 'file')
  err = helpers.exit_message(capsys, main.run, not_dir, str(tmp_path / 'w2'), mode='build')
  assert 'is a file' in err
  fault('main', 'config.data.data_dir is a file', err)

  err = helpers.exit_message(capsys, main.run, tiny_config, str(tmp_path / 'file'), mode='build')
  assert '--workdir <tmp>/file is a file'.replace('<tmp>', str(tmp_path)) in err
  assert 'data_dir' not in err
  fault('main', '--workdir that is a file', err)
