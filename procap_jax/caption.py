r"""Caption your own image pairs with a trained run.

  python -m procap_jax.caption --workdir W before.png after.png
  python -m procap_jax.caption --workdir W --csv pairs.csv            # columns before,after
  python -m procap_jax.caption --workdir W --before_dir A --after_dir B

Prints one line per pair, `<before>\t<after>\t<caption>`, as soon as its batch is captioned;
`--out F.json` also writes them (atomically) as a JSON list. The workdir (a ProCap or DUDA run
with a config.json, a caption checkpoint and, unless it is DUDA on patches, a tokenizer
checkpoint) is checked first, then the pairs,
then every image is read, and only then is the model loaded: a mistake anywhere is one sentence
on stderr and exit status 2, before the slow part.

Pairing `--before_dir A --after_dir B`: the same file names in both folders pair by name;
otherwise files pair by the number in their names (the last run of digits, ignoring a final
`_2`-style suffix), so CLEVR-Change's `images/CLEVR_default_000123.png` pairs with
`sc_images/CLEVR_semantic_000123.png` and Spot-the-Diff's `12.png` with `12_2.png` (also when
both are in the same folder, as its `resized_images/`). A file without a partner, or a number
two files share, stops the command and names them; `procap_jax.data.pairing` has the rules.

Images may be any size, format or mode PIL reads; they are converted to RGB and resized to the
run's image size as the dataset builders do. A conversion that changes the image (16-bit,
grayscale, palette, transparency) or an image too small to show much gets one notice line on
stderr, e.g. `before.png: 16-bit grayscale, converted to 8-bit RGB`. Stage 2 needs no
interpolation: only the before and after images reach the model.

From Python, `Captioner` keeps the model loaded for many pairs:

  from procap_jax import caption
  captioner = caption.Captioner('workdir/synthetic')
  print(captioner('before.png', 'after.png'))           # paths, PIL images or uint8 arrays
  captions = captioner.caption_batch(befores, afters)   # lists of the same

This module imports no training code (no optax, grain, TFDS or task modules): JAX, flax and
the model definitions only, and those only once the inputs are checked. The first start
restores the checkpoints (orbax) and compiles the model; it keeps both results in
`W/caption/inference_cache/` when the workdir is writable (`params.npz`: the caption and
tokenizer parameters, about a third of a checkpoint's size, remade when a checkpoint or
config.json changes; `xla/`: XLA's compilation cache), so later starts skip most of that work.
`--warm_up` fills that cache and captions nothing; the training command runs it when a run
finishes, so the first caption after training is already a fast start.
`bench/caption_startup.py` measures both starts.

  python -m procap_jax.caption --workdir W --warm_up
"""

import argparse
import hashlib
import json
import os
import sys
from typing import Any, Callable, Sequence

import ml_collections
import numpy as np

from procap_jax import config_lib
from procap_jax import errors
from procap_jax import hostmem
from procap_jax.data import images
from procap_jax.data import pairing

ImageInput = Any  # a path (str / os.PathLike), encoded bytes, a PIL image or a uint8 array


load_run_config = config_lib.load_run_config


def vocab_path(config: ml_collections.ConfigDict, workdir: str) -> str:
  """The run's caption vocabulary file, found without opening the dataset (no TFDS import):
  `config.data.word2idx_file`, else the one `word2idx.json` under `<data_dir>/<name>/<config>/`.
  """
  if config.data.word2idx_file:
    path = config.data.word2idx_file
  else:
    base = os.path.join(config.data.data_dir or os.path.join(workdir, 'data'), config.data.name,
                        config.data.builder_config)
    found = sorted(os.path.join(base, v, 'word2idx.json') for v in
                   (os.listdir(base) if os.path.isdir(base) else ())
                   if os.path.isfile(os.path.join(base, v, 'word2idx.json')))
    if len(found) > 1:  # several dataset versions: the builder knows which one the run read
      from procap_jax.data import pipeline  # lazy: start-up (captioner ~4 s)
      return os.path.join(pipeline.dataset_dir(config, workdir), 'word2idx.json')
    path = found[0] if found else os.path.join(base, '<version>', 'word2idx.json')
  if not os.path.isfile(path):
    raise errors.UserError(
        f"the run's caption vocabulary {path} does not exist (it is written next to the "
        'dataset the run was trained on); keep that dataset, or set data.word2idx_file in '
        f'{os.path.join(workdir, "config.json")} to the vocabulary file')
  return path


