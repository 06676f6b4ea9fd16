r"""Is the change in the features? Attribute probes on frozen tokenizer features and on pixels.

  python -m procap_jax.diagnostics.probe_attributes --workdir W   # W: a run with a tokenizer
  python -m procap_jax.diagnostics.probe_attributes --workdir W --inputs features --steps 2000
  python -m procap_jax.diagnostics.probe_attributes --workdir W --cache C.npz  # reuse the images
  python -m procap_jax.diagnostics.probe_attributes --workdir W --inputs pixels --source render
  python -m procap_jax.diagnostics.probe_attributes --workdir W --inputs stage1,memory  # finished run

Dimension legend: M pairs, S image side, h x w tokenizer grid, C channels, K classes.

Reads the before and after images of every pair of the train, val and test splits and the
renderer's ground truth of the synthetic benchmark (`change_params`; `--source render` renders
the same pairs from the scene specification instead, without a built dataset), and asks small models
trained on train, with the step chosen on val and the score reported on test, what a caption
needs to get right. Tasks (`TASKS`; a pair without a label for a task is left out of it):

  change     change pair (1) or no-change distractor (0): every pair
  type       color / material / add / drop / move: change pairs
  color      the changed object's colour (8; the added object's for add): change pairs
  material   its material (rubber / metal), `shape` (3) and `size` (small / large) likewise
  new_color  the colour it changed to (8): colour changes
  where      the cell of a 3 x 3 grid over the image holding the centre of its box (before
             image; after image for add): change pairs

Inputs (`--inputs`):
  features  the run's frozen tokenizer features [h, w, C] of before and after (what stage 1
            embeds), stacked with their difference: [h, w, 3C].
  pixels    the images themselves [S, S, 9] (before, after, difference in [0, 1]) through a
            learned (S / h) x (S / h) patch embedding onto the same h x w grid: an upper-ish
            reference that separates "the tokenizer's features lose it" from "a model does not
            learn it".
  stage1    the run's stage-1 encoder (its pretrain checkpoint, as stage 2 starts from it) on
            the pair as stage 2 presents it (before, k query slots, after; no text): its output
            tokens [T, h, w, D] stacked on channels, [h, w, T D].
  memory    the trained captioner's decoder memory (its best caption checkpoint; what the
            decoder attends to), [T, h, w, H] stacked likewise: [h, w, T H].
All get two coordinate channels, a learned patch embedding (1 x 1 for features), two 3 x 3
convolutions (`--width` channels), the spatial max and mean, a hidden layer and one linear head
per task; all tasks train together (the sum of their masked cross-entropies; Adam, batch
`--batch`). Inputs are standardised per channel on train.

One JSON line per input and task: the probe's `grid` side, `val_acc` at the step best on val (`best_step`), `test_acc`
at that step, `majority_test_acc` (always the class most frequent in train), the number of
pairs per split, and the test accuracy per change type (`test_acc_by_type`).
"""

import argparse
import json
import math
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from procap_jax import caption as caption_cli
from procap_jax import errors
from procap_jax.data import datasets
from procap_jax.data import pipeline
from procap_jax.diagnostics import records
from procap_jax.models import encodings
from procap_jax.tasks import caption as caption_task
from procap_jax.tasks import pretrain
from tfds_builders.synthetic_change import generate
from tfds_builders.synthetic_change import render
from tfds_builders.synthetic_change import scene
from tfds_builders.synthetic_change import synthetic_change_dataset_builder as builder

SPLITS = ('train', 'val', 'test')
CHANGES = ('color', 'material', 'add', 'drop', 'move')
COLORS = ('gray', 'red', 'blue', 'green', 'brown', 'purple', 'cyan', 'yellow')
TASKS = {  # name -> classes
    'change': ('no', 'yes'),
    'type': CHANGES,
    'color': COLORS,
    'material': ('rubber', 'metal'),
    'shape': ('cube', 'sphere', 'cylinder'),
    'size': ('small', 'large'),
    'new_color': COLORS,
    'where': tuple(f'{r}{c}' for r in 'tmb' for c in 'lcr'),
}


