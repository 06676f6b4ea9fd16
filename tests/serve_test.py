"""The demo page and JSON service end to end: `python -m procap_jax.serve` on a free loopback port
with a finished tiny run, pairs posted to `/caption`, and the page in a headless browser
(Debian's chromium; skipped with the reason when none is installed).
"""

import base64
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid

import numpy as np
import PIL.Image
import pytest

from procap_jax import main

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_MB = 0.5  # the test server's request limit


@pytest.fixture(scope='module')
def finished_run(short_tiny_config, tmp_path_factory):
  # 2 steps a stage: the tests check what the service returns against the run's own Captioner,
  # not how well it captions.
  config = short_tiny_config(2, 2)
  workdir = str(tmp_path_factory.mktemp('run'))
  main.run(config, workdir)
  return config, workdir


@pytest.fixture(scope='module')
def server(finished_run, tmp_path_factory):
  """The base URL of `python -m procap_jax.serve --port 0` on the finished run (its request log
  goes to a file: a pipe nobody reads would fill and stop the server)."""
  _, workdir = finished_run
  log = tmp_path_factory.mktemp('serve') / 'stderr.txt'
  with open(log, 'w') as stderr:
    proc = subprocess.Popen(
        [sys.executable, '-m', 'procap_jax.serve', '--workdir', workdir, '--port', '0',
         '--max_mb', str(MAX_MB)], cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True,
        env=dict(os.environ, JAX_PLATFORMS='cpu'))
  lines, found = [], []

  def read():  # the first stdout line names the address; a reader thread bounds the wait
    line = proc.stdout.readline()
    lines.append(line)
    found.extend(re.findall(r'http://127\.0\.0\.1:\d+/', line))

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  reader.join(timeout=600)
  try:
    assert found, f'no address in {lines}; stderr: {log.read_text()[-3000:]}'
    yield found[0].rstrip('/')
  finally:
    proc.terminate()
    proc.wait(timeout=60)


def _request(url: str, body: bytes | None = None, content_type: str | None = None):
  """(status, parsed JSON or text) of a GET (no body) or POST."""
  req = urllib.request.Request(url, data=body,
                               headers={'Content-Type': content_type} if content_type else {})
  try:
    with urllib.request.urlopen(req, timeout=120) as response:
      status, kind, raw = response.status, response.headers['Content-Type'], response.read()
  except urllib.error.HTTPError as e:
    status, kind, raw = e.code, e.headers['Content-Type'], e.read()
  return status, json.loads(raw) if kind == 'application/json' else raw.decode('utf-8')


def _multipart(fields: dict[str, bytes]) -> tuple[bytes, str]:
  boundary = uuid.uuid4().hex
  parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
           f'filename="{name}.png"\r\nContent-Type: application/octet-stream\r\n\r\n'.encode()
           + data + b'\r\n' for name, data in fields.items()]
  return b''.join(parts) + f'--{boundary}--\r\n'.encode(), \
      f'multipart/form-data; boundary={boundary}'


def _post_files(url: str, **files: bytes):
  return _request(url + '/caption', *_multipart(files))


def _png(array: np.ndarray) -> bytes:
  buf = io.BytesIO()
  PIL.Image.fromarray(array).save(buf, format='PNG')
  return buf.getvalue()


def _data(url: str) -> bytes:
  assert url.startswith('data:image/png;base64,')
  return base64.b64decode(url.partition(',')[2])


def _examples(server) -> list[dict]:
  status, examples = _request(server + '/examples')
  assert status == 200
  return examples


def test_caption_endpoint_answers_with_caption_decision_and_frames(server, finished_run):
  config, workdir = finished_run
  examples = _examples(server)
  # The tiny test split: the first pair of each change type (none among them) come first.
  assert {e['change_type'] for e in examples} >= {'none', 'color', 'move'}
  from procap_jax.demo import captioning
  demo = captioning.Demo(workdir)  # in-process, to compare with the server's answers
  assert demo.no_change_sentences  # the tiny benchmark has no-change pairs
  for example in examples[:3]:
    before, after = _data(example['before']), _data(example['after'])
    status, got = _post_files(server, before=before, after=after)
    assert status == 200, got
    b = demo.image(before, 'before', print)
    a = demo.image(after, 'after', print)
    assert got['caption'] == demo.captioner(b, a)  # the caption command's caption
    said_none = got['caption'] in demo.no_change_sentences
    assert got['decision'] == ('no change' if said_none else 'change')
    p = got['no_change_probability']
    assert 0.0 < p < 1.0
    assert got['decision_probability'] == pytest.approx(p if said_none else 1 - p)
    if example is examples[0]:  # the probability is the model's: the same sum from its
      # cached step-by-step decoder
      assert p == pytest.approx(_stepwise_no_change_probability(demo, b, a), rel=1e-3)
    # k imagined frames at the model's image size, as PNG.
    assert len(got['frames']) == config.data.num_keyframes
    for frame in got['frames']:
      image = np.asarray(PIL.Image.open(io.BytesIO(_data(frame))))
      assert image.shape == (config.data.image_size, config.data.image_size, 3)
    assert 'procedure queries imagine' in got['frames_note'] and got['step'] == demo.captioner.step
  # The same pair as JSON (base64 and data: URLs) gets the same answer.
  json_body = json.dumps({'before': example['before'],
                          'after': base64.b64encode(after).decode()}).encode()
  assert _request(server + '/caption', json_body, 'application/json') == (200, got)


