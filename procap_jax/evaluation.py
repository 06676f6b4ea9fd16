"""Caption metrics exactly as the original evaluates them (pycocoevalcap), breakdowns, files, CLI.

The original (`src/utils.py` `score_generation`) runs pycocoevalcap's `COCOEvalCap` with
`params['image_id'] = <predicted ids>`: PTBTokenizer on references and hypotheses, then
corpus-level BLEU-1..4 (`closest` reference length), METEOR 1.5, ROUGE-L and pycocoevalcap's
`Cider` (the CIDEr-D formulation; its document frequencies come from the references of the ids
being scored, so every group is re-scored on its own ids, as the original re-runs `evaluate`).
We call the same scorer classes on the same inputs, with three practical changes that do not
change any score (the Java side is `java_scorers`):

* the PTB tokenizer jar is run by our own wrapper (same jar, flags and punctuation filter) that
  tokenises references and hypotheses in one Java call, keeps Java's chatter off the console,
  writes its temporary file to the system temp dir rather than into site-packages, and turns
  exotic line breaks (\\r, U+2028, ...) into spaces so lines cannot shift between captions;
* one METEOR Java process (about 10 s to start) serves all groups of a call;
* SPICE is optional: it needs Stanford CoreNLP 3.6.0, which pycocoevalcap downloads on first
  use. We never download: without the jar, SPICE is reported as `None` with a note (checked once
  per process, at no cost). Per-group SPICE is the mean of per-id scores, as SPICE computes it.

Empty captions are scored, not rejected, because the original scores them and real data has
them: the Spot-the-Diff test references (the file CLIP4IDC and ProCap evaluate with) give 7 ids a
single empty caption, and a weak model may decode `[EOS]` first (an empty prediction). Each call
notes how many there were. Wrong types (a caption that is not a string, references that are not
a list), predicted ids without references and an empty prediction set are user errors.

CLI: `python -m procap_jax.evaluation --results R.json --references G.json [--out M.json]
[--no-meteor] [--no-spice] [--types T.json] [--clevr]`.
"""

import argparse
import json
import os
import re
from typing import Iterable, Mapping, Sequence

import numpy as np
from pycocoevalcap.bleu import bleu
from pycocoevalcap.cider import cider
from pycocoevalcap.rouge import rouge

from procap_jax import errors
from procap_jax import java_scorers

RESERVED_NAMES = ('all', 'notes')
_METRIC_ORDER = ('CIDEr', 'Bleu_4', 'METEOR', 'ROUGE_L', 'SPICE', 'Bleu_1', 'Bleu_2', 'Bleu_3')


# ---------------------------------------------------------------------------------------------
# Scoring.


