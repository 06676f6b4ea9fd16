r"""Where the stage-2 decoder looks: its cross-attention over the memory's frame slots.

  python -m procap_jax.diagnostics.memory_attention --workdir W [--split val] [--which best]
  (W: a ProCap run with a caption stage, with or without procedure queries)

Dimension legend: B batch, L caption length, T frame slots (before, the k procedure
queries, after), N = h * w tokens per frame, M = T * N memory slots.

Each pair's first reference caption is fed teacher-forced; the decoder's cross-attention
weights (heads x L x M a pair) are averaged over heads and the caption's positions ([BOS] and
its words; padding skipped). Prints one JSON line (`records.emit`) per decoder layer and one for
all layers together:
  frames        the share of attention on each frame slot: before, query_1 .. query_k, after
                (sums to 1)
  object        on the change pairs whose changed object has a box (`change_params`): the share
                on the token cells its box overlaps, in the frame it is in (the before box in the
                before frame, the after box in the after frame)
  object_in_queries  the share on the same cells (of either box) in the procedure-query frames
  ..._uniform   those cells' share of the M slots: what attention spread evenly would give
The split's pairs are read in record order (`pipeline.make_eval_iterator`), so runs of the same
dataset are measured on the same pairs.
"""

import argparse
import sys

import flax.linen as nn
import jax
import numpy as np

from procap_jax import caption as caption_cli
from procap_jax import checkpointing
from procap_jax import errors
from procap_jax import token_ids
from procap_jax.data import pipeline
from procap_jax.diagnostics import records
from procap_jax.models import captioner as captioner_lib
from procap_jax.models import encodings
from procap_jax.tasks import caption as caption_task


def box_cells(box: list[float] | None, grid: tuple[int, int]) -> np.ndarray:
  """bool [h, w]: the token cells a box [x0, y0, x1, y1] in [0, 1] image coordinates overlaps
  (all False for None)."""
  h, w = grid
  cells = np.zeros([h, w], bool)
  if box is None:
    return cells
  x0, y0, x1, y1 = (min(max(v, 0.0), 1.0) for v in box)
  rows = range(min(int(y0 * h), h - 1), min(int(np.ceil(y1 * h)), h))
  cols = range(min(int(x0 * w), w - 1), min(int(np.ceil(x1 * w)), w))
  for r in rows:
    cells[r, list(cols)] = True
  return cells


def object_slots(params: dict, grid: tuple[int, int], frames: int) -> np.ndarray:
  """bool [2, T * N]: the changed object's cells (none for a no-change pair). Row 0: its before
  box in frame 0 and its after box in frame T - 1; row 1: the cells of either box in each
  procedure-query frame 1 .. T - 2 (the queries sit on the same grid)."""
  h, w = grid
  before = box_cells(params.get('bbox_before'), grid).ravel()
  after = box_cells(params.get('bbox_after'), grid).ravel()
  slots = np.zeros([2, frames, h * w], bool)
  slots[0, 0], slots[0, -1] = before, after
  slots[1, 1:-1] = before | after
  return slots.reshape(2, -1)


def _layer_order(path: tuple[str, ...]) -> tuple:
  """Sorts 'blocks_10' after 'blocks_9'."""
  return tuple(int(p.rsplit('_', 1)[1]) if p.rsplit('_', 1)[-1].isdigit() else p for p in path)


def cross_attention(intermediates: dict) -> list[np.ndarray]:
  """The sown cross-attention weights of each decoder layer, in layer order, averaged over the
  heads: [B, L, M] each."""
  found = []

  def walk(tree, path):
    for key in sorted(tree):
      if isinstance(tree[key], dict):
        walk(tree[key], path + (key,))
      elif key == 'attention_weights' and 'cross_attn' in path:
        found.append((path, np.asarray(tree[key][0]).mean(axis=1)))

  walk(intermediates, ())
  if not found:
    raise errors.UserError('the decoder sowed no cross-attention weights: this run is not a '
                           'ProCap captioner (DUDA has no decoder memory of frame slots)')
  return [w for _, w in sorted(found, key=lambda item: _layer_order(item[0]))]


