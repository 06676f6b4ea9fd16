"""What a comparison of two differently compiled programs can promise, for the tests that make one.

Two XLA programs computing the same function (another sharding or mesh, another batch split or
chunking, cached vs full decoding, another CPU's vector width) may add up the same terms in
another order, so their float32 results differ by rounding. Summing n terms of scale s rounds
once per addition; the errors add up like a random walk, about sqrt(n) ulps of s (the worst case,
n ulps, needs every rounding to go the same way). So:

- float results are compared with a tolerance of a few ulps x sqrt(n) x the compared tensor's
  largest |value| (`sum_tolerance`, `assert_trees_close`), not with a fixed atol;
- discrete results (greedy ids, VQ codes, an argmax) are equal only where the decision had a
  margin: the top-2 gap of the scores exceeds twice the float error either program can make
  (`top2_gap`, `greedy_gaps`, `assert_same_ids_with_margins`; for codes `code_gaps`,
  `code_error`, `clear_codes`). The tests check the margin, so a near-tie makes them fail loudly
  (or, where stated, leaves a counted row or code out, with an asserted minimum kept) instead of
  flipping on another CPU.

The ulps factors are practical bounds (several times the random walk's typical size, not the
worst case); where a test can, it also checks the float error it assumes against the difference
it measures between the two programs, so a CPU that rounds worse fails that check by name.
"""

import math

import jax
import numpy as np

from procap_jax.models import vqgan

EPS = float(np.finfo(np.float32).eps)  # 1 ulp of 1.0 in float32


def sum_tolerance(scale: float, n: int, ulps: float = 8.0) -> float:
  """Rounding error bound for results made of n-term float32 sums of terms of size `scale`."""
  return ulps * EPS * math.sqrt(n) * float(scale)


def assert_trees_close(got, want, n: int, ulps: float = 8.0) -> None:
  """Every leaf of `got` within `sum_tolerance(max |leaf of want|, n, ulps)` of `want`'s leaf,
  plus a floor of `sum_tolerance(largest |value| of any leaf, n, 1)`: a leaf whose true value is
  0 (e.g. a bias before a normalisation) holds the rounding noise of its cancelling terms, whose
  scale is the tree's, not its own."""
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  overall = max(float(np.abs(np.asarray(w)).max(initial=0.0)) for w in want_leaves)
  floor = sum_tolerance(overall, n, 1.0)
  for (path, a), b in zip(got_leaves, want_leaves):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    bound = sum_tolerance(np.abs(b).max(initial=0.0), n, ulps) + floor
    err = float(np.abs(a - b).max(initial=0.0))
    assert err <= bound, f'{jax.tree_util.keystr(path)}: max |difference| {err:.3g} > {bound:.3g}'


def top2_gap(scores: np.ndarray, chosen: np.ndarray, banned: tuple[int, ...] = ()) -> np.ndarray:
  """scores [..., V], chosen [...] -> scores[chosen] minus the best other score ([...]), the
  `banned` columns (never chosen, e.g. a suppressed [UNK]) left out. Negative when `chosen` is
  not the argmax."""
  scores = np.array(scores, np.float32)
  scores[..., list(banned)] = -np.inf
  chosen = np.asarray(chosen)[..., None]
  top = np.take_along_axis(scores, chosen, -1)[..., 0]
  np.put_along_axis(scores, chosen, -np.inf, -1)
  return top - scores.max(-1)


def greedy_gaps(logits: np.ndarray, tokens: np.ndarray, eos_id: int,
                banned: tuple[int, ...] = ()) -> np.ndarray:
  """The top-2 gap of each greedy decision: logits [B, L-1, V] (teacher-forced on `tokens`, row t
  scoring token t + 1), tokens [B, L] -> gaps [B, L-1]; +inf for the steps after a row's [EOS]
  (no decision: [PAD] follows)."""
  tokens = np.asarray(tokens)
  gaps = top2_gap(logits, tokens[:, 1:], banned)
  done = np.cumsum(tokens[:, 1:-1] == eos_id, axis=1) > 0  # [B, L-2]: [EOS] already written
  gaps[:, 1:][done] = np.inf
  return gaps


def assert_same_ids_with_margins(got: np.ndarray, want: np.ndarray, gaps: np.ndarray,
                                 error: float, min_clear_rows: int) -> None:
  """`got` equals `want` [B, L] in every row whose decisions all had a top-2 gap above 2 *
  `error` (the largest float error of either program's scores), and at least `min_clear_rows`
  rows are such; in a row with a near-tie at step t, the tokens up to t (decided with margins)
  are equal and the rest may differ."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape
  near = gaps <= 2.0 * error  # [B, L-1]
  clear = ~near.any(axis=1)
  assert clear.sum() >= min_clear_rows, (
      f'only {clear.sum()} of {len(clear)} rows decided every word with a top-2 gap above '
      f'{2 * error:.3g}; smallest gap per row: {gaps.min(axis=1)}')
  for i in range(want.shape[0]):
    upto = want.shape[1] if clear[i] else int(np.argmax(near[i])) + 1  # tokens 0..t
    np.testing.assert_array_equal(got[i, :upto], want[i, :upto], err_msg=f'row {i}')


def code_gaps(z: np.ndarray, codebook: np.ndarray) -> np.ndarray:
  """z [..., D], codebook [K, D] -> the squared distance to the second-nearest code minus that
  to the nearest ([...]): how far `vqgan.nearest_code`'s choice is from a tie."""
  z, codebook = np.asarray(z, np.float64), np.asarray(codebook, np.float64)
  d = np.sum((z[..., None, :] - codebook) ** 2, axis=-1)  # [..., K]
  two = np.partition(d, 1, axis=-1)[..., :2]
  return two[..., 1] - two[..., 0]


def code_error(z: np.ndarray, codebook: np.ndarray, rel: float) -> np.ndarray:
  """Bound on how much a relative error `rel` in z (||dz|| <= rel ||z||) moves a code_gaps
  value: each distance ||z - e_k||^2 moves by at most 2 ||z - e_k|| ||dz|| (+ ||dz||^2), the gap
  by twice the largest of those ([...])."""
  z, codebook = np.asarray(z, np.float64), np.asarray(codebook, np.float64)
  dz = rel * np.linalg.norm(z, axis=-1)  # [...]
  far = np.linalg.norm(z[..., None, :] - codebook, axis=-1).max(-1)  # [...]
  return 2 * (2 * far * dz + dz ** 2)


def clear_codes(model: vqgan.VQGAN, params, images01, rel: float) -> np.ndarray:
  """[M, h*w] bool: which of `model.encode_tokens(images01)`'s codes win by more than a relative
  error `rel` of the encoder output can move the distances (`code_gaps` > `code_error`)."""
  def z_of(p, x):
    return model.apply({'params': p}, x, method=lambda m, x: m.quant_conv(
        m.encoder(vqgan.scale_input(x, m.token_input_scale), False)))
  z = np.asarray(jax.jit(z_of)(params, images01), np.float32)  # [M, h, w, D]
  z = z.reshape(z.shape[0], -1, z.shape[-1])  # [M, h*w, D]
  codebook = params['quantize']['embedding']
  return code_gaps(z, codebook) > code_error(z, codebook, rel)