def check_run(workdir: str, which: str = 'best') -> ml_collections.FrozenConfigDict:
  """The run's config (resolved when it was saved, migrated by `load_run_config`, frozen), once
  `workdir` is checked to hold what captioning needs (a config.json, caption and tokenizer
  checkpoints, the vocabulary); UserError naming the first thing missing.
  """
  config_lib.check_run(workdir, which)
  config = load_run_config(workdir)
  vocab_path(config, workdir)
  return ml_collections.FrozenConfigDict(config)


def _build_model(config: ml_collections.ConfigDict):
  """The run's captioner as training builds it: ProCap's (`models.captioner.from_config`) or,
  for `caption.model.kind='duda'`, DUDA (`models.duda.from_config`)."""
  if config_lib.caption_kind(config) == 'duda':
    from procap_jax.models import duda as duda_lib  # lazy: start-up (captioner ~4 s)
    return duda_lib.from_config(config)
  from procap_jax.models import captioner as captioner_lib  # lazy: start-up (captioner ~4 s)
  return captioner_lib.from_config(config)


CACHE_DIR = os.path.join('caption', 'inference_cache')  # under the workdir


def _use_compilation_cache(directory: str) -> None:
  """XLA's persistent compilation cache in `directory`, unless one is set already."""
  import jax
  if not jax.config.jax_compilation_cache_dir:  # else the caller's (e.g. the test session's)
    jax.config.update('jax_compilation_cache_dir', directory)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)


def _checkpoints_key(workdir: str, which: str, config: ml_collections.ConfigDict) -> str:
  """What the cached parameters were made from: the caption and tokenizer checkpoints restored
  (folder, step, and the step folder's inode and time: a retrained step is a new folder) and
  the run's config.json."""
  parts = []
  for stage, pick in config_lib.run_checkpoints(config, which):
    folder = config_lib.checkpoint_dir(workdir, stage, pick)
    step = max((n for n in os.listdir(folder) if n.isdigit()), key=int)
    st = os.stat(os.path.join(folder, step))
    parts.append(f'{os.path.relpath(folder, workdir)}/{step}:{st.st_ino}:{st.st_mtime_ns}')
  with open(os.path.join(workdir, 'config.json'), 'rb') as f:
    parts.append(hashlib.sha256(f.read()).hexdigest())
  return ' '.join(parts)


def _flat(prefix: str, tree: dict, out: dict) -> dict:
  for k, v in tree.items():
    if isinstance(v, dict):
      _flat(f'{prefix}/{k}', v, out)
    else:
      out[f'{prefix}/{k}'] = np.asarray(v)
  return out


def _nested(flat: dict, prefix: str) -> dict:
  tree: dict = {}
  for key, value in flat.items():
    if key.startswith(prefix + '/'):
      node = tree
      *path, leaf = key[len(prefix) + 1:].split('/')
      for part in path:
        node = node.setdefault(part, {})
      node[leaf] = value
  return tree


