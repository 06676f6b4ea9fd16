"""Random stand-ins for a step's inputs when their values do not matter.

The step benchmarks (bench/) time train steps on them and the sharding tests compare one step on
several meshes: a batch of the batch contract (docs/architecture.md) with random content and a
randomly initialised tokenizer in place of the frozen one.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from procap_jax import config_lib
from procap_jax.models import vqgan


def fake_batch(config, batch_size: int, seed: int = 0, feature_cache: bool = False,
               scenes: bool = False) -> dict:
  """A batch of the contract with random content: frames [B, T, S, S, 3] and captions [B, L].

  With `feature_cache` it also carries the tokenizer feature cache's keys (random features
  [B, T, h, w, C] in `config.data.feature_cache_dtype`, codes [B, T, h*w]). With `scenes` rows
  2i and 2i + 1 have the same before image (keyframe 0), as whole CLEVR scenes do.
  """
  rng = np.random.default_rng(seed)
  s, t, l = config.data.image_size, config_lib.frame_slots(config), config.data.max_caption_len
  frames = rng.integers(0, 256, (batch_size, t, s, s, 3), dtype=np.uint8)
  if scenes:
    frames[1::2, 0] = frames[0::2, 0][:batch_size // 2]
  caption = rng.integers(8, 40, (batch_size, l)).astype(np.int32)
  caption[:, 0] = 4
  caption[:, 12] = 5
  caption[:, 13:] = 0
  batch = {
      'before': frames[:, 0], 'after': frames[:, -1], 'keyframes': frames,
      'keyframe_index': np.tile(np.linspace(0, 8, t).astype(np.int32), (batch_size, 1)),
      'caption_in': caption, 'encoder_text': np.where(caption > 7, caption, 0).astype(np.int32),
      'change_type': rng.integers(0, 6, batch_size).astype(np.int32),
      'example_index': np.arange(batch_size, dtype=np.int32),
      'valid': np.ones(batch_size, bool),
  }
  if feature_cache:
    (h, w), m = config.pretrain.model.grid, config.pretrain.model
    batch['keyframe_features'] = rng.normal(size=(batch_size, t, h, w, m.feature_dim)).astype(
        config.data.feature_cache_dtype)
    batch['keyframe_codes'] = rng.integers(0, m.codebook_size, (batch_size, t, h * w),
                                           dtype=np.int32)
  return batch


def random_tokenizer(config) -> dict:
  """Randomly initialised VQGAN 'params' of `config.tokenizer.model` (host numpy)."""
  model = vqgan.VQGAN(**config.tokenizer.model)
  s = config.data.image_size
  variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros([1, s, s, 3]))
  return jax.tree.map(np.asarray, jax.device_get(nn.meta.unbox(variables['params'])))
