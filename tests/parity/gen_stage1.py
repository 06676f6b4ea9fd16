"""Writes the stage-1 parity fixtures with the ORIGINAL ProCap code. Run by hand, WITH torch:

  python tests/parity/gen_stage1.py --original ORIG \
      --out tests/parity/fixtures [--size small|paper]

It imports the original's own modules from `--original` (never edited, never copied) and:
  1. builds a small OpenAI CLIP ViT with `clip_model.CLIP` (random weights: every LayerNorm, bias
     and embedding perturbed so a skipped or swapped tensor shows), casts it with the original's
     `convert_weights` (Linear/Conv/attention projections to float16, the rest float32, as
     OpenAI's release) and saves it TRACED with `torch.jit` like `ViT-B-32.pt`;
  2. builds the stage-1 `BERT` (dalle_beit.py) with the flags of scripts/train_*_stage1.sh,
     read through the original's own `process_args`; its blocks come from the archive through
     the original's loading path (`OpenAICLIPTransformer`: jit.load, build_model, .float());
     other parameters are seeded, and the LayerNorms, biases and `image_mask` (zeros at init)
     are perturbed;
  3. runs the original forward (three transformer passes and the three losses) on explicit
     inputs: a stand-in VQGAN (`vae`) returns fixed encoder features and code targets for
     frame-id images, the mask strategies are pinned (per sample 2 = fully masked, or 3 whose
     RandomErasing stand-in returns our keep-mask), and `warp` returns frame-id images of the
     fixed corrupted clips;
  4. takes one optimiser step as train_stage1.py does (`loss.backward()`, `clip_grad_norm_`
     1.0, torch Adam, lr from DeepSpeed's WarmupLR(1e-6, lr, 5000) as `prepare_lr_scheduler`
     builds it; `pip install --no-deps deepspeed==0.18.5` plus its small imports).

Files, `<prefix>` = stage1_small (committed, ~1.4 MB in all) or stage1_paper:
  clip_<size>.pt           the TorchScript CLIP archive (float16 like OpenAI's).
  <prefix>_init.pt         {'weights', 'optimizer' (fresh), 'iter': 0, 'hparams', 'vae_params'}:
                           train_stage1.py's checkpoint layout, holding the weights the step
                           starts from (its `vae.*` are the stand-in's, as a real one holds the
                           VQGAN's).
  <prefix>_step1.pt        what train_stage1.py saves after that first update (iteration 0):
                           the same keys, the optimizer with Adam's exp_avg / exp_avg_sq.
  <prefix>_io.npz          inputs (text, features, features_neg, codes, mask [True = masked],
                           fully_masked), outputs (frame_logits, rel_pos, rel_neg, vid_pos,
                           vid_neg, loss_msm, loss_align, loss_csy, loss), lr and grad_norm of
                           the step, lr_schedule (the lr of updates 0..11), the trainable
                           parameter names in optimizer order, sizes.

Stand-ins: bench/original.py's (inert torchvision, imageio, dominate, ...), with RandomErasing
replaced by the pinned masks above; that module also builds the BERT, its arguments and its
optimiser as train_stage1.py does. Small size only:
`clip_model.VisualTransformer` is given 4 heads, because build_model derives heads as
width // 64 and the small width is 40; the paper size needs no such patch (768 // 64 = 12).
Never collected by pytest (no test_ prefix); tests/parity_stage1_test.py reads the outputs
without torch.
"""

import argparse
import os
import resource
import sys
import tempfile
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import original  # pylint: disable=wrong-import-position

SCHEDULE_UPDATES = 12  # the first lrs of the original's schedule, recorded for the test
SIZES = {
    # width 40 with 4 heads (head dim 10), 2 of the archive's 3 blocks, grid 3x3 (N = 9).
    'small': dict(width=40, depth=2, heads=4, clip_layers=3, clip_patch=4, clip_resolution=16,
                  text_vocab=37, text_len=24, frames=4, grid=3, feature_dim=16, codebook=29,
                  batch=4, prefix='stage1_small'),
    # The paper's CLEVR encoder: 12 x 768, 12 heads, ViT-B/32's visual shapes; batch 2.
    'paper': dict(width=768, depth=12, heads=None, clip_layers=12, clip_patch=32,
                  clip_resolution=224, text_vocab=49408, text_len=24, frames=4, grid=14,
                  feature_dim=256, codebook=1024, batch=2, prefix='stage1_paper'),
}


class KeepMasks:
  """Stand-in for torchvision's RandomErasing: returns the next fixed keep-mask (1 = keep)."""
  queue: list = []

  def __init__(self, *args, **kwargs):
    del args, kwargs

  def __call__(self, x):
    return KeepMasks.queue.pop(0).reshape(x.shape).to(x)