def load_parameters(workdir: str, which: str = 'best', config=None,
                    cache: bool = True) -> tuple[dict, dict, int]:
  """(caption params, tokenizer params, caption step) of a run, as host numpy trees (the
  tokenizer's {} when stage 2 reads pixels: DUDA on patches).

  From `W/caption/inference_cache/params.npz` when it was made from the same checkpoints and
  config.json; otherwise restored with `checkpointing` (checking the checkpoint's config against
  the run's) and, with `cache` and a writable workdir, saved there for the next start.
  """
  config_lib.check_run(workdir, which)
  config = config or load_run_config(workdir)
  path = os.path.join(workdir, CACHE_DIR, 'params.npz')
  key = _checkpoints_key(workdir, which, config)
  if cache and os.path.isfile(path):
    try:
      with np.load(path, allow_pickle=False) as f:
        flat = {k: f[k] for k in f.files}
      if str(flat.pop('key')) == key:
        return _nested(flat, 'caption'), _nested(flat, 'tokenizer'), int(flat.pop('step'))
    except (OSError, ValueError, KeyError):
      pass  # unreadable (e.g. cut by a full disk): restore and write it again
  from procap_jax import checkpointing  # lazy: start-up (captioner ~4 s)
  meta = checkpointing.read_meta(workdir, 'caption', which)
  if meta:
    checkpointing.check_config_compatible(meta.get('config'), config, 'caption')
  restored = checkpointing.load_stage_variables(workdir, 'caption', which)
  tokenizer = (checkpointing.load_stage_variables(workdir, 'tokenizer')['params']
               if config_lib.reads_tokenizer(config) else {})
  params, step = restored['params'], int(restored['step'])
  flat = _flat('tokenizer', tokenizer, _flat('caption', params, {}))
  if cache and all(a.dtype.kind in 'biuf' for a in flat.values()):
    try:
      with errors.atomic_path(path) as tmp:
        with open(tmp, 'wb') as buf:
          np.savez(buf, key=np.str_(key), step=np.int64(step), **flat)
    except (errors.UserError, OSError):
      pass  # a read-only workdir: no cache, the next start restores again
  return params, tokenizer, step


