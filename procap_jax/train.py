"""The one training loop shared by every stage (tokenizer, pretrain, caption).

A stage is described by a `Task` (see docs/architecture.md); this module owns the mesh, the
sharded train state, the jitted step, checkpoints, metrics and progress.
"""

import dataclasses
import json
import math
import os
import time
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from procap_jax import checkpointing
from procap_jax import errors
from procap_jax import sharding
from procap_jax import train_log
from procap_jax.data import feature_cache
from procap_jax.data import pipeline


@dataclasses.dataclass(frozen=True)
class Task:
  """What differs between stages.

  Attributes:
    name: 'tokenizer' | 'pretrain' | 'caption' (also the config section and workdir subfolder).
    build_model: (config) -> flax.linen.Module.
    init_params: (model, config, rng, batch) -> params pytree (leaves may be boxed with logical
      axis names via nn.with_logical_partitioning); `batch` is a batch of the batch contract.
    init_model_state: (model, config, rng, batch) -> pytree of non-trainable mutable state
      updated by the step (e.g. code-usage counters); {} when unused.
    load_constants: (config, workdir) -> pytree of frozen inputs (e.g. tokenizer variables),
      passed replicated to every step; None when unused.
    restore_init: optional (params, config, workdir) -> params applied once after a fresh
      init (not on resume), outside jit, e.g. stage 2 loading the stage-1 encoder.
    loss_fn: (params, model_state, constants, batch, rng, config, model) ->
      (loss, (metrics dict of scalars, new model_state)). Pure and jittable; train mode.
    value_and_grad: None, or (params, model_state, constants, batch, rng, config, model) ->
      ((loss, (metrics, new model_state)), gradients): what the step differentiates with
      instead of `jax.value_and_grad(loss_fn)` (stages 1 and 2: gradient accumulation over
      micro-batches, `micro_batched`); it must give the same values.
    make_optimizer: (config, total_steps) -> optax.GradientTransformation.
    evaluate: (state, constants, config, model, split, workdir) -> dict of python floats
      (host side; may call jitted functions).
    feature_cache: None, or (config) -> the stage's frozen tokenizer: the stage then reads its
      encodings from the tokenizer feature cache when `config.data.feature_cache`
      (`data/feature_cache.py`); the trainer builds a missing one with this tokenizer and
      `constants['tokenizer']`, and its batches carry the cached keys.
    host_batch: None, or (host batch, mesh) -> host batch, applied to every training batch
      before it is placed on the mesh in one-process runs; it may change array shapes (the
      step then compiles once per shape) but not the values the step computes (stage 2:
      `encodings.share_before`).
  """
  name: str
  build_model: Callable[..., Any]
  init_params: Callable[..., Any]
  loss_fn: Callable[..., Any]
  make_optimizer: Callable[..., Any]
  evaluate: Callable[..., Any]
  init_model_state: Callable[..., Any] = lambda model, config, rng, batch: {}
  load_constants: Callable[..., Any] = lambda config, workdir: None
  restore_init: Callable[..., Any] | None = None
  feature_cache: Callable[..., Any] | None = None
  value_and_grad: Callable[..., Any] | None = None
  host_batch: Callable[..., Any] | None = None


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any


# ----------------------------------------------------------------------------------------------
# Selection metric per stage (validation split): name, 'max' | 'min'.
# ----------------------------------------------------------------------------------------------
SELECTION = {'tokenizer': ('psnr', 'max'), 'pretrain': ('loss', 'min'), 'caption': ('CIDEr', 'max')}