def summarise(weights: np.ndarray, positions: np.ndarray, objects: np.ndarray,
              frames: int) -> dict:
  """Shares of one layer's (or the layers' mean) weights.

  Args:
    weights: [B, L, M] cross-attention weights (averaged over heads).
    positions: bool [B, L], the caption positions that count.
    objects: bool [B, 2, M], the changed object's slots in before and after, and in the query
      frames (`object_slots`; a pair without any is skipped).
    frames: T.
  """
  count = positions.sum(axis=1, keepdims=True)  # [B, 1]
  per_pair = (weights * positions[..., None]).sum(axis=1) / np.maximum(count, 1)  # [B, M]
  by_frame = per_pair.reshape(per_pair.shape[0], frames, -1).sum(axis=2).mean(axis=0)  # [T]
  names = ['before'] + [f'query_{i + 1}' for i in range(frames - 2)] + ['after']
  out = {'frames': {n: round(float(v), 4) for n, v in zip(names, by_frame)}}
  has = objects[:, 0].any(axis=1)
  if has.any():
    for key, row in (('object', 0), ('object_in_queries', 1)):
      if row == 1 and frames == 2:
        continue
      out[key] = round(float((per_pair * objects[:, row]).sum(axis=1)[has].mean()), 4)
      out[key + '_uniform'] = round(float(objects[:, row].mean(axis=1)[has].mean()), 4)
    out['object_pairs'] = int(has.sum())
  return out


@errors.exit_on_user_error
def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--split', default='val')
  parser.add_argument('--which', default='best', choices=('best', 'latest'))
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--batches', type=int, default=0, help='0 = the whole split')
  args = parser.parse_args(argv)
  config = caption_cli.load_run_config(args.workdir)
  model = caption_task.build_model(config)
  if not isinstance(model, captioner_lib.ProCapModel):
    raise errors.UserError(f'{args.workdir} is not a ProCap captioner run (its captioner has no '
                           'decoder memory of frame slots)')
  tokenizer = caption_task.vqgan_tokenizer(config)
  tok_params = checkpointing.load_stage_variables(args.workdir, 'tokenizer')['params']
  params = nn.meta.unbox(
      checkpointing.load_stage_variables(args.workdir, 'caption', args.which)['params'])
  src = pipeline.open_source(config, args.workdir, args.split)

  @jax.jit
  def weights_of(params, tok_params, before, after, tokens):
    fb, fa = encodings.pair_features(tokenizer, tok_params, {'before': before, 'after': after})
    _, state = model.apply({'params': params}, fb, fa, tokens, mutable=['intermediates'])
    return state['intermediates']

  batches, positions, objects = [], [], []
  grid = tuple(config.pretrain.model.grid)
  for batch in pipeline.make_eval_iterator(config, args.split, args.workdir, args.batch,
                                           num_batches=args.batches):
    keep = np.asarray(batch['valid'], bool)
    tokens = np.asarray(batch['caption_in'])
    state = weights_of(params, tok_params, batch['before'], batch['after'], tokens)
    weights = [w[keep] for w in cross_attention(state)]  # each layer's [B, L, M]
    frames = weights[0].shape[-1] // (grid[0] * grid[1])  # T frame slots of N (`encode` decides)
    batches.append(weights)
    positions.append((tokens != token_ids.PAD)[keep])
    for i in np.asarray(batch['example_index'])[keep]:
      objects.append(object_slots(pipeline.change_params(src[int(i)]), grid, frames))
  if not batches:
    raise errors.UserError(f'the {args.split} split of {args.workdir} has no pairs')
  layers = [np.concatenate(per_layer) for per_layer in zip(*batches)]
  positions, objects = np.concatenate(positions), np.stack(objects)
  common = {'measurement': 'memory_attention', 'workdir': args.workdir, 'split': args.split,
            'pairs': int(len(positions))}
  for i, w in enumerate(layers):
    records.emit({**common, 'layer': i, **summarise(w, positions, objects, frames)})
  records.emit({**common, 'layer': 'mean',
                **summarise(np.mean(layers, axis=0), positions, objects, frames)})


if __name__ == '__main__':
  main(sys.argv[1:])