class _PinnedNumpy:
  """numpy for dalle_beit: `np.random.choice` of a mask strategy returns the pinned ones."""

  def __init__(self, strategies):
    def choice(a, *args, **kwargs):
      if list(a) == [1, 2, 3, 4] and strategies:
        return strategies.pop(0)
      return np.random.choice(a, *args, **kwargs)
    self.random = types.SimpleNamespace(choice=choice)

  def __getattr__(self, name):
    return getattr(np, name)


def _perturb(torch, module, scale=0.1):
  """Adds noise to LayerNorm weights/biases, every bias and every 1-d parameter, so a tensor
  that a converter skips, swaps or mis-transposes changes the outputs."""
  with torch.no_grad():
    for name, p in module.named_parameters():
      if p.ndim == 1 or name.endswith('bias'):
        p.add_(scale * torch.randn_like(p))


def _clip_archive(torch, clip_model, size, path, dtype_half=True):
  """Builds, casts and traces a small CLIP ViT the way OpenAI's archive holds it."""
  s = size
  text_width = 64  # one head under build_model's width // 64 rule
  model = clip_model.CLIP(embed_dim=32, image_resolution=s['clip_resolution'],
                          vision_layers=s['clip_layers'], vision_width=s['width'],
                          vision_patch_size=s['clip_patch'], context_length=8, vocab_size=11,
                          transformer_width=text_width, transformer_heads=1,
                          transformer_layers=1)
  _perturb(torch, model)
  # OpenAI's archive also holds these three scalars (build_model deletes them from its dict).
  for name, value in (('input_resolution', s['clip_resolution']), ('context_length', 8),
                      ('vocab_size', 11)):
    if hasattr(model, name):
      delattr(model, name)
    model.register_buffer(name, torch.tensor(value))
  if dtype_half:
    clip_model.convert_weights(model)
  # The original's copy of ResidualAttentionBlock sets `attn_mask` only when given one, so its
  # visual tower cannot run; give those instances None to trace (not part of the state dict).
  for block in model.visual.transformer.resblocks:
    block.attn_mask = None
  model.eval()
  image = torch.rand(1, 3, s['clip_resolution'], s['clip_resolution'])
  text = torch.randint(1, 11, (1, 8))
  with torch.no_grad():
    traced = torch.jit.trace(model, (image, text), check_trace=False)
  torch.jit.save(traced, path)
  return {k: v.clone() for k, v in traced.state_dict().items()}


def _fake_vae(torch, nn, features_table, codes_table, size):
  """The VQGAN stand-in: images are frame ids; encoder -> fixed features, codes -> fixed."""
  s = size

  class Encoder(nn.Module):

    def forward(self, x):  # [(B T), 3, S, S] frame-id images -> [(B T), C, h, w]
      ids = x[:, 0, 0, 0].round().long()
      return features_table[ids].permute(0, 3, 1, 2)

  class FakeVAE(nn.Module):

    def __init__(self):
      super().__init__()
      self.model = nn.Module()  # .encoder and .quantize (e_dim, a codebook) as in taming
      self.model.encoder = Encoder()
      self.model.quantize = nn.Module()
      self.model.quantize.e_dim = s['feature_dim']
      self.model.quantize.embedding = nn.Embedding(s['codebook'], s['feature_dim'])
      self.num_layers = 4
      self.image_size = s['grid'] * 2 ** self.num_layers
      self.num_tokens = s['codebook']

    def get_codebook_indices(self, img):
      return codes_table[img[:, 0, 0, 0].round().long()]

  return FakeVAE()


def _id_images(torch, ids, image_size):
  """[B, T] frame ids -> [B, T, 3, S, S] images whose pixels hold the id."""
  b, t = ids.shape
  return ids.float().reshape(b, t, 1, 1, 1).expand(b, t, 3, image_size, image_size).contiguous()


