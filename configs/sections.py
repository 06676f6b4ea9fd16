"""The sections of the synthetic benchmark's config, every entry with what it means.

`configs/synthetic.py`'s presets fill them (each preset states all the values that differ
between presets: the arguments here); the real datasets' configs start from those presets
(`configs/real_common.py`). The caption section, with the DUDA baseline's settings, is
synthetic.py's `_caption`.
"""

import ml_collections

STAGES = ('tokenizer', 'pretrain', 'caption')


def data(*, builder_config: str, image_size: int,
          feature_cache: bool) -> ml_collections.ConfigDict:
  d = ml_collections.ConfigDict()
  d.name = 'synthetic_change'          # TFDS builder name
  d.builder_config = builder_config
  d.data_dir = ''                      # '' -> <workdir>/data
  d.manual_dir = ''                    # real datasets only
  d.image_size = image_size
  d.frame_source = 'frames'            # 'frames' (stored interpolation) | 'oracle' | 'crossfade'
  d.num_keyframes = 2                  # k: imagined frames between before and after (the
                                       # encoder's T = k + 2 frame slots is derived from it)
  d.sampler = 'confidence'             # 'confidence' | 'uniform' | 'topk'
  d.scores_feature = 'stats'           # feature function for the confidence scores file
  d.scores_file = ''                   # '' -> computed next to the dataset; or an official file
  d.max_caption_len = 24
  d.min_word_count = 3                 # words kept when count > this (reproduces Spot/IER files)
  d.word2idx_file = ''                 # '' -> build from train captions
  # Stage-1 encoder text (batch key encoder_text): 'words' = caption vocabulary ids (no [BOS] /
  # [EOS]); 'clip_bpe' = the original's CLIP BPE ids (spec 1.6; pretrain text_vocab_size 49408).
  d.encoder_text = 'words'
  # 'clip_bpe' only: CLIP's bpe_simple_vocab_16e6.txt[.gz]; '' -> the copy shipped by an installed
  # open_clip_torch or clip package. Read only when captions are tokenised.
  d.bpe_merges_file = ''
  d.num_workers = 0                    # grain worker processes (0 = in-process)
  # Stages 1 and 2 read the frozen tokenizer's features and codes of every source frame from a
  # cache built once after stage 0 (<data dir>/<dataset>/feature_cache/; docs/performance.md,
  # "Tokenizer feature cache") instead of encoding the frames every step. Same values.
  d.feature_cache = feature_cache
  # Its feature storage: 'float32' (the encoded values) | 'float16' (half the disk, rounded).
  d.feature_cache_dtype = 'float32'
  # Build a missing dataset on Apache Beam with these flags (pip install -e '.[beam]'), e.g.
  # '--runner=DirectRunner --direct_num_workers=2 --direct_running_mode=multi_processing';
  # '' = the local process pool (docs/performance.md, "Building datasets on Beam").
  d.beam_options = ''
  return d


