r"""Semantic scores on the synthetic change benchmark: what a caption says, against the truth.

  python -m procap_jax.semantic_scores --workdir W --split test       # a finished run's captions
  python -m procap_jax.semantic_scores --data_dir D --split test      # reference rows, and how
      # many of the split's references the grammar reads back as their pair's truth

The benchmark's captions come from a small grammar (`tfds_builders/synthetic_change/captions.py`:
a few no-change sentences and, per change type, templates around the changed object's phrase
"the <size> <colour> <material> <shape>" and, for colour and material, the new value). `parse`
reads a caption back with that grammar into a `Reading` (type, the attributes it names, the new
value); `truth_of` reads a pair's truth from the dataset's stored `change_params`. The object
phrase is read leniently: any non-empty set of attribute words, each attribute at most once, in
any order, so a caption naming only "the red sphere" is read and judged on colour and shape.
A caption that fits no template is "unread": it claims a change (as `evaluation.change_decision`
counts it) of no readable type.

Scores (fractions in [0, 1]; `score` returns them as `semantic/<name>` over all pairs and
`semantic/<type>/<name>` over the pairs of one true change type):

  decision      change / no-change said right (a caption says "no change" iff it reads as one
                of the no-change sentences), over all pairs
  type          the change type right, over change pairs
  attributes    a change described naming at least one attribute of the changed object, every
                named attribute right, over change pairs
  size, color, material, shape   that attribute right, over the change pairs whose caption
                names it (absent when none does)
  names_all     the caption names all four attributes, over change pairs
  new_value     type and new value right, over colour and material change pairs
  parsed        the caption fits the grammar, over all pairs
  right, missed_change, invented_change, wrong_type, wrong_object, wrong_value
                the pairs of each error class (`error_class`), over all pairs

The changed object is the object before the change (the added object for add), as the
references name it. `reference_rows` scores captioners that know nothing of the images
(constant sentences) and one written from the truth, with the same scorers, on the same pairs.
"""

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
from typing import Iterable, Mapping

from procap_jax import config_lib
from procap_jax import errors
from procap_jax import evaluation
from procap_jax.data import pipeline
from tfds_builders.synthetic_change import captions as captions_lib
from tfds_builders.synthetic_change import scene
from tfds_builders.synthetic_change import synthetic_change_dataset_builder as builder_lib

DATASET = 'synthetic_change'
NONE = 'none'
CHANGE_TYPES = scene.CHANGE_TYPES  # color, material, add, drop, move
ATTRIBUTES = ('size', 'color', 'material', 'shape')
WORDS = {'size': scene.SIZES, 'color': tuple(scene.COLORS), 'material': scene.MATERIALS,
         'shape': scene.SHAPES}
NEW_VALUES = {'color': WORDS['color'], 'material': WORDS['material']}  # types with a new value
ERROR_CLASSES = ('right', 'missed_change', 'invented_change', 'wrong_type', 'wrong_object',
                 'wrong_value')
NO_CHANGE_SENTENCE = 'the scene is the same as before'
_ATTRIBUTE_OF = {w: a for a, words in WORDS.items() for w in words}


@dataclasses.dataclass(frozen=True)
class Reading:
  """What a caption says: `type` is 'none', a change type, or None (fits no template, or a
  colour/material template whose new value is neither); `object` maps each attribute the
  caption names to the word it uses; `new` is the new value of a colour/material template."""
  type: str | None
  object: Mapping[str, str] = dataclasses.field(default_factory=dict)
  new: str | None = None


@dataclasses.dataclass(frozen=True)
class Truth:
  """What happened in a pair: `type` ('none' or a change type), the changed object's four
  attributes (empty for none), the new colour or material (None for other types)."""
  type: str
  object: Mapping[str, str] = dataclasses.field(default_factory=dict)
  new: str | None = None


def normalise(caption: str) -> str:
  """Lower case, anything but letters and digits as a space, single spaces."""
  return ' '.join(re.sub(r'[^a-z0-9]', ' ', caption.lower()).split())


def _compile(template: str) -> re.Pattern:
  parts = re.split(r'(\{\w+\})', template.replace('{obj}', 'the {what}'))
  fields = {'{what}': r'(?P<what>[a-z0-9]+(?: [a-z0-9]+)*?)', '{new}': r'(?P<new>[a-z0-9]+)'}
  return re.compile(''.join(fields.get(p, re.escape(p)) for p in parts))


