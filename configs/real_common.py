"""Shared construction of the real-benchmark configs (paper size, spec table 9, and CPU smoke).

Each dataset file (`clevr_change.py`, `spot_the_diff.py`, `image_editing_request.py`,
`levir_cc.py`) calls `make(...)` with what differs per dataset; the schema is the synthetic
config's.
"""

import ml_collections

from configs import synthetic


def make(dataset: str, preset: str, *, encoder_depth: int, decoder_layers: int,
         word2idx_file: str = '', image_size: int = 224) -> ml_collections.ConfigDict:
  """A full config for `dataset` at `preset` ('paper' | 'cpu'); `image_size` is the paper
  preset's (the builder config `paper` of the dataset must give that size)."""
  if preset not in ('paper', 'cpu'):
    raise ValueError(f'unknown preset {preset!r} for {dataset}; choose paper or cpu')
  config = synthetic.get_config('quick' if preset == 'cpu' else 'default')
  config.preset = preset
  d = config.data
  d.name = dataset
  d.word2idx_file = word2idx_file
  # The original's CLEVR stage-2 step (spec 1.4): whole scenes, each scene's change pair and
  # its distractor in one batch (B/2 scenes); their shared before image is encoded once.
  config.caption.train.scene_pairs = dataset == 'clevr_change'
  # The original's stage 2 and frame tokens, not the synthetic default's recipe (docs/
  # fidelity.md): the decoder's scores / sqrt(d_model), label smoothing 0.1 summed over words,
  # the tokenizer's features alone, no change head.
  config.caption.model.attention_scale = 'd_model'
  config.caption.train.label_smoothing, config.caption.train.loss_reduction = 0.1, 'sum'
  config.tokenizer.model.feature_pixels = 0
  config.pretrain.model.pixel_stem = 0
  config.caption.model.change_head, config.caption.train.change_loss = 0, 0.0
  if preset == 'cpu':
    d.builder_config = 'tiny32'
    d.image_size = 32
    for stage in ('tokenizer', 'pretrain', 'caption'):
      config[stage].train.steps = 4
      config[stage].train.batch_size = 8
      config[stage].train.log_every = 2
      config[stage].train.eval_every = 4
      config[stage].train.checkpoint_every = 4
      config[stage].train.eval_batches = 1
    config.caption.model.layers = decoder_layers
    # A smoke run of the pipeline on real images, not the paper's model: it keeps the synthetic
    # `quick` preset's three non-original switches, named here so none is inherited silently
    # (docs/fidelity.md, "The real datasets' cpu presets").
    config.pretrain.model.frame_difference = 'before'
    config.pretrain.model.embedding_std = 0.02
    config.pretrain.binary_inputs = 'visible'
    return config

  # Paper size (spec section 9): 224 px, VQGAN f16 with 1024 codes of 256, encoder 768 wide.
  d.builder_config = 'paper'
  # The bf16 switches where the CPU has bf16 dot products, float32 elsewhere (and on
  # accelerators), chosen at start-up; a run's config.json records the choice
  # (docs/performance.md, "Which path runs"). Set either value to force it.
  config.compute_dtype = 'auto'
  config.tokenizer.frozen_dtype = 'auto'
  d.image_size = image_size
  d.encoder_text = 'clip_bpe'                    # the original's stage-1 text (spec 1.6)
  # Off at paper size: CLEVR-Change's cache would take 134 GiB in float32 (67 GiB in float16,
  # which rounds the features) and about 85 h to build on a 2-core CPU; it saves stage 1 two of
  # its three tokenizer passes a step, so switch it on where the disk allows
  # (docs/performance.md, "Tokenizer feature cache").
  d.feature_cache = False
  t = config.tokenizer.model
  t.ch, t.ch_mult, t.num_res_blocks, t.attn_resolutions = 128, (1, 1, 2, 2, 4), 2, (16,)
  t.resolution, t.z_channels, t.embed_dim, t.n_embed = image_size, 256, 256, 1024
  # The released VQGANs' attention level (16 px) has no block at 224 px: dropped there, used at
  # 256 px.
  config.tokenizer.init_drop_unused_attention = 16 not in [image_size >> i for i in range(5)]
  config.tokenizer.train.steps = 50_000
  config.tokenizer.train.batch_size = 16
  config.tokenizer.train.lr = 4.5e-6 * 16      # taming's base lr x batch
  # Memory only (same values): the 16 frames of a step go through the VQGAN 4 at a time in a
  # checkpointed loop, 21.5 -> 5.8 GiB of compiled temporaries (docs/performance.md).
  config.tokenizer.train.frames_chunk = 4
  p = config.pretrain.model
  p.width, p.depth, p.heads, p.mlp_ratio = 768, encoder_depth, 12, 4
  p.text_vocab_size = 49408                      # CLIP BPE's ids (data.encoder_text)
  p.grid = (image_size // 16, image_size // 16)  # f16: 14 x 14 tokens at 224 px
  p.feature_dim, p.codebook_size = 256, 1024  # T = num_keyframes + 2 = 4
  # Speed and memory only (same values): attention for 2 (batch, head) pairs at a time (their
  # scores stay in cache: stage 1 about 1.2x faster than attention in query chunks of 128,
  # which bounded memory as well), and stages 1 and 2 in micro-batches with accumulated
  # gradients, stage 1 one sample (3 fused sequences) and stage 2 two pairs at a time. With
  # micro-batches this small the blocks run unrolled and keep their activations (no
  # checkpointed scan): bf16 on the feature cache, stage 1 at batch 8 46.0 s a step against
  # 48.7 s with the scan, stage 2 at batch 8 (in 4 micro-batches) 14.1 against 15.0 s; compiled
  # temporaries 2.1 -> 1.9 and 1.8 -> 1.6 GiB (docs/performance.md). Stage 2's dropout draws
  # its masks per micro-batch. On a data-parallel mesh, each micro-batch's rows are what is
  # spread over the devices: choose M so that batch_size / M covers them, attention_group a
  # multiple of the data axis (each loop step then takes pairs from every device), and with
  # larger micro-batches set scan_blocks (and scan_keep_dense) back on to bound memory.
  p.scan_blocks, p.attention_chunk, p.attention_group = False, 0, 2
  p.embedding_std = 1.0                          # the original's N(0, 1) tables (4.1)
  p.frame_difference = 'none'                    # the original's frame tokens (fidelity.md)
  config.pretrain.binary_inputs = 'masked'       # the original's binary-head inputs (4.4)
  pt = config.pretrain.train
  pt.steps, pt.batch_size, pt.lr, pt.warmup_steps, pt.warmup = 200_000, 8, 1e-4, 5000, 'log'
  pt.decay_steps = 0                             # the original's constant lr after warmup
  pt.micro_batches = 8
  pt.eval_every, pt.checkpoint_every, pt.log_every = 5000, 5000, 100
  c = config.caption.model
  c.hidden, c.heads, c.ffn, c.layers = 512, 8, 2048, decoder_layers
  ct = config.caption.train
  ct.batch_size, ct.lr, ct.lr_encoder = 32, 5e-5, 2e-5
  ct.micro_batches = 16
  ct.steps = 40 * 2115            # 40 epochs; set from the train split size (see docstring)
  ct.eval_every = ct.checkpoint_every = 2115
  ct.log_every = 100
  ct.eval_batches = 0
  # Speed only (same values): in inference the captioner's encoder runs two pairs at a time
  # (bf16 on the feature cache, batch 32: 19.0 s against 29.2 s for the whole batch at once;
  # docs/performance.md, section "Inference").
  config.caption.decoding.encode_rows = 2
  return config
