"""The one training loop shared by every stage (tokenizer, pretrain, caption).

A stage is described by a `Task` (see docs/architecture.md); this module owns the mesh, the
sharded train state, the jitted step, checkpoints, metrics and progress.
"""

import dataclasses
from typing import Any, Callable

import flax.struct
import jax


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
    loss_fn: (params, model_state, constants, batch, rng, config, model) ->
      (loss, (metrics dict of scalars, new model_state)). Pure and jittable; train mode.
    make_optimizer: (config, total_steps) -> optax.GradientTransformation.
    evaluate: (state, constants, config, model, split, workdir) -> dict of python floats
      (host side; may call jitted functions).
  """
  name: str
  build_model: Callable[..., Any]
  init_params: Callable[..., Any]
  loss_fn: Callable[..., Any]
  make_optimizer: Callable[..., Any]
  evaluate: Callable[..., Any]
  init_model_state: Callable[..., Any] = lambda model, config, rng, batch: {}
  load_constants: Callable[..., Any] = lambda config, workdir: None


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any
