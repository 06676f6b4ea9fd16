r"""Why a stage-1 binary head ranks better than it decides: its raw logits on a run's splits.

  python -m procap_jax.diagnostics.head_logits --workdir W        # W: a run whose stage 1 finished
  python -m procap_jax.diagnostics.head_logits --workdir W --split test --threshold-split val \
      --which latest

Dimension legend: B batch, M samples of a split.

Runs stage 1's own evaluation forwards (`pretrain.batch_logits`: the same batches, order, masks
and corruptions as the logged validation and test metrics) with the chosen checkpoint and
prints one JSON line per head, `match` ([REL]: own caption vs the swapped one) and `csy`
([VID]: clean clip vs its corrupted copy), measured on `--split`:

  acc_at_0              the logged accuracy: each positive and each negative is one decision
  acc_at_threshold      the same with the threshold that is best on `--threshold-split` (never
                        chosen on `--split` itself; equal splits are refused)
  threshold             that threshold
  auc                   ROC AUC of all positives against all negatives (threshold-free)
  rank_acc              the logged `*_rank_acc`: a sample's positive above its own negative
  pos_mean/std, neg_mean/std   the logits' statistics over the split
  pos_neg_corr          correlation over samples of a sample's positive and negative logit: near
                        1 when the logit is mostly a per-clip offset that the pair shares, which
                        ranking cancels and a threshold cannot

and for `csy` per corruption kind (`corruptions.KINDS`): its count, rank_acc and the share of
its negatives below 0.

If acc_at_threshold is close to acc_at_0 while rank_acc is much higher, the gap is not a
misplaced threshold but per-clip variation of the logit that is larger than the effect of the
corruption (or of the swapped caption).
"""

import argparse
import functools
import os

import jax
import numpy as np
from scipy import stats

from procap_jax import caption as caption_cli
from procap_jax import checkpointing
from procap_jax import errors
from procap_jax.diagnostics import records
from procap_jax.tasks import corruptions
from procap_jax.tasks import pretrain

HEADS = (('match', 'rel_pos', 'rel_neg'), ('csy', 'vid_pos', 'vid_neg'))


def split_logits(config, workdir: str, params, split: str, batches: int = 0) -> dict:
  """{rel_pos, rel_neg, vid_pos, vid_neg: float [M], corruption: int [M]} of the valid rows
  of `split`, with the keys `pretrain.evaluate_batches` uses for each batch index."""
  model = pretrain.build_model(config)
  tokenizer = pretrain.vqgan_tokenizer(config)
  tokenizer_params = pretrain.load_constants(config, workdir)['tokenizer']
  forward = jax.jit(functools.partial(pretrain.batch_logits, config=config, model=model,
                                      tokenizer=tokenizer))
  keys = ('rel_pos', 'rel_neg', 'vid_pos', 'vid_neg', 'corruption')
  out = {k: [] for k in keys}
  for i, batch in enumerate(pretrain.eval_batches(config, split, workdir, batches)):
    rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), i)
    res = forward(params, tokenizer_params,
                  {k: batch[k] for k in ('keyframes', 'encoder_text', 'valid')}, rng)
    valid = np.asarray(batch['valid'], bool)
    for k in keys:
      out[k].append(np.asarray(res[k])[valid])
  if not out['rel_pos']:
    raise errors.UserError(f'the {split} split has no batches')
  return {k: np.concatenate(v) for k, v in out.items()}


def best_threshold(pos: np.ndarray, neg: np.ndarray) -> float:
  """The threshold (a logit is positive when above it) with the highest accuracy over the
  decisions pos (label 1) and neg (label 0); the midpoint between neighbouring scores."""
  scores = np.unique(np.concatenate([pos, neg]))
  candidates = np.concatenate([[scores[0] - 1.0], (scores[1:] + scores[:-1]) / 2,
                               [scores[-1] + 1.0]])
  acc = [np.mean(pos > c) + np.mean(neg <= c) for c in candidates]
  return float(candidates[int(np.argmax(acc))])