def score_captions(predictions: Mapping[str, str], references: Mapping[str, Sequence[str]],
                   groups: Mapping[str, Iterable[str]] | None = None, use_meteor: bool = True,
                   use_spice: bool = True) -> dict:
  """Scores one caption per id against its references, overall and per group.

  Args:
    predictions: id -> generated caption; only these ids are scored.
    references: id -> reference captions (a superset of the predicted ids is fine).
    groups: optional name -> ids (e.g. change types, `clevr_groups(...)`); each is scored on its
      ids that have a prediction; groups with none are left out (with a note).
    use_meteor: compute METEOR (about 10 s of Java start-up per call).
    use_spice: report SPICE (`None` with a note when Stanford CoreNLP is not installed).

  Returns:
    `{'all': {'Bleu_1'..'Bleu_4', 'METEOR', 'ROUGE_L', 'CIDEr', 'SPICE': float}, '<group>': {...}}`
    plus `'notes': [str]` when something was not computed. Metrics left out by the flags are
    absent; all values are in [0, 1] except CIDEr (up to 10).
  """
  ids = _validate(predictions, references, groups)
  group_ids = {'all': ids}
  notes = []
  empty_predictions = sum(not predictions[i].strip() for i in ids)
  if empty_predictions:
    notes.append(f'{empty_predictions} predictions are empty and were scored as empty captions')
  empty_references = sum(not any(r.strip() for r in references[i]) for i in ids)
  if empty_references:
    notes.append(f'{empty_references} scored ids have only empty reference captions (scored as '
                 'the original does)')
  for name, members in (groups or {}).items():
    members = set(members)
    subset = [i for i in ids if i in members]
    if subset:
      group_ids[name] = subset
    else:
      notes.append(f'group {name!r} has no predicted ids and was not scored')

  lines = java_scorers.ptb_tokenize([predictions[i] for i in ids] +
                                    [c for i in ids for c in references[i]])
  res, gts, pos = {}, {}, len(ids)
  for n, i in enumerate(ids):
    res[i] = [lines[n]]
    gts[i] = lines[pos:pos + len(references[i])]
    pos += len(references[i])

  spice_per_id = None
  if use_spice:
    spice_per_id, note = java_scorers.spice_scores(gts, res)
    if note:
      notes.append(note)
  meteor_scorer = java_scorers.start_meteor() if use_meteor else None
  try:
    results = {}
    for name, subset in group_ids.items():
      g = {i: gts[i] for i in subset}
      r = {i: res[i] for i in subset}
      scores = {}
      bleus, _ = bleu.Bleu(4).compute_score(g, r, verbose=0)
      for n, value in enumerate(bleus):
        scores[f'Bleu_{n + 1}'] = float(value)
      if meteor_scorer is not None:
        scores['METEOR'] = float(meteor_scorer.compute_score(g, r)[0])
      scores['ROUGE_L'] = float(rouge.Rouge().compute_score(g, r)[0])
      scores['CIDEr'] = float(cider.Cider().compute_score(g, r)[0])
      if use_spice:
        scores['SPICE'] = (None if spice_per_id is None else
                           float(np.mean([spice_per_id[i] for i in subset])))
      results[name] = scores
  finally:
    if meteor_scorer is not None:
      java_scorers.stop_meteor(meteor_scorer)
  if groups and 'change' in group_ids and 'no_change' in group_ids:
    results['all']['change_decision'] = change_decision(
        predictions, references, group_ids['change'], group_ids['no_change'])
  if notes:
    results['notes'] = notes
  return results


def _normalised(caption: str) -> str:
  return ' '.join(re.sub(r'[^a-z0-9 ]', ' ', caption.lower()).split())


def change_decision(predictions: Mapping[str, str], references: Mapping[str, Sequence[str]],
                    change_ids: Iterable[str], no_change_ids: Iterable[str]) -> float:
  """How often the captions get "changed or not" right: a prediction says "no change" when it is
  (up to case, punctuation and spacing) one of the reference sentences of the no-change pairs
  (CLEVR-Change's and the synthetic benchmark's few no-change templates), and is right when
  that agrees with its pair's group. Returns the fraction of `change_ids` + `no_change_ids`
  decided right (0.5 for a captioner that always or never says "no change" on balanced groups).
  """
  change_ids, no_change_ids = list(change_ids), list(no_change_ids)
  templates = {_normalised(r) for i in no_change_ids for r in references[i] if r.strip()}
  says_none = lambda i: _normalised(predictions[i]) in templates
  right = sum(not says_none(i) for i in change_ids) + sum(says_none(i) for i in no_change_ids)
  return right / max(1, len(change_ids) + len(no_change_ids))


def flat_metrics(scores: dict) -> dict[str, float]:
  """{'all': {...}, group: {...}} -> {'CIDEr': .., 'change/CIDEr': ..} (numbers only)."""
  out = {}
  for group, metrics in scores.items():
    if not isinstance(metrics, dict):
      continue  # 'notes'
    names = sorted(metrics, key=lambda n: (_METRIC_ORDER + (n,)).index(n))
    for name in names:
      value = metrics[name]
      if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        out[name if group == 'all' else f'{group}/{name}'] = float(value)
  return out


def clevr_groups(ids: Iterable[str]) -> dict[str, list[str]]:
  """CLEVR-Change breakdown of the original: `change` (ids `...c`) and `no_change` (`...nc`).

  Together with `'all'` (the "total" score the original logs and selects on) these are its three
  scorings. As in `src/evaluate.py`, every id not ending in `nc` counts as a change.
  """
  ids = list(ids)
  return {'change': [i for i in ids if not i.endswith('nc')],
          'no_change': [i for i in ids if i.endswith('nc')]}


