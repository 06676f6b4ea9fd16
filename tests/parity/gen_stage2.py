"""Writes the stage-2 parity fixtures with the original's own MMVID_IDC. Run by hand, WITH torch:

  python tests/parity/gen_stage2.py --original ORIG \
      --out tests/parity/fixtures                       # small, committed (~0.9 MB)
  python tests/parity/gen_stage2.py --original ORIG \
      --out P --size paper       # the paper's captioner, not committed

The model is the original's `src.mmvid_idc.MMVID_IDC` built from `config/mmvid_clevr_config.yaml`
with the sizes of `--size` (`SIZES`), from the source tree `--original` (read only), by
bench/original.py (which also sets up train_stage2.py's optimiser), with stand-ins for what the
CPU venv lacks or what is not ours to test:
  - the VQGAN (`get_vae_model`): a frozen stand-in whose `model.encoder` returns given feature
    maps (the frame's index is written in its pixel [0, 0, 0]), with a few `vae.*` tensors in
    the state dict as the real checkpoint has;
  - the CLIP blocks: OpenAI's `ViT-B-32.pt` is not loaded; `clip_model.build_model` returns the
    original's own `Transformer(width, depth, heads)` (its `resblocks` are what stage 2 keeps;
    `original.random_clip`);
  - torchvision, pycocoevalcap, pycocotools and nltk: inert modules (imported, never used here).
Every parameter is random from `--seed`: norms, biases and `image_mask` too (constant-initialised
tensors get N(0, 0.1) added, `image_mask` is N(0, 1)). The text table is replaced by one of
`text_vocab + 25` rows, as train_stage2.py's stage-1 load does (`param.data = ...`, so released
checkpoints hold the stage-1 table of 49,433 rows). Then `--warm-steps` Adam steps on the decoder
(dropout off) teach the model the batch's captions, so greedy decoding emits [EOS] and is far from
ties; these weights are the checkpoint.

Recorded with dropout OFF (model.eval()) everywhere, so every number is deterministic:
  - teacher-forced logits and the summed label-smoothed loss (change + no-change) of a CLEVR-style
    batch (`scenes` change pairs + their no-change pairs), as train_stage2.py computes them;
  - greedy captions as src/translator.py decodes them (24 full passes, [UNK] logits -1e10);
  - the parameters after the optimiser set up exactly as train_stage2.py does (BertAdam, its four
    groups: encoder at lr_finetune 2e-5 / the rest at lr 5e-5, weight decay 0.01 except names
    containing 'bias', warmup_linear with warmup 0.1, global grad clip 1.0). BertAdam's per-
    parameter step counter starts at 0, so its first update has lr 0: we run TWO steps on the same
    batch with t_total = T_TOTAL = 8; the first moves nothing (lr 0, checked) but fills the moments,
    the second has multiplier warmup_linear(1 / 8) = (1 - 0.125) / 0.9.

Files in `--out` (prefix `stage2_<size>`):
  _model.pt      `torch.save({'model': sd, 'model_cfg', 'opt', 'epoch': 0, 'optimizer'})`, the
                 layout of train_stage2.py's checkpoints (`model_cfg` an EasyDict, `opt` an
                 argparse.Namespace holding EasyDicts, `optimizer` a fresh BertAdam's state dict
                 with its schedule objects; fresh, i.e. without moments, to keep the file small).
  _word2idx.json the caption vocabulary (small: 8 specials + 17 words; paper: the official
                 cache/clevr_word2idx.json).
  _after.npz     every `model.named_parameters()` entry after the two steps (torch names).
  _io.npz        before / after [2B, h, w, C] features NHWC (rows: B change pairs, then their B
                 no-change pairs); caption_in, labels [2B, L] int32; logits [2B, L, V]; loss,
                 loss_change, loss_no_change; greedy [2B, L] int32 (raw: the original keeps
                 decoding after [EOS]); greedy_margin [2B] (smallest top-1 minus top-2 logit up
                 to the first [EOS]); lr_multiplier; meta (JSON: sizes, seed, T_TOTAL, the torch
                 name -> (group, requires_grad) table of the optimiser, captions).
Never collected by pytest; tests/parity_stage2_test.py reads the outputs without torch.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import original  # pylint: disable=wrong-import-position

SIZES = {
    'small': dict(width=48, depth=2, heads=4, grid=3, feature_dim=16, codebook=16, text_vocab=8,
                  hidden=32, dec_heads=4, ffn=64, layers=2, scenes=3, warm_steps=80,
                  warm_lr=3e-3),
    'paper': dict(width=768, depth=12, heads=12, grid=14, feature_dim=256, codebook=1024,
                  text_vocab=49408, hidden=512, dec_heads=8, ffn=2048, layers=2, scenes=3,
                  warm_steps=150, warm_lr=1e-3),
}
SMALL_WORDS = ('added', 'been', 'blue', 'change', 'changed', 'cube', 'cylinder', 'has', 'is',
               'large', 'no', 'red', 'removed', 'small', 'sphere', 'the', 'there')
CAPTIONS = (  # scene i: (change caption, no-change caption); 'purple' and '.' are [UNK]
    ('the small red cube has been added', 'no change'),
    ('the large blue sphere has been removed .', 'the scene is the same as before'),
    ('the small purple cylinder has changed', 'there is no change'),
)
LONG_TAIL = ' the large red cube is the small blue sphere'  # one caption over 22 words
MAX_T_LEN, NUM_TARGETS, T_TOTAL = 24, 4, 8
SPECIALS = ('[PAD]', '[CLS]', '[SEP]', '[VID]', '[BOS]', '[EOS]', '[UNK]', '[MASK]')


# ----------------------------------------------------------------------------- stand-ins


class FeatureEncoder(torch.nn.Module):
  """Stands in for the VQGAN encoder: frame k (k in its pixel [0, 0, 0]) -> `table[k]`."""

  def __init__(self):
    super().__init__()
    self.conv_in = torch.nn.Conv2d(3, 4, 1)  # a few `vae.*` tensors, as the real checkpoint
    self.table = None

  def forward(self, images):
    return self.table[images[:, 0, 0, 0].round().long()]  # [b*t, C, h, w]


class StandInVAE(torch.nn.Module):
  """The attributes BERT reads from `VQGanVAE1024` (f16: num_layers 4)."""

  def __init__(self, grid: int, feature_dim: int, codebook: int):
    super().__init__()
    self.model = torch.nn.Module()
    self.model.encoder = FeatureEncoder()
    self.model.quantize = torch.nn.Module()
    self.model.quantize.embedding = torch.nn.Embedding(codebook, feature_dim)
    self.model.quantize.e_dim = feature_dim
    self.num_layers, self.image_size, self.num_tokens = 4, grid * 16, codebook


def _build(original_dir: str, size: dict, vocab_size: int):
  """The original MMVID_IDC at `size`, its config (EasyDict) and the stand-in VAE."""
  cfg = original.stage2_config(original_dir, dict(size, frames=NUM_TARGETS), vocab_size)
  vae = StandInVAE(size['grid'], size['feature_dim'], size['codebook'])
  model = original.mmvid_idc(cfg, vae, size['heads'])
  return model, cfg, vae


def _randomise(model: torch.nn.Module, size: dict) -> None:
  """Noise on constant-initialised tensors; the stage-1-sized text table (see docstring)."""
  gen = model.intermediate_generator
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.startswith('intermediate_generator.vae.'):
        continue
      if name == 'intermediate_generator.image_mask':
        p.copy_(torch.randn_like(p))
      elif p.numel() > 1 and bool((p == p.flatten()[0]).all()):
        p.add_(0.1 * torch.randn_like(p))
    rows = size['text_vocab'] + gen.text_seq_len + 1
    gen.text_emb.weight.data = torch.randn(rows, size['width'])


# ----------------------------------------------------------------------------- batch


def _vocab(original: str, size_name: str) -> dict:
  if size_name == 'paper':
    with open(os.path.join(original, 'cache', 'clevr_word2idx.json')) as f:
      return json.load(f)
  return {w: i for i, w in enumerate(SPECIALS + SMALL_WORDS)}


def _encode(caption: str, word2idx: dict) -> tuple[list[int], list[int]]:
  """(ids, labels) as clevr_dataset.py: [BOS] w1..w22 [EOS] [PAD]..., labels shifted left."""
  words = ['[BOS]'] + caption.lower().split()[:MAX_T_LEN - 2] + ['[EOS]']
  valid = len(words)
  ids = [word2idx.get(w, word2idx['[UNK]']) for w in words] + [0] * (MAX_T_LEN - valid)
  mask = [1] * valid + [0] * (MAX_T_LEN - valid)
  labels = [i if m else -1 for i, m in zip(ids, mask)][1:] + [-1]
  return ids, labels


def _batch(size: dict, word2idx: dict, rng: np.random.Generator) -> dict:
  """`scenes` change pairs then their no-change pairs (the two halves of a CLEVR batch)."""
  b, g, c = size['scenes'], size['grid'], size['feature_dim']
  captions = [list(pair) for pair in CAPTIONS[:b]]
  captions[0][0] = captions[0][0] + LONG_TAIL * 3
  ordered = [pair[0] for pair in captions] + [pair[1] for pair in captions]
  encoded = [_encode(t, word2idx) for t in ordered]
  before = rng.normal(size=(b, g, g, c)).astype(np.float32)
  after_change = before + rng.normal(scale=1.5, size=(b, g, g, c)).astype(np.float32)
  after_same = before + rng.normal(scale=0.1, size=(b, g, g, c)).astype(np.float32)  # distractor
  return dict(before=np.concatenate([before, before]),
              after=np.concatenate([after_change, after_same]),
              caption_in=np.array([e[0] for e in encoded], np.int32),
              labels=np.array([e[1] for e in encoded], np.int32), captions=ordered)


def _clips(batch: dict, vae: StandInVAE) -> torch.Tensor:
  """Clips [2B, 3, T', S, S] whose frames point at the features (2 frames: before, after)."""
  feats = np.stack([batch['before'], batch['after']], 1)  # [2B, 2, h, w, C]
  n = feats.shape[0]
  vae.model.encoder.table = torch.from_numpy(feats.reshape((2 * n,) + feats.shape[2:])).permute(
      0, 3, 1, 2).contiguous()  # [2B*2, C, h, w] in (b t) order
  s = vae.image_size
  clip = torch.zeros(n, 3, 2, s, s)
  clip[:, 0, 0, 0, 0] = torch.arange(n) * 2.0
  clip[:, 0, 1, 0, 0] = torch.arange(n) * 2.0 + 1.0
  return clip


# ----------------------------------------------------------------------------- what we record


def _halves(batch: dict, clip: torch.Tensor):
  """The (clip, video_mask, ids, labels) of the change half and of the no-change half."""
  n = clip.shape[0] // 2
  ids = torch.from_numpy(batch['caption_in']).long()
  labels = torch.from_numpy(batch['labels']).long()
  vmask = torch.ones(2 * n, NUM_TARGETS)
  return [(clip[s], vmask[s], ids[s], labels[s]) for s in (slice(0, n), slice(n, 2 * n))]


def _loss(model, batch, clip) -> tuple[torch.Tensor, list]:
  """train_stage2.train_epoch's CLEVR loss: change loss + no-change loss (text_masks None)."""
  out = [model(c, m, i, None, l) for c, m, i, l in _halves(batch, clip)]
  return out[0][0] + out[1][0], out


def _greedy(model, batch, clip) -> tuple[np.ndarray, np.ndarray]:
  """src/translator.py's greedy decoding per half, and each caption's smallest top-2 margin."""
  from src.translator import Translator  # pylint: disable=import-outside-toplevel
  rows, margins = [], []
  with torch.no_grad():
    for c, m, i, l in _halves(batch, clip):
      ids = Translator.translate_batch_single_sentence_untied_greedy(
          c, m, i, torch.ones_like(i), l, model)
      # The same passes once more to read the margins the decisions were taken with.
      memory = model.encode(c, m)
      _, scores, _ = model.decode(ids, None, l, memory)
      scores[:, :, 6] = -1e10
      top2 = scores.topk(2, dim=-1).values  # [n, L, 2]
      gap = (top2[..., 0] - top2[..., 1]).numpy()
      for row, g in zip(ids.numpy(), gap):
        eos = np.flatnonzero(row == 5)
        end = int(eos[0]) if len(eos) else MAX_T_LEN - 1  # position that predicted the [EOS]
        margins.append(float(g[:end].min()))
      rows.append(ids.numpy())
  return np.concatenate(rows).astype(np.int32), np.array(margins, np.float32)


def _step(model, optimizer, batch, clip) -> float:
  optimizer.zero_grad()
  loss, _ = _loss(model, batch, clip)
  loss.backward()
  torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
  optimizer.step()
  return loss.item()


def _warm(model, batch, clip, steps: int, lr: float) -> list[float]:
  """Adam on the caption decoder alone (the encoder and MLP stay random, their memory is computed
  once) so that the model writes the batch's captions; cheap at paper size too."""
  halves = _halves(batch, clip)
  with torch.no_grad():
    memories = [model.encode(c, m) for c, m, _, _ in halves]
  params = list(model.text_decoder.parameters())
  adam = torch.optim.Adam(params, lr=lr)
  losses = []
  for _ in range(steps):
    adam.zero_grad()
    loss = sum(model.decode(i, None, l, mem)[0] for (_, _, i, l), mem in zip(halves, memories))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    adam.step()
    losses.append(loss.item())
  return losses


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--original', required=True, help='the ProCap source tree (read only)')
  parser.add_argument('--out', required=True)
  parser.add_argument('--size', choices=tuple(SIZES), default='small')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--warm-steps', type=int, default=None)
  args = parser.parse_args()
  size = dict(SIZES[args.size])
  if args.warm_steps is not None:
    size['warm_steps'] = args.warm_steps
  start = time.time()
  original.install_stand_ins(args.original)
  torch.manual_seed(args.seed)
  rng = np.random.default_rng(args.seed)
  word2idx = _vocab(args.original, args.size)
  model, cfg, vae = _build(args.original, size, len(word2idx))
  _randomise(model, size)
  model.eval()  # dropout off for everything recorded (and for the warm steps)
  batch = _batch(size, word2idx, rng)
  clip = _clips(batch, vae)
  warm = _warm(model, batch, clip, size['warm_steps'], size['warm_lr'])
  print(f'warm-up loss {warm[0]:.3f} -> {warm[-1]:.3f} ({len(warm)} steps)', flush=True)

  sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
  optimizer, table = original.stage2_optimizer(model, T_TOTAL)
  prefix = os.path.join(args.out, f'stage2_{args.size}')
  os.makedirs(args.out, exist_ok=True)
  opt_ns = argparse.Namespace(**{k: v for k, v in cfg.items()})
  torch.save({'model': sd, 'model_cfg': cfg.decoder_param, 'opt': opt_ns, 'epoch': 0,
              'optimizer': optimizer.state_dict()}, prefix + '_model.pt')
  with open(prefix + '_word2idx.json', 'w') as f:
    json.dump(word2idx, f, indent=4)

  with torch.no_grad():
    loss, halves = _loss(model, batch, clip)
  logits = torch.cat([h[1] for h in halves]).numpy()
  greedy, margins = _greedy(model, batch, clip)

  before_step = {k: p.detach().clone() for k, p in model.named_parameters()}
  _step(model, optimizer, batch, clip)
  moved = [k for k, p in model.named_parameters() if not torch.equal(p, before_step[k])]
  if moved:
    raise SystemExit(f'the lr-0 first step moved {moved[:3]}')
  _step(model, optimizer, batch, clip)
  multiplier = optimizer.param_groups[0]['schedule'].get_lr(1)
  np.savez(prefix + '_after.npz', **{k: p.detach().numpy() for k, p in model.named_parameters()})

  idx2word = {i: w for w, i in word2idx.items()}
  decoded = [' '.join(idx2word[int(t)] for t in row[1:list(row).index(5) if 5 in row else None])
             for row in greedy]
  meta = dict(size=args.size, seed=args.seed, sizes=size, t_total=T_TOTAL, lr=5e-5,
              lr_finetune=2e-5, warmup=0.1, weight_decay=0.01, clip=1.0, label_smoothing=0.1,
              max_t_len=MAX_T_LEN, num_targets=NUM_TARGETS, vocab_size=len(word2idx),
              text_len=model.intermediate_generator.text_seq_len,
              text_rows=int(model.intermediate_generator.text_emb.weight.shape[0]),
              groups=table, warm_losses=[warm[0], warm[-1]], captions=batch['captions'],
              greedy_captions=decoded, torch=torch.__version__,
              seconds=round(time.time() - start, 1))
  np.savez(prefix + '_io.npz', before=batch['before'], after=batch['after'],
           caption_in=batch['caption_in'], labels=batch['labels'], logits=logits,
           loss=np.float32(loss), loss_change=np.float32(halves[0][0]),
           loss_no_change=np.float32(halves[1][0]), greedy=greedy, greedy_margin=margins,
           lr_multiplier=np.float32(multiplier), meta=json.dumps(meta))
  print(f'loss {float(loss):.4f}; greedy margins >= {margins.min():.3g}; lr multiplier '
        f'{multiplier:.4f}; {time.time() - start:.1f} s', flush=True)
  for caption in decoded:
    print('  ', caption)


if __name__ == '__main__':
  main()
