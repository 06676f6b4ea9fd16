r"""The embedded default: every stage on the synthetic change benchmark.

Command (the README's first command):

  python -m procap_jax.main --config configs/synthetic.py --workdir workdir/synthetic

Presets (`--config configs/synthetic.py:<preset>`):
  tiny     tests only: a few dozen scenes, 32 px, a few steps per stage (seconds).
  quick    end to end in about 5 minutes on a 2-core CPU.
  default  (no preset) the `small` synthetic benchmark, 64 px: tokenizer 800 steps, a 64-wide,
           2-block stage-1 encoder for 200 steps, stage 2 for 900 steps; about 40 minutes on a
           2-core CPU (README "Results"; it trains the ablation table's full k = 2 row).
  large    the default until 2026-11-27: a 128-wide, 4-block stage-1 encoder for 2,000 steps,
           stage 2 for 700 steps; 1 to 2 hours on a 2-core CPU; its stage 1 leaves chance
           (match 63 %), its captions are about the default's (docs/results.md).
  ablation the default with a smaller report (one gallery pair per change type): the preset of
           `python -m procap_jax.ablations` (docs/results.md, "The ablation table").

Hardware: written for a 2-core CPU; runs unchanged on accelerators (mesh from `config.mesh`).
Expected results: see README.md (figures measured with this file).

Ablation variants (comma-separated after the preset, e.g. `:default,static`):
  static       no stage 1, no procedure queries (before/after only)
  no_queries   stage 1, then captioning without queries
  no_stage1    queries without stage 1 (k = 1)
  k1, k2, k4   full model with k imagined frames
  oracle       keyframes from the renderer's true procedure instead of flow frames
  faithful     the paper presets' stage-1 switches (frame_difference none, embedding_std 1.0,
               binary_inputs masked, no lr decay) on the synthetic data

The field's baseline (variants too; alone, e.g. `:duda_patches`, they apply to the default):
  duda_patches DUDA (Park et al., ICCV 2019) on image patches from scratch; stage 2 only
  duda         DUDA on the frozen tokenizer's features; the tokenizer stage, then stage 2
"""

import ml_collections

STAGES = ('tokenizer', 'pretrain', 'caption')


def _data(preset: str) -> ml_collections.ConfigDict:
  d = ml_collections.ConfigDict()
  d.name = 'synthetic_change'          # TFDS builder name
  d.builder_config = {'tiny': 'tiny', 'quick': 'tiny', 'default': 'small'}[preset]
  d.data_dir = ''                      # '' -> <workdir>/data
  d.manual_dir = ''                    # real datasets only
  d.image_size = {'tiny': 32, 'quick': 32, 'default': 64}[preset]
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
  # Off for the default preset (one run: get_config), on for the others here.
  d.feature_cache = True
  # Its feature storage: 'float32' (the encoded values) | 'float16' (half the disk, rounded).
  d.feature_cache_dtype = 'float32'
  # Build a missing dataset on Apache Beam with these flags (pip install -e '.[beam]'), e.g.
  # '--runner=DirectRunner --direct_num_workers=2 --direct_running_mode=multi_processing';
  # '' = the local process pool (docs/performance.md, "Building datasets on Beam").
  d.beam_options = ''
  return d


def _tokenizer(preset: str) -> ml_collections.ConfigDict:
  t = ml_collections.ConfigDict()
  small = preset in ('tiny', 'quick')
  t.model = ml_collections.ConfigDict(dict(
      ch=16,                           # ch=32 costs ~3x per step at 64 px
      ch_mult=(1, 2, 4) if small else (1, 2, 2, 4),
      num_res_blocks=1,
      attn_resolutions=(),
      resolution=32 if small else 64,
      z_channels=32 if small else 64,
      embed_dim=32 if small else 64,
      n_embed=64 if small else 256,
      dropout=0.0,
      beta=0.25,
      feature_input_scale='unit',      # 'unit': features see [0,1] images (original quirk)
      token_input_scale='signed',      # 'signed': codes see [-1,1] images (original)
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
      steps={'tiny': 20, 'quick': 150, 'default': 800}[preset],
      batch_size={'tiny': 8, 'quick': 16, 'default': 16}[preset],
      lr=2e-3 if small else 3e-3,      # default: 3e-3 beat 1e-3 at 300 steps (23.3 vs 22.7 dB)
      warmup_steps=10 if preset == 'tiny' else 100,
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
      log_every=10 if preset == 'tiny' else 50,
      eval_every={'tiny': 20, 'quick': 150, 'default': 400}[preset],
      checkpoint_every={'tiny': 10, 'quick': 150, 'default': 400}[preset],
      eval_batches=2 if preset == 'tiny' else 8,
  ))
  return t


