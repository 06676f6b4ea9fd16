"""Tests of models/decoder.py: shapes, causality, tied embedding, the original's quirks."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from procap_jax.models import decoder

B, L, M, H, HEADS, F, V = 3, 7, 5, 12, 3, 17, 11


def _decoder(**kwargs) -> decoder.CaptionDecoder:
  args = dict(vocab_size=V, hidden=H, heads=HEADS, ffn=F, layers=2, dropout=0.1, max_len=L)
  args.update(kwargs)
  return decoder.CaptionDecoder(**args)


def _inputs(seed: int = 0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  tokens = jax.random.randint(k1, (B, L), 0, V)
  memory = jax.random.normal(k2, (B, M, H))
  return tokens, memory


def _init(model, tokens, memory):
  return nn.meta.unbox(model.init(jax.random.key(1), tokens, memory))


def test_logits_shape_and_parameter_names():
  model = _decoder()
  tokens, memory = _inputs()
  variables = _init(model, tokens, memory)
  logits = model.apply(variables, tokens, memory)
  assert logits.shape == (B, L, V) and logits.dtype == jnp.float32
  params = variables['params']
  assert set(params) == {'output', 'blocks_0', 'blocks_1'}
  assert params['output']['kernel'].shape == (H, V) and params['output']['bias'].shape == (V,)
  # the original's attention has no projection biases
  assert set(params['blocks_0']['self_attn']['query']) == {'kernel'}


def test_qkv_bias_switch_adds_biases():
  model = _decoder(qkv_bias=True)
  tokens, memory = _inputs()
  params = _init(model, tokens, memory)['params']
  for name in ('query', 'key', 'value', 'out'):
    assert params['blocks_0']['cross_attn'][name]['bias'].shape == (H,)


def test_causal_and_memory_dependence():
  model = _decoder()
  tokens, memory = _inputs()
  variables = _init(model, tokens, memory)
  logits = model.apply(variables, tokens, memory)
  changed = tokens.at[:, 4].set((tokens[:, 4] + 1) % V)
  logits2 = model.apply(variables, changed, memory)
  np.testing.assert_allclose(logits2[:, :4], logits[:, :4], atol=1e-6)
  assert np.abs(logits2[:, 4:] - logits[:, 4:]).max() > 1e-4
  logits3 = model.apply(variables, tokens, memory + 1.0)
  assert np.abs(logits3 - logits).max() > 1e-4


def test_tied_embedding_is_scaled_output_kernel():
  model = _decoder()
  tokens, memory = _inputs()
  variables = _init(model, tokens, memory)
  emb = model.apply(variables, tokens, method=lambda m, t: m.output.embed(t))
  kernel = np.asarray(variables['params']['output']['kernel'])
  np.testing.assert_allclose(emb, kernel.T[np.asarray(tokens)] * math.sqrt(H), rtol=1e-6)
  # the embedding gets gradient through the output kernel (no separate table exists)
  grad = jax.grad(lambda p: model.apply({'params': p}, tokens, memory)[:, 0].sum())(
      variables['params'])
  rows = np.abs(np.asarray(grad['output']['kernel'])).sum(0)
  assert rows.min() > 0


def test_sinusoid_table_formula():
  table = decoder.sinusoid_table(5, 6)
  for p in range(5):
    for c in range(6):
      angle = p / 10000 ** ((c - c % 2) / 6)
      expected = math.sin(angle) if c % 2 == 0 else math.cos(angle)
      assert table[p, c] == pytest.approx(expected, abs=1e-6)


def test_layernorm_variants_by_hand():
  x = np.array([[1.0, 2.0, 4.0, 7.0], [0.5, -1.0, 3.0, 0.0]], np.float32)
  gamma = np.array([1.0, 2.0, 0.5, -1.0], np.float32)
  beta = np.array([0.1, 0.0, -0.2, 0.3], np.float32)
  params = {'params': {'scale': gamma, 'bias': beta}}
  mean = x.mean(-1, keepdims=True)
  unbiased = gamma * (x - mean) / (x.std(-1, ddof=1, keepdims=True) + 1e-6) + beta
  standard = gamma * (x - mean) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) + beta
  got_u = decoder.DecoderLayerNorm('unbiased_std').apply(params, x)
  got_s = decoder.DecoderLayerNorm('standard').apply(params, x)
  np.testing.assert_allclose(got_u, unbiased, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_s, standard, rtol=1e-5, atol=1e-6)
  assert np.abs(unbiased - standard).max() > 0.05


@pytest.mark.parametrize('scale', ['d_model', 'head_dim'])
def test_attention_by_hand(scale):
  hidden, heads, lq, lk = 8, 2, 3, 5
  attn = decoder.Attention(hidden, heads, scale=scale, use_bias=False, dropout=0.1)
  x = jax.random.normal(jax.random.key(2), (1, lq, hidden))
  kv = jax.random.normal(jax.random.key(3), (1, lk, hidden))
  mask = np.tril(np.ones([lq, lk], bool), k=1)
  params = nn.meta.unbox(attn.init(jax.random.key(4), x, kv, mask, True))
  got = attn.apply(params, x, kv, mask, True)

  p = jax.tree.map(np.asarray, params['params'])
  q, k, v = (np.asarray(a)[0] @ p[n]['kernel'] for a, n in ((x, 'query'), (kv, 'key'),
                                                            (kv, 'value')))
  d_h = hidden // heads
  divisor = math.sqrt(hidden if scale == 'd_model' else d_h)
  outs = []
  for h in range(heads):
    sl = slice(h * d_h, (h + 1) * d_h)
    s = q[:, sl] @ k[:, sl].T / divisor
    s = np.where(mask, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    outs.append((w / w.sum(-1, keepdims=True)) @ v[:, sl])
  expected = np.concatenate(outs, -1) @ p['out']['kernel']
  np.testing.assert_allclose(got[0], expected, rtol=1e-5, atol=1e-6)


def test_attention_scale_switch_changes_outputs():
  tokens, memory = _inputs()
  a, b = _decoder(attention_scale='d_model'), _decoder(attention_scale='head_dim')
  variables = _init(a, tokens, memory)
  diff = a.apply(variables, tokens, memory) - b.apply(variables, tokens, memory)
  assert np.abs(diff).max() > 1e-4


def test_dropout_only_in_train_mode():
  model = _decoder()
  tokens, memory = _inputs()
  variables = _init(model, tokens, memory)
  eval1 = model.apply(variables, tokens, memory)
  np.testing.assert_array_equal(eval1, model.apply(variables, tokens, memory))
  train = model.apply(variables, tokens, memory, train=True, rngs={'dropout': jax.random.key(5)})
  assert np.abs(train - eval1).max() > 1e-4


def test_cached_steps_equal_full_pass():
  model = _decoder(layers=3)
  tokens, memory = _inputs(seed=7)
  variables = _init(model, tokens, memory)
  full = model.apply(variables, tokens, memory)
  cache = model.apply(variables, memory, method='init_cache')
  step = jax.jit(lambda c, t, p: model.apply(variables, c, t, p, method='step'))
  for pos in range(L):
    logits, cache = step(cache, tokens[:, pos], pos)
    np.testing.assert_allclose(logits, full[:, pos], atol=1e-5)


def test_too_long_caption_is_rejected():
  model = _decoder(max_len=4)
  tokens, memory = _inputs()
  with pytest.raises(ValueError, match='max_len'):
    model.init(jax.random.key(0), tokens, memory)


@pytest.mark.parametrize('attention_scale', ['d_model', 'head_dim'])
def test_learns_to_read_a_local_signal_from_the_memory(attention_scale):
  """With the original's quirks on, a small decoder trained briefly writes the class hidden at
  ONE random memory slot (a stand-in for a local change among position-dominated slots): the
  cross-attention path can learn to find it, so a captioner that ignores its images is not
  explained by the decoder alone (see bench/diagnose_caption.py)."""
  import optax
  v, length, hidden, m, classes = 20, 5, 32, 32, 4
  dec = decoder.CaptionDecoder(vocab_size=v, hidden=hidden, heads=4, ffn=64, layers=2,
                               dropout=0.0, max_len=length, attention_scale=attention_scale,
                               qkv_bias=False, layernorm='unbiased_std')
  rng = np.random.default_rng(0)
  slots = rng.normal(size=(m, hidden)).astype(np.float32)  # [M, H] shared "positions"
  signal = 2.0 * rng.normal(size=(classes, hidden)).astype(np.float32)  # [C, H]

  def batch(n):
    c = rng.integers(0, classes, n)
    memory = np.broadcast_to(slots, (n, m, hidden)).copy()
    memory[np.arange(n), rng.integers(0, m, n)] += signal[c]
    tokens = np.stack([[1, 5 + k, 10 + k, 2, 0] for k in c]).astype(np.int32)  # [n, L]
    return jnp.asarray(memory), jnp.asarray(tokens)

  memory, tokens = batch(2)
  params = dec.init(jax.random.PRNGKey(0), tokens, memory)['params']
  opt = optax.adam(3e-3)
  opt_state = opt.init(params)

  def accuracy_and_loss(p, memory, tokens):
    logits = dec.apply({'params': p}, tokens, memory)[:, :-1]  # [n, L-1, V]
    labels, keep = tokens[:, 1:], tokens[:, 1:] != 0
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    acc = jnp.sum((jnp.argmax(logits, -1) == labels) & keep) / jnp.sum(keep)
    return jnp.sum(ce * keep) / jnp.sum(keep), acc

  @jax.jit
  def step(p, s, memory, tokens):
    (loss, _), g = jax.value_and_grad(accuracy_and_loss, has_aux=True)(p, memory, tokens)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  for _ in range(300):
    params, opt_state = step(params, opt_state, *batch(32))
  _, acc = accuracy_and_loss(params, *batch(256))
  # Without reading the memory: [EOS] right, the two class words at chance 1/4 -> about 0.5.
  assert float(acc) > 0.9
