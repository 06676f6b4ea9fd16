r"""Inference speed: TPS as the paper defines it, captions per second, latency of one pair.

  python -m bench.caption_speed                                   # synthetic default, batch 32
  python -m bench.caption_speed --config configs/clevr_change.py:paper --batch 32 --repeats 2
  python -m bench.caption_speed --config configs/synthetic.py:tiny --batch 8
  python -m bench.caption_speed --config configs/clevr_change.py:paper --batch 32 \
      --dtype bfloat16 --set tokenizer.frozen_dtype=bfloat16 --feature_cache on

TPS (spec section 7): batch x 24 / (time of the encoder plus the greedy decode), i.e. every one
of the 24 caption slots counts as a token; the time covers the tokenizer encoder on the two
frames, the procedure encoder, the memory MLP and the decoding loop. Our greedy decoder uses a
KV cache and stops when every caption has emitted [EOS]; a randomly initialised model rarely
emits [EOS], so these figures are for the full 24 steps, like the original's. Random weights:
speed does not depend on them.

`--scenes` makes rows 2i and 2i + 1 of the batch share their before image, as a CLEVR split read
in record order does (each scene's change pair, then its distractor: the batch is B/2 scenes,
both halves of the original's evaluation of them), so `generate` encodes each before image once
(`encodings.share_before`). The original's TPS times the change half alone (B scenes), so this
is not the row `bench/compare_original.py` compares.

`--feature_cache on` times inference as evaluation runs it on the tokenizer feature cache
(`data.feature_cache`): the batch carries random cached keyframe features, so the tokenizer
encoder does not run and the time covers the captioner alone.

One JSON line: `samples_per_s` = captions/s, `tokens_per_s` = TPS, `latency_one_pair_ms`,
`peak_rss_gib` (this process: run it alone for a per-measurement figure, as `bench.suite` does).
`mfu` is null: XLA's cost analysis counts the decode loop's body once, not per step.
"""

import argparse
import time

import flax.linen as nn
import jax
import numpy as np

from bench import common
from bench import train_step as bench_step
from procap_jax import hostmem
from procap_jax import stages
from procap_jax.diagnostics import stand_ins
from procap_jax.tasks import caption as caption_task


def measure(config_spec: str, batch_size: int, repeats: int, dtype: str,
            overrides: list[str] | tuple[str, ...] = (), feature_cache: bool = False,
            scenes: bool = False) -> dict:
  """Times batched generation and one-pair latency; returns the JSON record. `scenes`: rows
  2i and 2i + 1 share their before image."""
  config = bench_step.load_config(config_spec, overrides)
  config.compute_dtype = dtype
  bench_step.fill_vocab_sizes(config)
  task = stages.TASKS['caption']
  model = task.build_model(config)
  batch = stand_ins.fake_batch(config, batch_size, feature_cache=feature_cache, scenes=scenes)
  params = jax.jit(lambda r: nn.meta.unbox(task.init_params(model, config, r, batch)))(
      jax.random.key(0))
  constants = {'tokenizer': stand_ins.random_tokenizer(config)}

  cached = batch.get('keyframe_features') if feature_cache else None

  def run(rows):
    return caption_task.generate(
        params, constants, config, model, batch['before'][rows], batch['after'][rows],
        keyframe_features=None if cached is None else cached[rows])

  whole, one = slice(None), slice(0, 1)
  t0 = time.perf_counter()
  run(whole)
  compile_s = time.perf_counter() - t0
  times = common.time_all(lambda: run(whole), warmup=0, repeats=repeats)
  sec = float(np.median(times))
  run(one)
  latency = common.time_all(lambda: run(one), warmup=0, repeats=max(3, repeats))
  max_len = int(config.caption.model.max_len)
  return {
      'bench': 'caption_speed', 'config': config_spec, 'dtype': dtype,
      'frozen_dtype': config.tokenizer.frozen_dtype, 'batch': batch_size,
      'overrides': list(overrides) or None, 'feature_cache': feature_cache, 'scenes': scenes,
      'decoding': config.caption.decoding.method, 'batch_s': sec, 'batch_s_best': min(times),
      'samples_per_s': batch_size / sec, 'tokens_per_s': batch_size * max_len / sec,
      'tps': batch_size * max_len / sec, 'captions_per_s': batch_size / sec,
      'latency_one_pair_ms': float(np.median(latency)) * 1000,
      'latency_one_pair_best_ms': min(latency) * 1000, 'first_call_s': compile_s,
      'mfu': None, 'peak_rss_gib': common.peak_rss_gib(),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/synthetic.py')
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE')
  parser.add_argument('--feature_cache', default='off', choices=('off', 'on'),
                      help='on: from random cached keyframe features, no tokenizer encode')
  parser.add_argument('--scenes', action='store_true',
                      help='rows 2i and 2i + 1 share their before image (whole CLEVR scenes)')
  args = parser.parse_args()
  common.emit(measure(args.config, args.batch, args.repeats, args.dtype, args.set,
                      args.feature_cache == 'on', args.scenes))


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