def _pretrain(preset: str) -> ml_collections.ConfigDict:
  p = ml_collections.ConfigDict()
  small = preset in ('tiny', 'quick')
  p.model = ml_collections.ConfigDict(dict(
      width=64 if small else 128,
      depth=2 if small else 4,
      heads=4,
      mlp_ratio=4,
      text_len=24,
      text_vocab_size=0,               # 0 -> taken from the caption vocabulary at build time
      grid=(8, 8) if small else (8, 8),  # tokens per frame side = image_size / 2**(len(ch_mult)-1)
      feature_dim=32 if small else 64,   # tokenizer z_channels
      codebook_size=64 if small else 256,  # tokenizer n_embed
      # Init std of the embedding tables. 1.0 = original; with it the summed axial positions
      # drown the frame content and a caption never binds to frames in a CPU budget (a toy task
      # with one coloured token per frame stays at chance; docs/fidelity.md). 0.02 = BERT/ViT.
      embedding_std=1.0 if preset == 'tiny' else 0.02,
      # 'before': frame tokens also embed (feature - before frame's feature) at the same position.
      # Not the original; without it a from-scratch encoder never learns the before/after
      # comparison on this CPU budget and match stays at chance (docs/fidelity.md).
      frame_difference='none' if preset == 'tiny' else 'before',
      remat=False,                     # nn.remat per block; on XLA:CPU it saves no memory
      scan_blocks=False,               # blocks as a checkpointed lax.scan (memory, same values)
      scan_keep_dense=False,           # with scan_blocks: keep the dense outputs (speed, memory)
      attention_chunk=0,               # >0: attention queries in chunks (memory, same values)
      # Attention for 2 (batch, head) pairs at a time: same values, their scores stay in cache
      # (stage 1 about 1.5x faster here; docs/performance.md). 0 = all pairs at once.
      attention_group=0 if preset == 'tiny' else 2,
  ))
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
  p.binary_inputs = 'masked' if preset == 'tiny' else 'visible'
  p.train = ml_collections.ConfigDict(dict(
      steps={'tiny': 20, 'quick': 150, 'default': 2000}[preset],
      batch_size={'tiny': 8, 'quick': 16, 'default': 8}[preset],
      lr=5e-4 if small else 3e-4,      # original 1e-4 at batch 8 for 200k steps
      warmup_min=1e-6,
      warmup_steps=10 if preset == 'tiny' else 100,
      warmup='log',                    # 'log' (original DeepSpeed WarmupLR) | 'linear'
      # Last steps with the lr decayed linearly to 0 (0 = the original's constant lr); measured
      # on the default: val loss 36.32 -> 36.14, test consistency 58.6 -> 61.4 % (fidelity.md).
      decay_steps={'tiny': 0, 'quick': 0, 'default': 500}[preset],
      clip=1.0,
      # M > 1: the encoder's forwards and backward in M micro-batches of batch_size / M rows,
      # gradients accumulated; the same values (masks, negatives and divisors are the whole
      # batch's), so speed and memory only.
      micro_batches=1,
      log_every=10 if preset == 'tiny' else 50,
      eval_every={'tiny': 20, 'quick': 150, 'default': 250}[preset],
      checkpoint_every={'tiny': 10, 'quick': 150, 'default': 250}[preset],
      # 0 = the whole val split (400 clips in the default: 800 binary decisions per head).
      eval_batches={'tiny': 2, 'quick': 8, 'default': 0}[preset],
  ))
  return p


