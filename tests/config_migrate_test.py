"""config_migrate.migrate: an older run's config.json reads in today's schema, with the values
that reproduce that run; a current config is left as it is."""

import json

import pytest

from configs import clevr_change
from configs import synthetic
from procap_jax import config_lib
from procap_jax import config_migrate
from procap_jax import errors
from procap_jax import sharding


def _old_run_json() -> dict:
  """The tiny preset's config.json as a run saved before every key of ADDED_LATER (and with
  pretrain.model.num_frames, which T = k + 2 has replaced)."""
  saved = json.loads(synthetic.get_config('tiny').to_json_best_effort())
  for dotted in config_migrate.ADDED_LATER:
    *parents, leaf = dotted.split('.')
    node = saved
    for part in parents:
      node = node[part]
    del node[leaf]
  saved['pretrain']['model']['num_frames'] = 4
  return saved


def _leaf(config, dotted: str):
  for part in dotted.split('.'):
    config = config[part]
  return config


def test_an_old_run_config_loads_with_the_documented_values(tmp_path):
  (tmp_path / 'config.json').write_text(json.dumps(_old_run_json()))
  config = config_lib.load_run_config(str(tmp_path))
  for dotted, value in config_migrate.ADDED_LATER.items():
    got = _leaf(config, dotted)
    got = got.to_dict() if hasattr(got, 'to_dict') else got
    assert got == value, dotted
  assert 'num_frames' not in config.pretrain.model
  assert tuple(config.pretrain.model.grid) == (8, 8)  # JSON lists come back as tuples
  # The run's own values are kept where they differ from the filled ones.
  assert config.pretrain.train.steps == synthetic.get_config('tiny').pretrain.train.steps


def test_the_code_paths_that_read_the_filled_keys_run_as_the_old_run(tmp_path):
  """What used to read these keys with .get(key, default) now reads them as they are."""
  config = config_migrate.migrate(_old_run_json())
  config_lib.validate(config)
  assert config_lib.caption_kind(config) == 'procap' and config_lib.reads_tokenizer(config)
  assert config_lib.decoding_settings(config)['encode_rows'] == 0
  for stage in ('tokenizer', 'pretrain', 'caption'):  # no row loop in an old run: no notes
    assert sharding.replicated_work_notes(config, stage, 2) == []
  from procap_jax.models import vqgan
  from procap_jax.tasks import pretrain_optimizer
  assert vqgan.frozen_from_config(config).chunk == 0  # float32: no bf16 row bands
  schedule = pretrain_optimizer.learning_rate(config, config.pretrain.train.steps)
  lr, steps = float(config.pretrain.train.lr), config.pretrain.train.steps
  # decay_steps 0: the lr stays at its peak to the last update (a decay would end it at 0)
  assert float(schedule(steps)) == pytest.approx(lr)


@pytest.mark.parametrize('arg', list(synthetic.PRESETS) + ['default,static', 'tiny,duda',
                                                           'default,duda_patches'])
def test_a_current_config_is_unchanged(arg):
  config = synthetic.get_config(arg)
  migrated = config_migrate.migrate(config)
  assert migrated.to_dict() == config.to_dict()
  assert config_migrate.migrate(migrated).to_dict() == config.to_dict()  # idempotent


def test_a_paper_config_is_unchanged_and_the_argument_is_not_changed():
  config = clevr_change.get_config('paper')
  before = config.to_json_best_effort()
  assert config_migrate.migrate(json.loads(before)).to_dict() == config_migrate.migrate(
      config).to_dict() == config.to_dict()
  assert config.to_json_best_effort() == before


def test_a_damaged_section_is_left_for_its_reader():
  """A section that is not a dict gets nothing filled (read_saved_config's callers refuse it)."""
  saved = _old_run_json()
  saved['caption']['decoding'] = [1, 2]
  saved['mesh'] = 'none'
  config = config_migrate.migrate(saved)
  assert config.caption.decoding == (1, 2) and config.mesh == 'none'
  assert config.caption.model.kind == 'procap'


def test_an_old_run_resumes_with_the_config_it_was_made_with(tmp_path):
  """The workdir check compares the migrated saved config: a run saved before the newer keys
  matches the same preset today (its model/data values are the old behaviour's), and another
  model setup is still refused."""
  (tmp_path / 'config.json').write_text(json.dumps(_old_run_json()))
  config_lib.check_saved_config(synthetic.get_config('tiny'), str(tmp_path))
  other = synthetic.get_config('tiny')
  other.pretrain.model.attention_group = 2  # schedule only: still the same run
  config_lib.check_saved_config(other, str(tmp_path))
  other.pretrain.model.frame_difference = 'before'
  with pytest.raises(errors.UserError, match=r'differs in pretrain\.model'):
    config_lib.check_saved_config(other, str(tmp_path))