def labels_of(params: dict) -> dict[str, int]:
  """The task labels of one pair from its `change_params` (-1 where a task has no label)."""
  out = {t: -1 for t in TASKS}
  kind = params['type']
  out['change'] = int(kind != 'none')
  if kind == 'none':
    return out
  obj = params['object']
  out['type'] = CHANGES.index(kind)
  for t in ('color', 'material', 'shape', 'size'):
    out[t] = TASKS[t].index(obj[t])
  if kind == 'color':
    out['new_color'] = COLORS.index(params['to'])
  box = params['bbox_after'] if kind == 'add' else params['bbox_before']
  if box is not None:
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    cell = lambda v: min(int(v * 3), 2)
    out['where'] = 3 * cell(cy) + cell(cx)
  return out


def load_split(config, workdir: str, split: str, limit: int = 0) -> dict[str, np.ndarray]:
  """{'before', 'after': uint8 [M, S, S, 3] at config.data.image_size, one int array [M] per
  task, 'kind': change type index [M] (pipeline.CHANGE_TYPES)} of the split's first `limit`
  pairs (0 = all)."""
  src = datasets.data_source(config.data.name, config.data.builder_config,
                             pipeline.data_dir(config, workdir), split)
  n = len(src) if limit <= 0 else min(limit, len(src))
  size = int(config.data.image_size)
  out = {'before': [], 'after': [], 'kind': []}
  out.update({t: [] for t in TASKS})
  for i in range(n):
    record = src[i]
    out['before'].append(pipeline.resize(record['before'], size))
    out['after'].append(pipeline.resize(record['after'], size))
    out['kind'].append(int(record['change_type']))
    raw = record['change_params']
    for t, v in labels_of(json.loads(raw.decode() if isinstance(raw, bytes) else raw)).items():
      out[t].append(v)
  return {k: np.stack(v) if k in ('before', 'after') else np.asarray(v, np.int32)
          for k, v in out.items()}


