r"""Do XLA:CPU flags speed up a train step? Each flag set against none, alternating, one machine.

  python -m bench.xla_flags --config configs/synthetic.py --stage pretrain --steps 4 --rounds 3
  python -m bench.xla_flags --stage caption --flags 'onednn=--xla_cpu_use_onednn=true'

XLA reads its flags once per process, so every measurement is a fresh process
(`python -m bench.train_step --in_process`, the step as training compiles it, with the tokenizer
feature cache as the synthetic presets use it) with `XLA_FLAGS` set; the flag sets run in turns,
baseline first, round after round, so a changing machine load hits them alike. Prints one JSON
line per measurement, then one per flag set: the median over rounds of (its step time / the same
round's baseline step time), below 1 = faster, and whether its loss matched the baseline's.

A flag this XLA build does not know makes the child fail; that set is reported with its error
and the others go on.
"""

import argparse
import os

import numpy as np

from bench import common

# name -> XLA_FLAGS value. Found in this jaxlib's XLA:CPU flag list; none is on by default here.
FLAG_SETS = {
    'onednn': '--xla_cpu_use_onednn=true',
    'xnnpack': '--xla_cpu_use_xnnpack=true',
    'vector512': '--xla_cpu_prefer_vector_width=512',
    'concurrency_sched': '--xla_cpu_enable_concurrency_optimized_scheduler=true',
}


def parse_flag_sets(items: list[str]) -> dict[str, str]:
  """['name=--flag=value --flag2=v', ...] -> {name: flags}; [] -> FLAG_SETS."""
  if not items:
    return dict(FLAG_SETS)
  out = {}
  for item in items:
    name, sep, flags = item.partition('=')
    if not sep or not name or not flags.startswith('--'):
      raise SystemExit(f"error: --flags {item!r} is not 'name=--xla_flag=value ...'")
    out[name] = flags
  return out


def summarise(records: list[dict], names: list[str]) -> list[dict]:
  """Per flag set: median over rounds of step_s / the round's baseline step_s."""
  base = {r['round']: r for r in records if r['flags_name'] == 'baseline' and 'step_s' in r}
  out = []
  for name in names:
    mine = [r for r in records if r['flags_name'] == name]
    errors = [r['error'] for r in mine if 'error' in r]
    ratios = [r['step_s'] / base[r['round']]['step_s'] for r in mine
              if 'step_s' in r and r['round'] in base]
    compared = [abs(r['loss'] - base[r['round']]['loss']) <= 1e-3 * max(
        1.0, abs(base[r['round']]['loss'])) for r in mine if 'loss' in r and r['round'] in base]
    losses_match = all(compared) if compared else None
    out.append({'bench': 'xla_flags', 'flags_name': name, 'rounds': len(ratios),
                'step_over_baseline': float(np.median(ratios)) if ratios else None,
                'per_round': [round(x, 3) for x in ratios], 'loss_matches': losses_match,
                **({'error': errors[0]} if errors else {})})
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/synthetic.py')
  parser.add_argument('--stage', default='pretrain', choices=('tokenizer', 'pretrain', 'caption'))
  parser.add_argument('--steps', type=int, default=4, help='timed steps per measurement')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--batch', type=int, default=None)
  parser.add_argument('--flags', action='append', default=[], metavar='NAME=FLAGS',
                      help='a flag set to try (repeatable); default: ' + ', '.join(FLAG_SETS))
  args = parser.parse_args()
  sets = parse_flag_sets(args.flags)
  child = ['--config', args.config, '--stage', args.stage, '--steps', str(args.steps),
           '--in_process', *(['--batch', str(args.batch)] if args.batch else []),
           *(['--feature_cache', 'on'] if args.stage != 'tokenizer' else [])]
  inherited = os.environ.get('XLA_FLAGS', '')
  records = []
  for round_ in range(args.rounds):
    for name, flags in [('baseline', '')] + list(sets.items()):
      env = {'XLA_FLAGS': ' '.join(f for f in (inherited, flags) if f)}
      for record in common.run_child('bench.train_step', child, env=env):
        record = dict(record, round=round_, flags_name=name, xla_flags=flags,
                      load=[round(x, 2) for x in os.getloadavg()])
        records.append(record)
        common.emit(record)
  for record in summarise(records, list(sets)):
    common.emit(record)


if __name__ == '__main__':
  main()
