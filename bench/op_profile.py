r"""Where a train step's or an encode's time goes, op by op: one call traced and summed.

  python -m bench.op_profile --config configs/clevr_change.py:paper --stage caption --batch 8 \
      --dtype bfloat16 --feature_cache on --set caption.train.micro_batches=4
  python -m bench.op_profile --config configs/clevr_change.py:paper --part encode --images 8

`--part step` (default) compiles the stage's train step as `bench.train_step` prepares it (random
weights and batch); `--part encode` the frozen tokenizer's `encode_features` of `--images`
random images in `--frozen_dtype`. Then: `--warmup` calls, `--rounds` timed calls with the
process's CPU use (CPU seconds of all its threads over wall seconds; 2.0 = both of 2 cores busy
throughout), and one call under `jax.profiler.trace`, whose XLA ops are summed. Ops are the
trace's events named after an instruction of the compiled module, innermost ones only (a
loop's own event holds its body's ops and is not counted again); their names without the
instance number are their `kind` (`ynn_fusion`: a YNNPACK fusion, i.e. a product with what it
fused; `copy_bitcast_fusion`: mostly transposing copies; `wrapped_broadcast`: a buffer filled
with a constant).

One JSON line each (`batch`: the step's batch, or the number of images):
  - `total`: the timed calls' seconds (`step_s` their median, `step_times`), CPU use, the
    traced call's seconds, the summed op seconds and `concurrency`: seconds with 0, 1, 2 and 3
    or more ops running at once (XLA runs independent ops side by side on its threads; an op
    that shares the cores runs slower on its own clock);
  - `kind`: summed seconds and calls per op kind, the largest `--top`;
  - `scope`: summed seconds per model scope (the op's metadata path without jit, loop and
    checkpoint wrappers, cut to `--scope_depth` parts; `bwd:` in front for the backward pass
    JAX derives; a custom VJP's backward, such as the grouped attention's, keeps its forward's
    scope);
  - `op`: the `--top` largest single ops (summed over their calls) with shape and scope.
The trace costs a little time of its own (the traced call is slower than the timed ones).
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax
import numpy as np

from bench import common
from bench import train_step as bench_step
from procap_jax import hostmem

# Metadata path parts that only say how an op was reached.
_WRAPPERS = {'while', 'body', 'closed_call', 'checkpoint', 'remat', 'cond', 'branch_0',
             'branch_1', 'rematted_computation'}


def _step_call(args):
  """(call() -> output, compiled HLO text, batch size) for a stage's train step; the state
  threads through the calls (the step donates it)."""
  _, batch_size, compiled, state, batch, constants, rng, _ = bench_step.compile_step(
      args.config, args.stage, args.batch, args.dtype, args.set, args.feature_cache == 'on')
  box = [state]

  def call():
    out = jax.block_until_ready(compiled(box[0], batch, constants, rng))
    box[0] = out[0]
    return out

  return call, compiled.as_text(), batch_size


def _encode_call(args):
  """(call() -> features, compiled HLO text, images) for the frozen tokenizer's encode."""
  from procap_jax.diagnostics import stand_ins
  from procap_jax.models import vqgan
  config = bench_step.load_config(args.config, args.set)
  params = stand_ins.random_tokenizer(config)
  side = int(config.tokenizer.model.resolution)
  images = jax.random.uniform(jax.random.key(0), (args.images, side, side, 3))
  fn = jax.jit(vqgan.frozen(config.tokenizer.model, args.frozen_dtype).encode_features)
  compiled = fn.lower(params, images).compile()
  return (lambda: jax.block_until_ready(compiled(params, images))), compiled.as_text(), args.images


def hlo_ops(text: str) -> dict[str, tuple[str, str]]:
  """Op name -> (result shape, metadata op_name) from a compiled module's text."""
  ops = {}
  for line in text.splitlines():
    m = re.match(r'\s*(?:ROOT )?%(\S+) = (.+?) [\w-]+\(', line)
    if m:
      meta = re.search(r'op_name="([^"]+)"', line)
      ops[m.group(1)] = (m.group(2).split('{')[0], meta.group(1) if meta else '')
  return ops


def scope(op_name: str, depth: int) -> str:
  """'jit(step)/while/body/transpose(jvp(M))/M/enc/block_3/mlp/dot_general' -> 'bwd:M/enc/block_3'
  at depth 3: wrappers and the primitive dropped, the backward marked."""
  if not op_name:
    return '(no metadata)'
  parts = op_name.split('/')[1:-1]  # without jit(...) and the primitive
  backward = any(p.startswith('transpose(') for p in parts)
  kept = [p for p in parts if p not in _WRAPPERS and '(' not in p]
  return ('bwd:' if backward else '') + ('/'.join(kept[:depth]) or '(top level)')