_PATTERNS = tuple((kind, _compile(t)) for kind, templates in captions_lib.TEMPLATES.items()
                  for t in templates)


def _phrase(text: str) -> dict[str, str] | None:
  """An object phrase's attributes, or None when a word is no attribute or one repeats."""
  named = {}
  for word in text.split():
    attribute = _ATTRIBUTE_OF.get(word)
    if attribute is None or attribute in named:
      return None
    named[attribute] = word
  return named


def parse(caption: str) -> Reading | None:
  """Reads a caption with the benchmark's grammar; None when it fits no template."""
  text = normalise(caption)
  found = set()
  for kind, pattern in _PATTERNS:
    m = pattern.fullmatch(text)
    if m is None:
      continue
    groups = m.groupdict()
    named = _phrase(groups['what']) if 'what' in groups else {}
    if named is not None:
      found.add((kind, tuple(sorted(named.items())), groups.get('new')))
  if not found:
    return None
  if len({kind for kind, _, _ in found}) > 1:  # a template colour and material share
    found = {f for f in found if f[0] in NEW_VALUES and f[2] in NEW_VALUES[f[0]]}
    if len({kind for kind, _, _ in found}) != 1:
      _, named, new = min(found, key=repr) if found else (None, (), None)
      return Reading(None, dict(named), new)
  kind, named, new = min(found, key=repr)  # one reading, whatever the set's order
  return Reading(kind, dict(named), new)


def truth_of(change_params: Mapping) -> Truth:
  """A pair's truth from its dataset record's `change_params` (decoded JSON)."""
  if not isinstance(change_params, Mapping) or change_params.get('type') not in (
      (NONE,) + CHANGE_TYPES):
    raise errors.UserError('a record has no change truth (change_params without a type); '
                           'semantic scores exist for the synthetic_change benchmark only')
  kind = change_params['type']
  if kind == NONE:
    return Truth(NONE)
  obj = {a: change_params['object'][a] for a in ATTRIBUTES}
  return Truth(kind, obj, change_params['to'] if kind in NEW_VALUES else None)


def write(truth: Truth) -> str:
  """The caption of `truth` in the first template of its type (the template oracle)."""
  if truth.type == NONE:
    return captions_lib.TEMPLATES[NONE][0]
  what = ' '.join(truth.object[a] for a in ATTRIBUTES)
  return captions_lib.TEMPLATES[truth.type][0].format(obj=f'the {what}', what=what,
                                                      new=truth.new or '')


def object_right(reading: Reading, truth: Truth) -> bool:
  """The reading names at least one attribute, and each as the truth's object has it."""
  return bool(reading.object) and all(truth.object.get(a) == w for a, w in reading.object.items())


def error_class(reading: Reading | None, truth: Truth) -> str:
  """One of ERROR_CLASSES, the first that applies: a no-change pair is right or an invented
  change; a change pair read as no change is a missed change; then wrong type (unread captions
  included), wrong object (a named attribute wrong, or none named), wrong new value, right."""
  says = reading.type if reading is not None else None
  if truth.type == NONE:
    return 'right' if says == NONE else 'invented_change'
  if says == NONE:
    return 'missed_change'
  if says != truth.type:
    return 'wrong_type'
  if not object_right(reading, truth):
    return 'wrong_object'
  if truth.new is not None and reading.new != truth.new:
    return 'wrong_value'
  return 'right'


def _mean(flags: Iterable[bool]) -> float | None:
  flags = list(flags)
  return sum(map(bool, flags)) / len(flags) if flags else None


def _group_scores(rows: list[tuple[Reading | None, Truth, str]]) -> dict[str, float]:
  """The scores (module docstring) of (reading, truth, error class) rows; undefined ones absent."""
  says = lambda r: r.type if r is not None else None
  out = {'decision': _mean((says(r) == NONE) == (t.type == NONE) for r, t, _ in rows),
         'parsed': _mean(r is not None for r, _, _ in rows)}
  change = [(r or Reading(None), t) for r, t, _ in rows if t.type != NONE]
  if change:
    out['type'] = _mean(r.type == t.type for r, t in change)
    described = [(r, t) for r, t in change if r.type != NONE]
    out['attributes'] = _mean(r.type != NONE and object_right(r, t) for r, t in change)
    for a in ATTRIBUTES:
      named = [(r, t) for r, t in described if a in r.object]
      if named:
        out[a] = _mean(r.object[a] == t.object[a] for r, t in named)
    out['names_all'] = _mean(r.type != NONE and len(r.object) == len(ATTRIBUTES)
                             for r, t in change)
    valued = [(r, t) for r, t in change if t.new is not None]
    if valued:
      out['new_value'] = _mean(r.type == t.type and r.new == t.new for r, t in valued)
  counts = collections.Counter(c for _, _, c in rows)
  out.update({c: counts[c] / len(rows) for c in ERROR_CLASSES})
  return {k: float(v) for k, v in out.items() if v is not None}


