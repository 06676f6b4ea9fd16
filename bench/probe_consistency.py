r"""Can stage 1's consistency task be learned, and does masking stop it? Probes on cached features.

  python -m bench.probe_consistency --workdir W                    # W: a run with a tokenizer
  python -m bench.probe_consistency --workdir W --keep 0.2,1.0 --steps 1500
  python -m bench.probe_consistency --workdir W --task align       # the caption-match head
  python -m bench.probe_consistency --workdir W --task change      # change or not, told directly
  python -m bench.probe_consistency --workdir W --task change --toy  # the same on hand-made clips

Dimension legend: B batch, T frames, h x w tokenizer grid, C feature channels.

Encodes `--clips` training clips and one L_csy corruption of each (`config.pretrain.corruption`)
with the run's frozen tokenizer once, keeps 20 % of them aside, and trains on the rest, batch 8,
Adam, reporting held-out accuracy (each clean and each corrupted clip one decision, chance 0.5):

  mlp       a one-hidden-layer MLP on the per-frame mean features [T * C]: is the task learnable
            from the features at all, and how fast?
  encoder   the run's ProcedureEncoder config from scratch with only its [VID] head and L_csy,
            the same random token mask for the clean and corrupted clip (as in stage 1), once
            per `--keep` (fraction of tokens kept; the original keeps 0.2; 1.0 = no mask).
            `--task align` trains the [REL] head on L_align instead: the clean clip with its own
            caption against the same clip with the caption of the sample half a batch away.
  detector  (`--task align` only) how many pairs does caption/frame matching need, for a model
            built for it? A one-hop grounding detector: each caption word w scores
            max over tokens j of cos(E[w], W x_j), the clip scores sum_w a[w] * that + b; x_j is a
            token's tokenizer feature (`features`) or the mean/std/max/min RGB of its pixel patch
            (`pixels`, the easiest input there is). Batch `--detector-batch`, lr 3e-3.

`--task change` asks the question under matching's easiest part (a "nothing has changed"
caption on a changed clip, or the reverse): can a model tell a change pair from a no-change
distractor, from the frames alone, when told the answer directly? Label 1 = change pair.
  diff_mlp  the MLP (batch 8) on the spatial max and mean of |after - before| tokenizer
            features: a comparison made by hand, at the same positions.
  pixel_diff_mlp  the same on each token's pixel-patch statistics (mean/std/max/min RGB):
            how far the pixels themselves separate a change from the distractors' jitter.
  encoder   the run's ProcedureEncoder from scratch, frames only (an empty caption), its [REL]
            head (or [VID], `--head vid`) trained with BCE on the label (batch 8, `--lr` after
            a 100-step warmup); `--init stage1` starts it from the run's stage-1 checkpoint.
            `--head max` reads the frame tokens instead of a control token: a linear score of
            each LayerNormed last-layer frame token, the clip's logit its max over the tokens,
            so a change that one token detects is not averaged away.
            `--frame-difference none|before` overrides the run's encoder input switch
            (docs/fidelity.md), e.g. to measure what it buys on the same clips.
`--toy` replaces the run's clips by hand-made ones of the run's shapes (`toy_change_clips`):
random features, the after frame a noisy copy of the before frame, and in change clips one
token of the after frame moved by 3 standard deviations in every channel, up or down at random
(a change the encoder's per-token LayerNorm keeps); the two middle frames go 1/3 and 2/3 of the
way from before to after.
No tokenizer is read. It asks whether the encoder can learn a before/after comparison at the
same position at all, where the difference MLP needs a hundred steps.
Its records add `chance`, the held-out share of the larger class (about 0.5), and three
threshold-free figures of the held-out logits: `held_out_auc` (ROC AUC, 0.5 = no ranking),
`logit_mean` and `logit_std`. Accuracy alone cannot tell a head that ranks the clips but sits
off its threshold (AUC > 0.5, |mean| > std) from one whose logits no longer depend on the clip
(AUC near 0.5, std near 0). The encoder's records also describe the hidden state its head reads
(the [REL] or [VID] row, or for `max` the top-scoring frame token): `read_mean_norm`, the norm
of its mean over the held-out clips, and `read_clip_std`, the root of its summed variance
across them. A clip-independent state has a large mean and a small spread.

One JSON line per evaluation: {probe, keep, step, samples, held_out_acc} (more for `--task change`).
"""

