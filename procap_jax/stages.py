"""What `main` runs: data preparation, the stages in order, the final test evaluation.

Every step is skipped when its output is complete (a built dataset, a scores file, a stage's
DONE file, a results.json and report of the same finished stages, decoding and report
settings), and an unfinished stage resumes from its latest checkpoint.
"""

import collections
import json
import os
import time

import jax
import numpy as np

from procap_jax import checkpointing
from procap_jax import config_lib
from procap_jax import errors
from procap_jax import evaluation
from procap_jax import report
from procap_jax import semantic_scores
from procap_jax import train
from procap_jax.data import datasets
from procap_jax.data import feature_cache
from procap_jax.data import pipeline
from procap_jax.models import vqgan
from procap_jax.procedure import scores as scores_lib
from procap_jax.tasks import caption as caption_task
from procap_jax.tasks import pretrain as pretrain_task
from procap_jax.tasks import tokenizer as tokenizer_task

TASKS = {
    'tokenizer': tokenizer_task.TASK,
    'pretrain': pretrain_task.TASK,
    'caption': caption_task.TASK,
}


def prepare_data(config, workdir: str) -> None:
  """Builds the dataset when missing (synthetic always; real ones from config.data.manual_dir)
  and computes the confidence scores file when the sampler needs it.

  With several processes, process 0 prepares first while the others wait at a barrier; they then
  prepare only what they still lack (a host-local data_dir), so a shared data_dir is written by
  one process only.
  """
  if jax.process_count() == 1:
    _prepare_data(config, workdir)
    return
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  if jax.process_index() == 0:
    _prepare_data(config, workdir)
  multihost_utils.sync_global_devices('procap_jax.stages.prepare_data')
  if jax.process_index() != 0:
    _prepare_data(config, workdir)


def _prepare_data(config, workdir: str) -> None:
  name, bc = config.data.name, config.data.builder_config
  ddir = pipeline.data_dir(config, workdir)
  if not datasets.is_prepared(name, bc, ddir):
    module = datasets.builder_module(name)
    if name != 'synthetic_change' and not config.data.manual_dir:
      raise errors.UserError(
          f'dataset {name}/{bc} is not built in {ddir}; download it by hand (see '
          f'tfds_builders/{name}/README.md) and set --config.data.manual_dir=<folder>')
    t0 = time.time()
    print(f'building {name}/{bc} in {ddir} ...', flush=True)
    beam = config.data.beam_options or None
    if name == 'synthetic_change':
      module.prepare(bc, ddir, beam_options=beam)
    else:
      module.prepare(bc, ddir, manual_dir=config.data.manual_dir, beam_options=beam)
    print(f'built {name}/{bc} in {time.time() - t0:.0f} s', flush=True)
  else:
    print(f'using the dataset {name}/{bc} already built in '
          f'{datasets.dataset_dir(name, bc, ddir)}', flush=True)
  if config.data.sampler == 'confidence' and not config.data.scores_file:
    path = pipeline.scores_path(config, workdir)
    if not os.path.exists(path) and config.data.scores_feature == 'stats':
      _compute_scores(config, workdir, path)


def _tokenizer_feature_fn(config, workdir: str):
  """The trained tokenizer's (frozen) encoder as a scores feature function."""
  variables = {'params': checkpointing.load_stage_variables(workdir, 'tokenizer')['params']}
  model = vqgan.VQGAN(**config.tokenizer.model)
  encode = jax.jit(lambda x: model.apply(variables, x, method=vqgan.VQGAN.encode_features))
  return scores_lib.make_encoder_feature_fn(lambda x: np.asarray(encode(x)),
                                            image_size=config.data.image_size)


def _compute_scores(config, workdir: str, path: str, feature: str = 'stats') -> None:
  t0 = time.time()
  if feature == 'stats':  # a plain function: scored on every core
    feature_fn, workers = scores_lib.FEATURES['stats'], len(os.sched_getaffinity(0))
  else:  # the jitted tokenizer: in this process
    feature_fn, workers = _tokenizer_feature_fn(config, workdir), 1
  entries = {}
  for split in ('train', 'val', 'test'):
    src = pipeline.open_source(config, workdir, split)
    entries.update(scores_lib.scores_for_split(src, config.data.frame_source, feature_fn,
                                               workers=workers))
  scores_lib.write_scores(path, entries, 'auto')
  print(f'wrote confidence scores for {len(entries)} pairs in {time.time() - t0:.0f} s', flush=True)


def _wants_tokenizer_scores(config, workdir: str) -> bool:
  return (config.data.sampler == 'confidence' and not config.data.scores_file
          and config.data.scores_feature == 'tokenizer'
          and not os.path.exists(pipeline.scores_path(config, workdir))
          and os.path.exists(train.stage_done_path(workdir, 'tokenizer')))


