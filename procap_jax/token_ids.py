"""The caption vocabulary's special tokens and their ids (the first rows of every vocabulary,
`data/vocab.py`), and the label the loss skips. Models and decoding need the ids, not the
vocabulary, so they live here, below both.
"""

SPECIAL_TOKENS = ('[PAD]', '[CLS]', '[SEP]', '[VID]', '[BOS]', '[EOS]', '[UNK]', '[MASK]')
PAD, CLS, SEP, VID, BOS, EOS, UNK, MASK = range(len(SPECIAL_TOKENS))
# the special ids a caption search needs (`procap_jax.decoding.search`)
DECODING_IDS = dict(bos_id=BOS, eos_id=EOS, unk_id=UNK, pad_id=PAD)
IGNORE = -1  # label of positions the loss skips