import argparse
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench import common
from procap_jax import checkpointing
from procap_jax import errors
from procap_jax.data import pipeline
from procap_jax.tasks import corruptions
from procap_jax.tasks import pretrain


def encode_clips(config, workdir: str, clips: int, seed: int = 0):
  """(clean [M, T, h, w, C], corrupted [M, T, h, w, C], encoder_text [M, L], pixel patch
  statistics [M, T, h, w, 12], change [M] bool: a change pair, not a distractor) of M training
  clips."""
  tokenizer = pretrain.vqgan_tokenizer(config)
  params = pretrain.load_constants(config, workdir)['tokenizer']
  ds = pipeline.make_train_dataset(config, workdir, 16, seed)

  @jax.jit
  def encode(frames, rng):
    x = frames.astype(jnp.float32) / 255.0  # [B, T, S, S, 3]
    corrupted, _ = corruptions.corrupt_from_config(rng, x, config)
    # pylint: disable-next=protected-access
    enc = lambda v: pretrain._encode_clips(tokenizer.encode_features, params, v)
    return enc(x), enc(corrupted)

  clean, bad, text, pixels, change = [], [], [], [], []
  for i in range(max(1, clips // 16)):
    batch = ds[i]
    a, b = encode(jnp.asarray(batch['keyframes']), jax.random.key(seed * 1000 + i))
    clean.append(np.asarray(a))
    bad.append(np.asarray(b))
    text.append(np.asarray(batch['encoder_text']))
    pixels.append(patch_statistics(batch['keyframes'], a.shape[2:4]))
    change.append(np.asarray(batch['change_type']) != pipeline.CHANGE_TYPES.index('none'))
  return (np.concatenate(clean), np.concatenate(bad), np.concatenate(text),
          np.concatenate(pixels), np.concatenate(change))


def toy_change_clips(m: int, grid: tuple[int, int], channels: int, seed: int = 0):
  """`--toy` clips: (features [m, 4, h, w, C] float32, change [m] bool). The before frame is
  N(0, 1) noise, the after frame the before frame plus N(0, 0.05^2) (a nuisance); in change clips
  (about half) one random token of the after frame moves by 3.0 in every channel, up or down at
  random per channel. Frames 1 and 2 are the procedure: the before frame moved 1/3 and 2/3 of the
  way to the after frame, plus their own N(0, 0.05^2). (The same shift in every channel would be
  invisible to the encoder: its frame embedding starts with a per-token LayerNorm.)"""
  rng = np.random.default_rng(seed)
  h, w = grid
  before = rng.normal(size=(m, h, w, channels)).astype(np.float32)
  after = before + 0.05 * rng.normal(size=(m, h, w, channels))
  change = rng.random(m) < 0.5
  for i in np.flatnonzero(change):
    y, x = rng.integers(h), rng.integers(w)
    after[i, y, x] += 3.0 * rng.choice([-1.0, 1.0], size=channels)
  middle = [before + f * (after - before) + 0.05 * rng.normal(size=before.shape)
            for f in (1 / 3, 2 / 3)]
  return np.stack([before] + middle + [after], 1).astype(np.float32), change


def patch_statistics(keyframes: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
  """Mean, std, max and min RGB of each token's pixel patch: [B, T, S, S, 3] -> [B, T, h, w, 12]."""
  x = np.asarray(keyframes, np.float32) / 255.0
  b, t, s = x.shape[:3]
  h, w = grid
  x = x.reshape(b, t, h, s // h, w, s // w, 3)
  return np.concatenate([f(x, axis=(3, 5)) for f in (np.mean, np.std, np.max, np.min)], -1)


def _held_out_acc(logit_fn, clean, bad) -> float:
  return 0.5 * (float(np.mean(logit_fn(clean) > 0)) + float(np.mean(logit_fn(bad) < 0)))


def _standardise(x: np.ndarray, n_train: int, *others: np.ndarray) -> list[np.ndarray]:
  """`x` and `others` [M, d] standardised per column with the mean and std of x[:n_train]."""
  mu, sd = x[:n_train].mean(0), x[:n_train].std(0) + 1e-6
  return [(v - mu) / sd for v in (x,) + others]


def _mlp(d: int):
  """(parameters, apply) of a one-hidden-layer GELU MLP [M, d] -> logits [M]."""
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {'w1': jax.random.normal(k1, (d, 256)) / np.sqrt(d), 'b1': jnp.zeros(256),
            'w2': jax.random.normal(k2, (256, 1)) / 16.0, 'b2': jnp.zeros(1)}
  apply = lambda p, x: (jax.nn.gelu(x @ p['w1'] + p['b1']) @ p['w2'] + p['b2'])[:, 0]
  return params, apply


def probe_mlp(clean, bad, n_train: int, steps: int, every: int):
  """Yields records of an MLP on per-frame mean features."""
  pool = lambda x: x.mean((2, 3)).reshape(len(x), -1)  # [M, T*C]
  xp, xn = _standardise(pool(clean), n_train, pool(bad))
  params, apply = _mlp(xp.shape[1])
  tx = optax.adam(1e-3)
  opt = tx.init(params)

  @jax.jit
  def step(p, o, a, b):
    x, y = jnp.concatenate([a, b]), jnp.r_[jnp.ones(len(a)), jnp.zeros(len(b))]
    g = jax.grad(lambda p: optax.sigmoid_binary_cross_entropy(apply(p, x), y).mean())(p)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  rng = np.random.default_rng(0)
  for s in range(1, steps + 1):
    i = rng.integers(0, n_train, 8)
    params, opt = step(params, opt, xp[i], xn[i])
    if s % every == 0:
      acc = _held_out_acc(lambda x: np.asarray(apply(params, x)), xp[n_train:], xn[n_train:])
      yield {'probe': 'mlp', 'keep': None, 'step': s, 'samples': 8 * s, 'held_out_acc': acc}


def probe_encoder(config, clean, bad, text, n_train: int, keep: float, steps: int, every: int,
                  lr: float, task: str = 'csy'):
  """Yields records of the run's ProcedureEncoder trained on L_csy (or L_align) alone with masks
  keeping `keep` of the tokens."""
  model = pretrain.build_model(config)
  params = nn.meta.unbox(pretrain.init_params(model, config, jax.random.key(0), None))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))
  opt = tx.init(params)
  t, n = clean.shape[1], clean.shape[2] * clean.shape[3]

  def logits(p, a, b, txt, rng):
    mask = jax.random.uniform(rng, (a.shape[0], t, n)) >= keep  # True = masked
    if task == 'align':  # positives: own caption; negatives: the same clip, swapped caption
      out = model.apply({'params': p}, jnp.concatenate([txt, pretrain.swap_batch(txt)]),
                        jnp.concatenate([a, a]), jnp.concatenate([mask, mask]), use_rel=True)
      return out['rel_logit']  # [2B]
    out = model.apply({'params': p}, jnp.concatenate([txt, txt]), jnp.concatenate([a, b]),
                      jnp.concatenate([mask, mask]), use_rel=True)
    return out['vid_logit']  # [2B]: clean then corrupted

  @jax.jit
  def step(p, o, a, b, txt, rng):
    y = jnp.r_[jnp.ones(len(a)), jnp.zeros(len(b))]
    bce = lambda p: optax.sigmoid_binary_cross_entropy(logits(p, a, b, txt, rng), y).mean()
    g = jax.grad(bce)(p)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  evaluate = jax.jit(logits)
  rng = np.random.default_rng(0)
  for s in range(1, steps + 1):
    i = rng.integers(0, n_train, 8)
    params, opt = step(params, opt, clean[i], bad[i], text[i], jax.random.key(s))
    if s % every == 0:
      correct, total = 0.0, 0
      for j in range(n_train, len(clean), 64):
        v = np.asarray(evaluate(params, clean[j:j + 64], bad[j:j + 64], text[j:j + 64],
                                jax.random.key(-1 - j)))
        k = len(v) // 2
        correct += float(np.sum(v[:k] > 0) + np.sum(v[k:] < 0))
        total += 2 * k
      yield {'probe': f'encoder_{task}', 'keep': keep, 'step': s, 'samples': 8 * s,
             'held_out_acc': correct / total}


def probe_detector(tokens, text, n_train: int, steps: int, every: int, batch: int,
                   name: str):
  """Yields records of the one-hop grounding detector (see the module docstring) on L_align."""
  m, c = len(tokens), tokens.shape[-1]
  x_all = tokens.reshape(m, -1, c)  # [M, T*N, C]
  mu, sd = x_all[:n_train].mean((0, 1)), x_all[:n_train].std((0, 1)) + 1e-6
  x_all = (x_all - mu) / sd
  vocab = int(text.max()) + 1
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {'E': 0.1 * jax.random.normal(k1, (vocab, 32)),
            'W': jax.random.normal(k2, (c, 32)) / np.sqrt(c),
            'a': jnp.zeros(vocab), 'b': jnp.zeros(())}

  def logits(p, x, txt):  # [B, T*N, C], [B, L] -> [2B]: own captions, then swapped ones
    z = x @ p['W']
    z = z / jnp.linalg.norm(z, axis=-1, keepdims=True)  # [B, T*N, 32]

    def score(t):
      s = jnp.einsum('bld,bnd->bln', p['E'][t], z).max(-1)  # [B, L]
      return jnp.sum(p['a'][t] * s * (t > 0), -1) + p['b']

    return jnp.concatenate([score(txt), score(pretrain.swap_batch(txt))])

  tx = optax.adam(optax.linear_schedule(0.0, 3e-3, 100))
  opt = tx.init(params)

  @jax.jit
  def step(p, o, x, txt):
    y = jnp.r_[jnp.ones(len(x)), jnp.zeros(len(x))]
    g = jax.grad(lambda p: optax.sigmoid_binary_cross_entropy(logits(p, x, txt), y).mean())(p)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  evaluate = jax.jit(logits)
  rng = np.random.default_rng(0)
  for s in range(1, steps + 1):
    i = rng.integers(0, n_train, batch)
    params, opt = step(params, opt, x_all[i], text[i])
    if s % every == 0:
      correct, total = 0.0, 0
      for j in range(n_train, len(x_all) - batch + 1, batch):
        v = np.asarray(evaluate(params, x_all[j:j + batch], text[j:j + batch]))
        correct += float(np.sum(v[:batch] > 0) + np.sum(v[batch:] < 0))
        total += 2 * batch
      yield {'probe': f'detector_{name}', 'keep': 1.0, 'step': s, 'samples': batch * s,
             'held_out_acc': correct / total}


def _fit_binary(name: str, apply, params, x, y, n_train: int, steps: int, every: int,
                lr: float, warmup: int = 0, read=None):
  """Yields records of `apply(params, x[i]) -> logits` trained with BCE on labels `y` [M] on
  the first `n_train` rows (batch 8, Adam, global-norm clip 1), scored on the rest: accuracy at
  logit 0, and (threshold-free) the ROC AUC and the mean and spread of the held-out logits.
  With `read(params, x) -> (logits [B], state [B, D])`, the logits and the hidden state the head
  reads from one forward, evaluation uses it and the records add `read_mean_norm`, the norm of
  that state's mean over the held-out clips, and `read_clip_std`, the root of its summed
  variance across them (how much of it depends on the clip at all)."""
  y = np.asarray(y, np.float32)
  schedule = optax.linear_schedule(lr * 1e-3, lr, warmup) if warmup else lr
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
  opt = tx.init(params)

  @jax.jit
  def step(p, o, xb, yb):
    g = jax.grad(lambda p: optax.sigmoid_binary_cross_entropy(apply(p, xb), yb).mean())(p)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  evaluate = jax.jit(read if read is not None else lambda p, xb: (apply(p, xb), None))
  held = y[n_train:] > 0.5
  chance = float(max(held.mean(), 1.0 - held.mean()))
  rng = np.random.default_rng(0)
  for s in range(1, steps + 1):
    i = rng.integers(0, n_train, 8)
    params, opt = step(params, opt, x[i], y[i])
    if s % every == 0:
      outs = [evaluate(params, x[j:j + 64]) for j in range(n_train, len(x), 64)]
      v = np.concatenate([np.asarray(o[0]) for o in outs])  # [M - n_train] logits
      record = {'probe': name, 'keep': 1.0, 'step': s, 'samples': 8 * s,
                'held_out_acc': float(np.mean((v > 0) == held)), 'chance': chance,
                'held_out_auc': common.roc_auc(v, held), 'logit_mean': float(v.mean()),
                'logit_std': float(v.std())}
      if read is not None:
        h = np.concatenate([np.asarray(o[1]) for o in outs])  # [M - n_train, D]
        record['read_mean_norm'] = float(np.linalg.norm(h.mean(0)))
        record['read_clip_std'] = float(np.sqrt(np.sum(h.var(0))))
      yield record


def _pooled_difference(tokens: np.ndarray, n_train: int) -> np.ndarray:
  """Spatial max and mean of |after - before| per channel, standardised on the training rows:
  [M, T, h, w, C] -> [M, 2C]."""
  diff = np.abs(tokens[:, -1] - tokens[:, 0])  # [M, h, w, C]: after vs before, same position
  pooled = np.concatenate([diff.max((1, 2)), diff.mean((1, 2))], -1)  # [M, 2C]
  return _standardise(pooled, n_train)[0]


def probe_change(config, clean, change, n_train: int, steps: int, every: int, lr: float,
                 head: str = 'rel', init_params=None, pixels=None):
  """Yields records of the `--task change` probes (see the module docstring); the encoder
  starts from `init_params` (e.g. the run's stage-1 parameters) when given, else from scratch.
  With `pixels` [M, T, h, w, 12] (`patch_statistics`), the difference MLP also runs on them."""
  inputs = [('change_diff_mlp', clean)]
  if pixels is not None:
    inputs.append(('change_pixel_diff_mlp', pixels))
  for name, tokens in inputs:
    pooled = _pooled_difference(tokens, n_train)
    mlp, apply_mlp = _mlp(pooled.shape[1])
    yield from _fit_binary(name, apply_mlp, mlp, pooled, change, n_train, steps, every, 1e-3)

  model = pretrain.build_model(config)
  if init_params is None:
    params = nn.meta.unbox(pretrain.init_params(model, config, jax.random.key(0), None))
  else:  # no scratch initialisation to throw away
    params = jax.tree.map(jnp.asarray, init_params)
  params = {'encoder': params}
  if head == 'max':  # a linear score per frame token, read out by its max over the tokens
    params['max_readout'] = {'w': jnp.zeros(model.width), 'b': jnp.zeros(())}
  t, n = clean.shape[1], clean.shape[2] * clean.shape[3]

  def forward(p, x):  # frames only: an empty caption, nothing masked
    empty = jnp.zeros((x.shape[0], model.text_len), jnp.int32)
    return model.apply({'params': p['encoder']}, empty, x, jnp.zeros((x.shape[0], t, n), bool),
                       use_rel=True)

  def token_scores(p, x):  # [B, T*N] scores and [B, T*N, D] LayerNormed frame hidden states
    h = forward(p, x)['frame_hidden']
    h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
    return h @ p['max_readout']['w'] + p['max_readout']['b'], h

  def apply_encoder(p, x):
    if head == 'max':
      return token_scores(p, x)[0].max(-1)  # [B]
    return forward(p, x)[f'{head}_logit']  # [B]

  def read(p, x):  # logits [B] and the hidden state the head reads [B, D], from one forward
    if head == 'max':
      scores, h = token_scores(p, x)
      return scores.max(-1), jnp.take_along_axis(h, scores.argmax(-1)[:, None, None], axis=1)[:, 0]
    out = forward(p, x)
    row = 0 if head == 'rel' else model.text_len + 2  # [REL] | [VID] (after the text and [ST1])
    return out[f'{head}_logit'], out['hidden'][:, row]

  yield from _fit_binary(f'change_encoder_{head}', apply_encoder, params, clean, change, n_train,
                         steps, every, lr, warmup=100, read=read)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True, help='a run whose tokenizer stage finished')
  parser.add_argument('--clips', type=int, default=1920)
  parser.add_argument('--keep', default='0.2,1.0', help='comma-separated token keep fractions')
  parser.add_argument('--steps', type=int, default=1500)
  parser.add_argument('--every', type=int, default=100)
  parser.add_argument('--lr', type=float, default=1e-3)
  parser.add_argument('--task', default='csy', choices=('csy', 'align', 'change'))
  parser.add_argument('--head', default='rel', choices=('rel', 'vid', 'max'),
                      help='--task change: the encoder head trained on the label (max: a linear '
                           'score per frame token, its max over the tokens)')
  parser.add_argument('--init', default='scratch', choices=('scratch', 'stage1'),
                      help="--task change: the encoder from scratch or from the run's stage-1 "
                           'checkpoint (best)')
  parser.add_argument('--toy', action='store_true',
                      help='--task change: hand-made clips of the run\'s shapes instead of its '
                           'data (see the module docstring); reads no tokenizer')
  parser.add_argument('--frame-difference', default='run', choices=('run', 'none', 'before'),
                      help="the encoder probes' config.pretrain.model.frame_difference: the run's "
                           '(default) or the one given')
  parser.add_argument('--detector-batch', type=int, default=64,
                      help='batch of the align detector probes')
  args = parser.parse_args()
  config_path = os.path.join(args.workdir, 'config.json')
  if not os.path.exists(config_path):
    raise SystemExit(f'error: {config_path} does not exist; pass the workdir of a run')
  from procap_jax import caption as caption_cli
  config = caption_cli.load_run_config(args.workdir)
  pipeline.resolve_vocab_sizes(config, args.workdir)
  if args.toy and args.task != 'change':
    raise SystemExit('error: --toy applies to --task change only')
  if args.frame_difference != 'run':
    if args.init == 'stage1':
      raise SystemExit("error: --init stage1 uses the run's own encoder; drop --frame-difference")
    with config.unlocked():
      config.pretrain.model.frame_difference = args.frame_difference
  init = None
  try:
    if args.task == 'change' and args.init == 'stage1':  # before minutes of encoding
      init = checkpointing.load_stage_variables(args.workdir, 'pretrain', which='best')['params']
    if args.toy:
      m = config.pretrain.model
      clean, change = toy_change_clips(args.clips, tuple(m.grid), int(m.feature_dim))
      pixels = None
    else:
      clean, bad, text, pixels, change = encode_clips(config, args.workdir, args.clips)
  except errors.UserError as e:
    raise SystemExit(f'error: {e}') from None
  n_train = int(0.8 * len(clean))
  if args.task == 'change':
    if change.all() or not change.any():
      raise SystemExit('error: --task change needs both change pairs and no-change distractors '
                       'in the training split (the synthetic benchmark has both)')
    for record in probe_change(config, clean, change, n_train, args.steps, args.every, args.lr,
                               args.head, init, pixels):
      common.emit(record)
    return
  if args.task == 'csy':
    for record in probe_mlp(clean, bad, n_train, args.steps, args.every):
      common.emit(record)
  else:
    for name, tokens in (('pixels', pixels), ('features', clean)):
      for record in probe_detector(tokens, text, n_train, args.steps, args.every,
                                   args.detector_batch, name):
        common.emit(record)
  for keep in (float(k) for k in args.keep.split(',') if k):
    for record in probe_encoder(config, clean, bad, text, n_train, keep, args.steps, args.every,
                                args.lr, args.task):
      common.emit(record)


if __name__ == '__main__':
  main()
