r"""Image-Editing-Request (Tan et al. 2019) at paper size, and a CPU smoke variant.

Commands (build from your manual download first, see
tfds_builders/image_editing_request/README.md):

  python -m procap_jax.main --config configs/image_editing_request.py:paper --workdir W \
      --config.data.manual_dir=<ier download>
  python -m procap_jax.main --config configs/image_editing_request.py:cpu --workdir W \
      --config.data.manual_dir=<folder>

Paper size (spec table 9): 224 px, VQGAN f16 1024x256, encoder 12 x 768, decoder 2 x 512,
vocab 524, k = 2.
Stage-1 text is CLIP BPE as in the original: add --config.data.bpe_merges_file=<CLIP's
bpe_simple_vocab_16e6.txt[.gz]> (openai/CLIP, or the ProCap source), or have open_clip_torch
installed (it ships the file).
Hardware: one 8-GPU/TPU host; the CPU variant runs anywhere.
Paper's result: CIDEr 40.6 on the test split (checkpoint chosen on test; ours on val).
Set --config.caption.train.steps to 40 epochs of your train split (3,061 pairs / 32 x 40 = 3,840).
"""

from configs import real_common


def get_config(arg: str | None = None):
  config = real_common.make('image_editing_request', arg or 'paper', encoder_depth=12,
                            decoder_layers=2)
  if (arg or 'paper') == 'paper':
    config.caption.train.steps = 3840
    config.caption.train.eval_every = config.caption.train.checkpoint_every = 96
  return config