def dataset_statistics(config, workdir: str) -> dict:
  stats = {'dataset': f'{config.data.name}/{config.data.builder_config}',
           'data_dir': pipeline.data_dir(config, workdir), 'splits': {}}
  for split in ('train', 'val', 'test'):
    info = pipeline.load_split_info(config, split, workdir)
    types = collections.Counter(pipeline.CHANGE_TYPES[r['change_type']] for r in info)
    stats['splits'][split] = {'pairs': len(info), 'scenes': len({r['scene_id'] for r in info}),
                              'captions': sum(len(r['captions']) for r in info),
                              'change_types': dict(sorted(types.items()))}
  stats['vocab_size'] = pipeline.load_vocab(config, workdir).size
  return stats


def _inputs_of(config, stage: str) -> tuple[str, ...]:
  """The stages whose checkpoints `stage` starts from (frozen tokenizer, stage-1 encoder)."""
  if stage == 'pretrain':
    return ('tokenizer',)
  if stage == 'caption':
    if not config_lib.reads_tokenizer(config):  # DUDA from pixels
      return ()
    from_stage1 = (config.caption.init_from_pretrain and not config.caption.init_from
                   and config_lib.caption_kind(config) == 'procap')
    return ('tokenizer', 'pretrain') if from_stage1 else ('tokenizer',)
  return ()


def check_stage_inputs(config, workdir: str) -> None:
  """Raises UserError, before any training, when a stage to train needs the checkpoint of a
  stage that has none in `workdir` and does not run earlier in `config.stages`."""
  planned = []
  for stage in config.stages:
    if not os.path.exists(train.stage_done_path(workdir, stage)):
      for need in _inputs_of(config, stage):
        if need not in planned and not checkpointing.has_checkpoint(workdir, need):
          extra = (' or set --config.caption.init_from_pretrain=False'
                   if (stage, need) == ('caption', 'pretrain') else '')
          raise errors.UserError(
              f'the {stage} stage starts from the {need} checkpoint, but '
              f'{os.path.join(workdir, need)} has none; run the {need} stage first (e.g. '
              f'--config.stages=\'("{need}", "{stage}")\'){extra}')
    planned.append(stage)


def run_all(config, workdir: str) -> dict:
  """Trains every stage of `config.stages` (skipping finished ones) and evaluates on test."""
  t0 = time.time()
  check_stage_inputs(config, workdir)
  for stage in config.stages:
    done = train.stage_done_path(workdir, stage)
    if os.path.exists(done):
      print(f'[{stage}] already finished ({done}); skipping', flush=True)
      continue
    print(f'[{stage}] training ...', flush=True)
    train.run(TASKS[stage], config, workdir)
    if stage == 'tokenizer' and _wants_tokenizer_scores(config, workdir):
      _compute_scores(config, workdir, pipeline.scores_path(config, workdir), 'tokenizer')
  if _wants_tokenizer_scores(config, workdir):  # tokenizer finished in an earlier call
    _compute_scores(config, workdir, pipeline.scores_path(config, workdir), 'tokenizer')
  if 'pretrain' in config.stages:
    evaluate_pretrain_test(config, workdir)
  results_path = os.path.join(workdir, 'results.json')
  if 'caption' not in config.stages:
    return {}
  cached = current_results(config, workdir)
  if cached is not None:
    print(f'{results_path} is current (same finished stages, decoding and report settings); '
          'not evaluating again', flush=True)
    print(headline(cached), flush=True)
    return cached
  restored = restore_for_eval(config, workdir, 'caption', 'best')
  results = evaluate_caption(config, workdir, 'test', 'best', restored=restored)
  results['wall_clock_seconds_this_call'] = time.time() - t0
  errors.write_text_atomic(results_path, json.dumps(results, indent=1))
  _, model, state, constants, _ = restored

  def imagine_fn(batch):
    frames = caption_task.imagine_frames(state.params, constants, config, model,
                                         batch['before'], batch['after'])
    return np.clip(np.rint(frames * 255), 0, 255).astype(np.uint8)

  # Without procedure queries (static / no-queries variants, DUDA) there is nothing to imagine.
  imagines = config.caption.model.use_queries and config_lib.caption_kind(config) == 'procap'
  report.write_report(config, workdir, results, imagine_fn=imagine_fn if imagines else None)
  print(f'wrote {results_path} and {os.path.join(workdir, "report.html")}', flush=True)
  return results


# The figures README's results table gives, in its order: (key in results['metrics'], name).
HEADLINE_METRICS = (('Bleu_4', 'BLEU-4'), ('METEOR', 'METEOR'), ('ROUGE_L', 'ROUGE-L'),
                    ('CIDEr', 'CIDEr'))


def headline(results: dict) -> str:
  """One line of a results dict's headline scores (x 100, as README's table), e.g.
  `test (best checkpoint, step 20): BLEU-4 12.3, METEOR 15.0, ROUGE-L 30.1, CIDEr 41.2`."""
  metrics = results.get('metrics') or {}
  scores = ', '.join(f'{name} {100 * metrics[key]:.1f}' for key, name in HEADLINE_METRICS
                     if isinstance(metrics.get(key), (int, float)))
  return (f'{results.get("split")} ({results.get("checkpoint")} checkpoint, step '
          f'{results.get("checkpoint_step")}): {scores or "no scores"}')