def type_groups(type_mapping: Mapping[str, Iterable[str]],
                ids: Iterable[str]) -> dict[str, list[str]]:
  """Resolves a type file (type name -> ids) against the predicted ids.

  An entry matches a predicted id directly or, failing that, by the original's CLEVR rule
  (`'000123.png'` -> `'000123c'`, `utils.py` `score_generation_by_type`), so the CLEVR-Change
  `type_mapping.json` works as is. Entries matching no prediction are dropped.
  """
  known = set(ids)
  out = {}
  for name, entries in type_mapping.items():
    resolved = []
    for entry in entries:
      entry = str(entry)
      if entry not in known:
        entry = entry.split('.')[0] + 'c'
      if entry in known:
        resolved.append(entry)
    out[str(name)] = resolved
  return out


def _validate(predictions, references, groups) -> list[str]:
  """Checks the inputs; returns the predicted ids in reference order."""
  if not isinstance(predictions, Mapping) or not predictions:
    raise errors.UserError('there are no predictions to score; pass at least one id -> caption')
  if not isinstance(references, Mapping):
    raise errors.UserError('references must map each id to a list of captions, got '
                           f'{type(references).__name__}')
  missing = [i for i in predictions if i not in references]
  if missing:
    shown = ', '.join(repr(i) for i in missing[:3])
    raise errors.UserError(f'{len(missing)} of {len(predictions)} predicted ids have no references '
                           f'(e.g. {shown}); score against the reference file of the same split')
  for i, caption in predictions.items():
    if not isinstance(caption, str):
      raise errors.UserError(f'the prediction for id {i!r} is {_describe(caption)}; every '
                             'prediction must be a caption string')
  for i in predictions:
    refs = references[i]
    if isinstance(refs, str) or not isinstance(refs, Sequence) or not refs:
      raise errors.UserError(f'the references of id {i!r} are {_describe(refs)}; give a '
                             'non-empty list of caption strings per id')
    bad = [r for r in refs if not isinstance(r, str)]
    if bad:
      raise errors.UserError(f'a reference of id {i!r} is {_describe(bad[0])}; references '
                             'must be caption strings')
  if groups is not None:
    if not isinstance(groups, Mapping):
      raise errors.UserError(f'groups must map a name to a list of ids, got {_describe(groups)}')
    for name, members in groups.items():
      if not isinstance(name, str) or name in RESERVED_NAMES:
        raise errors.UserError(f'{name!r} cannot name a group; use a string other than '
                               f'{" / ".join(RESERVED_NAMES)}')
      if isinstance(members, str) or not isinstance(members, Iterable):
        raise errors.UserError(f'group {name!r} must be a list of ids, got {_describe(members)}')
  wanted = set(predictions)
  return [i for i in references if i in wanted]  # the reference file's order, as COCO's


def _describe(value) -> str:
  if isinstance(value, str):
    return 'empty' if not value.strip() else repr(value[:40])
  text = repr(value)
  return f'{type(value).__name__} {text if len(text) <= 40 else text[:37] + "..."}'


# ---------------------------------------------------------------------------------------------
# COCO-format files.


def write_results(path: str, predictions: Mapping[str, str]) -> None:
  """Writes `[{"image_id": id, "caption": c}, ...]` (the COCO results format), atomically."""
  entries = [{'image_id': i, 'caption': c} for i, c in predictions.items()]
  errors.write_text_atomic(os.fspath(path), json.dumps(entries, indent=1) + '\n')


def read_results(path: str) -> dict[str, str]:
  """Reads a COCO results file (or the original's `{"results": {id: [{"sentence"}]}}`).

  Ids are returned as strings.
  """
  data = _read_json(path, 'results')
  if isinstance(data, dict) and isinstance(data.get('results'), dict):
    out = {}
    for i, entries in data['results'].items():
      if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        raise errors.UserError(f'results file {path} has no sentence for id {i!r}')
      out[str(i)] = entries[0].get('sentence')
    return out
  if not isinstance(data, list):
    raise errors.UserError(f'results file {path} is not a list of {{"image_id", "caption"}} '
                           'entries; write it with write_results')
  out = {}
  for n, entry in enumerate(data):
    if not isinstance(entry, dict) or 'image_id' not in entry or 'caption' not in entry:
      raise errors.UserError(f'entry {n} of results file {path} lacks "image_id" or "caption"; '
                             'each entry must have both')
    i = str(entry['image_id'])
    if i in out:
      raise errors.UserError(f'results file {path} has two captions for id {i!r}; keep one '
                             'caption per id')
    out[i] = entry['caption']
  return out