def render_split(config, split: str, limit: int = 0, size: int = 0) -> dict[str, np.ndarray]:
  """As `load_split`, with the before and after images rendered from the synthetic benchmark's
  scene specification (the same pixels as the built dataset's records, in the same order) instead
  of read from a built dataset. It makes no interpolated frames and encodes no PNG, so it is
  several times faster than a build (minutes for `small`). `size` > 0 draws the same scenes at
  that image size instead (the renderer's own drawing, not a resize)."""
  if config.data.name != 'synthetic_change':
    raise errors.UserError('--source render needs the synthetic benchmark; use --source dataset')
  spec = {c.name: c for c in builder.CONFIGS}[config.data.builder_config]
  n = spec.num_scenes(split) if limit <= 0 else min(-(-limit // 2), spec.num_scenes(split))
  drawn = size or spec.image_size
  size = size or int(config.data.image_size)
  out = {'before': [], 'after': [], 'kind': []}
  out.update({t: [] for t in TASKS})
  for i in range(n):
    for pair in scene.sample_pairs(spec.seed, split, i):  # change pair, then distractor
      out['before'].append(pipeline.resize(render.render(*pair.at(0.0), drawn), size))
      out['after'].append(pipeline.resize(render.render(*pair.at(1.0), drawn), size))
      out['kind'].append(pipeline.CHANGE_TYPES.index(pair.change_type))
      for t, v in labels_of(generate.change_params(pair)).items():
        out[t].append(v)
  stop = limit if limit > 0 else None  # an odd limit: the last scene's change pair only
  return {k: np.stack(v[:stop]) if k in ('before', 'after') else np.asarray(v[:stop], np.int32)
          for k, v in out.items()}


def load_splits(config, workdir: str, limit: int = 0, cache: str = '',
                source: str = 'dataset', render_size: int = 0) -> dict[str, dict]:
  """`load_split` (`source` 'dataset') or `render_split` ('render') of every split; read from
  (or written to) the .npz file `cache` if given."""
  if cache and os.path.exists(cache):
    with np.load(cache) as f:
      return {s: {k.split('/', 1)[1]: f[k] for k in f.files if k.startswith(s + '/')}
              for s in SPLITS}
  if source == 'render':
    data = {s: render_split(config, s, limit, render_size) for s in SPLITS}
  else:
    data = {s: load_split(config, workdir, s, limit) for s in SPLITS}
  if cache:
    with errors.atomic_path(cache) as tmp:
      with open(tmp, 'wb') as buf:
        np.savez(buf, **{f'{s}/{k}': v for s, d in data.items() for k, v in d.items()})
  return data


def tokenizer_features(config, workdir: str, images: np.ndarray, batch: int = 64) -> np.ndarray:
  """The run's frozen tokenizer features: uint8 [M, S, S, 3] -> float32 [M, h, w, C]."""
  tokenizer = pretrain.vqgan_tokenizer(config)
  params = pretrain.load_constants(config, workdir)['tokenizer']
  encode = jax.jit(lambda p, x: tokenizer.encode_features(p, encodings.images01(x)))
  return np.concatenate([np.asarray(encode(params, jnp.asarray(images[i:i + batch])))
                         for i in range(0, len(images), batch)])


def encoder_outputs(config, workdir: str, which: str, batch: int = 64):
  """A function uint8 before and after [M, S, S, 3] -> float32 [M, h, w, T * D]: the output
  tokens of the run's stage-1 encoder (`which` 'stage1', before any stage-2 training) or the
  trained captioner's decoder memory ('memory'), the T frame slots stacked on channels. The
  parameters are restored and the model compiled once, for every split."""
  model = caption_task.build_model(config)
  if which == 'memory':
    params, tokenizer_params, _ = caption_cli.load_parameters(workdir, 'best', config, cache=False)
    run = lambda p, b, a: model.apply({'params': p}, b, a, method='encode')
  else:
    tokenizer_params = caption_task.load_constants(config, workdir)['tokenizer']
    gh, gw = config.pretrain.model.grid
    zeros = jnp.zeros([1, gh, gw, config.pretrain.model.feature_dim], jnp.float32)
    params = model.init(jax.random.key(0), zeros, zeros, jnp.zeros([1, 2], jnp.int32))['params']
    params = nn.meta.unbox(caption_task.restore_pretrained_encoder(params, workdir))
    run = lambda p, b, a: model.apply(
        {'params': p}, b, a, method=lambda m, x, y: m._encoder_outputs(x, y)['frame_hidden'])
  tokenizer = caption_task.vqgan_tokenizer(config)

  @jax.jit
  def outputs(p, tp, b, a):
    n = b.shape[0]
    feats = tokenizer.encode_features(tp, encodings.images01(jnp.concatenate([b, a])))
    out = run(p, feats[:n], feats[n:])  # [n, T*N, D]
    _, gh, gw, _ = feats.shape
    out = out.reshape(n, -1, gh, gw, out.shape[-1])  # [n, T, h, w, D]
    return jnp.moveaxis(out, 1, 3).reshape(n, gh, gw, -1)  # [n, h, w, T*D]

  return lambda before, after: np.concatenate([
      np.asarray(outputs(params, tokenizer_params, jnp.asarray(before[i:i + batch]),
                         jnp.asarray(after[i:i + batch])))
      for i in range(0, len(before), batch)])


def pair_inputs(before: np.ndarray, after: np.ndarray) -> np.ndarray:
  """[M, H, W, C] before and after -> [M, H, W, 3C]: before, after, after - before."""
  before, after = np.asarray(before, np.float32), np.asarray(after, np.float32)
  return np.concatenate([before, after, after - before], -1)


class Probe(nn.Module):
  """A `patch` x `patch` stride-`patch` convolution, two 3 x 3 convolutions,
  spatial max and mean, a hidden layer, one linear head per task: [B, H, W, C] -> a list of
  logits [B, K_task]."""
  classes: tuple[int, ...]
  patch: int = 1
  width: int = 64

  @nn.compact
  def __call__(self, x: jax.Array) -> list[jax.Array]:
    b, h, w = x.shape[:3]
    ys, xs = jnp.meshgrid(jnp.linspace(-1, 1, h), jnp.linspace(-1, 1, w), indexing='ij')
    x = jnp.concatenate([x, jnp.broadcast_to(jnp.stack([ys, xs], -1), (b, h, w, 2))], -1)
    # A learned patch embedding, as a ViT's (a 1 x 1 convolution for features).
    x = nn.gelu(nn.Conv(self.width, (self.patch,) * 2, strides=(self.patch,) * 2)(x))
    for _ in range(2):
      x = nn.gelu(nn.Conv(self.width, (3, 3))(x))
    pooled = jnp.concatenate([x.max((1, 2)), x.mean((1, 2))], -1)  # [B, 2 width]
    hidden = nn.gelu(nn.Dense(4 * self.width)(pooled))
    return [nn.Dense(k)(hidden) for k in self.classes]


def _accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
  keep = labels >= 0
  return float(np.mean(logits[keep].argmax(-1) == labels[keep])) if keep.any() else math.nan


def fit(inputs: dict[str, np.ndarray], labels: dict[str, dict[str, np.ndarray]], patch: int,
        steps: int, every: int, batch: int = 64, lr: float = 1e-3, width: int = 64,
        seed: int = 0, log=None) -> dict[str, dict]:
  """Trains one `Probe` on inputs['train'] [M, H, W, C] with labels[split][task] [M] (-1 = no
  label) and returns per task {'best_step', 'val_acc', 'test_acc', 'test_logits'} at the step
  with the best val accuracy (ties: the earliest). `log(step, val accuracy per task)` is called
  at every check when given."""
  tasks = tuple(TASKS)
  mu = inputs['train'].mean((0, 1, 2))
  sd = inputs['train'].std((0, 1, 2)) + 1e-6
  x = {s: jnp.asarray((v - mu) / sd, jnp.float32) for s, v in inputs.items()}
  y = {s: np.stack([labels[s][t] for t in tasks], -1) for s in inputs}  # [M, tasks]
  model = Probe(tuple(len(TASKS[t]) for t in tasks), patch, width)
  params = model.init(jax.random.key(seed), x['train'][:1])['params']
  tx = optax.adam(optax.linear_schedule(lr * 1e-2, lr, min(100, steps)))
  opt = tx.init(params)

  def loss_fn(p, xb, yb):
    total = 0.0
    for i, logits in enumerate(model.apply({'params': p}, xb)):
      valid = yb[:, i] >= 0
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(yb[:, i], 0))
      total += jnp.sum(ce * valid) / jnp.maximum(valid.sum(), 1)
    return total

  @jax.jit
  def step(p, o, xb, yb):
    u, o = tx.update(jax.grad(loss_fn)(p, xb, yb), o, p)
    return optax.apply_updates(p, u), o

  apply = jax.jit(lambda p, xb: model.apply({'params': p}, xb))

  def predict(p, split):
    outs = [apply(p, x[split][j:j + 256]) for j in range(0, len(x[split]), 256)]
    return [np.concatenate([np.asarray(o[i]) for o in outs]) for i in range(len(tasks))]

  rng = np.random.default_rng(seed)
  best = {t: {'best_step': 0, 'val_acc': math.nan, 'test_acc': math.nan, 'test_logits': None}
          for t in tasks}
  n = len(x['train'])
  for s in range(1, steps + 1):
    rows = rng.integers(0, n, batch)
    params, opt = step(params, opt, x['train'][rows], y['train'][rows])
    if s % every and s != steps:
      continue
    val, test = predict(params, 'val'), predict(params, 'test')
    if log:
      log(s, {t: _accuracy(val[i], y['val'][:, i]) for i, t in enumerate(tasks)})
    for i, t in enumerate(tasks):
      acc = _accuracy(val[i], y['val'][:, i])
      if best[t]['test_logits'] is None or acc > best[t]['val_acc']:  # a nan never wins later
        best[t] = {'best_step': s, 'val_acc': acc, 'test_acc': _accuracy(test[i], y['test'][:, i]),
                   'test_logits': test[i]}
  return best


def report(name: str, best: dict[str, dict], labels: dict[str, dict[str, np.ndarray]],
           kinds: np.ndarray) -> list[dict]:
  """One record per task of `fit`'s result; `kinds` [M_test] are the test pairs' change types."""
  out = []
  for task, b in best.items():
    train, test = labels['train'][task], labels['test'][task]
    majority = int(np.bincount(train[train >= 0], minlength=len(TASKS[task])).argmax())
    record = {'probe': 'attributes', 'input': name, 'task': task, 'classes': len(TASKS[task]),
              **{f'n_{s}': int(np.sum(labels[s][task] >= 0)) for s in SPLITS},
              'best_step': b['best_step'], 'val_acc': b['val_acc'], 'test_acc': b['test_acc'],
              'majority_test_acc': float(np.mean(test[test >= 0] == majority))}
    right = b['test_logits'].argmax(-1) == test
    record['test_acc_by_type'] = {
        pipeline.CHANGE_TYPES[k]: round(float(right[(kinds == k) & (test >= 0)].mean()), 4)
        for k in np.unique(kinds[test >= 0])}
    out.append(record)
  return out


def probe_inputs(config, workdir: str, data: dict[str, dict], which: str, pixel_patch: int = 0):
  """(inputs per split [M, H, W, C], the probe's patch size) of input `which` (module
  docstring); `pixel_patch` > 0 overrides the pixels' patch size S / h."""
  if which == 'features':
    feats = {s: pair_inputs(tokenizer_features(config, workdir, d['before']),
                            tokenizer_features(config, workdir, d['after']))
             for s, d in data.items()}
    return feats, 1
  if which == 'pixels':
    size = data['train']['before'].shape[1]
    grid = int(config.pretrain.model.grid[0])
    return ({s: pair_inputs(d['before'] / 255.0, d['after'] / 255.0) for s, d in data.items()},
            pixel_patch or max(1, size // grid))
  if which in ('stage1', 'memory'):
    outputs = encoder_outputs(config, workdir, which)
    return {s: outputs(d['before'], d['after']) for s, d in data.items()}, 1
  raise errors.UserError(f'unknown probe input {which!r}; choose features, pixels, stage1 or '
                         'memory')


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True, help='a run whose tokenizer stage finished')
  parser.add_argument('--inputs', default='features,pixels')
  parser.add_argument('--steps', type=int, default=2000)
  parser.add_argument('--every', type=int, default=250, help='steps between val checks')
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--lr', type=float, default=1e-3)
  parser.add_argument('--width', type=int, default=64)
  parser.add_argument('--pixel-patch', type=int, default=0,
                      help='pixels: patch size (default S / h, the tokenizer grid; 4 at 64 px '
                      'gives a 16 x 16 grid)')
  parser.add_argument('--limit', type=int, default=0, help='pairs per split (0 = all)')
  parser.add_argument('--cache', default='', help='an .npz file of the images and labels')
  parser.add_argument('--source', default='dataset', choices=('dataset', 'render'),
                      help="the run's built dataset, or (synthetic benchmark only) the same "
                      'pairs rendered from its scene specification')
  parser.add_argument('--render-size', type=int, default=0,
                      help='--source render: draw the scenes at this image size (default: the '
                      "benchmark's); pixels only")
  args = parser.parse_args(argv)
  if not os.path.exists(os.path.join(args.workdir, 'config.json')):
    raise SystemExit(f'error: {args.workdir} holds no config.json; pass the workdir of a run')
  config = caption_cli.load_run_config(args.workdir)
  try:
    data = load_splits(config, args.workdir, args.limit, args.cache, args.source,
                       args.render_size)
    labels = {s: {t: d[t] for t in TASKS} for s, d in data.items()}
    for which in (w for w in args.inputs.split(',') if w):
      inputs, patch = probe_inputs(config, args.workdir, data, which, args.pixel_patch)
      best = fit(inputs, labels, patch, args.steps, args.every, args.batch, args.lr, args.width,
                 log=lambda s, acc: print(json.dumps({'input': which, 'step': s, 'val_acc': {
                     t: round(a, 3) for t, a in acc.items()}}), file=sys.stderr, flush=True))
      for record in report(which, best, labels, data['test']['kind']):
        records.emit({**record, 'grid': inputs['train'].shape[1] // patch})
  except errors.UserError as e:
    raise SystemExit(f'error: {e}') from None


if __name__ == '__main__':
  main(sys.argv[1:])
