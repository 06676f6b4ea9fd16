"""Weights from the original world: torch-free file reading and converters.

  torch_files   reads `torch.save` archives (.pt/.pth/.ckpt) and TorchScript archives into numpy
                without torch, executing no pickle global outside a short allow-list, checking
                every tensor against its storage and capping what a file may expand to.
  safetensors_files  reads safetensors files (each tensor checked to lie inside the file).
  common        the shared checks every converter uses (one-sentence errors naming the key).
  clip          OpenAI CLIP ViT visual blocks -> the stage-1 encoder's resblocks.
  taming        a taming `VQModel` checkpoint -> the VQGAN tokenizer.
  procap_stage1, procap_stage2
                released ProCap stage-1 / stage-2 checkpoints -> our stage checkpoints.
  init          `<stage>.init_from`: which file kind a state dict is, and its conversion.
  __main__      `python -m procap_jax.convert {clip,taming,procap} ...`.
"""
