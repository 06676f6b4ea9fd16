"""Writes the VQGAN parity fixtures with taming's own `VQModel`. Run by hand, WITH torch:

  python tests/parity/gen_vqgan.py --original ORIG \
      --out tests/parity/fixtures                       # small, committed (0.95 MB)
  python tests/parity/gen_vqgan.py --original ORIG \
      --out P --size paper              # the paper's tokenizer, not committed

The model is built from the original source tree (`--original`, read-only) by bench/original.py
with its stand-ins for what the CPU venv lacks: a `pytorch_lightning` whose LightningModule is
torch.nn.Module, and a loss module holding a few `loss.*` tensors (as a real checkpoint's
LPIPS/discriminator do) that the converter must ignore. Every parameter is random from `--seed`,
norms and biases included (N(1, 0.2) scales, N(0, 0.1) biases), so a converter that drops them
cannot pass. The codebook is drawn around the encoder's actual outputs so the test images use
many codes, and the generator refuses a draw whose nearest-code choice is nearly tied (float
rounding could flip it).

Files in `--out`:
  vqgan.ckpt    `torch.save({'state_dict': sd, 'epoch': 0, 'global_step': 0, ...})`, zipfile
                serialisation, the layout of a taming/Lightning checkpoint. The small size stores
                float16 tensors to stay under 1 MB (the model computed with exactly those values
                widened to float32); paper size stores float32 like the released files.
  vqgan_io.npz  all images NHWC (not torch's NCHW):
    config        JSON of the VQGAN kwargs (`procap_jax.models.vqgan.VQGAN(**config)`).
    pixels        [B, S, S, 3] uint8; the images are pixels / 255 in float32.
    features      [B, h, w, Z] `encoder(x)` with x in [0, 1] (ProCap's stage-1 inputs, spec 3).
    codes         [B, h*w] int32, argmin of the quantiser on quant_conv(encoder(2x - 1)),
                  row-major over (h, w) (ProCap's `get_codebook_indices`).
    decoder_out   [B, S, S, 3] `decode(embedding(codes))`, unclipped, in the [-1, 1] space.
    decoded       [B, S, S, 3] ProCap's `VQGanVAE1024.decode`: (clamp(decoder_out, -1, 1) + 1)/2.
    code_gap      [B, h*w] float32, second-nearest minus nearest squared distance (the
                  generator refuses a gap under 1e-5 distance_scale).
    distance_scale  the largest squared norm of a z or a code vector.
Never collected by pytest; tests/parity_vqgan_test.py reads the outputs without torch.
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

SMALL = dict(ch=32, ch_mult=(2, 1), num_res_blocks=1, attn_resolutions=(16,), resolution=32,
             z_channels=16, embed_dim=12, n_embed=67)
PAPER = original.PAPER_VQGAN


def _randomise(model: torch.nn.Module, images01: torch.Tensor, float16: bool) -> None:
  """Random norms and biases, a codebook around the encoder's outputs, float16-exact values."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.startswith('loss.'):
        continue
      if '.norm' in name and name.endswith('.weight'):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith('.bias'):
        p.copy_(0.1 * torch.randn_like(p))
    # Codes spread around the encoder's outputs, so the test images use many of them.
    z = model.quant_conv(model.encoder(2 * images01 - 1))  # [B, D, h, w]
    flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
    table = model.quantize.embedding.weight
    table.copy_(flat.mean(0) + flat.std(0) * torch.randn_like(table))
    # A decoder output mostly inside [-1, 1], so the clipped image still carries the values.
    out = model.decode(model.quantize(z)[0])
    model.decoder.conv_out.weight.mul_(0.6 / out.std())
    if float16:
      for p in model.parameters():
        p.copy_(p.half().float())


