"""Stage 0: train the VQGAN tokenizer from scratch on the frames of the batch contract.

Dimensions: B batch, T keyframes per example, F frames per step (B * frames_per_example), S image
side, N = h*w tokens per frame, D code width (embed_dim), K codebook size.

Frames: each step takes `frames_per_example` random distinct keyframes of every example
(before, after and imagined frames alike; 0 = all T), so F = B * frames_per_example.

Loss (per step, `config.tokenizer.train` = tc):
  l1_weight * L1 + l2_weight * L2        reconstruction, computed in the model's [-1, 1] space
                                         (taming's space; both are 2x / 4x their [0, 1] values)
  + codebook_weight * beta * commitment  ||sg(code) - z||^2 pulls the encoder to its codes
  + gan terms                            only when gan_weight > 0 (see below)
The codebook itself gets no gradient (so taming's legacy question of which term carries beta does
not arise): it follows exponential moving averages (k-means style, as VQ-VAE-2) of the encoder
outputs assigned to each code, and dead codes are restarted:

  model_state = {step, cluster_size [K] (EMA of per-step code usage counts), embed_sum [K, D]}
  cluster_size <- decay * cluster_size + (1 - decay) * counts; embed_sum likewise with the sums
  codebook     <- embed_sum / cluster_size (codes never used keep their value)
  every `restart_every` steps (from step 0, so step 0 is a data-dependent initialisation) codes
  with cluster_size < dead_code_threshold are re-initialised from random encoder outputs z of the
  current batch (jnp.where; rng from the step rng); their statistics restart at the threshold,
  so a restarted code that stays unused for a whole window is restarted again.

Because the trainer only changes params through the optimizer, the new codebook reaches the
params through the gradient: the loss holds a zero-valued term whose gradient with respect to
`quantize/embedding` is (codebook - new_codebook), and `make_optimizer` routes that leaf through
plain SGD with learning rate 1 (no clipping), so after the update the codebook equals the EMA /
restart codebook exactly. The rest of the VQGAN uses clipped Adam with warmup + cosine decay.
The trainer must use `make_optimizer`'s transformation unchanged for this to hold (its logged
`grad_norm` includes this codebook term, which is large at restart steps).

Optional patch GAN (gan_weight > 0): a small PatchGAN discriminator lives in params['disc'] with
its own clipped Adam (optax.multi_transform). Hinge losses; one combined loss with stop_gradient
so each player only moves its own parameters: the generator term sees sg(disc params), the
discriminator term sees sg(reconstruction). No adaptive weight or delayed start (taming has both).
Other stages may apply the VQGAN to the whole params tree: linen ignores the extra 'disc' entry.

Train metrics: loss, l1, l2, commitment, psnr (batch, [0, 1] images), perplexity (batch code
usage), codes_active (share of codes with EMA usage >= threshold), codes_restarted (+ gan_g,
gan_d). `evaluate` reports psnr, l1, codebook_usage, perplexity and frames on a split.
"""

import functools
import os
from typing import Any, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from PIL import Image

from procap_jax import errors
from procap_jax import sharding
from procap_jax import train
from procap_jax.convert import init as convert_init
from procap_jax.data import pipeline
from procap_jax.models import conv_grads
from procap_jax.models import vqgan
from procap_jax.models import vqgan_layers

PSNR_MSE_FLOOR = 1e-10  # a perfect reconstruction scores 10 * log10(1 / 1e-10) = 100 dB
NUM_SHOWN = 8  # frames in the reconstruction PNG


def build_model(config: ml_collections.ConfigDict) -> vqgan.VQGAN:
  return vqgan.VQGAN(**config.tokenizer.model, dtype=jnp.dtype(config.compute_dtype))


class PatchDiscriminator(nn.Module):
  """A small PatchGAN (taming's NLayerDiscriminator with GroupNorm instead of BatchNorm).

  [F, S, S, 3] in [-1, 1] -> per-patch logits [F, S/4, S/4, 1].
  """
  ch: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.leaky_relu(vqgan_layers.conv(self.ch, 4, 'conv_0', jnp.float32, 2, 1)(x), 0.2)
    h = vqgan_layers.conv(2 * self.ch, 4, 'conv_1', jnp.float32, 2, 1)(h)
    h = nn.leaky_relu(vqgan_layers.group_norm(2 * self.ch, 'norm_1')(h), 0.2)
    h = vqgan_layers.conv(4 * self.ch, 3, 'conv_2', jnp.float32)(h)
    h = nn.leaky_relu(vqgan_layers.group_norm(4 * self.ch, 'norm_2')(h), 0.2)
    return vqgan_layers.conv(1, 3, 'conv_out', jnp.float32)(h)


