r"""Why does a captioner ignore its images? Three measurements on a run's workdir.

  python -m procap_jax.diagnostics.diagnose_caption --workdir W [--which best]
  (W: a run with a caption stage)

Dimension legend: B batch, M memory length, H decoder width, C tokenizer feature channels,
h x w tokenizer grid, P probe features.

Prints one JSON line per measurement:
  memory      how much of the stage-2 decoder memory [B, M, H] depends on the image pair: the
              std across pairs (per slot, averaged) over the std across slots of the batch mean.
              Near 0 means every pair gets (almost) the same memory, so the decoder can only
              learn a language model. Measured for the trained checkpoint (`--which`) and for a
              fresh initialisation (`init`) of the same config.
  probe       a linear probe (softmax regression, 500 Adam steps) on pooled statistics of the
              frozen tokenizer features (mean, std, max over the grid of after - before, their
              absolute values, and the mean |after - before|), fitted on `--probe_train_batches`
              train batches and scored on the whole val split: change-type accuracy and
              change-vs-no-change accuracy, beside the majority-class rates. It says whether the
              change is recoverable from the features at all, with no learning of alignment.
  captions    distinct greedy captions over the val split (1 = collapsed to one sentence).
"""

import argparse
import collections
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from procap_jax import caption as caption_cli
from procap_jax import checkpointing
from procap_jax import errors
from procap_jax.data import pipeline
from procap_jax.diagnostics import records
from procap_jax.tasks import caption as caption_task


def memory_dependence(memory: np.ndarray) -> float:
  """std over pairs (per slot, mean over slots and channels) / std over slots of the pair mean.

  Args:
    memory: [B, M, H].
  """
  across_pairs = memory.std(axis=0).mean()
  across_slots = memory.mean(axis=0).std(axis=0).mean()
  return float(across_pairs / max(across_slots, 1e-12))


def pooled_difference_features(before: np.ndarray, after: np.ndarray) -> np.ndarray:
  """[B, h, w, C] features of a pair -> [B, P] pooled statistics of their difference."""

  def stats(x):
    return np.concatenate([x.mean((1, 2)), x.std((1, 2)), x.max((1, 2))], axis=-1)  # [B, 3C]

  d = stats(after) - stats(before)
  return np.concatenate([d, np.abs(d), np.abs(after - before).mean((1, 2))], axis=-1)


def linear_probe(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray,
                 num_classes: int, steps: int = 500) -> np.ndarray:
  """Standardised softmax regression (Adam 1e-2, L2 1e-3); returns val predictions [B_val]."""
  mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
  xt, xv = jnp.asarray((x_train - mu) / sd), jnp.asarray((x_val - mu) / sd)
  yt = jnp.asarray(y_train)
  params = (jnp.zeros((xt.shape[1], num_classes)), jnp.zeros(num_classes))
  opt = optax.adam(1e-2)
  state = opt.init(params)

  def loss(p):
    logits = xt @ p[0] + p[1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, yt).mean() + 1e-3 * jnp.sum(
        p[0] ** 2)

  @jax.jit
  def step(p, s):
    g = jax.grad(loss)(p)
    u, s = opt.update(g, s)
    return optax.apply_updates(p, u), s

  for _ in range(steps):
    params, state = step(params, state)
  return np.asarray(jnp.argmax(xv @ params[0] + params[1], -1))


@errors.exit_on_user_error
def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--which', default='best', choices=('best', 'latest'))
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--probe_train_batches', type=int, default=30)
  args = parser.parse_args(argv)
  config = caption_cli.load_run_config(args.workdir)
  model = caption_task.build_model(config)
  tokenizer = caption_task.vqgan_tokenizer(config)
  tok_params = checkpointing.load_stage_variables(args.workdir, 'tokenizer')['params']
  trained = nn.meta.unbox(
      checkpointing.load_stage_variables(args.workdir, 'caption', args.which)['params'])
  features = jax.jit(lambda b, a: caption_task._features(tokenizer, tok_params, b, a))
  encode = jax.jit(lambda p, fb, fa: model.apply({'params': p}, fb, fa, method='encode'))

  batch = next(iter(pipeline.make_eval_iterator(config, 'val', args.workdir, args.batch,
                                                num_batches=1)))
  fb, fa = features(batch['before'], batch['after'])
  fresh = nn.meta.unbox(model.init(jax.random.PRNGKey(config.seed), fb[:1], fa[:1],
                                   jnp.asarray(batch['caption_in'][:1]))['params'])
  for name, params in ((args.which, trained), ('init', fresh)):
    records.emit({'measurement': 'memory', 'params': name, 'batch': args.batch,
                 'image_dependence': memory_dependence(np.asarray(encode(params, fb, fa)))})

  def collect(split, num_batches):
    xs, ys = [], []
    for b in pipeline.make_eval_iterator(config, split, args.workdir, args.batch,
                                         num_batches=num_batches):
      keep = np.asarray(b['valid'], bool)
      fb, fa = features(b['before'], b['after'])
      xs.append(pooled_difference_features(np.asarray(fb), np.asarray(fa))[keep])
      ys.append(np.asarray(b['change_type'])[keep])
    return np.concatenate(xs), np.concatenate(ys)

  x_train, y_train = collect('train', args.probe_train_batches)
  x_val, y_val = collect('val', 0)
  num_classes = int(max(y_train.max(), y_val.max())) + 1
  pred = linear_probe(x_train, y_train, x_val, num_classes)
  majority = collections.Counter(y_train.tolist()).most_common(1)[0][0]
  none_rate = float(np.mean(y_val == 0))
  records.emit({'measurement': 'probe', 'train_pairs': len(y_train), 'val_pairs': len(y_val),
               'change_type_acc': float(np.mean(pred == y_val)),
               'change_type_majority': float(np.mean(y_val == majority)),
               'change_vs_none_acc': float(np.mean((pred == 0) == (y_val == 0))),
               'change_vs_none_majority': max(none_rate, 1 - none_rate)})

  captions = collections.Counter()
  constants = {'tokenizer': tok_params}
  vocab = pipeline.load_vocab(config, args.workdir)
  for b in pipeline.make_eval_iterator(config, 'val', args.workdir, args.batch, num_batches=0):
    ids = caption_task.generate(trained, constants, config, model, b['before'], b['after'],
                                tokenizer)
    captions.update(vocab.decode(row) for row, v in zip(ids, b['valid']) if v)
  records.emit({'measurement': 'captions', 'split': 'val', 'pairs': sum(captions.values()),
               'distinct': len(captions), 'most_common': captions.most_common(1)[0][0],
               'most_common_share': captions.most_common(1)[0][1] / sum(captions.values())})


if __name__ == '__main__':
  main(sys.argv[1:])
