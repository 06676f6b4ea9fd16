r"""Can stage 1's consistency task be learned, and does masking stop it? Probes on cached features.

  python -m procap_jax.diagnostics.probe_consistency --workdir W   # W: a run with a tokenizer
  python -m procap_jax.diagnostics.probe_consistency --workdir W --keep 0.2,1.0 --steps 1500
  python -m procap_jax.diagnostics.probe_consistency --workdir W --task align  # caption match
  python -m procap_jax.diagnostics.probe_consistency --workdir W --task change  # change or not
  python -m procap_jax.diagnostics.probe_consistency --workdir W --task change --toy  # toy clips

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

`--task change` asks the question under matching's easiest part: can a model tell a change pair
from a no-change distractor, from the frames alone, when told the answer directly? Its probes
(`diff_mlp`, `pixel_diff_mlp`, `encoder`; `--head`, `--init`, `--frame-difference`) and the
threshold-free figures their records add are described in `probe_change`.
`--toy` replaces the run's clips by hand-made ones of the run's shapes (`toy_change_clips`):
random features, the after frame a noisy copy of the before frame, and in change clips one
token of the after frame moved by 3 standard deviations in every channel, up or down at random
(a change the encoder's per-token LayerNorm keeps); the two middle frames go 1/3 and 2/3 of the
way from before to after.
No tokenizer is read. It asks whether the encoder can learn a before/after comparison at the
same position at all, where the difference MLP needs a hundred steps.

One JSON line per evaluation: {probe, keep, step, samples, held_out_acc} (more for `--task change`).
"""

import argparse
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from procap_jax import caption as caption_cli
from procap_jax import checkpointing
from procap_jax import errors
from procap_jax.data import pipeline
from procap_jax.diagnostics import probe_change
from procap_jax.diagnostics import probe_training
from procap_jax.diagnostics import records
from procap_jax.models import encodings
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
    x = encodings.images01(frames)  # [B, T, S, S, 3]
    corrupted, _ = corruptions.corrupt_from_config(rng, x, config)
    enc = lambda v: encodings.encode_clips(tokenizer.encode_features, params, v)
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


def _pair_labels(k: int) -> np.ndarray:
  """Labels [2k] of k positives followed by k negatives."""
  return np.r_[np.ones(k), np.zeros(k)].astype(np.float32)


def _paired_acc(logits) -> float:
  """Share of right decisions over logit vectors [2k] (k positives, then k negatives): a positive
  is right above 0, a negative below."""
  right, total = 0.0, 0
  for v in logits:
    k = len(v) // 2
    right += float(np.sum(v[:k] > 0) + np.sum(v[k:] < 0))
    total += 2 * k
  return right / total


def probe_mlp(clean, bad, n_train: int, steps: int, every: int):
  """Yields records of an MLP on per-frame mean features."""
  pool = lambda x: x.mean((2, 3)).reshape(len(x), -1)  # [M, T*C]
  xp, xn = probe_training.standardise(pool(clean), n_train, pool(bad))
  params, apply = probe_training.mlp(xp.shape[1])
  logits = lambda p, a, b: apply(p, jnp.concatenate([a, b]))  # [2B]: clean then corrupted
  batch = lambda s, i: (_pair_labels(len(i)), xp[i], xn[i])
  tx = optax.adam(1e-3)
  for s, params in probe_training.train_bce(logits, params, tx, batch, n_train, steps, every):
    acc = _paired_acc([np.asarray(logits(params, xp[n_train:], xn[n_train:]))])
    yield {'probe': 'mlp', 'keep': None, 'step': s, 'samples': 8 * s, 'held_out_acc': acc}


def probe_encoder(config, clean, bad, text, n_train: int, keep: float, steps: int, every: int,
                  lr: float, task: str = 'csy'):
  """Yields records of the run's ProcedureEncoder trained on L_csy (or L_align) alone with masks
  keeping `keep` of the tokens."""
  model = pretrain.build_model(config)
  params = nn.meta.unbox(pretrain.init_params(model, config, jax.random.key(0), None))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))
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

  batch = lambda s, i: (_pair_labels(len(i)), clean[i], bad[i], text[i], jax.random.key(s))
  evaluate = jax.jit(logits)
  for s, params in probe_training.train_bce(logits, params, tx, batch, n_train, steps, every):
    acc = _paired_acc(np.asarray(evaluate(params, clean[j:j + 64], bad[j:j + 64], text[j:j + 64],
                                          jax.random.key(-1 - j)))
                      for j in range(n_train, len(clean), 64))
    yield {'probe': f'encoder_{task}', 'keep': keep, 'step': s, 'samples': 8 * s,
           'held_out_acc': acc}


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
  rows = lambda s, i: (_pair_labels(len(i)), x_all[i], text[i])
  evaluate = jax.jit(logits)
  for s, params in probe_training.train_bce(logits, params, tx, rows, n_train, steps, every,
                                            size=batch):
    acc = _paired_acc(np.asarray(evaluate(params, x_all[j:j + batch], text[j:j + batch]))
                      for j in range(n_train, len(x_all) - batch + 1, batch))
    yield {'probe': f'detector_{name}', 'keep': 1.0, 'step': s, 'samples': batch * s,
           'held_out_acc': acc}


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
  config = caption_cli.load_run_config(args.workdir)
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
    for record in probe_change.probe_change(config, clean, change, n_train, args.steps,
                                            args.every, args.lr, args.head, init, pixels):
      records.emit(record)
    return
  if args.task == 'csy':
    for record in probe_mlp(clean, bad, n_train, args.steps, args.every):
      records.emit(record)
  else:
    for name, tokens in (('pixels', pixels), ('features', clean)):
      for record in probe_detector(tokens, text, n_train, args.steps, args.every,
                                   args.detector_batch, name):
        records.emit(record)
  for keep in (float(k) for k in args.keep.split(',') if k):
    for record in probe_encoder(config, clean, bad, text, n_train, keep, args.steps, args.every,
                                args.lr, args.task):
      records.emit(record)


if __name__ == '__main__':
  main()