def score(predictions: Mapping[str, str],
          truths: Mapping[str, Truth]) -> tuple[dict[str, float], dict[str, str]]:
  """Semantic scores of `predictions` (id -> caption) against `truths` (id -> Truth).

  Returns:
    (flat metrics `semantic/<name>` and `semantic/<type>/<name>`, id -> error class).

  Raises:
    UserError: no predictions, or a predicted id without a truth.
  """
  if not predictions:
    raise errors.UserError('there are no predictions to score; pass at least one id -> caption')
  missing = [i for i in predictions if i not in truths]
  if missing:
    raise errors.UserError(f'{len(missing)} predicted ids have no truth (e.g. {missing[0]!r}); '
                           'score against the split the predictions were made on')
  rows, classes = {}, {}
  for i, caption in predictions.items():
    reading = parse(caption) if isinstance(caption, str) else None
    classes[i] = error_class(reading, truths[i])
    rows[i] = (reading, truths[i], classes[i])
  out = {f'semantic/{k}': v for k, v in _group_scores(list(rows.values())).items()}
  for kind in (NONE,) + CHANGE_TYPES:
    members = [row for row in rows.values() if row[1].type == kind]
    if members:
      out.update({f'semantic/{kind}/{k}': v for k, v in _group_scores(members).items()})
  return out, classes


def applies(config) -> bool:
  """Whether the run's dataset is the synthetic benchmark (the only one with this grammar)."""
  return config.data.name == DATASET


def split_truths(info: list[dict]) -> dict[str, Truth]:
  """pair_id -> Truth of `pipeline.load_split_info` records."""
  return {rec['pair_id']: truth_of(rec['change_params']) for rec in info}


def references_read_back(info: list[dict]) -> dict[str, int]:
  """{'references': how many the split's records hold, 'read_back': how many `parse` reads as
  exactly their pair's truth (type, the four attributes, the new value)}."""
  total = right = 0
  for rec in info:
    truth = truth_of(rec['change_params'])
    for caption in rec['captions']:
      reading = parse(caption)
      total += 1
      right += reading is not None and (reading.type, dict(reading.object), reading.new) == (
          truth.type, dict(truth.object), truth.new)
  return {'references': total, 'read_back': right}


def most_frequent_change_sentence(info: list[dict], ids: Iterable[str] | None = None) -> str:
  """The reference sentence of the change pairs that occurs most often (alphabetically first
  among equals), counted over every reference of the pairs `ids` (None: all)."""
  kept = None if ids is None else set(ids)
  counts = collections.Counter(
      normalise(c) for rec in info if kept is None or rec['pair_id'] in kept
      if truth_of(rec['change_params']).type != NONE for c in rec['captions'])
  if not counts:
    raise errors.UserError('the split has no change pairs; reference rows need some')
  return min(counts, key=lambda s: (-counts[s], s))


def reference_rows(info: list[dict], ids: Iterable[str] | None = None) -> dict[str, dict]:
  """Captioners that need no model, scored on the pairs `ids` (None: all) of a split.

  Rows: `no_change_constant` ("the scene is the same as before" for every pair),
  `change_constant` (the most frequent change sentence for every pair),
  `decision_and_change_constant` (the no-change sentence on no-change pairs, that change
  sentence on change pairs: a perfect decision), `template_oracle` (`write(truth)`: the
  ceiling). Each: {'captioner': what it writes, 'metrics': BLEU, ROUGE-L, CIDEr overall and per
  group (`change`, `no_change`, each type) and the semantic scores}.
  """
  kept = None if ids is None else set(ids)
  info = [rec for rec in info if kept is None or rec['pair_id'] in kept]
  truths = split_truths(info)
  references = {rec['pair_id']: rec['captions'] for rec in info}
  fixed = most_frequent_change_sentence(info)
  rows = {
      'no_change_constant': (f'"{NO_CHANGE_SENTENCE}" for every pair',
                             lambda t: NO_CHANGE_SENTENCE),
      'change_constant': (f'"{fixed}" (the most frequent change reference) for every pair',
                          lambda t: fixed),
      'decision_and_change_constant': (
          f'perfect decision: "{NO_CHANGE_SENTENCE}" on no-change pairs, "{fixed}" on change '
          'pairs', lambda t: NO_CHANGE_SENTENCE if t.type == NONE else fixed),
      'template_oracle': ('the truth written in the first template of its type (the ceiling)',
                          write),
  }
  out = {}
  for name, (captioner, caption_of) in rows.items():
    predictions = {i: caption_of(t) for i, t in truths.items()}
    scores = evaluation.score_captions(predictions, references,
                                       groups=pipeline.change_groups(info, predictions),
                                       use_meteor=False, use_spice=False)
    metrics = evaluation.flat_metrics(scores)
    metrics.update(score(predictions, truths)[0])
    out[name] = {'captioner': captioner, 'metrics': metrics}
  return out


