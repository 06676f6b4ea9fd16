"""What the demo shows for a pair: caption, change / no-change decision, imagined procedure.

`Demo` wraps a `caption.Captioner` (the model loaded once) and answers `Demo.run(before, after)`
with a `Result`:

  caption      the run's caption (greedy or beam as the run's config says), as the caption
               command writes it.
  decision     'no change' when the caption is one of the run's no-change sentences (up to case,
               punctuation and spacing), else 'change': the rule of `evaluation.change_decision`.
  no_change_probability
               the model's probability of writing a no-change sentence: the sum, over the run's
               no-change sentences, of the probability the captioner gives that whole word
               sequence ([EOS] included), teacher-forced, from the full softmax at temperature 1.
               It is the probability that a caption *sampled* from the model says "no change"
               under the same rule, not a decision head (ProCap has none) and not the greedy
               caption's confidence: the greedy caption can say "no change" while this is below
               0.5 (and the reverse). None when the run knows no no-change sentence.
  decision_probability
               that probability for the decision shown (p or 1 - p).
  frames       the k frames the procedure queries imagine (their outputs through the frozen
               stage-1 token head, decoded by the tokenizer), as in the report's gallery; empty
               when the captioner has no procedure queries (`frames_note` says why).

The run's no-change sentences are the distinct references of the no-change pairs (change type
'none') among the first `SCAN_RECORDS` records of its test split, as the training encoded them
(`Vocab.encode_decoder`), keeping those the vocabulary writes without [UNK]. The examples are
test pairs too: the first pair of each change type in record order, then the next ones.
"""

import dataclasses
from typing import Callable

import numpy as np

from procap_jax import caption
from procap_jax import config_lib
from procap_jax import evaluation
from procap_jax.data import images
from procap_jax.data import vocab as vocab_lib
from procap_jax.tasks import caption as caption_task

SCAN_RECORDS = 1000  # test records read for examples and no-change sentences
MAX_SENTENCES = 64  # no-change sentences scored at most


@dataclasses.dataclass(frozen=True)
class Example:
  """A test pair to try: uint8 [H, W, 3] images as stored, and what the dataset says."""
  pair_id: str
  change_type: str
  before: np.ndarray
  after: np.ndarray
  references: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Result:
  """The demo's answer for one pair (module docstring)."""
  caption: str
  decision: str
  no_change_probability: float | None
  decision_probability: float | None
  frames: tuple[np.ndarray, ...]  # k x uint8 [S, S, 3]
  frames_note: str
  notices: tuple[str, ...]


def read_test_split(config, workdir: str, examples: int) -> tuple[list[Example], list[str]]:
  """(`examples` test pairs, the no-change reference sentences) from the first SCAN_RECORDS
  records of the run's test split (UserError when the dataset is not built)."""
  from procap_jax.data import pipeline  # lazy: TFDS, seconds; only when the test split is read
  src = pipeline.open_source(config, workdir, 'test')
  picked, later, no_change, seen_types = [], [], [], set()
  for i in range(min(len(src), SCAN_RECORDS)):
    info = pipeline._record_info(src[i])  # pylint: disable=protected-access
    kind = pipeline.CHANGE_TYPES[info['change_type']]
    if kind == 'none':
      no_change += [c for c in info['captions'] if c.strip() and c not in no_change]
    if kind not in seen_types:
      seen_types.add(kind)
      picked.append(i)
    elif len(later) < examples:
      later.append(i)
  chosen = (picked + later)[:examples]
  out = []
  for i in chosen:
    record = src[i]
    info = pipeline._record_info(record)  # pylint: disable=protected-access
    out.append(Example(info['pair_id'], pipeline.CHANGE_TYPES[info['change_type']],
                       np.asarray(record['before'], np.uint8),
                       np.asarray(record['after'], np.uint8), tuple(info['captions'])))
  return out, no_change