def _stepwise_no_change_probability(demo, before, after) -> float:
  """Sum over the run's no-change sentences of the product of the decoder's step-by-step
  (KV-cache) word probabilities: another path than the demo's teacher-forced logits."""
  import jax
  from procap_jax.data import vocab as vocab_lib
  model, (params, tokenizer_params) = demo.captioner.model, demo.captioner.params
  variables = {'params': params}

  @jax.jit
  def start(before, after):
    inputs_b, inputs_a = demo.captioner.features(tokenizer_params, before[None], after[None])
    if demo.kind == 'duda':
      return model.apply(variables, inputs_b, inputs_a, method='init_cache')
    memory = model.apply(variables, inputs_b, inputs_a, method='encode')
    return model.apply(variables, memory, method='init_cache')

  @jax.jit
  def step(cache, token, pos):  # -> (log-probabilities [V], cache)
    logits, cache = model.apply(variables, cache, token[None], pos, method='decode_step')
    return jax.nn.log_softmax(logits[0]), cache

  total = 0.0
  for sentence in demo.no_change_sentences:
    ids = demo.captioner.vocab.encode_decoder(sentence, demo.config.caption.model.max_len)
    cache, logp = start(before, after), 0.0
    for pos in range(int(np.argmax(ids == vocab_lib.EOS))):
      logps, cache = step(cache, ids[pos], pos)
      logp += float(logps[ids[pos + 1]])
    total += np.exp(logp)
  return total


def test_bad_requests_get_one_sentence(server, fault):
  good = _png(np.zeros((40, 40, 3), np.uint8))
  status, got = _post_files(server, before=b'not an image at all', after=good)
  assert status == 400
  assert got['error'].startswith('the before image is not an image'), got
  assert '\n' not in got['error'] and set(got) == {'error'}
  fault('demo service', 'a text file posted as the before image', f'{status} {got["error"]}')
  status, got = _post_files(server, before=good)
  assert (status, got) == (400, {'error': 'the request has no after image; send both fields, '
                                          'before and after'})
  fault('demo service', 'a request with one image', f'{status} {got["error"]}')
  big = np.random.default_rng(0).integers(0, 256, (500, 500, 3), dtype=np.uint8)  # ~750 kB
  status, got = _post_files(server, before=_png(big), after=good)
  assert status == 413 and f'above the limit of {MAX_MB:g} MB' in got['error'], got
  fault('demo service', f'a request above --max_mb {MAX_MB:g}', f'{status} {got["error"]}')
  status, got = _request(server + '/caption', b'{"before": 1}', 'application/json')
  assert status == 400 and 'base64' in got['error']
  status, got = _request(server + '/caption', b'before=x', 'application/x-www-form-urlencoded')
  assert status == 400 and 'multipart/form-data or application/json' in got['error']
  assert _request(server + '/nothing')[0] == 404
  # Still serving after all that.
  assert _post_files(server, before=good, after=good)[0] == 200


def test_page_offers_examples_and_says_what_the_probability_is(server):
  status, page = _request(server + '/')
  assert status == 200
  assert 'id="caption"' in page and 'choose or drop an image' in page
  assert 'the sum of the probabilities it gives each no-change sentence' in page
  for i, example in enumerate(_examples(server)):
    assert example['before'] in page  # the examples are one click away, in the page itself


def test_a_run_that_is_not_there_is_one_sentence(tmp_path, capsys):
  err = _exit_sentence(capsys, ['--workdir', str(tmp_path / 'missing'), '--port', '0'])
  assert err.startswith('error: workdir') and 'does not exist' in err


