r"""The original ProCap's own modules, built from its source tree with random weights.

Run under a Python with torch (the project's own code never imports this module):

  import sys; sys.path.insert(0, REPO)        # REPO: this checkout, so `bench` imports
  from bench import original
  original.install_stand_ins(ORIG)            # ORIG: the original's source tree
  vae = original.vae(original.vqmodel(original.PAPER_VQGAN))
  with original.random_clip(width=768, heads=12):
    bert = original.bert(vae, original.stage1_args(batch=8, text_len=24, frames=4,
                                                   image_size=224, depth=12, width=768))

What it builds, each through the original's own classes and argument parsers (the source tree is
read, never edited, and none of its code is copied here):
  - `vqmodel`: taming's `VQModel` with a stand-in loss (`StubLoss`: a few `loss.*` tensors, as
    the LPIPS/discriminator loss of a real checkpoint); `vae`: the original's `VQGanVAE1024`
    around it without its file loading (any size; ProCap's class only accepts 224 or 256 px);
  - `bert`: the stage-1 `BERT` of dalle_beit.py, arguments from `utils_args.process_args` as
    scripts/train_*_stage1.sh passes them (`stage1_args`); its CLIP blocks from an OpenAI-style
    archive (`openai_clip_model_path`), or, inside `random_clip`, random ones of any width
    without `ViT-B-32.pt` (`clip_model.build_model` returns the original's `Transformer`);
  - `mmvid_idc`: the stage-2 `MMVID_IDC` from config/mmvid_clevr_config.yaml at given sizes,
    with a given VAE (its `get_vae_model` would read a VQGAN file);
  - the optimisers: train_stage1.py's (`utils_train.get_optimizer` + `prepare_lr_scheduler`,
    DeepSpeed's WarmupLR: deepspeed must be installed) and train_stage2.py's four BertAdam groups.

Stand-ins (`install_stand_ins`) for what a CPU venv lacks or what is never called on these
paths: `pytorch_lightning` (its LightningModule is torch.nn.Module), torchvision (a working
`RandomErasing` written from the spec, section 4.3; everything else inert), imageio, dominate,
pycocoevalcap, pycocotools and nltk (inert: any name imported from them is a do-nothing class).
"""

import argparse
import contextlib
import math
import os
import sys
import types

import torch

PAPER_VQGAN = dict(ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, attn_resolutions=(16,),
                   resolution=224, z_channels=256, embed_dim=256, n_embed=1024)
INERT_MODULES = ('torchvision', 'torchvision.transforms', 'torchvision.transforms.functional',
                 'torchvision.io', 'torchvision.utils', 'torchvision.models', 'imageio',
                 'dominate', 'dominate.tags', 'pycocoevalcap', 'pycocoevalcap.eval',
                 'pycocotools', 'pycocotools.coco', 'nltk')


class StubLoss(torch.nn.Module):
  """Stands in for VQLPIPSWithDiscriminator: a few tensors under `loss.` like the real one."""

  def __init__(self, **unused):
    super().__init__()
    self.discriminator = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 4, 2, 1))
    self.register_buffer('logvar', torch.zeros(()))


class Inert:
  """Any name imported from an inert module (never called on the paths run here)."""

  def __init__(self, *args, **kwargs):
    del args, kwargs


class _InertModule(types.ModuleType):

  def __getattr__(self, name):
    if name.startswith('__'):
      raise AttributeError(name)
    return Inert


class RandomErasing:
  """torchvision's RandomErasing as spec section 4.3 describes it: with probability p, one
  rectangle of area scale x H x W and log-uniform aspect ratio, at the same place in every
  leading slice, set to `value`; up to 10 draws, no erasing when none fits."""

  def __init__(self, p=0.5, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0, inplace=False):
    self.p, self.scale, self.ratio, self.value, self.inplace = p, scale, ratio, value, inplace

  def __call__(self, img: torch.Tensor) -> torch.Tensor:
    if torch.rand(1).item() >= self.p:
      return img
    height, width = img.shape[-2:]
    log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
    for _ in range(10):
      area = height * width * torch.empty(1).uniform_(*self.scale).item()
      aspect = math.exp(torch.empty(1).uniform_(*log_ratio).item())
      h, w = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
      if h < height and w < width:
        i = int(torch.randint(0, height - h + 1, (1,)).item())
        j = int(torch.randint(0, width - w + 1, (1,)).item())
        out = img if self.inplace else img.clone()
        out[..., i:i + h, j:j + w] = self.value
        return out
    return img


def install_stand_ins(original: str, random_erasing: type = RandomErasing) -> None:
  """Makes the original's modules importable from `original` (put first on sys.path).

  Args:
    original: the ProCap source tree.
    random_erasing: the class dalle_beit.py gets as `torchvision.transforms.RandomErasing`.
  """
  for name in INERT_MODULES:
    sys.modules[name] = _InertModule(name)
    parent, _, child = name.rpartition('.')
    if parent:
      setattr(sys.modules[parent], child, sys.modules[name])
  sys.modules['torchvision.transforms'].RandomErasing = random_erasing
  lightning = types.ModuleType('pytorch_lightning')
  lightning.LightningModule = torch.nn.Module
  sys.modules['pytorch_lightning'] = lightning
  sys.path.insert(0, os.path.abspath(original))