class Demo:
  """A run's captioner for the demo page and the JSON endpoint: `run(before, after)`.

  Not thread-safe: the server calls it under one lock.
  """

  def __init__(self, workdir: str, which: str = 'best', examples: int = 6):
    """Checks and loads the run (UserError naming what is missing), reads its test split's
    examples and no-change sentences, and compiles the functions for one pair."""
    self.captioner = caption.Captioner(workdir, which, batch_size=1)
    self.config = config = self.captioner.config
    self.workdir = workdir
    self.kind = config_lib.caption_kind(config)
    self.imagines = bool(config.caption.model.use_queries) and self.kind == 'procap'
    self.examples, references = read_test_split(config, workdir, examples)
    # The sequences the model is scored on: each no-change reference as training encoded it,
    # kept when the vocabulary writes all its words (no [UNK]) within the caption length.
    vocab, max_len = self.captioner.vocab, int(config.caption.model.max_len)
    sequences, self.no_change_sentences = {}, []
    for sentence in references:
      ids, n = vocab.encode_decoder(sentence, max_len), len(vocab_lib.tokenize(sentence))
      fits = n <= max_len - 2 and not np.any(ids[1:1 + n] == vocab_lib.UNK)
      if fits and tuple(ids) not in sequences and len(sequences) < MAX_SENTENCES:
        sequences[tuple(ids)] = ids
        self.no_change_sentences.append(vocab.decode(ids))
    self._sequences = np.stack(list(sequences.values())) if sequences else None
    self._says_none = {evaluation._normalised(s) for s in references}  # pylint: disable=protected-access
    self._compile()

  def _compile(self) -> None:
    import jax
    import jax.numpy as jnp
    captioner, model = self.captioner, self.captioner.model
    sequences = self._sequences

    def log_probs(params, tokenizer_params, before, after):  # uint8 [1, S, S, 3] -> [n]
      feats_b, feats_a = captioner.features(tokenizer_params, before, after)
      n = sequences.shape[0]
      tokens = jnp.asarray(sequences)  # [n, L]
      logits = model.apply({'params': params}, jnp.repeat(feats_b, n, 0),
                           jnp.repeat(feats_a, n, 0), tokens[:, :-1])  # [n, L-1, V]
      logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      target = tokens[:, 1:]  # [n, L-1]
      picked = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
      return jnp.sum(jnp.where(target != 0, picked, 0.0), axis=1)  # [PAD] = 0 scores nothing

    self._log_probs = jax.jit(log_probs) if sequences is not None else None

  @property
  def image_size(self) -> int:
    return self.captioner.image_size

  def image(self, data: bytes, name: str, notify: Callable[[str], None]) -> np.ndarray:
    """Encoded image bytes -> the model's uint8 [S, S, 3] (UserError naming `name`)."""
    return images.load_image(bytes(data), self.image_size, name=name, notify=notify)

  def no_change_probability(self, before: np.ndarray, after: np.ndarray) -> float | None:
    """The model's probability of writing one of the run's no-change sentences (module
    docstring) for uint8 [S, S, 3] images; None when it knows none."""
    if self._log_probs is None:
      return None
    logp = np.asarray(self._log_probs(*self.captioner.params, before[None], after[None]))
    return float(np.exp(logp.astype(np.float64)).sum())

  def imagine(self, before: np.ndarray, after: np.ndarray) -> tuple[np.ndarray, ...]:
    """The k imagined frames, uint8 [S, S, 3] each (none without procedure queries)."""
    if not self.imagines:
      return ()
    params, tokenizer_params = self.captioner.params
    frames = caption_task.imagine_frames(  # [1, k, S, S, 3] in [0, 1]
        params, {'tokenizer': tokenizer_params}, self.config, self.captioner.model,
        before[None], after[None], tokenizer=self.captioner.tokenizer)
    return tuple(np.clip(np.rint(frames[0] * 255), 0, 255).astype(np.uint8))

  def frames_note(self) -> str:
    """What the frames are, or why there are none."""
    if self.imagines:
      return ('the frames the procedure queries imagine between before and after (their '
              'outputs through the stage-1 token head, decoded by the tokenizer)')
    if self.kind != 'procap':
      return (f'this run\'s captioner, {self.kind.upper()}, has no procedure queries, so it '
              'imagines no frames')
    return ('this run\'s captioner has no procedure queries (caption.model.use_queries is off: '
            'the static or no-queries variant), so it imagines no frames')

  def run(self, before: np.ndarray, after: np.ndarray, notices: tuple[str, ...] = ()) -> Result:
    """The demo's `Result` for uint8 [S, S, 3] images (`image` makes them from files)."""
    text = self.captioner(before, after)
    says_none = evaluation._normalised(text) in self._says_none  # pylint: disable=protected-access
    p = self.no_change_probability(before, after)
    return Result(
        caption=text, decision='no change' if says_none else 'change',
        no_change_probability=p,
        decision_probability=None if p is None else (p if says_none else 1.0 - p),
        frames=self.imagine(before, after), frames_note=self.frames_note(),
        notices=tuple(notices))