def _discriminator(config: ml_collections.ConfigDict) -> PatchDiscriminator:
  return PatchDiscriminator(config.tokenizer.model.ch)


def init_params(model: vqgan.VQGAN, config: ml_collections.ConfigDict, rng: jax.Array,
                batch: dict) -> Any:
  """Boxed VQGAN parameters (+ 'disc' when gan_weight > 0), initialised on one frame."""
  x = batch['keyframes'][:1, 0].astype(jnp.float32) / 255.0  # [1, S, S, 3]
  model_rng, disc_rng = jax.random.split(rng)
  params = dict(model.init({'params': model_rng, 'dropout': model_rng}, x, train=False)['params'])
  if config.tokenizer.train.gan_weight > 0:
    params['disc'] = _discriminator(config).init(disc_rng, 2.0 * x - 1.0)['params']
  return params


def init_model_state(model: vqgan.VQGAN, config: ml_collections.ConfigDict, rng: jax.Array,
                     batch: dict) -> dict:
  """EMA codebook statistics, all zero: every code is 'dead' until the step-0 restart."""
  del config, rng, batch
  return dict(step=jnp.zeros((), jnp.int32),
              cluster_size=jnp.zeros((model.n_embed,), jnp.float32),
              embed_sum=jnp.zeros((model.n_embed, model.embed_dim), jnp.float32))


def load_constants(config: ml_collections.ConfigDict, workdir: str) -> None:
  """The tokenizer trains from scratch: no frozen inputs."""
  del config, workdir
  return None


def select_frames(keyframes: jax.Array, per_example: int, rng: jax.Array) -> jax.Array:
  """uint8 [B, T, S, S, 3] -> float [B * f, S, S, 3] in [0, 1]; f random distinct frames per
  example (f = per_example), or all T when per_example is 0 or >= T."""
  b, t = keyframes.shape[:2]
  if 0 < per_example < t:
    order = jnp.argsort(jax.random.uniform(rng, (b, t)), axis=1)[:, :per_example]  # [B, f]
    keyframes = jnp.take_along_axis(keyframes, order[:, :, None, None, None], axis=1)
  frames = keyframes.reshape((-1,) + keyframes.shape[2:])  # [B*f, S, S, 3]
  return frames.astype(jnp.float32) / 255.0


def update_codebook(state: dict, codebook: jax.Array, z: jax.Array, indices: jax.Array,
                    rng: jax.Array, tc: ml_collections.ConfigDict) -> tuple[dict, jax.Array, dict]:
  """One EMA step of the codebook plus the periodic dead-code restart (pure).

  Args:
    state: model_state (step, cluster_size [K], embed_sum [K, D]).
    codebook: [K, D] current codes.
    z: [F, h, w, D] pre-quantisation vectors of this step.
    indices: [F, N] their nearest codes.
    rng: picks the encoder outputs that replace dead codes.
    tc: config.tokenizer.train.

  Returns:
    (new state, new codebook [K, D], metrics dict(codes_restarted, codes_active)).
  """
  k, d = codebook.shape
  z = jax.lax.stop_gradient(z).reshape(-1, d)  # [F*N, D]
  onehot = jax.nn.one_hot(indices.reshape(-1), k, dtype=jnp.float32)  # [F*N, K]
  decay = tc.codebook_decay
  size = decay * state['cluster_size'] + (1.0 - decay) * onehot.sum(0)  # [K]
  embed_sum = decay * state['embed_sum'] + (1.0 - decay) * (onehot.T @ z)  # [K, D]
  seen = size > 1e-12
  ema = jnp.where(seen[:, None], embed_sum / jnp.where(seen, size, 1.0)[:, None], codebook)

  threshold = tc.dead_code_threshold
  restart_now = jnp.logical_and(tc.dead_code_restart, state['step'] % tc.restart_every == 0)
  dead = jnp.logical_and(size < threshold, restart_now)  # [K]
  n = z.shape[0]
  rows = (jax.random.permutation(rng, n)[:k] if n >= k
          else jax.random.randint(rng, (k,), 0, n))  # [K]
  fresh = z[rows]  # [K, D]
  new_codebook = jnp.where(dead[:, None], fresh, ema)
  size = jnp.where(dead, threshold, size)
  embed_sum = jnp.where(dead[:, None], fresh * threshold, embed_sum)
  new_state = dict(step=state['step'] + 1, cluster_size=size, embed_sum=embed_sum)
  metrics = dict(codes_restarted=dead.sum().astype(jnp.float32),
                 codes_active=jnp.mean((size >= threshold).astype(jnp.float32)))
  return new_state, new_codebook, metrics


