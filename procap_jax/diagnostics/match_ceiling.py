r"""What stage 1's caption matching can reach on the synthetic benchmark, by what a model knows.

  python -m procap_jax.diagnostics.match_ceiling         # the `small` benchmark's train scenes
  python -m procap_jax.diagnostics.match_ceiling --scenes 500 --draws 5000

L_align pairs a clip with its own caption (positive) and with another sample's caption
(negative); half the samples are no-change distractors with "nothing has changed" captions.
This regenerates the scenes (no rendering) and scores decision rules that know the scenes
perfectly but use only part of what the captions say:

  colour        match iff an object of the caption's colour is in the before or after scene
                (a coin for a no-change caption)
  phrase        the same with the full phrase: size, colour, material and shape
  kind          match iff the caption and the clip agree on change / no change
  kind+colour, kind+phrase  both conditions

Each positive and each negative is one decision (chance 50 %), as `match_acc` counts them;
negatives take a uniformly random other sample, as the shuffled training batches do. One JSON
line per rule: {rule, accuracy, decisions}.
"""

import argparse

import numpy as np

from procap_jax.diagnostics import records
from tfds_builders.synthetic_change import captions
from tfds_builders.synthetic_change import scene

FULL = ('size', 'color', 'material', 'shape')
RULES = ('colour', 'phrase', 'kind', 'kind+colour', 'kind+phrase')


def _present(pair: scene.Pair, obj: scene.Object, attrs: tuple[str, ...]) -> bool:
  return any(all(getattr(x, a) == getattr(obj, a) for a in attrs)
             for x in pair.objects + pair.after_objects())


def decide(rule: str, clip: scene.Pair, caption_of: scene.Pair, coin: bool) -> bool:
  """Whether `rule` says the caption of `caption_of` describes `clip`."""
  named = captions.subject(caption_of)
  attrs = ('color',) if rule.endswith('colour') else FULL
  if rule in ('colour', 'phrase'):
    return coin if named is None else _present(clip, named, attrs)
  same_kind = (named is None) == (clip.change_type == 'none')
  if rule == 'kind':
    return same_kind
  return same_kind and (named is None or _present(clip, named, attrs))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--scenes', type=int, default=1500, help='train scenes (2 pairs each)')
  parser.add_argument('--draws', type=int, default=20000, help='samples per rule')
  parser.add_argument('--seed', type=int, default=0, help="the benchmark's seed")
  args = parser.parse_args()
  pairs = [p for i in range(args.scenes) for p in scene.sample_pairs(args.seed, 'train', i)]
  for rule in RULES:
    rng = np.random.default_rng(0)
    right = []
    for _ in range(args.draws):
      i, j = rng.choice(len(pairs), size=2, replace=False)
      right.append(decide(rule, pairs[i], pairs[i], bool(rng.random() < 0.5)))
      right.append(not decide(rule, pairs[i], pairs[j], bool(rng.random() < 0.5)))
    records.emit({'rule': rule, 'accuracy': float(np.mean(right)), 'decisions': len(right)})


if __name__ == '__main__':
  main()