def leaf_ops(events: list[dict], op_names: set[str]) -> list[dict]:
  """The complete events named after an op of the compiled module that hold no other such
  event of their thread (a loop's event holds its body's ops)."""
  by_thread = collections.defaultdict(list)
  for e in events:
    if e.get('ph') == 'X' and 'dur' in e and e.get('name') in op_names:
      by_thread[(e.get('pid'), e.get('tid'))].append(e)
  leaves = []
  for evs in by_thread.values():
    evs.sort(key=lambda e: (e['ts'], -e['dur']))
    stack, parent = [], set()
    for e in evs:
      while stack and stack[-1]['ts'] + stack[-1]['dur'] <= e['ts']:
        stack.pop()
      if stack:
        parent.add(id(stack[-1]))
      stack.append(e)
    leaves.extend(e for e in evs if id(e) not in parent)
  return leaves


def concurrency(ops: list[dict]) -> dict[str, float]:
  """Seconds with 0, 1, 2 and 3+ ops running, from the first op's start to the last's end."""
  edges = sorted([(e['ts'], 1) for e in ops] + [(e['ts'] + e['dur'], -1) for e in ops])
  spans = collections.Counter()
  running, last = 0, edges[0][0] if edges else 0.0
  for t, step in edges:
    spans[min(running, 3)] += t - last
    running, last = running + step, t
  return {('3+' if k == 3 else str(k)): spans[k] / 1e6 for k in range(4)}


def profile(call, op_names: set[str], warmup: int, rounds: int) -> tuple[dict, list[dict]]:
  """(timing record, leaf op events of one traced call)."""
  common.time_all(call, warmup=warmup, repeats=0)
  c0 = os.times()
  walls = common.time_all(call, warmup=0, repeats=rounds)
  c1 = os.times()
  cpu = (c1.user - c0.user) + (c1.system - c0.system)
  with tempfile.TemporaryDirectory() as folder:
    t0 = time.perf_counter()
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      call()
    traced = time.perf_counter() - t0
    paths = glob.glob(os.path.join(folder, '**', '*.trace.json.gz'), recursive=True)
    if not paths:
      raise SystemExit('error: jax.profiler wrote no trace file')
    with gzip.open(paths[0]) as f:
      data = json.load(f)
  events = data['traceEvents'] if isinstance(data, dict) else data
  ops = leaf_ops(events, op_names)
  record = {'step_s': float(np.median(walls)) if walls else None,
            'step_times': [round(w, 3) for w in walls],
            'cpu_use': float(cpu / sum(walls)) if walls else None,
            'traced_s': traced}
  return record, ops


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default='configs/clevr_change.py:paper')
  parser.add_argument('--part', choices=('step', 'encode'), default='step')
  parser.add_argument('--stage', choices=bench_step.STAGES, default='caption')
  parser.add_argument('--batch', type=int, default=None)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='bfloat16')
  parser.add_argument('--feature_cache', choices=('off', 'on'), default='off')
  parser.add_argument('--images', type=int, default=8)
  parser.add_argument('--frozen_dtype', choices=('float32', 'bfloat16'), default='bfloat16')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                      help='config override, e.g. --set caption.train.micro_batches=4')
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--top', type=int, default=25)
  parser.add_argument('--scope_depth', type=int, default=4)
  args = parser.parse_args()

  call, hlo_text, batch = (_step_call if args.part == 'step' else _encode_call)(args)
  names = hlo_ops(hlo_text)
  record, ops = profile(call, set(names), args.warmup, args.rounds)
  what = ({'part': 'step', 'stage': args.stage, 'dtype': args.dtype,
           'feature_cache': args.feature_cache == 'on'} if args.part == 'step'
          else {'part': 'encode', 'frozen_dtype': args.frozen_dtype})
  base = {'bench': 'op_profile', 'config': args.config, 'batch': batch, **what,
          'overrides': args.set or None}

  per_op = collections.Counter()
  calls = collections.Counter()
  for e in ops:
    per_op[e['name']] += e['dur'] / 1e6
    calls[e['name']] += 1
  kinds, kind_calls = collections.Counter(), collections.Counter()
  scopes = collections.Counter()
  for name, seconds in per_op.items():
    kind = re.sub(r'\.\d+$', '', name)
    kinds[kind] += seconds
    kind_calls[kind] += calls[name]
    scopes[scope(names.get(name, ('', ''))[1], args.scope_depth)] += seconds

  common.emit({**base, 'record': 'total', **record, 'ops_s': float(sum(per_op.values())),
               'op_calls': len(ops), 'concurrency': concurrency(ops),
               'peak_rss_gib': common.peak_rss_gib()})
  for kind, seconds in kinds.most_common(args.top):
    common.emit({**base, 'record': 'kind', 'kind': kind, 'seconds': seconds,
                 'calls': kind_calls[kind]})
  for where, seconds in scopes.most_common(args.top):
    common.emit({**base, 'record': 'scope', 'scope': where, 'seconds': seconds})
  for name, seconds in per_op.most_common(args.top):
    shape, op_name = names.get(name, ('', ''))
    common.emit({**base, 'record': 'op', 'op': name, 'seconds': seconds, 'calls': calls[name],
                 'shape': shape, 'scope': scope(op_name, args.scope_depth)})


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