def read_references(path: str) -> dict[str, list[str]]:
  """Reads a COCO caption reference file: `{"annotations": [{"image_id", "caption"}], ...}`.

  Ids are returned as strings; captions keep the file's order (empty ones included).
  """
  data = _read_json(path, 'reference')
  if not isinstance(data, dict) or not isinstance(data.get('annotations'), list):
    raise errors.UserError(f'reference file {path} has no "annotations" list; expected the COCO '
                           'caption format')
  out = {}
  for n, ann in enumerate(data['annotations']):
    if not isinstance(ann, dict) or 'image_id' not in ann or not isinstance(
        ann.get('caption'), str):
      raise errors.UserError(f'annotation {n} of reference file {path} lacks an "image_id" or a '
                             'string "caption"; fix or regenerate the file')
    out.setdefault(str(ann['image_id']), []).append(ann['caption'])
  if not out:
    raise errors.UserError(f'reference file {path} has no annotations; use a non-empty file')
  return out


def write_references(path: str, references: Mapping[str, Sequence[str]]) -> None:
  """Writes references in the COCO caption format `read_references` (and pycocotools) read."""
  images, annotations = [], []
  for i, captions in references.items():
    images.append({'id': i, 'file_name': i})
    for caption in captions:
      annotations.append({'image_id': i, 'caption': caption, 'id': len(annotations)})
  data = {'info': {'description': 'procap-jax references'}, 'licenses': [], 'type': 'captions',
          'images': images, 'annotations': annotations}
  errors.write_text_atomic(os.fspath(path), json.dumps(data, indent=1) + '\n')


def _read_json(path: str, what: str):
  path = os.fspath(path)
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except FileNotFoundError:
    raise errors.UserError(f'{what} file {path} does not exist; check the path') from None
  except json.JSONDecodeError as e:
    message = e.msg.removesuffix(' at')  # 'Unterminated string starting at' + ' at line 1'
    raise errors.UserError(f'{what} file {path} is not valid JSON ({message} at line {e.lineno} '
                           f'column {e.colno}); '
                           'check that it was written completely') from None
  except (OSError, UnicodeDecodeError) as e:
    raise errors.UserError(f'cannot read {what} file {path} ({e}); check the file') from None


# ---------------------------------------------------------------------------------------------
# CLI.


@errors.exit_on_user_error
def main(argv: Sequence[str] | None = None) -> dict:
  """Scores a results file against a reference file; prints (and optionally writes) metrics."""
  parser = argparse.ArgumentParser(
      prog='python -m procap_jax.evaluation',
      description='Scores generated captions with pycocoevalcap as the original ProCap does.')
  parser.add_argument('--results', required=True, help='COCO results JSON (image_id, caption)')
  parser.add_argument('--references', required=True, help='COCO caption reference JSON')
  parser.add_argument('--out', help='write the metrics JSON here (atomically)')
  parser.add_argument('--types', help='JSON object: group name -> list of ids (the CLEVR-Change '
                      'type_mapping.json works as is)')
  parser.add_argument('--clevr', action='store_true', help='add change / no_change groups')
  parser.add_argument('--no-meteor', action='store_true', help='skip METEOR (saves ~10 s)')
  parser.add_argument('--no-spice', action='store_true', help='skip SPICE')
  args = parser.parse_args(argv)
  predictions = read_results(args.results)
  references = read_references(args.references)
  groups = {}
  if args.clevr:
    groups.update(clevr_groups(predictions))
  if args.types:
    mapping = _read_json(args.types, 'types')
    if not isinstance(mapping, dict) or not all(isinstance(v, list) for v in mapping.values()):
      raise errors.UserError(f'types file {args.types} must be a JSON object mapping each group '
                             'name to a list of ids')
    groups.update(type_groups(mapping, predictions))
  metrics = score_captions(predictions, references, groups or None,
                           use_meteor=not args.no_meteor, use_spice=not args.no_spice)
  unscored = [i for i in references if i not in predictions]
  if unscored:  # a results file of part of the split: scored, but said so
    metrics.setdefault('notes', []).append(
        f'{len(unscored)} of the {len(references)} reference ids have no prediction (e.g. '
        f'{unscored[0]!r}); the scores are over the {len(predictions)} predicted ids only')
  text = json.dumps(metrics, indent=2)
  if args.out:
    errors.write_text_atomic(args.out, text + '\n')
  print(text)
  return metrics


if __name__ == '__main__':
  main()