def _outputs(model: torch.nn.Module, images01: torch.Tensor) -> dict[str, np.ndarray]:
  """What ProCap computes (spec section 3, src/mmvid_pytorch/vae.py and dalle_beit.py)."""
  nhwc = lambda t: t.permute(0, 2, 3, 1).numpy().astype(np.float32)
  b = images01.shape[0]
  with torch.no_grad():
    features = model.encoder(images01)  # dalle_beit: vae.model.encoder(x), x in [0, 1]
    z = model.quant_conv(model.encoder(2 * images01 - 1))  # vae.get_codebook_indices
    _, _, (_, _, codes) = model.quantize(z)
    codes = codes.reshape(b, -1)  # [B, h*w], rows of the h x w grid
    flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
    d = torch.cdist(flat.double(), model.quantize.embedding.weight.double()) ** 2
    gap = d.topk(2, dim=1, largest=False).values.diff(dim=1).reshape(b, -1)
    # Float32 distances are off by a few ulps of the larger of |z|^2 and |e|^2.
    magnitude = max(float((flat ** 2).sum(1).max()),
                    float((model.quantize.embedding.weight ** 2).sum(1).max()))
    side = z.shape[2]
    q = model.quantize.embedding(codes).reshape(b, side, side, -1).permute(0, 3, 1, 2)
    decoder_out = model.decode(q)  # vae.decode before its clamp
    decoded = (decoder_out.clamp(-1.0, 1.0) + 1) * 0.5
  return dict(pixels=(images01 * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy(),
              features=nhwc(features),
              codes=codes.numpy().astype(np.int32), decoder_out=nhwc(decoder_out),
              decoded=nhwc(decoded), code_gap=gap.float().numpy(),
              distance_scale=np.float32(magnitude))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--original', required=True, help='the ProCap source tree (read only)')
  parser.add_argument('--out', required=True)
  parser.add_argument('--size', choices=('small', 'paper'), default='small')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--batch', type=int, default=2)
  args = parser.parse_args()
  cfg = dict(SMALL if args.size == 'small' else PAPER)
  float16 = args.size == 'small'
  original.install_stand_ins(args.original)
  torch.manual_seed(args.seed)
  model = original.vqmodel(cfg)
  s = cfg['resolution']
  # Smooth random images (a coarse grid upsampled bilinearly plus a little noise), in [0, 1].
  coarse = torch.rand(args.batch, 3, s // 8, s // 8)
  images = torch.nn.functional.interpolate(coarse, size=(s, s), mode='bilinear')
  images = (images + 0.05 * torch.randn_like(images)).clamp(0.0, 1.0)
  pixels = (images * 255).round().to(torch.uint8)  # 8-bit like real frames
  images = pixels.float() / 255
  _randomise(model, images, float16)
  start = time.perf_counter()
  io = _outputs(model, images)
  seconds = time.perf_counter() - start
  smallest = float(io['code_gap'].min())
  if smallest < 1e-5 * float(io['distance_scale']):
    raise SystemExit(f'seed {args.seed}: a nearest code is nearly tied (gap {smallest:.3g}, '
                     f'distances up to {float(io["distance_scale"]):.3g}); choose another --seed')

  state = model.state_dict()
  if float16:
    state = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
  config = dict(cfg, dropout=0.0, beta=0.25, feature_input_scale='unit',
                token_input_scale='signed')
  os.makedirs(args.out, exist_ok=True)
  torch.save({'state_dict': state, 'epoch': 0, 'global_step': 0,
              'pytorch-lightning_version': '1.0.8'}, os.path.join(args.out, 'vqgan.ckpt'))
  np.savez_compressed(os.path.join(args.out, 'vqgan_io.npz'), config=json.dumps(config), **io)
  used = len(np.unique(io['codes']))
  print(f'wrote {args.out}/vqgan.ckpt and vqgan_io.npz: {args.size}, '
        f'{sum(p.numel() for n, p in model.named_parameters() if not n.startswith("loss."))} '
        f'parameters, {used} distinct codes in {io["codes"].size}, smallest code gap '
        f'{smallest:.3g}, decoder_out std {io["decoder_out"].std():.3f}, '
        f'{np.mean(np.abs(io["decoder_out"]) > 1):.1%} clipped, torch forward {seconds:.2f} s')


if __name__ == '__main__':
  main()