def rank_acc(pos: np.ndarray, neg: np.ndarray) -> float:
  """Share of samples whose positive scores above its own negative, ties to within rounding
  counting half: the logged metric's rule (`pretrain.rank_credit`)."""
  return float(np.mean(pretrain.rank_credit(pos, neg)))


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """ROC AUC of `scores` [M] for bool `labels` [M] (Mann-Whitney, ties count half); 0.5 when
  one class is absent."""
  pos, neg = scores[labels], scores[~labels]
  if not len(pos) or not len(neg):
    return 0.5
  ranks = stats.rankdata(np.concatenate([pos, neg]))  # average ranks for ties
  return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def summary(pos: np.ndarray, neg: np.ndarray, threshold: float) -> dict:
  """The per-head record (see the module docstring) of logits pos, neg [M]."""
  corr = np.corrcoef(pos, neg)[0, 1] if pos.std() > 0 and neg.std() > 0 else float('nan')
  return dict(
      samples=int(len(pos)),
      acc_at_0=float((np.mean(pos > 0) + np.mean(neg < 0)) / 2),
      acc_at_threshold=float((np.mean(pos > threshold) + np.mean(neg <= threshold)) / 2),
      threshold=threshold,
      auc=roc_auc(np.concatenate([pos, neg]), np.arange(len(pos) + len(neg)) < len(pos)),
      rank_acc=rank_acc(pos, neg),
      pos_mean=float(pos.mean()), pos_std=float(pos.std()),
      neg_mean=float(neg.mean()), neg_std=float(neg.std()), pos_neg_corr=float(corr))


def by_corruption(pos: np.ndarray, neg: np.ndarray, kind: np.ndarray) -> dict:
  """{kind name: {count, rank_acc, neg_below_0}} over the corruption kinds present."""
  out = {}
  for i, name in enumerate(corruptions.KINDS):
    sel = kind == i
    if sel.any():
      p, n = pos[sel], neg[sel]
      out[name] = dict(count=int(sel.sum()), rank_acc=rank_acc(p, n),
                       neg_below_0=float(np.mean(n < 0)))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True, help='a run whose stage 1 finished')
  parser.add_argument('--split', default='test', help='the split measured')
  parser.add_argument('--threshold-split', default='val', help='the split choosing thresholds')
  parser.add_argument('--which', default='best', choices=('best', 'latest'),
                      help='the stage-1 checkpoint')
  parser.add_argument('--batches', type=int, default=0, help='batches per split (0 = all)')
  args = parser.parse_args()
  if args.split == args.threshold_split:
    raise SystemExit('error: --threshold-split must differ from --split (a threshold chosen on '
                     'the measured split is not a result)')
  if not os.path.exists(os.path.join(args.workdir, 'config.json')):
    raise SystemExit(f'error: {args.workdir} holds no config.json; pass the workdir of a run')
  config = caption_cli.load_run_config(args.workdir)
  try:
    params = checkpointing.load_stage_variables(args.workdir, 'pretrain', args.which)['params']
    chooser = split_logits(config, args.workdir, params, args.threshold_split, args.batches)
    measured = split_logits(config, args.workdir, params, args.split, args.batches)
  except errors.UserError as e:
    raise SystemExit(f'error: {e}') from None
  for head, pos_key, neg_key in HEADS:
    threshold = best_threshold(chooser[pos_key], chooser[neg_key])
    record = {'measure': 'head_logits', 'head': head, 'split': args.split,
              'threshold_split': args.threshold_split, 'checkpoint': args.which,
              **summary(measured[pos_key], measured[neg_key], threshold)}
    if head == 'csy':
      record['by_corruption'] = by_corruption(measured[pos_key], measured[neg_key],
                                              measured['corruption'])
    records.emit(record)


if __name__ == '__main__':
  main()