def tokenizer(*, ch_mult: tuple[int, ...], resolution: int, z_channels: int, n_embed: int,
               train: dict) -> ml_collections.ConfigDict:
  """The VQGAN tokenizer (embed_dim = z_channels); `train`: steps, batch_size, lr,
  warmup_steps, log_every, eval_every, checkpoint_every, eval_batches."""
  t = ml_collections.ConfigDict()
  t.model = ml_collections.ConfigDict(dict(
      ch=16,                           # ch=32 costs ~3x per step at 64 px
      ch_mult=ch_mult,
      num_res_blocks=1,
      attn_resolutions=(),
      resolution=resolution,
      z_channels=z_channels,
      embed_dim=z_channels,
      n_embed=n_embed,
      dropout=0.0,
      beta=0.25,
      feature_input_scale='unit',      # 'unit': features see [0,1] images (original quirk)
      token_input_scale='signed',      # 'signed': codes see [-1,1] images (original)
      # P > 0: features also carry each token cell's pixels pooled to P x P (Z + 3 P^2 channels;
      # not the original's, docs/fidelity.md); 0: the tokenizer's features only (original)
      feature_pixels=0,
  ))
  # A taming VQModel checkpoint (.ckpt) to start from instead of a random init (README "Start
  # from the original's weights"); with train.steps=0 the stage keeps it as it is.
  t.init_from = ''
  # Level attention weights in the file that this config's resolution gives no attention block
  # (ProCap's VQGANs were fine-tuned at 256 px, so their level-4 attention; at 224 px the original
  # builds none and its strict=False load drops them). False refuses such a file instead.
  t.init_drop_unused_attention = False
  # The frozen tokenizer's convolutions (stages 1 and 2, the caption command): 'bfloat16' runs
  # them with bf16 operands, the 3x3 ones in row bands (docs/performance.md, "The tokenizer's
  # convolutions in row bands": a faster encode, features within a few per cent of float32's);
  # the feature cache is built in float32 either way. 'auto': as config.compute_dtype's.
  t.frozen_dtype = 'float32'
  t.train = ml_collections.ConfigDict(dict(
      **train,
      clip=1.0,                        # global-norm gradient clipping (codebook excluded)
      frames_per_example=1,            # random keyframes per example per step (0 = all T)
      # > 0: the step's frames go through the VQGAN (and discriminator) this many at a time, in
      # a checkpointed loop: memory of one chunk's activations, the same values (docs/
      # performance.md, "Memory"); 0 = all frames at once. Must divide batch x frames.
      frames_chunk=0,
      l1_weight=1.0,                   # reconstruction losses in the [-1, 1] space
      l2_weight=1.0,
      codebook_weight=1.0,             # x beta x commitment; the codebook itself follows an EMA
      codebook_decay=0.99,             # EMA decay of code usage counts and code sums
      dead_code_restart=True,
      restart_every=50,                # restart dead codes every this many steps (from step 0)
      dead_code_threshold=0.03,        # dead: EMA usage below this many uses per step
      gan_weight=0.0,                  # > 0 adds a PatchGAN discriminator (hinge loss)
  ))
  return t


def pretrain(*, model: dict, binary_inputs: str, train: dict) -> ml_collections.ConfigDict:
  """The stage-1 procedure encoder; `model`: width, depth, feature_dim (the tokenizer's
  z_channels), codebook_size (its n_embed), embedding_std, frame_difference, attention_group;
  `train`: steps, batch_size, lr, warmup_steps, decay_steps, log_every, eval_every,
  checkpoint_every, eval_batches."""
  p = ml_collections.ConfigDict()
  p.model = ml_collections.ConfigDict(dict(
      heads=4,
      mlp_ratio=4,
      text_len=24,
      text_vocab_size=0,               # 0 -> taken from the caption vocabulary at build time
      grid=(8, 8),                     # tokens per frame side = image_size / 2**(len(ch_mult)-1)
      remat=False,                     # nn.remat per block; on XLA:CPU it saves no memory
      scan_blocks=False,               # blocks as a checkpointed lax.scan (memory, same values)
      scan_keep_dense=False,           # with scan_blocks: keep the dense outputs (speed, memory)
      attention_chunk=0,               # >0: attention queries in chunks (memory, same values)
      # C1 > 0: a learned stem (two 3 x 3 convolutions of C1 channels) over the pooled pixels of
      # tokenizer.model.feature_pixels, added to the frame tokens (not the original's); 0: none
      pixel_stem=0,
  ))
  p.model.update(model)
  p.masking = ml_collections.ConfigDict(dict(
      strategy_probs=(0.7, 0.1, 0.1, 0.1, 0.0),  # random, all, in-box, out-box, stage-2 pattern
      keep_prob_range=(0.2, 0.2),
      box_scale=(0.2, 0.8),
      box_ratio=(0.5, 2.0),
  ))
  p.corruption = ml_collections.ConfigDict(dict(
      probs=(0.25, 0.25, 0.25, 0.25),  # replace frame, shuffle, colour shift, affine warp
      max_rotation_deg=30.0,
      max_translation=0.1,
      scale_range=(0.9, 1.1),
      color_shift=0.5,
  ))
  # Weights to start from: OpenAI CLIP ViT (ViT-B-32.pt) -> the first `depth` blocks, the rest
  # keeps its init; or a released ProCap stage-1 checkpoint -> the whole encoder. '' = random.
  p.init_from = ''
  # CLIP init only: round the block tensors OpenAI's convert_weights casts through float16 (what
  # clip.load(jit=False) gives a float32 file). False = the original's loader, which keeps the
  # file's values exactly (docs/fidelity.md).
  p.clip_fp16_round_trip = False
  p.loss_weights = ml_collections.ConfigDict(dict(msm=7.0, align=0.5, csy=0.5))
  p.csy_normalisation = 'code'         # 'code': fully masked samples in the numerator only; 'mean'
  p.fused_forwards = True              # the 3 stage-1 forwards as one batch-3B call (same losses)
  # Match/consistency judged on 'masked' frames (original) | 'visible' frames (a 4th forward;
  # docs/fidelity.md: on the original's masks a consistency head stays at chance).
  p.binary_inputs = binary_inputs
  p.train = ml_collections.ConfigDict(dict(
      **train,
      warmup_min=1e-6,
      warmup='log',                    # 'log' (original DeepSpeed WarmupLR) | 'linear'
      clip=1.0,
      # M > 1: the encoder's forwards and backward in M micro-batches of batch_size / M rows,
      # gradients accumulated; the same values (masks, negatives and divisors are the whole
      # batch's), so speed and memory only.
      micro_batches=1,
  ))
  return p


