r"""What a masked-token accuracy is worth: the tokenizer's code statistics on a run's keyframes.

  python -m procap_jax.diagnostics.code_statistics --workdir W     # W: a run with a tokenizer
  python -m procap_jax.diagnostics.code_statistics --workdir W --split test --batches 0

Dimension legend: B batch, T frames, h x w tokenizer grid, K codebook size.

Encodes the keyframe clips [B, T, S, S, 3] of `--split` (stage 1's evaluation order and batch)
with the run's frozen tokenizer into codes [B, T, h*w] and prints one JSON line:

  most_frequent_code_acc  the masked-token accuracy of always predicting the code most frequent
                          on the train split (train is read for `--train-batches` batches); the
                          floor stage 1's msm accuracy should beat
  perplexity, usage       exp entropy of the split's code histogram, share of the K codes used
  keep_before_after       share of grid positions whose code is the same in the before (t = 0)
                          and after (t = T-1) frames: how stable codes are under the pair's
                          viewpoint jitter and illumination change
  keep_adjacent           the same for neighbouring frames (t, t + 1)
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from procap_jax import caption as caption_cli
from procap_jax import errors
from procap_jax.diagnostics import records
from procap_jax.models import encodings
from procap_jax.tasks import pretrain
from procap_jax.tasks import tokenizer


def clip_encoder(config, workdir: str):
  """The run's frozen tokenizer as a jitted function: keyframes uint8 [B, T, S, S, 3] -> codes
  [B, T, h*w]."""
  tokenizer = pretrain.vqgan_tokenizer(config)
  params = pretrain.load_constants(config, workdir)['tokenizer']
  encode = jax.jit(lambda p, f: encodings.encode_clips(tokenizer.encode_tokens, p,
                                                      encodings.images01(f)))
  return lambda keyframes: np.asarray(encode(params, jnp.asarray(keyframes)))


def clip_codes(encode, config, workdir: str, split: str, num_batches: int) -> np.ndarray:
  """Codes [M, T, h*w] of the split's keyframe clips (`num_batches` 0 = the whole split)."""
  out = []
  for batch in pretrain.eval_batches(config, split, workdir, num_batches):
    out.append(encode(batch['keyframes'])[np.asarray(batch['valid'], bool)])  # pad rows dropped
  if not out:
    raise errors.UserError(f'the {split} split has no clips')
  return np.concatenate(out)


def statistics(codes: np.ndarray, train_codes: np.ndarray, codebook_size: int) -> dict:
  """The record's measures from codes [M, T, N] of the split and of train."""
  train_counts = np.bincount(train_codes.ravel(), minlength=codebook_size)
  counts = np.bincount(codes.ravel(), minlength=codebook_size)
  usage, perplexity = tokenizer.usage_stats(counts)
  return {
      'clips': int(len(codes)),
      'tokens': int(codes.size),
      'most_frequent_code_acc': float(counts[int(np.argmax(train_counts))] / counts.sum()),
      'perplexity': perplexity,
      'usage': usage,
      'keep_before_after': float(np.mean(codes[:, 0] == codes[:, -1])),
      'keep_adjacent': float(np.mean(codes[:, 1:] == codes[:, :-1])),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True, help='a run whose tokenizer stage finished')
  parser.add_argument('--split', default='val')
  parser.add_argument('--batches', type=int, default=0, help='batches of the split (0 = all)')
  parser.add_argument('--train-batches', type=int, default=50,
                      help='train batches that pick the most frequent code')
  args = parser.parse_args()
  if not os.path.exists(os.path.join(args.workdir, 'config.json')):
    raise SystemExit(f'error: {args.workdir} holds no config.json; pass the workdir of a run')
  config = caption_cli.load_run_config(args.workdir)
  try:
    encode = clip_encoder(config, args.workdir)
    codes = clip_codes(encode, config, args.workdir, args.split, args.batches)
    train_codes = clip_codes(encode, config, args.workdir, 'train', args.train_batches)
  except errors.UserError as e:
    raise SystemExit(f'error: {e}') from None
  record = statistics(codes, train_codes, int(config.tokenizer.model.n_embed))
  records.emit({'measure': 'code_statistics', 'split': args.split, **record})


if __name__ == '__main__':
  main()