def _dataset_config(data_dir: str, builder_config: str):
  import ml_collections  # pylint: disable=import-outside-toplevel
  return ml_collections.ConfigDict({'data': {'name': DATASET, 'builder_config': builder_config,
                                             'data_dir': data_dir}})


def rescore(workdir: str, split: str, with_reference_rows: bool = False) -> dict:
  """A finished run's saved predictions of `split` (`caption/predictions_<split>.json`) scored
  again: BLEU, ROUGE-L and CIDEr overall and per group (no METEOR), the semantic scores, the
  pairs per error class, and with `with_reference_rows` the reference rows on the same pairs."""
  config = config_lib.load_run_config(workdir)
  if not applies(config):
    raise errors.UserError(f'the run in {workdir} is on {config.data.name}; semantic scores exist '
                           f'for the {DATASET} benchmark only')
  path = os.path.join(workdir, 'caption', f'predictions_{split}.json')
  if not os.path.isfile(path):
    raise errors.UserError(
        f'{path} does not exist: the run has no saved {split} predictions; make them with '
        f'python -m procap_jax.main --config <the run\'s config> --workdir {workdir} '
        f'--mode evaluate --split {split}')
  predictions = evaluation.read_results(path)
  info = pipeline.load_split_info(config, split, workdir)
  references = {rec['pair_id']: rec['captions'] for rec in info}
  scores = evaluation.score_captions(predictions, references,
                                     groups=pipeline.change_groups(info, predictions),
                                     use_meteor=False, use_spice=False)
  metrics = evaluation.flat_metrics(scores)
  semantic, classes = score(predictions, split_truths(info))
  metrics.update(semantic)
  out = {'workdir': workdir, 'split': split, 'pairs': len(predictions), 'metrics': metrics,
         'error_classes': dict(collections.Counter(classes.values()))}
  if with_reference_rows:
    out['reference_rows'] = reference_rows(info, predictions)
  return out


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m procap_jax.semantic_scores',
      description='Semantic scores of captions on the synthetic change benchmark (JSON).')
  parser.add_argument('--workdir', help='a finished run: rescore its saved predictions')
  parser.add_argument('--data_dir', help='without --workdir: the data directory of a built '
                      'synthetic_change dataset; prints the reference rows of the split')
  parser.add_argument('--dataset_config', default='small',
                      help='with --data_dir: the synthetic_change config (tiny, small, full)')
  parser.add_argument('--split', default='test', help='train, val or test')
  parser.add_argument('--reference_rows', action='store_true',
                      help='with --workdir: add the reference rows on the same pairs')
  return parser


@errors.exit_on_user_error
def main(argv: list[str] | None = None) -> dict:
  args = _parser().parse_args(argv)
  if args.split not in scene.SPLITS:
    raise errors.UserError(f'--split {args.split} is not a split; choose one of '
                           f'{", ".join(scene.SPLITS)}')
  if args.workdir:
    out = rescore(args.workdir, args.split, args.reference_rows)
  elif args.data_dir:
    builder_lib.check_config_name(args.dataset_config)
    info = pipeline.load_split_info(_dataset_config(args.data_dir, args.dataset_config),
                                    args.split, '')
    out = {'dataset': f'{DATASET}/{args.dataset_config}', 'split': args.split,
           'pairs': len(info), **references_read_back(info),
           'reference_rows': reference_rows(info)}
  else:
    raise errors.UserError('give --workdir W (a finished run, to rescore its predictions) or '
                           '--data_dir D (a built synthetic_change dataset, for the reference '
                           'rows)')
  print(json.dumps(out, indent=1))
  return out


if __name__ == '__main__':
  main(sys.argv[1:])