def vqmodel(cfg: dict) -> torch.nn.Module:
  """taming's VQModel (eval mode) with the VQGAN sizes `cfg` (keys of PAPER_VQGAN)."""
  from taming.models import vqgan  # pylint: disable=import-outside-toplevel
  ddconfig = dict(double_z=False, z_channels=cfg['z_channels'], resolution=cfg['resolution'],
                  in_channels=3, out_ch=3, ch=cfg['ch'], ch_mult=list(cfg['ch_mult']),
                  num_res_blocks=cfg['num_res_blocks'],
                  attn_resolutions=list(cfg['attn_resolutions']), dropout=0.0)
  return vqgan.VQModel(ddconfig=ddconfig, lossconfig={'target': f'{__name__}.StubLoss'},
                       n_embed=cfg['n_embed'], embed_dim=cfg['embed_dim']).eval()


def vae(model: torch.nn.Module) -> torch.nn.Module:
  """The original's `VQGanVAE1024` wrapping `model` (its methods, not its file loading)."""
  from src.mmvid_pytorch import vae as vae_lib  # pylint: disable=import-outside-toplevel
  wrapper = vae_lib.VQGanVAE1024.__new__(vae_lib.VQGanVAE1024)
  torch.nn.Module.__init__(wrapper)
  wrapper.model = model
  ddconfig = model.encoder
  wrapper.num_layers = ddconfig.num_resolutions - 1  # 4 for f16, as the class hard-codes
  wrapper.image_size = ddconfig.resolution
  wrapper.num_tokens = model.quantize.n_e
  return wrapper


@contextlib.contextmanager
def random_clip(width: int, heads: int):
  """While active, the original's CLIP loading (`OpenAICLIPTransformer`) builds the original's
  `Transformer(width, depth, heads)` with torch's default random init instead of reading an
  archive (`torch.jit.load` returns an empty module; `build_model` ignores its state dict)."""
  from src.mmvid_pytorch.transformers import clip_model  # pylint: disable=import-outside-toplevel
  jit_load, build = torch.jit.load, clip_model.build_model
  torch.jit.load = lambda *args, **kwargs: types.SimpleNamespace(state_dict=dict)
  clip_model.build_model = lambda state, vision_layers=12: types.SimpleNamespace(
      visual=types.SimpleNamespace(transformer=clip_model.Transformer(
          width, vision_layers, heads)))
  try:
    yield
  finally:
    torch.jit.load, clip_model.build_model = jit_load, build


def stage1_args(batch: int, text_len: int, frames: int, image_size: int, depth: int,
                width: int, clip_path: str = 'ViT-B-32.pt') -> argparse.Namespace:
  """train_stage1.py's args for scripts/train_clevr_stage1.sh at these sizes (`process_args`)."""
  from utils import utils_args  # pylint: disable=import-outside-toplevel
  argv = sys.argv
  sys.argv = ['train_stage1.py', '--name', 'parity', '--image_text_folder', '.',
              '--dataset', 'h5_text', '--beit', '--num_visuals', '0', '--fullvc',
              '--batch_size', str(batch), '--text_seq_len', str(text_len),
              '--num_targets', str(frames), '--frame_num', str(frames),
              '--image_size', str(image_size), '--rel_no_fully_masked',
              '--vision_layers', str(depth), '--dim', str(width),
              '--openai_clip_model_path', clip_path]
  try:
    args = utils_args.process_args(train=True)
  finally:
    sys.argv = argv
  return args


def stage1_params(args: argparse.Namespace, text_vocab: int) -> dict:
  """The `dalle_params` train_stage1.py builds BERT from (and stores in its checkpoints)."""
  return dict(
      num_text_tokens=text_vocab, text_seq_len=args.text_seq_len, dim=args.dim,
      loss_img_weight=args.loss_img_weight, text_feature_dim=0,
      fixed_language_model=args.fixed_language_model,
      text_emb_bottleneck=args.text_emb_bottleneck, which_transformer=args.which_transformer,
      num_targets=args.num_targets, num_visuals=args.num_visuals,
      use_separate_visual_emb=args.use_separate_visual_emb, insert_sep=args.insert_sep,
      openai_clip_path=args.openai_clip_model_path, vision_layers=args.vision_layers,
      rel=args.beta_rel > 0, vid=args.beta_vid > 0)


def bert(vae_module: torch.nn.Module, args: argparse.Namespace,
         text_vocab: int = 49408) -> torch.nn.Module:
  """The stage-1 BERT as train_stage1.py builds it (49408: CLIP BPE's SimpleTokenizer)."""
  from src.mmvid_pytorch import dalle_beit  # pylint: disable=import-outside-toplevel
  return dalle_beit.BERT(vae=vae_module, cvae=None, **stage1_params(args, text_vocab))


