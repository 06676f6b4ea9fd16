"""Builds on Apache Beam through TFDS's own Beam support: one machine or a cluster.

Every builder makes its records with a per-example function (`generate.scene_examples` for
synthetic_change, `pair_examples.indexed_example` for the real datasets). Without Beam options
(the default) the builder runs it in this process or a local process pool and yields the records to
TFDS's sequential writer. With Beam options, the builder returns
`beam.Create(tasks) | beam.FlatMap(fn)` instead and TFDS's `BeamWriter` writes the same records
(same keys, same order, array_record) from a Beam pipeline: DirectRunner worker processes on one
machine, or a cluster runner (Flink, Spark; see docs/performance.md "Building datasets on
Beam"). TensorFlow is not needed on either path.

Beam options are Beam's own command-line flags, as one string or a list, e.g.
`'--runner=DirectRunner --direct_num_workers=2 --direct_running_mode=multi_processing'`.
A build with Beam needs the optional extra: `pip install -e ".[beam]"`.
"""

import contextlib
import io
import re
import shlex
from typing import Any, Callable, Iterable, Iterator, Sequence

import tensorflow_datasets as tfds

from procap_jax import errors

BeamOptions = str | Sequence[str] | None

_DONE_SETUPS: set[Callable[[], None]] = set()  # per process: setups already run
# How a UserError raised in a worker process appears in the error the runner raises here.
_REMOTE_USER_ERROR = re.compile(
    r'procap_jax\.errors\.UserError: ([^\n]*?)(?: \[while running .*)?$', re.MULTILINE)


def import_beam():
  """The `apache_beam` module; UserError naming the extra to install when it is missing."""
  try:
    import apache_beam  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise errors.UserError('building with Beam options needs Apache Beam, which is not '
                           'installed; run pip install -e ".[beam]" (or drop the Beam options '
                           'to build without it)') from None
  return apache_beam


def flags(beam_options: BeamOptions) -> list[str]:
  """Beam options as a list of flags ('' / None / [] -> [], the build without Beam)."""
  if not beam_options:
    return []
  out = shlex.split(beam_options) if isinstance(beam_options, str) else list(beam_options)
  bad = [f for f in out if not f.startswith('--')]
  if bad:
    raise errors.UserError(f'Beam options are flags such as --runner=DirectRunner; got '
                           f'{", ".join(map(repr, bad))}')
  return out


def pipeline_options(beam_options: BeamOptions):
  """Parses and checks Beam options into `PipelineOptions` (None when there are none).

  Raises:
    errors.UserError: Beam is not installed, a flag is unknown or its value is invalid.
  """
  argv = flags(beam_options)
  if not argv:
    return None
  beam = import_beam()
  options = beam.options.pipeline_options.PipelineOptions(argv)
  stderr = io.StringIO()
  try:
    with contextlib.redirect_stderr(stderr):
      known = options.get_all_options()
  except SystemExit:  # argparse: an invalid value (it printed its usage into `stderr`)
    reason = stderr.getvalue().strip().splitlines()[-1:] or ['invalid value']
    raise errors.UserError(f'invalid Beam option in {" ".join(argv)}: '
                           f'{reason[0].split("error: ")[-1]}') from None
  unknown = sorted(set(options.get_all_options(retain_unknown_options=True)) - set(known))
  if unknown:
    raise errors.UserError(f'unknown Beam option(s) {", ".join("--" + u for u in unknown)}; '
                           'see the pipeline options of your runner in the Beam documentation')
  return options


def download_config(beam_options: BeamOptions = None, **kwargs) -> tfds.download.DownloadConfig:
  """`tfds.download.DownloadConfig(**kwargs)`, with parsed `beam_options` when there are any."""
  options = pipeline_options(beam_options)
  if options is None:
    return tfds.download.DownloadConfig(**kwargs)
  return tfds.download.DownloadConfig(beam_options=options, **kwargs)


def uses_beam(config: tfds.download.DownloadConfig | None) -> bool:
  """Whether TFDS will build with Beam under this download config (a runner or options)."""
  return config is not None and (config.beam_runner is not None or
                                 config.beam_options is not None)


@contextlib.contextmanager
def user_errors_from_workers() -> Iterator[None]:
  """Re-raises a UserError of a Beam worker (a runner reports it as an error holding its
  traceback text) as a UserError here, so the build stops with one sentence."""
  try:
    yield
  except errors.UserError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    found = _REMOTE_USER_ERROR.search(str(e))
    if found is None:
      raise
    raise errors.UserError(found.group(1)) from e


def _run(task: Any, example_fn: Callable[[Any], Iterable[tuple[Any, dict]]],
         setup: Callable[[], None] | None) -> Iterable[tuple[Any, dict]]:
  if setup is not None and setup not in _DONE_SETUPS:
    setup()
    _DONE_SETUPS.add(setup)
  return example_fn(task)


def examples(tasks: Sequence[Any], fn: Callable[[Any], Iterable[tuple[Any, dict]]], *,
             setup: Callable[[], None] | None = None):
  """The Beam transform a builder's `_generate_examples` returns on the Beam path.

  Args:
    tasks: picklable work items (one scene or pair each); `beam.Create` spreads them over the
      workers (it reshuffles).
    fn: a module-level function, task -> [(integer key, example)], the same function the
      path without Beam calls; keys must be integers because the builders disable shuffling.
    setup: an optional module-level function run once per worker process before its first task.

  Returns:
    `beam.Create(tasks) | beam.FlatMap(...)`, a `PTransform` yielding (key, example).
  """
  beam = import_beam()
  return beam.Create(list(tasks)) | beam.FlatMap(_run, example_fn=fn, setup=setup)