def current_results(config, workdir: str) -> dict | None:
  """`workdir`'s results.json when it came from the stage checkpoints now there (their DONE
  summaries) with this config's decoding and report settings and the report exists; else None
  (also when it is unreadable: the caller evaluates again and rewrites it)."""
  try:
    results = _read_json(os.path.join(workdir, 'results.json'))
    made_from = _results_provenance(config, workdir)
  except (OSError, ValueError):
    return None
  if not isinstance(results, dict):
    return None
  current = (all(results.get(k) == v for k, v in made_from.items())
             and results.get('split') == 'test'
             and ('reference_rows' in results or not semantic_scores.applies(config))
             and os.path.exists(os.path.join(workdir, 'report.html')))
  return results if current else None


def _results_provenance(config, workdir: str) -> dict:
  """What results come from, recorded in them and compared by `current_results`: the finished
  stages' DONE summaries and the decoding and report settings."""
  return {'stages': {s: _read_json(train.stage_done_path(workdir, s)) for s in config.stages},
          'decoding': config.caption.decoding.to_dict(),
          'report': config.report.to_dict()}


def pretrain_test_path(workdir: str) -> str:
  return os.path.join(workdir, 'pretrain', 'test_metrics.json')


def evaluate_pretrain_test(config, workdir: str) -> dict:
  """Stage-1 metrics of the best (by val loss) checkpoint on the whole test split, computed once
  and kept in `pretrain/test_metrics.json`: the val split chose the checkpoint, so the figures
  to report come from test."""
  path = pretrain_test_path(workdir)
  if os.path.exists(path):
    return _read_json(path)
  task, model, state, constants, step = restore_for_eval(config, workdir, 'pretrain', 'best')
  cache = feature_cache.load(config, workdir, constants['tokenizer'])
  batches = pretrain_task.eval_batches(config, 'test', workdir, num_batches=0, cache=cache)
  metrics = task.evaluate(state, constants, config, model, 'test', workdir, batches=batches)
  out = {'split': 'test', 'checkpoint': 'best', 'checkpoint_step': int(step),
         'selected_on': 'val loss', 'metrics': {k: float(v) for k, v in metrics.items()}}
  errors.write_text_atomic(path, json.dumps(out, indent=1))
  print('[pretrain] test (best checkpoint): ' + ', '.join(
      f'{k} {v:.4g}' for k, v in out['metrics'].items()), flush=True)
  return out


def restore_for_eval(config, workdir: str, stage: str, which: str):
  """(task, model, state, constants) for host-side evaluation of a saved checkpoint; `config` is
  resolved (`pipeline.resolve`, or a run's saved config)."""
  task = TASKS[stage]
  model = task.build_model(config)
  variables = checkpointing.load_stage_variables(workdir, stage, which)
  meta = checkpointing.read_meta(workdir, stage, which)
  if meta:
    checkpointing.check_config_compatible(meta.get('config'), config, stage)
  state = train.TrainState(step=np.int32(variables['step']), params=variables['params'],
                           opt_state=None, model_state=variables['model_state'])
  state = jax.tree.map(jax.numpy.asarray, state)
  constants = task.load_constants(config, workdir)
  return task, model, state, constants, variables['step']


def evaluate_caption(config, workdir: str, split: str, which: str, restored=None) -> dict:
  """Scores a saved caption checkpoint on `split`; writes predictions in COCO format."""
  task, model, state, constants, step = restored or restore_for_eval(config, workdir, 'caption',
                                                                    which)
  t0 = time.time()
  metrics = task.evaluate(state, constants, config, model, split, workdir)
  results = {
      'dataset': f'{config.data.name}/{config.data.builder_config}',
      'split': split, 'checkpoint': which, 'checkpoint_step': int(step),
      'selected_on': 'val', 'metrics': {k: float(v) for k, v in metrics.items()},
      'eval_seconds': time.time() - t0,
      'pretrain_test': _read_json(pretrain_test_path(workdir)),
      **_results_provenance(config, workdir),
  }
  if semantic_scores.applies(config):
    results['reference_rows'] = reference_rows(config, workdir, split)
  print(json.dumps({'split': split, **{k: round(v, 4) for k, v in results['metrics'].items()
                                       if '/' not in k}}), flush=True)
  return results


def reference_rows(config, workdir: str, split: str) -> dict:
  """`semantic_scores.reference_rows` on the pairs of `split` the caption stage predicted
  (`caption/predictions_<split>.json`; all pairs of the split when there is no such file)."""
  info = pipeline.load_split_info(config, split, workdir)
  path = os.path.join(workdir, 'caption', f'predictions_{split}.json')
  ids = list(evaluation.read_results(path)) if os.path.exists(path) else None
  return semantic_scores.reference_rows(info, ids)


def _read_json(path: str):
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)