def assemble(preset: str, *, data: ml_collections.ConfigDict,
            tokenizer: ml_collections.ConfigDict, pretrain: ml_collections.ConfigDict,
            caption: ml_collections.ConfigDict,
            gallery_per_type: int = 3) -> ml_collections.ConfigDict:
  """A whole config from its stage sections and the entries every preset shares."""
  config = ml_collections.ConfigDict()
  config.preset = preset
  config.variant = ''
  config.seed = 0
  config.stages = STAGES
  config.data = data
  config.tokenizer = tokenizer
  config.pretrain = pretrain
  config.caption = caption
  # cpu_devices: a CPU-only host runs as this many devices; accelerators ignore it. 0 = one per
  # core (procap_jax.sharding.cpu_device_count), data-parallel: about a quarter less time per
  # step on 2 cores, the same computation rounded differently, and on seed 0 a default run whose
  # stage 2 did not leave the one-sentence plateau (docs/performance.md, "One device per core").
  # 1 keeps every documented result reproducible.
  config.mesh = ml_collections.ConfigDict(dict(data=-1, model=1, cpu_devices=1))
  config.sharding = ml_collections.ConfigDict(dict(rules=(
      ('batch', 'data'), ('embed', None), ('mlp', 'model'), ('heads', 'model'),
      ('vocab', 'model'), ('codebook', None), ('conv_in', None), ('conv_out', 'model'),
      ('norm', None), ('pos', None), ('text_vocab', None), ('length', None),
  )))
  # 'bfloat16': bf16 matmuls, f32 params and accumulation; 'auto' (the paper presets): bfloat16
  # where the CPU has bf16 dot products. float32 here keeps the documented results on every CPU.
  config.compute_dtype = 'float32'
  config.report = ml_collections.ConfigDict(dict(gallery_per_type=gallery_per_type))
  # Reading the original's weight files (init_from, python -m procap_jax.convert): strict refuses
  # a file whose pickle names code outside the reader's allow-list (by default it is read for its
  # tensors with one warning line); a file may expand to max_expansion x its size on disk.
  config.weight_files = ml_collections.ConfigDict(dict(strict=False, max_expansion=4.0))
  return config
