r"""CLEVR-Change (Park et al. 2019) at paper size, and a CPU smoke variant.

Commands (build the dataset from your manual download first, see
tfds_builders/clevr_change/README.md):

  python -m procap_jax.main --config configs/clevr_change.py:paper --workdir W \
      --config.data.manual_dir=<clevr_change download>
  python -m procap_jax.main --config configs/clevr_change.py:cpu --workdir W \
      --config.data.manual_dir=<folder>       # smoke run: 32 px, 4 steps per stage

Paper size (spec table 9): 224 px, VQGAN f16 1024x256, encoder 12 x 768 (CLIP ViT-B/32 blocks),
decoder 2 x 512, vocab 80, k = 2, stage-1 batch 8 for 200k steps, stage-2 batch 32 for 40 epochs
(33,830 train scenes x 2 pairs / 32 = 2,115 steps per epoch).
Stage-1 text is CLIP BPE as in the original: add --config.data.bpe_merges_file=<CLIP's
bpe_simple_vocab_16e6.txt[.gz]> (openai/CLIP, or the ProCap source), or have open_clip_torch
installed (it ships the file).
Hardware: meant for one 8-GPU/TPU host (set --config.mesh.data to the device count); the CPU
variant runs anywhere.
Paper's result: CIDEr 135.6 on the test split (their checkpoint was chosen on test; ours on val).
Use the official vocabulary for their checkpoints: --config.data.word2idx_file=clevr_word2idx.json.
"""

from configs import real_common


def get_config(arg: str | None = None):
  return real_common.make('clevr_change', arg or 'paper', encoder_depth=12, decoder_layers=2)
