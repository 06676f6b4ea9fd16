"""What every probe of `probe_consistency` shares: one jitted Adam/BCE trainer, a small MLP.

Dimension legend: M samples, d features, N decisions of a step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax


def train_bce(logits, params, tx, batch, n_train: int, steps: int, every: int, size: int = 8):
  """The one trainer of every probe: yields (step, params) every `every` steps.

  A step draws `size` of the first `n_train` rows (a numpy generator seeded 0, with replacement)
  and takes one jitted `tx` step on the mean binary cross-entropy of `logits(params, *inputs)`
  [N] against `labels` [N], where `batch(step, rows) -> (labels, *inputs)`.
  """
  opt = tx.init(params)

  @jax.jit
  def step(p, o, labels, *inputs):
    bce = lambda p: optax.sigmoid_binary_cross_entropy(logits(p, *inputs), labels).mean()
    u, o = tx.update(jax.grad(bce)(p), o, p)
    return optax.apply_updates(p, u), o

  rng = np.random.default_rng(0)
  for s in range(1, steps + 1):
    params, opt = step(params, opt, *batch(s, rng.integers(0, n_train, size)))
    if s % every == 0:
      yield s, params


def standardise(x: np.ndarray, n_train: int, *others: np.ndarray) -> list[np.ndarray]:
  """`x` and `others` [M, d] standardised per column with the mean and std of x[:n_train]."""
  mu, sd = x[:n_train].mean(0), x[:n_train].std(0) + 1e-6
  return [(v - mu) / sd for v in (x,) + others]


def mlp(d: int):
  """(parameters, apply) of a one-hidden-layer GELU MLP [M, d] -> logits [M]."""
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {'w1': jax.random.normal(k1, (d, 256)) / np.sqrt(d), 'b1': jnp.zeros(256),
            'w2': jax.random.normal(k2, (256, 1)) / 16.0, 'b2': jnp.zeros(1)}
  apply = lambda p, x: (jax.nn.gelu(x @ p['w1'] + p['b1']) @ p['w2'] + p['b2'])[:, 0]
  return params, apply