class Captioner:
  """A trained run's caption model, loaded once, for many pairs.

  Example:
    captioner = Captioner('workdir/synthetic')
    captioner('before.png', 'after.png')        # -> 'the small red cube has been moved'
    captioner.caption_batch(['b1.png', b2_array], ['a1.png', a2_pil_image])   # -> [str, str]

  Images are paths, encoded bytes, PIL images (any mode) or uint8 arrays ([H, W, 3] RGB,
  [H, W] grey, [H, W, 4] RGBA) of any size; they are converted and resized as the caption
  command does. Batches are padded to a power of two up to `batch_size`, so at most
  log2(batch_size) + 1 shapes are ever compiled.
  """

  def __init__(self, workdir: str, which: str = 'best', *, batch_size: int = 16,
               notify: Callable[[str], None] | None = None, cache: bool = True):
    """Checks `workdir` (UserError naming what is missing) and restores its caption model.

    Args:
      workdir: a finished training run.
      which: 'best' (on validation; else the latest) or 'latest' caption checkpoint.
      batch_size: most pairs decoded in one call.
      notify: called with a line for each image converted or too small (None: silent).
      cache: use and fill `workdir/caption/inference_cache/` (module docstring) when the
        workdir is writable; the XLA cache only when none is configured yet (this sets JAX's
        global cache options).
    """
    self.config = check_run(workdir, which)
    self.workdir, self.batch_size, self.notify = workdir, int(batch_size), notify
    cache_dir = os.path.join(workdir, CACHE_DIR)
    if cache:
      try:
        os.makedirs(cache_dir, exist_ok=True)
        cache = os.access(cache_dir, os.W_OK)
      except OSError:  # a read-only workdir: no cache
        cache = False
    if cache:
      _use_compilation_cache(os.path.join(cache_dir, 'xla'))
    import jax
    from procap_jax.data import vocab as vocab_lib  # lazy: start-up (captioner ~4 s)
    from procap_jax.models import captioner as captioner_lib  # lazy: start-up (captioner ~4 s)
    from procap_jax.models import duda as duda_lib  # lazy: start-up (captioner ~4 s)
    from procap_jax.models import vqgan  # lazy: start-up (captioner ~4 s)
    self.vocab = vocab_lib.Vocab.load(vocab_path(self.config, workdir))
    if self.vocab.size != self.config.caption.model.vocab_size:
      raise errors.UserError(
          f'the vocabulary {vocab_path(self.config, workdir)} has {self.vocab.size} words but '
          f'the run was trained with {self.config.caption.model.vocab_size}; restore the '
          'vocabulary file the run was trained with')
    params, tokenizer_params, self.step = load_parameters(workdir, which, self.config, cache)
    model = _build_model(self.config)
    tokenizer = (vqgan.frozen_from_config(self.config)
                 if config_lib.reads_tokenizer(self.config) else None)
    settings = config_lib.decoding_settings(self.config)
    self.model, self.tokenizer = model, tokenizer
    generate = (duda_lib.generate if config_lib.caption_kind(self.config) == 'duda'
                else captioner_lib.generate)

    def caption_ids(params, tokenizer_params, before, after):  # uint8 [B, S, S, 3] -> [B, L]
      inputs_b, inputs_a = self.features(tokenizer_params, before, after)
      return generate(model, params, inputs_b, inputs_a, **settings)

    self._ids = jax.jit(caption_ids)
    self._params = jax.device_put((params, tokenizer_params))

  @property
  def params(self) -> tuple[Any, Any]:
    """(caption params, tokenizer params) on the device, for more functions of `model` (the
    demo's imagined frames and sentence probabilities, `procap_jax.demo`)."""
    return self._params

  def features(self, tokenizer_params, before, after):
    """The model's inputs for uint8 before and after images [B, S, S, 3] (jit the caller):
    the frozen tokenizer's features [B, h, w, C] from one tokenizer call, or for DUDA on
    patches the images [B, S, S, 3] in [0, 1]."""
    import jax.numpy as jnp
    if self.tokenizer is None:
      return before.astype(jnp.float32) / 255.0, after.astype(jnp.float32) / 255.0
    n = before.shape[0]
    x = jnp.concatenate([before, after]).astype(jnp.float32) / 255.0
    feats = self.tokenizer.encode_features(tokenizer_params, x)  # [2B, h, w, C]
    return feats[:n], feats[n:]

  @property
  def image_size(self) -> int:
    return int(self.config.data.image_size)

  def image(self, x: ImageInput, name: str | None = None) -> np.ndarray:
    """One input as the model's uint8 [S, S, 3] (UserError for a bad file or array)."""
    size = self.image_size
    if isinstance(x, (str, os.PathLike, bytes, bytearray, memoryview)):
      return images.load_image(x, size, name=name, notify=self.notify)
    return images.from_image(x, size, name=name or 'image', notify=self.notify)

  def caption_batch(self, befores: Sequence[ImageInput],
                    afters: Sequence[ImageInput]) -> list[str]:
    """Captions pairs (befores[i], afters[i]); inputs as `image` takes them."""
    if len(befores) != len(afters):
      raise ValueError(f'{len(befores)} before images but {len(afters)} after images')
    out = []
    for i in range(0, len(befores), self.batch_size):
      b = np.stack([self.image(x) for x in befores[i:i + self.batch_size]])
      a = np.stack([self.image(x) for x in afters[i:i + self.batch_size]])
      n = len(b)
      padded = min(self.batch_size, 1 << (n - 1).bit_length())  # one of few compiled shapes
      if padded > n:
        b = np.concatenate([b, np.repeat(b[:1], padded - n, 0)])
        a = np.concatenate([a, np.repeat(a[:1], padded - n, 0)])
      ids = np.asarray(self._ids(*self._params, b, a))
      out += [self.vocab.decode(row) for row in ids[:n]]
    return out

  def __call__(self, before: ImageInput, after: ImageInput) -> str:
    """The caption of one pair."""
    return self.caption_batch([before], [after])[0]


def pairs_from_args(args) -> tuple[list[tuple[str, str]], str]:
  """The (before, after) paths the command line names, and how they were paired."""
  if args.csv:
    pairs, rule = pairing.pairs_from_csv(args.csv), 'as listed in the CSV file'
  elif args.before_dir or args.after_dir:
    if not (args.before_dir and args.after_dir):
      raise errors.UserError('--before_dir and --after_dir go together')
    pairs, rule = pairing.pair_folders(args.before_dir, args.after_dir)
  else:
    if len(args.images) != 2:
      raise errors.UserError('give exactly two images (before after), or --csv, or '
                             '--before_dir/--after_dir')
    pairs, rule = [(args.images[0], args.images[1])], 'as given'
  if not pairs:
    raise errors.UserError('no image pairs found')
  return pairs, rule