def _inputs(rng, s):
  """Text, features, corrupted features, codes and masks (numpy; mask True = masked)."""
  b, t, g, c = s['batch'], s['frames'], s['grid'], s['feature_dim']
  n = g * g
  text = rng.integers(1, s['text_vocab'], (b, s['text_len']))
  for i in range(b):
    text[i, rng.integers(4, s['text_len'] - 2):] = 0  # padding tail
  text[0, 2] = 0  # a 0 inside the caption (BPE '!') is padding too
  features = rng.standard_normal((b, t, g, g, c)).astype(np.float32)
  codes = rng.integers(0, s['codebook'], (b, t * n))
  # Corrupted clips, in the spirit of `warp`: replace a frame, shuffle, perturb, roll.
  neg = features.copy()
  kinds = []
  for i in range(b):
    kind = i % 4
    j = rng.integers(0, t)
    if kind == 0:
      neg[i, j] = features[(i + 1) % b, rng.integers(0, t)]
    elif kind == 1:
      neg[i] = features[i, [1, 0, 3, 2][:t] if t == 4 else rng.permutation(t)]
    elif kind == 2:
      neg[i, j] = features[i, j] + 0.5 * rng.standard_normal(features[i, j].shape)
    else:
      neg[i, j] = np.roll(features[i, j], 1, axis=0)
    kinds.append(kind)
  # Masks: random (keep 0.2), fully masked, in a box, outside the box; then again.
  mask = np.zeros((b, t, g, g), bool)
  box = np.zeros((g, g), bool)
  box[g // 4: g // 4 + max(1, g // 2), g // 3: g // 3 + max(1, g // 2 + 1)] = True
  for i in range(b):
    strategy = i % 4
    if strategy == 0:
      mask[i] = rng.random((t, g, g)) >= 0.2
    elif strategy == 1:
      mask[i] = True
    elif strategy == 2:
      mask[i] = box
    else:
      mask[i] = ~box
  return dict(text=text.astype(np.int64), features=features, features_neg=neg.astype(np.float32),
              codes=codes.astype(np.int64), mask=mask.reshape(b, t, n),
              fully_masked=mask.reshape(b, -1).all(-1), corruption=np.asarray(kinds))


def _check_fp32_loading(torch, clip_model, s, tmp):
  """What the original's loading does to an fp32 archive: prints whether it rounds."""
  path = os.path.join(tmp, 'clip_fp32.pt')
  sd = _clip_archive(torch, clip_model, s, path, dtype_half=False)
  clip = clip_model.OpenAICLIPTransformer(seq_len=8, which_model='openai_clip_visual',
                                          model_path=path, causal=False,
                                          vision_layers=s['depth'])
  worst_file, worst_half = 0.0, 0.0
  for name, p in clip.transformer.named_parameters():
    ref = sd[f'visual.transformer.{name}'].float()
    worst_file = max(worst_file, (p - ref).abs().max().item())
    worst_half = max(worst_half, (p - ref.half().float()).abs().max().item())
  print(f'fp32 CLIP archive through the original loader: max |loaded - file| = {worst_file:g}, '
        f'max |loaded - fp16(file)| = {worst_half:g}')


def _schedule(torch, lr_schedules, args, updates):
  """The lr of updates 0..updates-1 in train_stage1.py (scheduler stepped after each)."""
  opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
  scheduler = lr_schedules.WarmupLR(opt, 1e-6, args.learning_rate, args.lr_scheduler_warmup)
  out = []
  for _ in range(updates):
    out.append(opt.param_groups[0]['lr'])
    scheduler.step()
  return np.asarray(out)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--original', required=True, help='the ProCap checkout (read only)')
  parser.add_argument('--out', required=True)
  parser.add_argument('--size', choices=sorted(SIZES), default='small')
  parser.add_argument('--batch', type=int, default=0, help='override the size\'s batch (even)')
  parser.add_argument('--seed', type=int, default=0)
  opts = parser.parse_args()
  s = dict(SIZES[opts.size])
  if opts.batch:
    s['batch'] = opts.batch
  os.makedirs(opts.out, exist_ok=True)
  start = time.time()

  original.install_stand_ins(opts.original, random_erasing=KeepMasks)
  import torch
  from torch import nn
  from deepspeed.runtime import lr_schedules  # what prepare_lr_scheduler('warmuplr') builds
  from src.mmvid_pytorch import dalle_beit
  from src.mmvid_pytorch.transformers import clip_model

  torch.manual_seed(opts.seed)
  rng = np.random.default_rng(opts.seed)
  if s['heads'] is not None and s['heads'] != s['width'] // 64:
    original_visual = clip_model.VisualTransformer

    class VisualWithHeads(original_visual):

      def __init__(self, **kwargs):
        super().__init__(**dict(kwargs, heads=s['heads']))

    clip_model.VisualTransformer = VisualWithHeads
  heads = s['heads'] or s['width'] // 64

  clip_path = os.path.join(opts.out, f'clip_{opts.size}.pt')
  _clip_archive(torch, clip_model, s, clip_path)
  if opts.size == 'small':
    with tempfile.TemporaryDirectory() as tmp:
      _check_fp32_loading(torch, clip_model, s, tmp)

  # ---- inputs, stand-ins and the original BERT
  x = _inputs(rng, s)
  b, t, n = s['batch'], s['frames'], s['grid'] ** 2
  feats = torch.from_numpy(np.concatenate([x['features'], x['features_neg']]).reshape(
      2 * b * t, s['grid'], s['grid'], s['feature_dim']))
  codes = torch.from_numpy(x['codes'].reshape(b * t, n))
  vae = _fake_vae(torch, nn, feats, codes, s)
  args = original.stage1_args(batch=s['batch'], text_len=s['text_len'], frames=s['frames'],
                              image_size=s['grid'] * 16, depth=s['depth'], width=s['width'],
                              clip_path=clip_path)
  model = original.bert(vae, args, s['text_vocab'])
  _perturb(torch, nn.ModuleDict({k: getattr(model, k) for k in (
      'conv_to_embedding', 'to_logits', 'to_logits_rel', 'to_logits_vid')}))
  with torch.no_grad():
    model.image_mask.add_(torch.randn_like(model.image_mask))
  names = [k for k, p in model.named_parameters() if p.requires_grad]
  opt, _ = original.stage1_optimizer(args, model)  # stepped only after the update
  lr_schedule = _schedule(torch, lr_schedules, args, SCHEDULE_UPDATES)
  # What train_stage1.py stores (sizes of vae/heads are not in it).
  hparams = original.stage1_params(args, s['text_vocab'])
  torch.save({'iter': 0, 'hparams': hparams, 'vae_params': None,
              'weights': model.state_dict(), 'optimizer': opt.state_dict()},
             os.path.join(opts.out, f'{s["prefix"]}_init.pt'))

  # ---- the original forward on pinned masks and corruptions
  keep = torch.from_numpy(~x['mask'].reshape(b, t, n))
  strategies = [2 if fm else 3 for fm in x['fully_masked']]
  KeepMasks.queue = [keep[i].float() for i in range(b) if not x['fully_masked'][i]]
  dalle_beit.np = _PinnedNumpy(strategies)
  neg_ids = torch.arange(b * t, 2 * b * t).reshape(b, t)
  dalle_beit.warp = lambda frames, probs: _id_images(torch, neg_ids, vae.image_size)
  captured = {'to_logits': [], 'to_logits_rel': [], 'to_logits_vid': []}
  for name, store in captured.items():
    getattr(model, name).register_forward_hook(
        lambda mod, inp, out, store=store: store.append(out.detach().clone()))
  target = _id_images(torch, torch.arange(b * t).reshape(b, t), vae.image_size)
  text = torch.from_numpy(x['text'])
  model.train()
  loss_msm, loss_rel, loss_vid, loss = original.stage1_forward(model, args, text, target)
  assert not KeepMasks.queue and not strategies, 'the pinned masks were not all used'
  forward_time = time.time() - start

  # ---- one update, as train_stage1.py
  lr = opt.param_groups[0]['lr']
  opt.zero_grad()
  loss.backward()
  grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
  opt.step()
  torch.save({'iter': 0, 'hparams': hparams, 'vae_params': None,
              'weights': model.state_dict(), 'optimizer': opt.state_dict()},
             os.path.join(opts.out, f'{s["prefix"]}_step1.pt'))

  (frame_logits,), (rel_pos, rel_neg), (vid_pos, vid_neg) = (
      captured['to_logits'], captured['to_logits_rel'], captured['to_logits_vid'])
  out = dict(
      text=x['text'].astype(np.int32), features=x['features'], features_neg=x['features_neg'],
      codes=x['codes'].astype(np.int32), mask=x['mask'], fully_masked=x['fully_masked'],
      corruption=x['corruption'], frame_logits=frame_logits.numpy(),
      rel_pos=rel_pos.reshape(b).numpy(), rel_neg=rel_neg.reshape(b).numpy(),
      vid_pos=vid_pos.reshape(b).numpy(), vid_neg=vid_neg.reshape(b).numpy(),
      loss_msm=loss_msm.item(), loss_align=loss_rel.item(), loss_csy=loss_vid.item(),
      loss=loss.item(), lr=lr, lr_schedule=lr_schedule, grad_norm=grad_norm.item(),
      param_names=np.asarray(names),
      loss_weights=np.asarray([args.beta_msm, args.beta_rel, args.beta_vid]),
      width=s['width'], depth=s['depth'], heads=heads, text_len=s['text_len'],
      text_vocab_size=s['text_vocab'], num_frames=t, grid=s['grid'],
      feature_dim=s['feature_dim'], codebook_size=s['codebook'], clip_layers=s['clip_layers'])
  np.savez(os.path.join(opts.out, f'{s["prefix"]}_io.npz'), **out)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
  print(f'wrote {opts.size} stage-1 fixtures to {opts.out}: losses msm {loss_msm.item():.6f} '
        f'align {loss_rel.item():.6f} csy {loss_vid.item():.6f} total {loss.item():.6f}, '
        f'lr {lr:g}, grad norm {grad_norm.item():.6f}; forward {forward_time:.1f} s, '
        f'total {time.time() - start:.1f} s, peak RSS {peak:.2f} GiB')


if __name__ == '__main__':
  main()