def stage1_forward(model: torch.nn.Module, args: argparse.Namespace, text: torch.Tensor,
                   target: torch.Tensor) -> tuple[torch.Tensor, ...]:
  """train_stage1.py's model call: (loss_msm, loss_rel, loss_vid, the weighted total)."""
  loss_msm, loss_rel, loss_vid = model(
      text, visual=None, target=target, erase_visual=args.rand_visual, return_loss=True,
      rel=args.beta_rel > 0, vid=args.beta_vid > 0, msm_strategy_prob=args.msm_strategy_prob,
      msm_bernoulli_prob=args.msm_bernoulli_prob, vid_strategy_prob=args.vid_strategy_prob,
      rel_no_fully_masked=args.rel_no_fully_masked, negvc=args.negvc, visual_neg=None,
      text_neg=None, pc_prob=args.pc_prob, vc_mode=args.vc_mode, face_mode=None,
      visual_aug_mode=args.visual_aug_mode)
  loss = args.beta_msm * loss_msm + args.beta_rel * loss_rel + args.beta_vid * loss_vid
  return loss_msm, loss_rel, loss_vid, loss


def stage1_optimizer(args: argparse.Namespace, model: torch.nn.Module):
  """(optimizer, scheduler_step) as train_stage1.py: Adam on the trainable parameters and the
  lr schedule of `prepare_lr_scheduler` (constructing DeepSpeed's WarmupLR sets the first lr)."""
  from utils import utils_train  # pylint: disable=import-outside-toplevel
  opt = utils_train.get_optimizer(args, [p for p in model.parameters() if p.requires_grad])
  _, scheduler_step = utils_train.prepare_lr_scheduler(args, opt)
  return opt, scheduler_step


def stage2_config(original: str, size: dict, vocab_size: int):
  """config/mmvid_clevr_config.yaml (EasyDict) with the sizes in `size` (width, depth, hidden,
  ffn, layers, dec_heads) and what train_stage2.main sets (vocab, [MASK] id, effective lrs)."""
  import yaml  # pylint: disable=import-outside-toplevel
  from easydict import EasyDict  # pylint: disable=import-outside-toplevel
  with open(os.path.join(original, 'config', 'mmvid_clevr_config.yaml')) as f:
    cfg = EasyDict(yaml.safe_load(f))
  b = cfg.dalle_param.bert
  b.dim, b.vision_layers, b.num_targets = size['width'], size['depth'], size.get('frames', 4)
  dec = cfg.decoder_param
  dec.hidden_size, dec.intermediate_size = size['hidden'], size['ffn']
  dec.num_hidden_layers, dec.num_attention_heads = size['layers'], size['dec_heads']
  dec.vocab_size, dec.mask_token_id = vocab_size, 7
  cfg.lr, cfg.lr_finetune = 5e-5, 2e-5  # YAML lr; lr_finetune = the CLI default that wins
  return cfg


def mmvid_idc(cfg, vae_module: torch.nn.Module, heads: int) -> torch.nn.Module:
  """The stage-2 MMVID_IDC of `cfg` around `vae_module`, random CLIP blocks with `heads`."""
  from src import mmvid_idc as idc  # pylint: disable=import-outside-toplevel
  get_vae = idc.get_vae_model
  idc.get_vae_model = lambda *args, **kwargs: (vae_module, None)
  try:
    with random_clip(cfg.dalle_param.bert.dim, heads):
      return idc.MMVID_IDC(cfg)
  finally:
    idc.get_vae_model = get_vae


def stage2_optimizer(model: torch.nn.Module, t_total: int, lr: float = 5e-5,
                     lr_finetune: float = 2e-5, weight_decay: float = 0.01):
  """train_stage2.train's optimiser: BertAdam in four groups (encoder = names starting with
  intermediate_generator at lr_finetune; weight decay except names containing 'bias'),
  warmup_linear over t_total with warmup 0.1. Returns (optimizer, {name: (group,
  requires_grad)})."""
  from src.rtransformer import optimization  # pylint: disable=import-outside-toplevel
  no_decay = ['bias', 'LayerNorm.bias', 'LayerNorm.weight']
  table, groups = {}, [[], [], [], []]
  for name, p in model.named_parameters():
    encoder = name.startswith('intermediate_generator')
    decay = not any(nd in name for nd in no_decay)
    g = (0 if decay else 1) if encoder else (2 if decay else 3)
    groups[g].append(p)
    table[name] = (g, bool(p.requires_grad))
  grouped = [{'params': groups[0], 'weight_decay': weight_decay, 'lr': lr_finetune},
             {'params': groups[1], 'weight_decay': 0.0, 'lr': lr_finetune},
             {'params': groups[2], 'weight_decay': weight_decay},
             {'params': groups[3], 'weight_decay': 0.0}]
  optimizer = optimization.BertAdam(grouped, lr=lr, warmup=0.1, t_total=t_total,
                                    schedule='warmup_linear')
  return optimizer, table
