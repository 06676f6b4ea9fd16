r"""Spot-the-Diff (Jhamtani & Berg-Kirkpatrick 2018) at paper size, and a CPU smoke variant.

Commands (build from your manual download first, see tfds_builders/spot_the_diff/README.md):

  python -m procap_jax.main --config configs/spot_the_diff.py:paper --workdir W \
      --config.data.manual_dir=<spot_the_diff download>
  python -m procap_jax.main --config configs/spot_the_diff.py:cpu --workdir W \
      --config.data.manual_dir=<folder>

Paper size (spec table 9): 224 px, VQGAN f16 1024x256, encoder 4 x 768 (the first 4 CLIP
ViT-B/32 blocks), decoder 3 x 512, vocab 834, k = 2.
Stage-1 text is CLIP BPE as in the original: add --config.data.bpe_merges_file=<CLIP's
bpe_simple_vocab_16e6.txt[.gz]> (openai/CLIP, or the ProCap source), or have open_clip_torch
installed (it ships the file).
Hardware: one 8-GPU/TPU host; the CPU variant runs anywhere.
Paper's result: CIDEr 42.7 on the test split (checkpoint chosen on test; ours on val).
Set --config.caption.train.steps to 40 epochs of your train split (pairs / 32 x 40).
"""

from configs import real_common


def get_config(arg: str | None = None):
  return real_common.make('spot_the_diff', arg or 'paper', encoder_depth=4, decoder_layers=3)