def _caption(preset: str) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  small = preset in ('tiny', 'quick')
  c.model = ml_collections.ConfigDict(dict(
      hidden=64 if small else 128,
      heads=4 if small else 8,
      ffn=256 if small else 512,
      layers=2,
      dropout=0.1,
      max_len=24,
      attention_scale='d_model',       # original quirk; 'head_dim' = standard 1/sqrt(d_head)
      qkv_bias=False,                  # original: q/k/v/o projections without bias
      layernorm='unbiased_std',        # original: g*(x-mean)/(std_unbiased+eps)+b; 'standard'
      text_slot='code',                # stage-2 text slots: 'code' rows 0..L-1 | 'padding' | 'none'
      stage2_mask='code',              # 'code': original off-by-one [ST1]/[VID] rows | 'aligned'
      use_queries=True,                # False: static baseline memory (before/after only)
      vocab_size=0,                    # 0 -> taken from the caption vocabulary at build time
      # 'procap' (the settings above) | 'duda': the field's baseline, DUDA (Park et al., ICCV
      # 2019; procap_jax/models/duda.py), with the settings below and dropout above.
      kind='procap',
      duda=dict(
          input='pixels',              # 'pixels': patches, from scratch | 'features': tokenizer
          stem_patch=8,                # pixels: patch side (64 px -> an 8 x 8 grid)
          stem_channels=(128, 128),    # pixels: dense layers over each patch
          stem_convs=0,                # pixels: 3 x 3 convolutions on the grid after them
          coords=False,                # append each cell's x, y to the grids (AddSpatialInfo)
          attention_hidden=128,        # the dual attention's 1x1 conv width
          attention_norm='softmax',    # maps: 'softmax' over the grid | 'sigmoid' per cell
          feature_dim=128,             # the speaker's l_b, l_d, l_a width
          embed=64,                    # word embedding
          hidden=128,                  # both LSTMs
      ),
  ))
  c.init_from_pretrain = True          # restore the encoder from the stage-1 checkpoint
  c.init_from = ''                     # a released ProCap stage-2 checkpoint (whole captioner)
  c.train = ml_collections.ConfigDict(dict(
      steps={'tiny': 20, 'quick': 200, 'default': 700}[preset],
      batch_size={'tiny': 8, 'quick': 16, 'default': 16}[preset],
      lr=5e-4 if small else 3e-4,      # original 5e-5 (decoder+MLP) at batch 32 x 40 epochs
      lr_encoder=2e-4 if small else 1e-4,  # original 2e-5
      warmup_frac=0.1,
      weight_decay=0.01,
      clip=1.0,
      label_smoothing=0.1,
      loss_reduction='sum',            # original: KL summed over target words; 'mean' per word
      # M > 1: the captioner's forward and backward in M micro-batches of batch_size / M rows,
      # gradients accumulated; the same values except dropout's masks (drawn per micro-batch).
      micro_batches=1,
      # True: each batch holds whole scenes, a scene's change pair and its distractor pair in
      # rows 2i and 2i + 1 (the original's CLEVR step, B/2 scenes x 2 pairs); their shared
      # before image is encoded once. Needs a dataset whose records come in such pairs.
      scene_pairs=False,
      t_total_factor=1.0,              # schedule length / steps (2.0 = the original 2-GPU launch)
      log_every=10 if preset == 'tiny' else 50,
      eval_every={'tiny': 20, 'quick': 200, 'default': 350}[preset],
      checkpoint_every={'tiny': 10, 'quick': 200, 'default': 350}[preset],
      eval_batches=2 if preset == 'tiny' else 0,  # 0 = the whole split
  ))
  c.decoding = ml_collections.ConfigDict(dict(
      method='greedy',                 # original: greedy; 'beam'
      beam_size=3,
      alpha=0.0,                       # beam length penalty ((5+len)/6)^alpha; 0 = sum of log-probs
      # > 0: the captioner's encoder runs this many pairs at a time in inference (same values;
      # faster at paper size, docs/performance.md; on a data-parallel mesh use a multiple of
      # the data axis); 0: the whole batch at once.
      encode_rows=0,
  ))
  return c


PRESETS = ('tiny', 'quick', 'default', 'large', 'ablation')


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  parts = [p for p in (arg or 'default').split(',') if p]
  preset = parts[0] if parts and parts[0] in PRESETS else 'default'
  variants = [p for p in parts if p not in PRESETS]
  # default, large and ablation share the `small` benchmark, its tokenizer and the captioner;
  # the tables below are written for `large` ('default' keys) and `_short_stages` shrinks them.
  base = 'default' if preset in ('default', 'large', 'ablation') else preset

  config = ml_collections.ConfigDict()
  config.preset = preset
  config.seed = 0
  config.stages = STAGES
  config.data = _data(base)
  config.tokenizer = _tokenizer(base)
  config.pretrain = _pretrain(base)
  config.caption = _caption(base)
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
  config.report = ml_collections.ConfigDict(dict(gallery_per_type=3))
  # Reading the original's weight files (init_from, python -m procap_jax.convert): strict refuses
  # a file whose pickle names code outside the reader's allow-list (by default it is read for its
  # tensors with one warning line); a file may expand to max_expansion x its size on disk.
  config.weight_files = ml_collections.ConfigDict(dict(strict=False, max_expansion=4.0))
  if preset in ('default', 'ablation'):
    _short_stages(config)
  if preset == 'default':
    # One run: the cache would encode all 7,200 records' 9 frames twice to save the encoding
    # of about 1,600 stage-1 clips and 14,400 stage-2 pairs; measured on 2 cores, off is the
    # shorter job (docs/performance.md, "The default job's time"). The ablation runs share one.
    config.data.feature_cache = False
  if preset == 'ablation':
    config.report.gallery_per_type = 1
  config.variant = ','.join(variants)
  for v in variants:
    _apply_variant(config, v)
  return config