# ----------------------------------------------------------------------------------------------
# Sharded state creation.
# ----------------------------------------------------------------------------------------------
def _path_str(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def _opt_shardings(abstract_opt, param_shardings, abstract_params, mesh):
  """Optimizer-state leaves take the sharding of the parameter they mirror (same path suffix and
  shape); everything else (counters, scalars) is replicated."""
  by_path = {}
  for (path, leaf), sh in zip(jax.tree_util.tree_leaves_with_path(abstract_params),
                              jax.tree.leaves(param_shardings)):
    by_path[_path_str(path)] = (leaf.shape, sh)

  def one(path, leaf):
    p = _path_str(path)
    for ppath, (shape, sh) in by_path.items():
      if p.endswith(ppath) and tuple(leaf.shape) == tuple(shape):
        return sh
    return sharding.replicated(mesh)

  return jax.tree_util.tree_map_with_path(one, abstract_opt)


def create_state(task: 'Task', model, config, tx, rng, example_batch, mesh):
  """(state, state_shardings): the TrainState created directly with its shardings."""
  rules = config.sharding.rules

  def init_params(rng):
    return task.init_params(model, config, rng, example_batch)

  boxed = jax.eval_shape(init_params, rng)
  param_sh = sharding.logical_shardings(boxed, mesh, rules)
  abstract_params = sharding.unbox(boxed)
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  opt_sh = _opt_shardings(abstract_opt, param_sh, abstract_params, mesh)
  abstract_ms = jax.eval_shape(
      lambda r: task.init_model_state(model, config, r, example_batch), rng)
  ms_sh = jax.tree.map(lambda _: sharding.replicated(mesh), abstract_ms)
  state_sh = TrainState(step=sharding.replicated(mesh), params=param_sh, opt_state=opt_sh,
                        model_state=ms_sh)

  def init(rng):
    r1, r2 = jax.random.split(rng)
    params = sharding.unbox(task.init_params(model, config, r1, example_batch))
    return TrainState(step=jnp.zeros([], jnp.int32), params=params, opt_state=tx.init(params),
                      model_state=task.init_model_state(model, config, r2, example_batch))

  state = jax.jit(init, out_shardings=state_sh)(rng)
  return state, state_sh


def compiler_options(mesh) -> dict | None:
  """XLA options for the train step on the mesh's platform.

  CPU: the memory-minimising instruction scheduler instead of XLA:CPU's default
  concurrency-optimised one, which starts independent work early and keeps its results alive:
  the paper-size stage-1 step at batch 8 needs 27.3 instead of 43.7 GiB of temporaries
  (docs/performance.md); at the synthetic default's sizes memory and speed do not change.
  """
  if mesh.devices.flat[0].platform == 'cpu':
    return {'xla_cpu_scheduler_type': 'CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED'}
  return None


def micro_batch_rows(tree: Any, micro_batches: int) -> Any:
  """[B, ...] leaves -> [M, B / M, ...]: micro-batch j holds rows j, j + M, j + 2M, ... (so a
  batch sharded over devices stays spread evenly over the micro-batches)."""
  return jax.tree.map(lambda x: sharding.interleaved_rows(x, micro_batches), tree)


def accumulate_gradients(micro_loss: Callable[[Any, Any], tuple[jax.Array, dict]], params: Any,
                         rows: Any, sums: dict) -> tuple[Any, dict]:
  """Sums of `micro_loss`'s gradients and aux sums over the micro-batches `rows` ([M, ...]
  leaves), one micro-batch at a time in a `lax.scan`.

  Args:
    micro_loss: (params, one micro-batch's rows) -> (loss, dict of scalar sums).
    params: the differentiated parameters.
    rows: pytree of [M, ...] arrays (`micro_batch_rows`).
    sums: zeros shaped like micro_loss's dict.

  Returns:
    (gradients like `params`, the dict of sums).
  """
  def one(carry, r):
    grads, total = carry
    (_, micro_sums), micro_grads = jax.value_and_grad(micro_loss, has_aux=True)(params, r)
    return (jax.tree.map(jnp.add, grads, micro_grads),
            jax.tree.map(jnp.add, total, micro_sums)), None

  (grads, sums), _ = jax.lax.scan(one, (jax.tree.map(jnp.zeros_like, params), sums), rows)
  return grads, sums


def micro_batched(stage: str, loss_fn: Callable[..., Any],
                  micro_value_and_grad: Callable[..., Any]) -> Callable[..., Any]:
  """A `Task.value_and_grad`: `jax.value_and_grad(loss_fn)` when
  `config.<stage>.train.micro_batches` is 1, else `micro_value_and_grad(params, constants,
  batch, rng, config, model, micro_batches)` -> ((loss, metrics), gradients)."""
  def value_and_grad(params, model_state, constants, batch, rng, config, model):
    micro_batches = config[stage].train.micro_batches
    rows = jnp.shape(batch['valid'])[0]
    if micro_batches < 1 or rows % micro_batches:
      raise ValueError(f'config.{stage}.train.micro_batches ({micro_batches}) must divide the '
                       f'batch ({rows})')
    if micro_batches == 1:
      return jax.value_and_grad(loss_fn, has_aux=True)(params, model_state, constants, batch,
                                                       rng, config, model)
    (loss, metrics), grads = micro_value_and_grad(params, constants, batch, rng, config, model,
                                                  micro_batches)
    return (loss, (metrics, model_state)), grads
  return value_and_grad


def host_batch(task: 'Task', batch: dict, mesh) -> dict:
  """`task.host_batch(batch, mesh)` in one-process runs, else `batch` (under several processes
  each would decide alone, and the global shapes could disagree)."""
  if task.host_batch is None or jax.process_count() > 1:
    return batch
  return task.host_batch(batch, mesh)


def make_train_step(task: 'Task', model, config, tx, state_sh, batch_sh, const_sh, mesh):
  """The jitted, donated train step `(state, batch, constants, rng) -> (state, metrics)`."""

  def step(state, batch, constants, rng):
    # The mesh in context while tracing: code that must split work by device (the frozen
    # tokenizer's chunked encode, `vqgan.Frozen`) reads it from `jax.sharding.get_abstract_mesh`.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return traced_step(state, batch, constants, rng)

  def traced_step(state, batch, constants, rng):
    rng = jax.random.fold_in(rng, state.step)

    if task.value_and_grad is None:
      def loss_fn(params):
        return task.loss_fn(params, state.model_state, constants, batch, rng, config, model)

      (loss, (metrics, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          state.params)
    else:
      (loss, (metrics, model_state)), grads = task.value_and_grad(
          state.params, state.model_state, constants, batch, rng, config, model)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.global_norm(grads)
    metrics = dict(metrics)
    metrics['loss'] = loss
    metrics['grad_norm'] = grad_norm
    metrics['finite'] = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              model_state=model_state)
    return new_state, metrics

  return jax.jit(step, in_shardings=(state_sh, batch_sh, const_sh, sharding.replicated(mesh)),
                 out_shardings=(state_sh, sharding.replicated(mesh)), donate_argnums=(0,),
                 compiler_options=compiler_options(mesh))


def _better(new: float, old: float | None, mode: str) -> bool:
  if old is None or not math.isfinite(old):
    return math.isfinite(new)
  return new > old if mode == 'max' else new < old


# ----------------------------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------------------------
def stage_done_path(workdir: str, stage: str) -> str:
  return os.path.join(workdir, stage, 'DONE')


def run(task: 'Task', config, workdir: str, *, mesh=None, max_steps: int | None = None) -> dict:
  """Trains one stage to `config.<stage>.train.steps`, resuming from the latest checkpoint.

  Args:
    task: the stage's Task.
    config: the resolved config (`pipeline.resolve`: the vocabulary sizes filled).
    workdir: the run's workdir; the stage lives in `<workdir>/<task.name>/`.
    mesh: the device mesh (default: from `config.mesh`).
    max_steps: stop after this many steps in this call (tests of kill/resume); the stage is then
      not marked done.

  Returns:
    The stage summary (last validation metrics and the best checkpoint's step).
  """
  stage_dir = os.path.join(workdir, task.name)
  os.makedirs(stage_dir, exist_ok=True)
  mesh = mesh if mesh is not None else sharding.mesh_from_config(config)
  section = config[task.name]
  tcfg = section.train
  total = int(tcfg.steps)
  batch_size = int(tcfg.batch_size)
  if batch_size % mesh.shape['data']:
    raise errors.UserError(f'{task.name} batch size {batch_size} is not divisible by the mesh '
                           f'data axis ({mesh.shape["data"]}); change '
                           f'config.{task.name}.train.batch_size')
  for note in sharding.replicated_work_notes(config, task.name, mesh.shape['data']):
    print(f'[{task.name}] note: {note}', flush=True)
  seed = int(config.seed)
  select_name, select_mode = SELECTION[task.name]

  model = task.build_model(config)
  rows = sharding.process_batch_rows(mesh, batch_size) if jax.process_count() > 1 else None
  constants = task.load_constants(config, workdir)
  cache = (None if task.feature_cache is None else feature_cache.load(
      config, workdir, constants['tokenizer'], build_missing=True,
      tokenizer=task.feature_cache(config)))
  train_ds = pipeline.make_train_dataset(config, workdir, batch_size, seed, rows=rows,
                                         cache=cache,
                                         scene_pairs=task.name == 'caption' and bool(
                                             config.caption.train.scene_pairs))
  example = jax.tree.map(np.asarray, train_ds[0])
  tx = task.make_optimizer(config, total)
  rng = jax.random.key(seed)
  state, state_sh = create_state(task, model, config, tx, jax.random.fold_in(rng, 1), example,
                                 mesh)
  # Every key of the batch contract (the cache's keys included) along the 'data' axis.
  batch_sh = {k: sharding.batch_sharding(mesh, np.asarray(v).ndim) for k, v in example.items()}
  const_sh = jax.tree.map(lambda _: sharding.replicated(mesh), constants)
  constants = jax.device_put(constants, const_sh)
  step_fn = make_train_step(task, model, config, tx, state_sh, batch_sh, const_sh, mesh)

  ckpts = checkpointing.StageCheckpoints(stage_dir)
  train_iter = pipeline.TrainIterator(train_ds)
  best_value = None
  start = 0
  metrics_path = os.path.join(stage_dir, 'metrics.jsonl')
  logged = train_log.last_logged_step(metrics_path)
  if ckpts.latest_step() is not None:
    # Before restoring: a checkpoint of another model would fail inside orbax on its shapes.
    checkpointing.check_config_compatible((checkpointing.latest_meta(ckpts) or {}).get('config'),
                                          config, task.name)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, state_sh)
    state, data_state, meta = ckpts.restore_latest(abstract)
    train_iter.set_state(data_state)
    start = int(jax.device_get(state.step))
    best_value = meta.get('best_value')
  resumed = ckpts.latest_step() is not None
  print(train_log.start_line(task.name, os.path.join(stage_dir, 'checkpoints'),
                             start if resumed else None, logged, total), flush=True)
  if not resumed and task.restore_init is not None:
    params = task.restore_init(jax.device_get(state.params), config, workdir)
    state = state.replace(params=jax.device_put(params, state_sh.params))
  log = train_log.MetricsLog(metrics_path, start)
  meta_base = {'config': config.to_dict(), 'stage': task.name}

  def save(step_now: int, best: bool, metrics_now: dict | None = None):
    meta = dict(meta_base, step=step_now, best_value=best_value, metrics=metrics_now or {})
    ckpts.save(step_now, state, train_iter.get_state(), meta, best=best)

  def evaluate(step_now: int) -> dict:
    nonlocal best_value
    t0 = time.time()
    metrics = task.evaluate(state, constants, config, model, 'val', workdir)
    metrics = {k: float(v) for k, v in metrics.items()}
    is_best = select_name in metrics and _better(metrics[select_name], best_value, select_mode)
    if is_best:
      best_value = metrics[select_name]
    log.write({'step': step_now, 'split': 'val', **metrics, 'eval_seconds': time.time() - t0})
    shown = ', '.join(f'{k} {v:.4g}' for k, v in list(metrics.items())[:8])
    print(f'[{task.name}] step {step_now} val: {shown}{" (best)" if is_best else ""}', flush=True)
    save(step_now, is_best, metrics)
    return metrics

  last_good = ckpts.latest_step()
  end = total if max_steps is None else min(total, start + max_steps)
  t_start, s_start = time.time(), start
  finite = jnp.ones([], bool)
  pending = []
  val_metrics = {}
  step = start
  if total == 0 and start == 0:
    # A stage of 0 steps keeps its initialisation (e.g. converted weights from `init_from`):
    # validated and saved as its best checkpoint, so the later stages start from it.
    val_metrics = evaluate(0)
  for step in range(start + 1, end + 1):
    batch = sharding.shard_batch(host_batch(task, next(train_iter), mesh), mesh)
    state, metrics = step_fn(state, batch, constants, rng)
    finite = finite & metrics['finite']
    pending.append(metrics)
    is_log = step % tcfg.log_every == 0 or step == end
    is_eval = step % tcfg.eval_every == 0 or step == total
    is_ckpt = step % tcfg.checkpoint_every == 0 or step == end
    if is_log or is_eval or is_ckpt:
      if not bool(jax.device_get(finite)):
        bad = next(i for i, m in enumerate(pending) if not bool(jax.device_get(m['finite'])))
        bad_step = step - len(pending) + 1 + bad
        where = (f'the last good checkpoint is step {last_good} in '
                 f'{os.path.join(stage_dir, "checkpoints")}' if last_good is not None else
                 'there is no good checkpoint yet')
        raise errors.UserError(
            f'{task.name}: the loss or gradient became non-finite at step {bad_step}; {where} '
            '(lower the learning rate or check the data, then rerun to resume from it)')
      if is_log:
        means = {k: float(np.mean([float(m[k]) for m in pending])) for k in pending[-1]
                 if k != 'finite'}
        rate = (step - s_start) / max(1e-9, time.time() - t_start)
        eta = (total - step) / max(rate, 1e-9)
        log.write({'step': step, 'split': 'train', **means, 'steps_per_s': rate})
        print(f'[{task.name}] step {step}/{total} loss {means["loss"]:.4f} '
              f'{rate:.2f} steps/s ETA {eta/60:.1f} min', flush=True)
        pending = []
      if is_eval:
        val_metrics = evaluate(step)
        last_good = step
      elif is_ckpt:
        save(step, False)
        last_good = step
  if step == total:
    if not val_metrics:
      meta = checkpointing.latest_meta(ckpts)
      val_metrics = meta.get('metrics', {}) if meta else {}
    summary = {'stage': task.name, 'steps': total, 'val': val_metrics,
               'best': {select_name: best_value, 'step': ckpts.best.latest_step()}}
    if jax.process_index() == 0:
      errors.write_text_atomic(stage_done_path(workdir, task.name),
                               json.dumps(summary, indent=1))
  else:
    summary = {'stage': task.name, 'steps': step, 'val': val_metrics}
  log.close()
  ckpts.close()
  return summary
