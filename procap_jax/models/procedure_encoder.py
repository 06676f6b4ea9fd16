"""Stage-1 procedure encoder: a BEiT-style bidirectional transformer over caption + keyframes.

Dimension legend: B batch, T frames (keyframes), h x w token grid per frame, N = h*w tokens
per frame, L caption length (text_len), D width, K codebook size, C tokenizer feature channels,
S sequence length.

Sequence layout (stage 1, use_rel=True; the original's 811 tokens for L=24, T=4, N=196):

  0        [REL]                       special_emb[0] + special_pos_emb[0]
  1..L     caption                     text_emb[id'] + text_pos_emb[pos]; id' = id, or
                                       text_vocab_size + pos where id == 0 (padding)
  L+1      [ST1]                       special_emb[1] + special_pos_emb[1]
  L+2      [VID]                       special_emb[2] + special_pos_emb[2]
  L+3..    T x N frame tokens          (masked ? image_mask : conv_to_embedding(feature))
                                       + axial position e_t + e_h + e_w (flat t*N + i*w + j)

Stage 2 calls the encoder with use_rel=False and text=None: the text slots are then rows
0..L-1 of text_emb ('code', the original), the padding rows ('padding') or absent ('none'),
and the [ST1]/[VID] attention rows are either the original's off-by-one rows ('code') or the
actual ones ('aligned'); see `attention_mask`.

Parameter names follow the original `BERT` module (dalle_beit.py) so its checkpoints convert:
text_emb, text_pos_emb, special_emb, special_pos_emb, image_emb, image_mask (as is);
conv_to_embedding.{0,1} -> conv_to_embedding/{norm,dense}; target_pos_emb.weights_{0,1,2}
(1,T,1,1,D)... -> target_pos_emb/weights_{0,1,2} without the leading 1;
transformer.resblocks.{i} -> resblocks_{i} (see layers.py for the block layout);
to_logits{,_rel,_vid}.{0,1} -> to_logits{,_rel,_vid}/{norm,dense}. Linear weights transpose.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from procap_jax.models import layers

REL, ST1, VID = 0, 1, 2
NUM_SPECIAL = 5                  # REL, ST1, VID and two reserved rows, as the original
TEXT_SLOTS = ('code', 'padding', 'none')
STAGE2_MASKS = ('code', 'aligned')
FRAME_DIFFERENCES = ('none', 'before')

_PAPER_DEPTH = {'clevr_change': 12, 'spot_the_diff': 4, 'image_editing_request': 12}


def paper_config(dataset: str) -> dict:
  """The original's stage-1 encoder hyper-parameters for `dataset` (spec section 9).

  text_vocab_size is CLIP BPE's 49408 so the text table has the original's 49433 rows (for
  checkpoint conversion); our own runs use a word vocabulary instead.
  """
  if dataset not in _PAPER_DEPTH:
    raise ValueError(f'unknown dataset {dataset!r}; choose from {sorted(_PAPER_DEPTH)}')
  return dict(width=768, depth=_PAPER_DEPTH[dataset], heads=12, mlp_ratio=4, text_len=24,
              text_vocab_size=49408, num_frames=4, grid=(14, 14), feature_dim=256,
              codebook_size=1024)


def attention_mask(num_text: int, num_frame_tokens: int, *, use_rel: bool,
                   stage2_mask: str = 'code') -> np.ndarray:
  """Which keys each query may attend to (True = visible), as a static [S, S] bool array.

  Fully bidirectional, except two rows that cannot see any EARLIER position (they keep
  themselves and everything after). With use_rel those rows are [ST1] and [VID]: [ST1] sees
  itself, [VID] and the frames; [VID] sees itself and the frames.

  Without [REL] (stage 2) the row indices depend on `stage2_mask`:
    'code': the original's rows 1 + num_text and 2 + num_text, computed for the layout WITH
      [REL], so they hit [VID] and the first frame token (spec 5.2 / 8.2);
    'aligned': the actual [ST1] and [VID] rows.

  Args:
    num_text: number of text slots in the sequence (L, or 0 without text slots).
    num_frame_tokens: T * N.
    use_rel: whether [REL] leads the sequence.
    stage2_mask: 'code' | 'aligned'; ignored when use_rel.

  Returns:
    bool [S, S] with S = use_rel + num_text + 2 + num_frame_tokens; rows are queries.
  """
  if stage2_mask not in STAGE2_MASKS:
    raise ValueError(f'stage2_mask must be one of {STAGE2_MASKS}, got {stage2_mask!r}')
  st1 = int(use_rel) + num_text
  s = st1 + 2 + num_frame_tokens
  rows = (st1, st1 + 1)
  if not use_rel and stage2_mask == 'code':
    rows = (st1 + 1, st1 + 2)
  mask = np.ones((s, s), dtype=bool)
  for r in rows:
    mask[r, :r] = False
  return mask


class AxialPositionEmbedding(nn.Module):
  """Summed axial embedding e_t + e_h + e_w (lucidrains' AxialPositionalEmbedding: N(0, std),
  std 1 in the original)."""
  shape: tuple[int, int, int]
  width: int
  std: float = 1.0

  @nn.compact
  def __call__(self) -> jax.Array:
    """Returns [T, h, w, D]."""
    t, h, w = self.shape
    init = nn.initializers.normal(self.std)
    e_t = self.param('weights_0', nn.with_logical_partitioning(init, ('pos', None, None, 'embed')),
                     (t, 1, 1, self.width))
    e_h = self.param('weights_1', nn.with_logical_partitioning(init, (None, 'pos', None, 'embed')),
                     (1, h, 1, self.width))
    e_w = self.param('weights_2', nn.with_logical_partitioning(init, (None, None, 'pos', 'embed')),
                     (1, 1, w, self.width))
    return e_t + e_h + e_w  # [T, h, w, D]


def _table(module: nn.Module, name: str, rows: int, width: int, row_axis: str | None,
           std: float) -> jax.Array:
  return module.param(name, nn.with_logical_partitioning(nn.initializers.normal(std),
                                                         (row_axis, 'embed')), (rows, width))


class PixelStem(nn.Module):
  """A learned stem over the pooled pixels that `tokenizer.model.feature_pixels` appends to the
  features (not the original's; docs/fidelity.md): each frame's P x P pixels per token cell are
  put back into an image [hP, wP, 3], two 3 x 3 convolutions with ReLU (`channels` each) give the
  cells their neighbours' context, and each cell's P x P outputs are flattened.

  [B, T, h, w, 3 P^2] -> [B, T, h, w, P^2 channels].
  """
  pixels: int
  channels: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, h, w, _ = x.shape
    img = layers.cells_to_image(x.reshape(b * t, h, w, -1), self.pixels)  # [BT, hP, wP, 3]
    for i in range(2):
      img = nn.relu(nn.Conv(
          self.channels, (3, 3), name=f'conv_{i}',
          kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), (None,) * 4),
          bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)))(img))
    return layers.image_to_cells(img, self.pixels).reshape(b, t, h, w, -1)


class ProcedureEncoder(nn.Module):
  """[REL] + caption + [ST1] + [VID] + T x N frame tokens -> hidden states and stage-1 heads.

  Attributes (the keys of `config.pretrain.model`, plus dtype):
    width: D.
    depth: number of CLIP residual attention blocks.
    heads: attention heads.
    mlp_ratio: MLP width / D.
    text_len: L, caption slots.
    text_vocab_size: V_text; the text table has V_text + L + 1 rows (per-position padding).
    num_frames: T.
    grid: (h, w) tokens per frame side.
    feature_dim: C, channels of the tokenizer's continuous features.
    codebook_size: K, tokenizer codes (masked-token targets).
    embedding_std: std of the normal init of every embedding table (text, special, axial
      positions, the unused image_emb). 1.0 is the original's (torch nn.Embedding and
      lucidrains' axial embedding defaults); from scratch, a small value (e.g. 0.02) lets the
      frame content outweigh the positions at init (docs/fidelity.md).
    remat: recompute each block's activations in the backward pass instead of keeping them
      (`nn.remat`): the same values and parameter tree. Meant for accelerators; XLA:CPU
      schedules the recomputation early and saves no memory (docs/performance.md).
    scan_blocks: run the blocks as one `lax.scan` over their stacked parameters with each
      block `jax.checkpoint`ed, so the backward pass keeps only every block's input and
      attention output and recomputes one block at a time inside the loop (where no scheduler
      can hoist the recomputation, unlike `remat`). The parameters stay per block
      (`resblocks_<i>`, the original's layout); they are stacked on the fly. Same values; used
      after init.
    scan_keep_dense: with `scan_blocks`, each block also keeps the outputs of its dense
      products (in_proj, out_proj, c_fc), so the backward pass recomputes no product, only
      LayerNorms and activations: faster at about 2.5 times the scan's activation memory (paper
      stage 1; docs/performance.md). Same values.
    attention_chunk: 0 = full attention; C > 0 = attention queries in chunks of C, each
      rematerialised (`attention.chunked_attention`): the same values and parameter tree, with
      only a [B, H, C, S] block of scores alive at a time (docs/performance.md).
    attention_group: 0 = as `attention_chunk` says; G > 0 = attention for G (batch, head) pairs
      at a time (`attention.grouped_attention`, taking precedence over `attention_chunk`): the
      same values and parameter tree, a [G, S, S] block of scores alive at a time, which stays
      in a CPU's cache (attention 1.4 to 2.5 times as fast as either form above;
      docs/performance.md). On a data-parallel mesh, a multiple of the data axis keeps each
      device's rows on that device (each loop step takes pairs from every device).
    frame_difference: 'none' (the original) | 'before': every frame token after the first also
      adds `diff_to_embedding`, a Dense of (its tokenizer feature - the first frame's feature at
      the same grid position), zero where either token is masked. Not in the original: it hands
      the encoder the same-position before/after comparison that a from-scratch encoder does not
      learn in a CPU budget (docs/fidelity.md). No LayerNorm before the Dense, so the size of the
      difference survives. 'none' creates no parameter, so the original's layout is kept.
    pixels: P, the pooled pixels per token cell side at the end of the features
      (`tokenizer.model.feature_pixels`; `config_lib.encoder_kwargs` fills it); 0 = none.
    pixel_stem: 0 (the original) | C1 > 0: a `PixelStem` of C1 channels over those pixels adds
      `pixel_to_embedding` of its output to every frame token (and, with frame_difference
      'before', `pixel_diff_to_embedding` of its difference from the first frame's).
    dtype: computation dtype of the matmuls (parameters are float32).
  """
  width: int
  depth: int
  heads: int
  mlp_ratio: int
  text_len: int
  text_vocab_size: int
  num_frames: int
  grid: tuple[int, int]
  feature_dim: int
  codebook_size: int
  embedding_std: float = 1.0
  remat: bool = False
  scan_blocks: bool = False
  scan_keep_dense: bool = False
  attention_chunk: int = 0
  attention_group: int = 0
  frame_difference: str = 'none'
  pixels: int = 0
  pixel_stem: int = 0
  dtype: Any = jnp.float32

  def setup(self):
    d, std = self.width, self.embedding_std
    self.text_emb = _table(self, 'text_emb', self.text_vocab_size + self.text_len + 1, d,
                           'text_vocab', std)
    self.text_pos_emb = _table(self, 'text_pos_emb', self.text_len, d, 'pos', std)
    self.special_emb = _table(self, 'special_emb', NUM_SPECIAL, d, 'pos', std)
    self.special_pos_emb = _table(self, 'special_pos_emb', NUM_SPECIAL, d, 'pos', std)
    # Unused in the forward; kept (like torch's Embedding) for checkpoint compatibility.
    self.image_emb = _table(self, 'image_emb', self.codebook_size + 2, d, 'codebook', std)
    self.image_mask = self.param(
        'image_mask', nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)), (d,))
    self.conv_to_embedding = layers.LayerNormDense(d, (None, 'embed'), dtype=self.dtype)
    if self.frame_difference not in FRAME_DIFFERENCES:
      raise ValueError(f'frame_difference must be one of {FRAME_DIFFERENCES}, '
                       f'got {self.frame_difference!r}')
    if self.frame_difference == 'before':
      self.diff_to_embedding = layers.dense(d, (None, 'embed'), dtype=self.dtype,
                                            fan_in=self.feature_dim)
    if self.pixel_stem:
      if not self.pixels:
        raise ValueError('pixel_stem needs the pooled pixels of tokenizer.model.feature_pixels')
      self.stem = PixelStem(self.pixels, self.pixel_stem)
      self.pixel_to_embedding = layers.dense(d, (None, 'embed'), dtype=self.dtype,
                                             fan_in=self.pixels ** 2 * self.pixel_stem)
      if self.frame_difference == 'before':
        self.pixel_diff_to_embedding = layers.dense(d, (None, 'embed'), dtype=self.dtype,
                                                    fan_in=self.pixels ** 2 * self.pixel_stem)
    self.target_pos_emb = AxialPositionEmbedding((self.num_frames,) + tuple(self.grid), d, std)
    block = nn.remat(layers.ResidualAttentionBlock) if self.remat else layers.ResidualAttentionBlock
    self.resblocks = [block(d, self.heads, self.mlp_ratio, self.depth, self.dtype,
                            self.attention_chunk, self.attention_group)
                      for _ in range(self.depth)]
    self.to_logits = layers.LayerNormDense(self.codebook_size, ('embed', 'vocab'), self.dtype)
    self.to_logits_rel = layers.LayerNormDense(1, ('embed', None), self.dtype)
    self.to_logits_vid = layers.LayerNormDense(1, ('embed', None), self.dtype)

  def _special(self, token: int, batch: int) -> jax.Array:
    e = self.special_emb[token] + self.special_pos_emb[token]  # [D]
    return jnp.broadcast_to(e, (batch, 1, self.width))  # [B, 1, D]

  def _text(self, text: jax.Array | None, batch: int, text_slot: str) -> jax.Array:
    """Text slots [B, L, D] (or [B, 0, D] for text_slot='none' without text)."""
    pos = jnp.arange(self.text_len)
    if text is not None:
      if text.shape[1] != self.text_len:
        raise ValueError(f'text has length {text.shape[1]}, the encoder expects {self.text_len}')
      ids = jnp.where(text == 0, self.text_vocab_size + pos, text)  # [B, L]
    elif text_slot == 'code':
      ids = jnp.broadcast_to(pos, (batch, self.text_len))  # [B, L]: rows 0..L-1
    elif text_slot == 'padding':
      ids = jnp.broadcast_to(self.text_vocab_size + pos, (batch, self.text_len))  # [B, L]
    elif text_slot == 'none':
      return jnp.zeros((batch, 0, self.width), jnp.float32)
    else:
      raise ValueError(f'text_slot must be one of {TEXT_SLOTS}, got {text_slot!r}')
    return jnp.take(self.text_emb, ids, axis=0) + self.text_pos_emb[None]  # [B, L, D]

  def _frames(self, features: jax.Array, frame_mask: jax.Array,
              visible_frames: tuple[int, ...] | None = None) -> jax.Array:
    """Frame tokens [B, T*N, D] from features [B, T, h, w, C] and mask [B, T, N].

    T may be smaller than num_frames (stage 2 without queries): the frames then take the
    first T axial frame positions. `visible_frames` (static; see `__call__`) names the only
    frames with visible tokens: the pixel stem runs on those frames alone.
    """
    b, t, h, w, c = features.shape
    expected = tuple(self.grid) + (self.feature_dim,)
    if (h, w, c) != expected or t > self.num_frames:
      raise ValueError(f'frame_features have shape {features.shape[1:]}, expected '
                       f'({self.num_frames} or fewer frames,) + {expected}')
    f = features.astype(jnp.float32)  # [B, T, h, w, C]
    emb = self.conv_to_embedding(f).astype(jnp.float32)  # [B, T, h, w, D]
    if self.pixel_stem:
      pixels = f[..., c - 3 * self.pixels ** 2:]  # [B, T, h, w, 3 P^2]
      if visible_frames is not None and len(visible_frames) < t:
        # The other frames are masked whole: their stem output is replaced by the mask vector
        # and hidden from the difference below, so zeros stand in for it (the same values).
        shown = np.asarray(visible_frames)
        part = self.stem(pixels[:, shown])  # [B, len(shown), h, w, P^2 C1]
        stem = jnp.zeros((b, t) + part.shape[2:], part.dtype).at[:, shown].set(part)
      else:
        stem = self.stem(pixels)  # [B, T, h, w, P^2 C1]
      emb = emb + self.pixel_to_embedding(stem).astype(jnp.float32)
    masked = frame_mask.reshape(b, t, h, w, 1)  # [B, T, h, w, 1]
    emb = jnp.where(masked, self.image_mask, emb)  # [B, T, h, w, D]
    if self.frame_difference == 'before' and t > 1:
      diff = self.diff_to_embedding(f[:, 1:] - f[:, :1]).astype(jnp.float32)  # [B, T-1, h, w, D]
      if self.pixel_stem:
        diff = diff + self.pixel_diff_to_embedding(stem[:, 1:] - stem[:, :1]).astype(jnp.float32)
      hidden = masked[:, 1:] | masked[:, :1]  # either token masked: no difference to show
      emb = emb.at[:, 1:].add(jnp.where(hidden, 0.0, diff))  # [B, T, h, w, D]
    emb = emb + self.target_pos_emb()[None, :t]  # [B, T, h, w, D]
    return emb.reshape(b, t * h * w, self.width)  # [B, T*N, D]

  def _scanned_blocks(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """The blocks as a checkpointed `lax.scan` (see `scan_blocks`): [B, S, D] -> [B, S, D]."""
    stacked = jax.tree.map(lambda *p: jnp.stack(p),  # [depth, ...] per parameter
                           *[nn.meta.unbox(block.variables['params']) for block in self.resblocks])
    proto = layers.ResidualAttentionBlock(self.width, self.heads, self.mlp_ratio, self.depth,
                                          self.dtype, self.attention_chunk,
                                          self.attention_group, parent=None)

    def body(h, params):
      return proto.apply({'params': params}, h, mask), None

    # Keeping each block's attention output ([B, S, D]) spares the recomputed forward its
    # attention (the attention's backward recomputes its own probabilities anyway): paper
    # stage 1 at batch 2, bf16, about 9 % faster for 0.16 GiB (docs/performance.md).
    keep = (layers.ATTENTION_OUTPUT,) + ((layers.DENSE_OUTPUT,) if self.scan_keep_dense else ())
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.save_only_these_names(*keep))

    x, _ = jax.lax.scan(body, x, stacked)
    return x

  def __call__(self, text: jax.Array | None, frame_features: jax.Array, frame_mask: jax.Array, *,
               use_rel: bool, stage2_mask: str = 'code', text_slot: str = 'code',
               visible_frames: tuple[int, ...] | None = None) -> dict:
    """Encodes control tokens and frames.

    Args:
      text: int32 [B, L] caption ids (0 = padding), or None (stage 2; see `text_slot`).
      frame_features: [B, T, h, w, C] continuous tokenizer features (T <= num_frames).
      frame_mask: bool [B, T, N], True = replaced by the learned `image_mask` vector.
      use_rel: prepend [REL] (stage 1).
      stage2_mask: 'code' | 'aligned' attention rows when not use_rel (see `attention_mask`).
      text_slot: with text=None: 'code' (rows 0..L-1 of text_emb), 'padding' (the padding
        rows, an empty stage-1 caption) or 'none' (no text slots).
      visible_frames: None, or a static tuple of the frames that have visible tokens, every
        token of the other frames being masked (stage 2: before and after; the caller
        guarantees it). Only spares the pixel stem those frames' work: the same values.

    Returns:
      dict with hidden [B, S, D], frame_hidden [B, T*N, D], frame_logits [B, T*N, K] (f32),
      vid_logit [B] (f32) and, when use_rel, rel_logit [B] (f32).
    """
    b = frame_features.shape[0]
    parts = [self._special(REL, b)] if use_rel else []
    text_emb = self._text(text, b, text_slot)  # [B, L or 0, D]
    num_text = text_emb.shape[1]
    parts += [text_emb, self._special(ST1, b), self._special(VID, b)]
    control_len = sum(p.shape[1] for p in parts)
    frames = self._frames(frame_features, frame_mask, visible_frames)  # [B, T*N, D]
    x = jnp.concatenate(parts + [frames], axis=1)  # [B, S, D]
    mask = jnp.asarray(attention_mask(num_text, frames.shape[1], use_rel=use_rel,
                                      stage2_mask=stage2_mask))  # [S, S]
    if self.scan_blocks and not self.is_initializing():
      x = self._scanned_blocks(x, mask)
    else:
      for block in self.resblocks:
        x = block(x, mask)
    frame_hidden = x[:, control_len:]  # [B, T*N, D]
    out = dict(hidden=x, frame_hidden=frame_hidden,
               frame_logits=self.to_logits(frame_hidden).astype(jnp.float32),
               vid_logit=self.to_logits_vid(x[:, control_len - 1])[:, 0].astype(jnp.float32))
    if use_rel:
      out['rel_logit'] = self.to_logits_rel(x[:, 0])[:, 0].astype(jnp.float32)
    elif self.is_initializing():
      self.to_logits_rel(x[:, 0])  # create the head so every call path has the same tree
    return out


def param_count(model_kwargs: dict) -> int:
  """Number of parameters of ProcedureEncoder(**model_kwargs), without allocating them."""
  model = ProcedureEncoder(**model_kwargs)
  t, (h, w), c = model_kwargs['num_frames'], model_kwargs['grid'], model_kwargs['feature_dim']
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, model_kwargs['text_len']), jnp.int32),
                         jnp.zeros((1, t, h, w, c)), jnp.zeros((1, t, h * w), bool),
                         use_rel=True))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.meta.unbox(shapes['params'])))
