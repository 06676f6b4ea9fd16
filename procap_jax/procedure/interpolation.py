"""Frame interpolation from (before, after) to 2^L + 1 frames.

INTERFACE (stable; the implementation is being extended with the `flow` method):
  interpolate(before, after, num_frames=9, method='flow', size=None) -> uint8 [num_frames, H, W, 3]
"""

import numpy as np


def interpolate(before: np.ndarray, after: np.ndarray, num_frames: int = 9, method: str = 'flow',
                size: int | None = None) -> np.ndarray:
  """Placeholder: crossfade for every method until the flow engine lands."""
  a = before.astype(np.float32)
  b = after.astype(np.float32)
  ts = np.linspace(0.0, 1.0, num_frames, dtype=np.float32)[:, None, None, None]
  return np.clip(np.rint((1 - ts) * a[None] + ts * b[None]), 0, 255).astype(np.uint8)
