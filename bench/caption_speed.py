r"""Inference speed: TPS as the paper defines it, captions per second, latency of one pair.

  python -m bench.caption_speed                                   # synthetic default
  python -m bench.caption_speed --config configs/clevr_change.py:paper --batch 32
  python -m bench.caption_speed --config configs/synthetic.py:tiny --batch 8

TPS (spec section 7): batch x 24 / (time of the encoder plus the greedy decode), i.e. every one
of the 24 caption slots counts as a token; the time covers the tokenizer encoder on the two
frames, the procedure encoder, the memory MLP and the decoding loop. Our greedy decoder uses a
KV cache and stops when every caption has emitted [EOS]; a randomly initialised model rarely
emits [EOS], so these figures are for the full 24 steps, like the original's. One JSON line per
configuration. Random weights: speed does not depend on them.
"""

import argparse
import time

import flax.linen as nn
import jax
import numpy as np

from bench import common
from bench import train_step as bench_step
from procap_jax import stages
from procap_jax.tasks import caption as caption_task


def measure(config_spec: str, batch_size: int, repeats: int, dtype: str) -> dict:
  config = bench_step.load_config(config_spec)
  config.compute_dtype = dtype
  config.pretrain.model.text_vocab_size = config.pretrain.model.text_vocab_size or 80
  config.caption.model.vocab_size = config.caption.model.vocab_size or 80
  config.caption.init_from_pretrain = False
  task = stages.TASKS['caption']
  model = task.build_model(config)
  batch = bench_step.fake_batch(config, batch_size)
  params = jax.jit(lambda r: nn.meta.unbox(task.init_params(model, config, r, batch)))(
      jax.random.key(0))
  constants = {'tokenizer': bench_step.random_tokenizer(config)}

  def run(b, a):
    return caption_task.generate(params, constants, config, model, b, a)

  t0 = time.perf_counter()
  run(batch['before'], batch['after'])
  compile_s = time.perf_counter() - t0
  sec = common.time_calls(lambda: run(batch['before'], batch['after']), warmup=0,
                          repeats=repeats)
  one_b, one_a = batch['before'][:1], batch['after'][:1]
  run(one_b, one_a)
  latency = common.time_calls(lambda: run(one_b, one_a), warmup=0, repeats=repeats)
  max_len = int(config.caption.model.max_len)
  return {
      'bench': 'caption_speed', 'config': config_spec, 'dtype': dtype, 'batch': batch_size,
      'decoding': config.caption.decoding.method, 'batch_s': sec,
      'tps': batch_size * max_len / sec, 'captions_per_s': batch_size / sec,
      'latency_one_pair_ms': latency * 1000, 'first_call_s': compile_s,
      'peak_rss_gib': common.peak_rss_gib(),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/synthetic.py')
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  args = parser.parse_args()
  common.emit(measure(args.config, args.batch, args.repeats, args.dtype))


if __name__ == '__main__':
  main()