def _notice(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m procap_jax.caption',
      description='Caption your own before/after image pairs with a trained run.',
      epilog='--before_dir/--after_dir pairing: the same file names pair by name; otherwise '
      'files pair by the number in their names (the last run of digits, ignoring a final _2: '
      'CLEVR_default_000123.png with CLEVR_semantic_000123.png, 12.png with 12_2.png; the same '
      'folder twice pairs <name> with <name>_2). A file without a partner, or a number two '
      'files share, is an error: list such pairs in a --csv file.')
  parser.add_argument('images', nargs='*', help='before.png after.png')
  parser.add_argument('--workdir', required=True, help='a finished training run')
  parser.add_argument('--csv', help='CSV with columns before,after (paths relative to the CSV)')
  parser.add_argument('--before_dir', help='folder of before images (see pairing below)')
  parser.add_argument('--after_dir', help='folder of after images')
  parser.add_argument('--which', default='best', choices=('best', 'latest'))
  parser.add_argument('--batch_size', type=int, default=16, help='pairs decoded at once')
  parser.add_argument('--out', help='also write the captions as JSON here')
  parser.add_argument('--warm_up', action='store_true',
                      help='only fill W/caption/inference_cache (parameters and the compiled '
                      'single-pair model) so later starts are fast; takes no images')
  return parser


def warm_up(workdir: str, which: str = 'best') -> float:
  """Fills the inference cache of `workdir`: restores the parameters and compiles the
  single-pair model (one blank pair captioned, caption discarded). Returns the seconds taken.

  Raises:
    UserError: the workdir is not a finished run, or its caption folder is not writable.
  """
  import time
  start = time.perf_counter()
  config = check_run(workdir, which)
  cache_dir = os.path.join(workdir, CACHE_DIR)
  try:
    os.makedirs(cache_dir, exist_ok=True)
  except OSError as e:
    raise errors.UserError(f'cannot write the inference cache {cache_dir}: {e.strerror}') from e
  if not os.access(cache_dir, os.W_OK):
    raise errors.UserError(f'cannot write the inference cache {cache_dir}: not writable')
  captioner = Captioner(workdir, which, batch_size=1)
  blank = np.zeros((int(config.data.image_size),) * 2 + (3,), np.uint8)
  captioner(blank, blank)
  return time.perf_counter() - start


@errors.exit_on_user_error
def main(argv: list[str] | None = None) -> list[str]:
  args = _parser().parse_args(argv)
  if args.batch_size < 1:
    raise errors.UserError(f'--batch_size must be positive, got {args.batch_size}')
  if args.warm_up:
    if args.images or args.csv or args.before_dir or args.after_dir:
      raise errors.UserError('--warm_up takes no images: it only fills the inference cache')
    seconds = warm_up(args.workdir, args.which)
    print(f'inference cache of {args.workdir} ready ({seconds:.1f} s): later caption commands '
          'start without restoring or compiling', flush=True)
    return []
  config = check_run(args.workdir, args.which)  # the run first: a wrong --workdir fails at once
  pairs, rule = pairs_from_args(args)
  if len(pairs) > 1 or args.before_dir:
    _notice(f'{len(pairs)} pair{"s" if len(pairs) > 1 else ""}, paired {rule}')
  size = int(config.data.image_size)
  loaded = []  # every bad image fails before the (slower) model restore
  for b, a in pairs:
    loaded.append((images.load_image(b, size, notify=_notice),
                   images.load_image(a, size, notify=_notice)))
  captioner = Captioner(args.workdir, args.which, batch_size=args.batch_size)
  captions = []
  for i in range(0, len(pairs), args.batch_size):
    chunk = loaded[i:i + args.batch_size]
    for (b, a), c in zip(pairs[i:i + args.batch_size],
                         captioner.caption_batch([x for x, _ in chunk], [y for _, y in chunk])):
      print(f'{b}\t{a}\t{c}', flush=True)
      captions.append(c)
  if args.out:
    errors.write_text_atomic(args.out, json.dumps(
        [{'before': b, 'after': a, 'caption': c} for (b, a), c in zip(pairs, captions)], indent=1))
  return captions


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main(sys.argv[1:])