def assignment_term(param: jax.Array, target: jax.Array) -> jax.Array:
  """Zero-valued loss whose gradient w.r.t. `param` is (param - target): with SGD at lr 1 the
  optimizer step sets param := target."""
  delta = jax.lax.stop_gradient(param - target)
  value = jnp.sum(param * delta)
  return value - jax.lax.stop_gradient(value)


def perplexity(counts: jax.Array) -> jax.Array:
  """exp(entropy) of a code-usage histogram [K] (0 log 0 = 0)."""
  p = counts / jnp.maximum(counts.sum(), 1e-12)
  return jnp.exp(-jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)))


def _frame_terms(params: Any, x: jax.Array, dropout_rng: jax.Array,
                 config: ml_collections.ConfigDict, model: vqgan.VQGAN) -> tuple[dict, dict]:
  """The per-frame part of the loss on frames x [F, S, S, 3] in [0, 1].

  Returns (means over these frames: l1, l2, commitment (+ gan_g, gan_d_real, gan_d_fake);
  per-frame outputs: z [F, h, w, D], indices [F, N], mse [F]). Means of equal-sized chunks
  average to the means of their union, so `loss_fn` may run this on chunks of frames.
  """
  vq_params = {k: v for k, v in params.items() if k != 'disc'}
  out = model.apply({'params': vq_params}, x, train=True, rngs={'dropout': dropout_rng})
  diff = 2.0 * (out['reconstruction'] - x)  # [-1, 1] space
  means = dict(l1=jnp.mean(jnp.abs(diff)), l2=jnp.mean(diff ** 2),
               commitment=out['commitment_loss'])
  mse = jnp.mean((jnp.clip(out['reconstruction'], 0.0, 1.0) - x) ** 2, axis=(1, 2, 3))  # [F]
  if config.tokenizer.train.gan_weight > 0:
    disc = _discriminator(config)
    real, fake = 2.0 * x - 1.0, 2.0 * out['reconstruction'] - 1.0
    means['gan_g'] = -jnp.mean(disc.apply({'params': jax.lax.stop_gradient(params['disc'])},
                                          fake))
    logits_real = disc.apply({'params': params['disc']}, real)
    logits_fake = disc.apply({'params': params['disc']}, jax.lax.stop_gradient(fake))
    means['gan_d_real'] = jnp.mean(jax.nn.relu(1.0 - logits_real))
    means['gan_d_fake'] = jnp.mean(jax.nn.relu(1.0 + logits_fake))
  return means, dict(z=out['z'], indices=out['indices'], mse=mse)