def _fake_run(tmp_path, preset: str) -> pathlib.Path:
  """A run's config.json, vocabulary file and empty checkpoint folders: what the checks made
  before loading a model look at."""
  from configs import synthetic
  from procap_jax import config_lib
  config = synthetic.get_config(preset)
  config.caption.model.vocab_size = config.pretrain.model.text_vocab_size = 37
  config.data.word2idx_file = str(tmp_path / 'word2idx.json')
  (tmp_path / 'word2idx.json').write_text('{}')
  workdir = tmp_path / 'run'
  config_lib.check_workdir(config, str(workdir))
  for stage in ('caption', 'tokenizer'):
    (workdir / stage / 'best' / '20').mkdir(parents=True)
  return workdir


def _exit_sentence(capsys, argv) -> str:
  from procap_jax import serve
  with pytest.raises(SystemExit) as e:
    serve.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert '\n' not in err
  return err


def test_a_duda_run_is_served_without_frames(tiny_data_dir, tmp_path):
  """DUDA (the field's baseline, here on image patches: no tokenizer) has no procedure queries:
  the demo captions with it and says so instead of frames."""
  from configs import synthetic
  from procap_jax.demo import captioning
  from procap_jax.demo import page
  config = synthetic.get_config('tiny,duda_patches')
  config.data.data_dir = tiny_data_dir
  t = config.caption.train  # two steps: a DUDA run to serve, not a captioner to judge
  t.steps = t.eval_every = t.checkpoint_every = 2
  t.log_every, t.eval_batches = 1, 1
  main.run(config, str(tmp_path))
  demo = captioning.Demo(str(tmp_path), examples=2)
  example = demo.examples[0]
  b, a = demo.image(_png(example.before), 'b', print), demo.image(_png(example.after), 'a', print)
  result = demo.run(b, a)
  # a two-step model's greedy caption may be empty (an [EOS] first); the no-change probability
  # below, a number of this model's, is what shows the demo ran the run's own captioner
  assert result.caption == demo.captioner(b, a)
  assert result.frames == ()
  assert result.frames_note.startswith("this run's captioner, DUDA, has no procedure queries")
  assert result.no_change_probability == pytest.approx(
      _stepwise_no_change_probability(demo, b, a), rel=1e-3)
  assert 'duda captioner' in page.render(demo, [], 10**6)


def test_a_port_in_use_fails_before_the_model_loads(tmp_path, capsys):
  import socket
  workdir = _fake_run(tmp_path, 'tiny')  # no checkpoint to load: the port is checked first
  with socket.socket() as taken:
    taken.bind(('127.0.0.1', 0))
    taken.listen()
    port = taken.getsockname()[1]
    err = _exit_sentence(capsys, ['--workdir', str(workdir), '--port', str(port)])
  assert err.startswith(f'error: cannot listen on port {port} of 127.0.0.1 (')
  assert err.endswith('pass another --port (0 picks a free one)')


def _browser() -> str | None:
  for name in ('chromium', 'chromium-browser', 'google-chrome'):
    if shutil.which(name):
      return shutil.which(name)
  return '/usr/bin/chromium' if os.path.exists('/usr/bin/chromium') else None


def _headless(url: str, tmp_path, *flags: str) -> str:
  browser = _browser()
  proc = subprocess.run(
      [browser, '--headless', '--no-sandbox', '--disable-gpu', '--no-first-run',
       f'--user-data-dir={tmp_path / "profile"}', '--virtual-time-budget=30000', *flags, url],
      capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc.stdout


@pytest.mark.skipif(_browser() is None, reason='no chromium or google-chrome installed (Debian: '
                    'apt-get install chromium); the page is checked in a headless browser')
def test_page_in_a_headless_browser(server, tmp_path):
  """The page loads, submits example N (`?example=N`) and shows the service's caption."""
  examples = _examples(server)
  n = len(examples) - 1
  body = json.dumps({k: examples[n][k] for k in ('before', 'after')}).encode()
  status, expected = _request(server + '/caption', body, 'application/json')
  assert status == 200
  dom = _headless(f'{server}/?example={n}', tmp_path, '--dump-dom')
  caption = re.search(r'<span id="caption">([^<]*)</span>', dom)
  assert caption and caption.group(1) == expected['caption'], dom[-3000:]
  assert f'<b id="decision">{expected["decision"]}</b>' in dom
  assert dom.count('title="imagined frame') == len(expected['frames'])
  # An error is one sentence on the page.
  dom = _headless(f'{server}/?example=99', tmp_path, '--dump-dom')
  assert f'There is no example 99; this page has {len(examples)}' in dom
  # The screenshot is an image of the page.
  shot = tmp_path / 'page.png'
  _headless(f'{server}/?example={n}', tmp_path, f'--screenshot={shot}', '--window-size=900,700')
  assert PIL.Image.open(shot).size == (900, 700)
