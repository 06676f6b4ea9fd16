r"""Where a stage-1 step's time goes: the frozen tokenizer's encode and the encoder's backward.

  python -m bench.step_parts --config configs/clevr_change.py:paper              # batch 8
  python -m bench.step_parts --config configs/clevr_change.py:paper --batch 2 \
      --variants plain,scan,chunk,both

Times, in this process, with random weights and inputs:

  tokenizer   one `encode_features` call on the 4 B frames of a stage-1 batch (a step makes
              three such calls: clean features, clean codes, corrupted features);
  encoder     forward + backward of the procedure encoder at the fused batch 3B (the three
              forwards of a step as one call), for each `--variants` entry:
              plain (no memory switch), scan (`scan_blocks`), chunk (`attention_chunk=128`),
              both. FLOPs always come from the plain compile (XLA counts a loop body once).

One JSON line per part: seconds (best of `--repeats`), GFLOP, and utilisation = FLOP/s over the
matmul peak of the same precision measured in this process.
"""

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench import train_step as bench_step
from procap_jax import hostmem
from procap_jax.diagnostics import stand_ins
from procap_jax.tasks import pretrain

VARIANTS = {'plain': (False, 0), 'scan': (True, 0), 'chunk': (False, 128), 'both': (True, 128)}


def _best(fn, repeats: int) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return min(times)


def _config(spec: str, dtype: str, variant: str):
  config = bench_step.load_config(spec)
  config.compute_dtype = dtype
  config.pretrain.model.scan_blocks, config.pretrain.model.attention_chunk = VARIANTS[variant]
  bench_step.fill_vocab_sizes(config)
  return config


def tokenizer_part(spec: str, batch: int, dtype: str, repeats: int, peak: float) -> dict:
  config = _config(spec, dtype, 'plain')
  tokenizer = pretrain.vqgan_tokenizer(config)
  params = jax.device_put(stand_ins.random_tokenizer(config))
  s, t = config.data.image_size, config.data.num_keyframes + 2
  images = jnp.asarray(np.random.default_rng(0).random((batch * t, s, s, 3), np.float32))
  compiled = jax.jit(tokenizer.encode_features).lower(params, images).compile()
  flops = common.compiled_flops(compiled)
  sec = _best(lambda: compiled(params, images), repeats)
  return {'part': 'tokenizer encode_features', 'images': batch * t, 's': sec,
          'gflop': flops / 1e9, 'util': flops / sec / peak}


def encoder_parts(spec: str, batch: int, dtype: str, repeats: int, peak: float,
                  variants: list[str]) -> list[dict]:
  plain = pretrain.build_model(_config(spec, dtype, 'plain'))
  b = 3 * batch
  gh, gw = plain.grid
  rng = np.random.default_rng(0)
  feats = jnp.asarray(rng.standard_normal((b, plain.num_frames, gh, gw, plain.feature_dim)),
                      jnp.float32)
  text = jnp.asarray(rng.integers(1, 80, (b, plain.text_len)), jnp.int32)
  mask = jnp.asarray(rng.random((b, plain.num_frames, gh * gw)) < 0.8)
  params = jax.jit(lambda: nn.meta.unbox(plain.init(
      jax.random.key(0), text[:1], feats[:1], mask[:1], use_rel=True)['params']))()

  def compiled_grad(model):
    def loss(p):
      out = model.apply({'params': p}, text, feats, mask, use_rel=True)
      return (jnp.mean(out['frame_logits'] ** 2) + jnp.sum(out['rel_logit'])
              + jnp.sum(out['vid_logit']))
    return jax.jit(jax.grad(loss)).lower(params).compile()

  flops = common.compiled_flops(compiled_grad(plain))
  records = []
  for variant in variants:
    model = plain if variant == 'plain' else pretrain.build_model(_config(spec, dtype, variant))
    compiled = compiled_grad(model)
    sec = _best(lambda c=compiled: c(params), repeats)
    records.append({'part': 'encoder forward+backward', 'variant': variant, 'batch': b, 's': sec,
                    'gflop': flops / 1e9, 'util': flops / sec / peak})
  return records


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/clevr_change.py:paper')
  parser.add_argument('--batch', type=int, default=8, help='stage-1 batch (encoder sees 3x)')
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  parser.add_argument('--variants', default='both', help=f'comma-separated of {list(VARIANTS)}')
  parser.add_argument('--repeats', type=int, default=2)
  args = parser.parse_args()
  variants = [v for v in args.variants.split(',') if v]
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    parser.error(f'unknown variants {unknown}; choose from {list(VARIANTS)}')
  peak = common.matmul_peak_flops(args.dtype)
  base = {'bench': 'step_parts', 'config': args.config, 'dtype': args.dtype,
          'matmul_peak_gflops': peak / 1e9}
  common.emit({**base, **tokenizer_part(args.config, args.batch, args.dtype, args.repeats, peak)})
  for record in encoder_parts(args.config, args.batch, args.dtype, args.repeats, peak, variants):
    common.emit({**base, **record})
  common.emit({**base, 'part': 'process', 'peak_rss_gib': common.peak_rss_gib()})


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