def chunked_frame_terms(params: Any, x: jax.Array, dropout_rng: jax.Array,
                        config: ml_collections.ConfigDict,
                        model: vqgan.VQGAN) -> tuple[dict, dict]:
  """`_frame_terms` on all frames, or with `frames_chunk` C > 0 on C frames at a time.

  Chunks run as a `lax.map` with a checkpointed body, so the backward pass keeps only each
  chunk's input frames and recomputes one chunk's activations at a time: memory for C frames
  instead of F, for the same values (up to summation order; dropout masks differ per chunk).
  XLA:CPU keeps `nn.remat` recomputations alive across blocks, so only a loop bounds it
  (docs/performance.md, "Memory"). Chunk j holds frames j, j + F/C, ... (as training's
  micro-batches take rows), so on a data-parallel mesh with C a multiple of the data axis each
  chunk takes frames from every device, and each device runs its own frames.
  """
  f = x.shape[0]
  c = int(config.tokenizer.train.frames_chunk)
  if c <= 0 or c >= f:
    return _frame_terms(params, x, dropout_rng, config, model)
  if f % c:
    raise ValueError(f'config.tokenizer.train.frames_chunk={c} must divide the {f} frames of a '
                     'step (batch_size x frames_per_example)')
  chunks = sharding.interleaved_rows(x, f // c)  # [F/C, C, S, S, 3]: frames j, j + F/C, ...
  rngs = jax.random.split(dropout_rng, f // c)

  @jax.checkpoint
  def body(args):
    frames, rng = args
    return _frame_terms(params, frames, rng, config, model)

  with conv_grads.in_loop():  # the library's convolution gradients crawl inside loops
    means, per_frame = jax.lax.map(body, (chunks, rngs))
  means = jax.tree.map(lambda v: jnp.mean(v, axis=0), means)
  per_frame = jax.tree.map(sharding.rows_in_order, per_frame)  # [F, ...] in the frames' order
  return means, per_frame


def loss_fn(params: Any, model_state: dict, constants: Any, batch: dict, rng: jax.Array,
            config: ml_collections.ConfigDict, model: vqgan.VQGAN) -> tuple[jax.Array, tuple]:
  """Training loss (see the module docstring); pure and jittable."""
  del constants
  tc = config.tokenizer.train
  params = nn.meta.unbox(params)
  frame_rng, restart_rng, dropout_rng = jax.random.split(rng, 3)
  x = select_frames(batch['keyframes'], tc.frames_per_example, frame_rng)  # [F, S, S, 3]
  means, out = chunked_frame_terms(params, x, dropout_rng, config, model)
  l1, l2 = means['l1'], means['l2']
  loss = tc.l1_weight * l1 + tc.l2_weight * l2
  loss += tc.codebook_weight * model.beta * means['commitment']

  codebook = params['quantize']['embedding']
  new_state, new_codebook, code_metrics = update_codebook(
      model_state, jax.lax.stop_gradient(codebook), out['z'], out['indices'], restart_rng, tc)
  loss += assignment_term(codebook, new_codebook)

  counts = jnp.zeros((model.n_embed,), jnp.float32).at[out['indices'].reshape(-1)].add(1.0)
  metrics = dict(l1=l1, l2=l2, commitment=means['commitment'],
                 psnr=jnp.mean(psnr_from_mse(out['mse'])), perplexity=perplexity(counts),
                 **code_metrics)
  if tc.gan_weight > 0:
    g_loss = means['gan_g']
    d_loss = 0.5 * (means['gan_d_real'] + means['gan_d_fake'])
    loss += tc.gan_weight * g_loss + d_loss
    metrics.update(gan_g=g_loss, gan_d=d_loss)
  metrics['loss'] = loss
  return loss, (metrics, new_state)


def _param_label(path: tuple, leaf: Any) -> str:
  del leaf
  keys = [getattr(p, 'key', None) for p in path]
  if keys[:1] == ['disc']:
    return 'disc'
  if keys[:2] == ['quantize', 'embedding']:
    return 'codebook'
  return 'model'


def make_optimizer(config: ml_collections.ConfigDict, total_steps: int
                   ) -> optax.GradientTransformation:
  """Clipped Adam, linear warmup then cosine decay to 0 at total_steps; the codebook leaf gets
  SGD(1.0) (it receives the EMA assignment 'gradient', see the module docstring)."""
  tc = config.tokenizer.train
  total_steps = max(int(total_steps), 1)
  warmup = min(int(tc.warmup_steps), total_steps - 1)
  schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup, total_steps, 0.0)

  def adam():
    return optax.chain(optax.clip_by_global_norm(tc.clip), optax.adam(schedule))

  transforms = {'model': adam(), 'codebook': optax.sgd(1.0)}
  if tc.gan_weight > 0:
    transforms['disc'] = adam()
  return optax.multi_transform(
      transforms, lambda params: jax.tree_util.tree_map_with_path(_param_label, params))


# ----------------------------------------------------------------------------- evaluation


def psnr_from_mse(mse: Any) -> Any:
  """PSNR in dB of [0, 1] images from their mean squared error (floored at PSNR_MSE_FLOOR)."""
  return -10.0 * jnp.log10(jnp.maximum(mse, PSNR_MSE_FLOOR))


def usage_stats(counts: np.ndarray) -> tuple[float, float]:
  """(share of codes used at least once, perplexity) of a code-usage histogram [K]."""
  counts = np.asarray(counts, np.float64)
  return float(np.mean(counts > 0)), float(perplexity(jnp.asarray(counts, jnp.float32)))


@functools.partial(jax.jit, static_argnums=0)
def _reconstruct(model: vqgan.VQGAN, params: Any, frames: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """uint8 [F, S, S, 3] -> (reconstruction [F, S, S, 3] clipped to [0, 1], indices [F, N])."""
  out = model.apply({'params': params}, frames.astype(jnp.float32) / 255.0, train=False)
  return jnp.clip(out['reconstruction'], 0.0, 1.0), out['indices']


def evaluate(state: train.TrainState, constants: Any, config: ml_collections.ConfigDict,
             model: vqgan.VQGAN, split: str, workdir: str, *,
             batches: Iterable[dict] | None = None) -> dict[str, float]:
  """Reconstruction and codebook metrics on `split`; writes a reconstruction PNG.

  Args:
    state: the train state (params boxed or not).
    constants: unused.
    config: the run config.
    model: the VQGAN.
    split: dataset split name.
    workdir: run directory; the PNG goes to <workdir>/tokenizer/reconstructions_<split>.png.
    batches: optional batches of the contract (tests); default: the pipeline's eval iterator
      with config.tokenizer.train.eval_batches batches.

  Returns:
    dict(psnr: mean per-frame PSNR in dB on [0, 1] images, l1: mean absolute error on [0, 1]
    images, codebook_usage: share of the K codes used on the split, perplexity: exp entropy of
    the code usage, frames: number of frames evaluated). Padding rows (valid=False) are skipped.
  """
  del constants
  tc = config.tokenizer.train
  if batches is None:
    # Imported here: the input pipeline pulls in grain/cv2/TFDS, which training steps never need.
    batches = pipeline.make_eval_iterator(config, split, workdir, tc.batch_size,
                                          num_batches=tc.eval_batches)
  params = {k: v for k, v in nn.meta.unbox(state.params).items() if k != 'disc'}
  counts = np.zeros((model.n_embed,), np.int64)
  psnr_sum = l1_sum = 0.0
  num_frames = 0
  shown_x, shown_y = [], []
  for batch in batches:
    keyframes = np.asarray(batch['keyframes'])
    b, t = keyframes.shape[:2]
    frames = keyframes.reshape((b * t,) + keyframes.shape[2:])  # [B*T, S, S, 3]
    valid = np.repeat(np.asarray(batch['valid'], bool), t)  # [B*T]
    rec, indices = jax.device_get(
        _reconstruct(model, params, sharding.place_eval_batch(frames, config)))
    x = frames[valid].astype(np.float32) / 255.0
    rec = np.asarray(rec, np.float32)[valid]
    mse = np.mean((rec - x) ** 2, axis=(1, 2, 3))  # [F]
    psnr_sum += float(np.sum(psnr_from_mse(mse)))
    l1_sum += float(np.sum(np.mean(np.abs(rec - x), axis=(1, 2, 3))))
    counts += np.bincount(np.asarray(indices)[valid].reshape(-1), minlength=model.n_embed)
    num_frames += int(valid.sum())
    room = NUM_SHOWN - len(shown_x)
    shown_x.extend(x[:room])
    shown_y.extend(rec[:room])
  if num_frames == 0:
    raise errors.UserError(f'the {split} split gave no frames to evaluate the tokenizer on; '
                           'check that the dataset split is not empty')
  usage, ppl = usage_stats(counts)
  write_reconstructions(os.path.join(workdir, 'tokenizer', f'reconstructions_{split}.png'),
                        np.stack(shown_x), np.stack(shown_y))
  return dict(psnr=psnr_sum / num_frames, l1=l1_sum / num_frames, codebook_usage=usage,
              perplexity=ppl, frames=float(num_frames))


def write_reconstructions(path: str, originals: np.ndarray, reconstructions: np.ndarray) -> None:
  """Writes a PNG atomically: originals in the top row, reconstructions below.

  Args:
    path: output .png path.
    originals: [M, S, S, 3] float in [0, 1].
    reconstructions: [M, S, S, 3] float in [0, 1].
  """
  m, s = originals.shape[:2]
  gap = 2
  canvas = np.ones((2 * s + gap, m * (s + gap) - gap, 3), np.float32)
  for i in range(m):
    c = i * (s + gap)
    canvas[:s, c:c + s] = originals[i]
    canvas[s + gap:, c:c + s] = reconstructions[i]
  image = Image.fromarray(np.rint(np.clip(canvas, 0.0, 1.0) * 255).astype(np.uint8))
  with errors.atomic_path(path) as tmp:
    image.save(tmp, format='PNG')


TASK = train.Task(
    name='tokenizer',
    build_model=build_model,
    init_params=init_params,
    init_model_state=init_model_state,
    load_constants=load_constants,
    loss_fn=loss_fn,
    make_optimizer=make_optimizer,
    evaluate=evaluate,
    restore_init=lambda params, config, workdir: convert_init.restore('tokenizer', params, config),
)