def _short_stages(config: ml_collections.ConfigDict) -> None:
  """`large`'s dataset, tokenizer and captioner with a smaller stage-1 encoder (width 64, 2
  blocks: a third of `large`'s stage-1 step time), a short stage 1 and a longer stage 2,
  validated on the whole val split. On seed 0 it scored test CIDEr 65.0 on a fresh clone (66.6
  with the feature cache, 72.2 in the ablation table's one-thread run) against `large`'s 67.1,
  its stage 1 at chance, in a sixth of the stage-1 + stage-2 time (docs/results.md,
  docs/performance.md)."""
  config.pretrain.model.width = 64
  config.pretrain.model.depth = 2
  p = config.pretrain.train
  p.steps, p.eval_every, p.checkpoint_every, p.log_every, p.lr = 200, 100, 100, 50, 5e-4
  p.decay_steps = min(p.decay_steps, 70)  # 0 stays 0 ('faithful')
  c = config.caption.train
  # 900 stage-2 steps: at 300 (and at 450, from the same stage 1) every run still wrote one
  # sentence for every pair; at 900 the full model decides change / no-change (docs/results.md).
  c.steps, c.eval_every, c.checkpoint_every, c.log_every = 900, 150, 150, 50
  c.lr, c.lr_encoder = 5e-4, 2e-4      # the quick preset's rates for its encoder size; not tuned


def _apply_variant(config: ml_collections.ConfigDict, variant: str) -> None:
  if variant == 'static':
    config.stages = ('tokenizer', 'caption')
    config.caption.init_from_pretrain = False
    config.caption.model.use_queries = False
  elif variant == 'no_queries':
    config.caption.model.use_queries = False
  elif variant == 'no_stage1':
    config.stages = ('tokenizer', 'caption')
    config.caption.init_from_pretrain = False
    _set_k(config, 1)
  elif variant in ('k1', 'k2', 'k4'):
    _set_k(config, int(variant[1]))
  elif variant == 'oracle':
    config.data.frame_source = 'oracle'
  elif variant in ('duda_patches', 'duda'):
    _set_duda(config, 'pixels' if variant == 'duda_patches' else 'features')
  elif variant == 'faithful':
    # The paper presets' stage-1 switches (configs/real_common.py) on the synthetic data, at
    # the preset's budget: what each departure of the default buys, measured (issue 24's row).
    config.pretrain.model.frame_difference = 'none'
    config.pretrain.model.embedding_std = 1.0
    config.pretrain.binary_inputs = 'masked'
    config.pretrain.train.decay_steps = 0
  else:
    raise ValueError(f'unknown config variant {variant!r}: the presets are tiny, quick, default, '
                     'large, ablation (first, e.g. configs/synthetic.py:quick) and the ablation '
                     'variants, after a preset, static, no_queries, no_stage1, k1, k2, k4, '
                     'oracle, faithful, and the DUDA baseline duda_patches, duda (e.g. '
                     ':default,static)')


def _set_k(config: ml_collections.ConfigDict, k: int) -> None:
  config.data.num_keyframes = k


def _set_duda(config: ml_collections.ConfigDict, inputs: str) -> None:
  """The DUDA baseline (docs/results.md, "DUDA baseline"): stage 2 only, a DUDA captioner on
  image patches ('pixels': no tokenizer, no stage 1) or on the frozen tokenizer's
  features ('features': the tokenizer stage first). The recipe is tuned on val only."""
  config.stages = ('caption',) if inputs == 'pixels' else ('tokenizer', 'caption')
  config.caption.model.kind = 'duda'
  config.caption.model.duda.input = inputs
  config.caption.init_from_pretrain = False
  config.data.sampler = 'uniform'      # DUDA reads before and after only: no scores file
  if inputs == 'pixels':
    config.data.feature_cache = False  # nothing to cache without a tokenizer
  t = config.caption.train
  t.lr = 1e-3                          # Adam (optax.adamw), warmup then linear decay to 0
  t.weight_decay = 0.0
  t.label_smoothing = 0.0
  t.loss_reduction = 'mean'
  t.warmup_frac = 0.05
  # As the original DUDA's step: each batch holds a scene's change pair and its distractor (the
  # same before image), so the captions of two pairs that differ only in the after image teach
  # the model to read the change; without it the speaker learns one sentence for every pair.
  t.scene_pairs = True
  if inputs == 'pixels':
    # A stem with spatial context that a small viewpoint shift leaves alone: 4 px patches (a
    # 16 x 16 grid), two 3 x 3 convolutions, and each cell's coordinates (the original's
    # AddSpatialInfo) so the attended features say where.
    d = config.caption.model.duda
    d.stem_patch, d.stem_channels, d.stem_convs, d.coords = 4, (64,), 2, True
  # The original's maps: a sigmoid per cell, summed (not a softmax): one map can weigh a moved
  # object's old and new place at once; with a softmax, moves were called additions.
  config.caption.model.duda.attention_norm = 'sigmoid'
  if config.preset != 'tiny':
    t.steps, t.batch_size = 2000, 32
    t.eval_every = t.checkpoint_every = 500
    t.log_every = 50
