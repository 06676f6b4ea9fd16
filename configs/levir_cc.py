r"""LEVIR-CC (Liu et al. 2022, remote-sensing change captioning) at the paper's sizes, 256 px,
and a CPU smoke variant.

Commands (download by hand first, see tfds_builders/levir_cc/README.md; the first run builds the
dataset into W/data, `--mode build` builds only):

  python -m procap_jax.main --config configs/levir_cc.py:paper --workdir W \
      --config.data.manual_dir=<LEVIR-CC folder with LevirCCcaptions.json and images/>
  python -m procap_jax.main --config configs/levir_cc.py:cpu --workdir W \
      --config.data.manual_dir=<folder>       # smoke run: 32 px, 4 steps per stage

`paper`: the images' own 256 px (builder config `paper`, flow interpolation at build time), the
paper's model sizes as for CLEVR-Change and IER (spec table 9): VQGAN f16 with 1024 codes of
256 (a 16 x 16 token grid; its 16 px attention level is used at this size, so a taming VQGAN
trained at 256 px loads as it is), encoder 12 x 768 (CLIP ViT-B/32 blocks), decoder 2 x 512,
k = 2, stage-1 batch 8 for 200k steps, stage-2 batch 32 for 40 epochs (6,815 train pairs / 32 =
213 steps per epoch). Stage-1 text is CLIP BPE as in the original: add
--config.data.bpe_merges_file=<CLIP's bpe_simple_vocab_16e6.txt[.gz]>.
`cpu`: a smoke run of the pipeline (builder config `tiny32`, 4 steps per stage, batch 8), not a
captioner.
Hardware: `paper` is meant for one 8-GPU/TPU host (set --config.mesh.data to the device count);
`cpu` runs anywhere.
Expected use and result: ProCap's paper reports no LEVIR-CC score, so there is no figure to
reproduce. results.json holds BLEU-1..4, METEOR, ROUGE-L and CIDEr over all test pairs, over the
change pairs (`change/...`, changeflag 1) and over the no-change pairs (`no_change/...`,
changeflag 0), the split the remote-sensing papers report; the checkpoint is chosen on val.
"""

from configs import real_common

TRAIN_PAIRS = 6815  # LEVIR-CC's train split
STEPS_PER_EPOCH = -(-TRAIN_PAIRS // 32)  # stage-2 batch 32: 213


def get_config(arg: str | None = None):
  config = real_common.make('levir_cc', arg or 'paper', encoder_depth=12, decoder_layers=2,
                            image_size=256)
  if (arg or 'paper') == 'paper':
    ct = config.caption.train
    ct.steps = 40 * STEPS_PER_EPOCH
    ct.eval_every = ct.checkpoint_every = STEPS_PER_EPOCH
  return config
