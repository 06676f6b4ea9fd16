r"""The demo page and JSON service of a trained run, on a local web server.

  python -m procap_jax.serve --workdir W [--port 8000] [--host 127.0.0.1]

One page at `/`: choose or drop a before and an after image (or click one of the run's test
pairs) and see the caption, the change / no-change decision with its probability and the
procedure the model imagines (`procap_jax/demo/captioning.py` says exactly what each is).
`/?example=N` submits example N as the page loads (what the headless-browser test uses).

The same as a service:

  curl -F before=@before.png -F after=@after.png http://127.0.0.1:8000/caption

`POST /caption` takes multipart/form-data with the files `before` and `after`, or JSON
`{"before": B, "after": A}` with each image as base64 or a `data:` URL, and answers
`{"caption", "decision", "no_change_probability", "decision_probability", "frames",
"frames_note", "notices", "step"}`, `frames` being PNG `data:` URLs. A mistake (not an
image, a body above `--max_mb`, a missing field) is `{"error": "<one sentence>"}` with status
400 (413 for the size). `GET /examples` lists the example pairs as JSON.

The workdir is checked and the model loaded and compiled once, before the server listens; a
mistake there is one sentence on stderr and exit status 2. The standard library's
ThreadingHTTPServer serves; requests reach the model one at a time. Ctrl-C stops it.
"""

import argparse
import base64
import binascii
import email.parser
import errno
import email.policy
import http.server
import io
import json
import sys
import threading
import traceback
import urllib.parse

import numpy as np

from procap_jax import caption
from procap_jax import errors
from procap_jax import hostmem


def png_data_url(image: np.ndarray) -> str:
  """uint8 [H, W, 3] -> `data:image/png;base64,...`."""
  from PIL import Image
  buf = io.BytesIO()
  Image.fromarray(np.ascontiguousarray(image)).save(buf, format='PNG')
  return 'data:image/png;base64,' + base64.b64encode(buf.getvalue()).decode('ascii')


def result_json(result, step: int) -> dict:
  """A `captioning.Result` as the endpoint's JSON object."""
  return {'caption': result.caption, 'decision': result.decision,
          'no_change_probability': result.no_change_probability,
          'decision_probability': result.decision_probability,
          'frames': [png_data_url(f) for f in result.frames], 'frames_note': result.frames_note,
          'notices': list(result.notices), 'step': step}


def _decode_base64(value, name: str) -> bytes:
  if not isinstance(value, str):
    raise errors.UserError(f'"{name}" must be a string of base64 image data')
  if value.startswith('data:'):
    value = value.partition(',')[2]
  try:
    return base64.b64decode(value, validate=True)
  except (binascii.Error, ValueError):
    raise errors.UserError(f'"{name}" is not base64 image data; send the file\'s bytes as '
                           'base64 or a data: URL') from None


def parse_pair(content_type: str, body: bytes) -> tuple[bytes, bytes]:
  """The encoded before and after images of a `POST /caption` body (UserError otherwise)."""
  kind = content_type.split(';')[0].strip().lower()
  files = {}
  if kind == 'multipart/form-data':
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b'Content-Type: ' + content_type.encode('latin-1') + b'\r\n\r\n' + body)
    for part in (message.iter_parts() if message.is_multipart() else ()):
      name = part.get_param('name', header='content-disposition')
      if name in ('before', 'after'):
        files[name] = part.get_payload(decode=True) or b''
  elif kind == 'application/json':
    try:
      fields = json.loads(body)
    except (UnicodeDecodeError, ValueError):
      raise errors.UserError('the request body is not valid JSON; send {"before": ..., '
                             '"after": ...} with base64 images') from None
    if not isinstance(fields, dict):
      raise errors.UserError('the JSON body must be an object {"before": ..., "after": ...}')
    files = {k: _decode_base64(fields[k], k) for k in ('before', 'after') if k in fields}
  else:
    raise errors.UserError(f'send the two images as multipart/form-data or application/json, '
                           f'not {kind or "a body without a Content-Type"}')
  missing = [k for k in ('before', 'after') if k not in files]
  if missing:
    raise errors.UserError(f'the request has no {" and no ".join(missing)} image; send both '
                           'fields, before and after')
  return files['before'], files['after']


class DemoServer(http.server.ThreadingHTTPServer):
  """Serves one `captioning.Demo` (the model loaded once) and its page."""

  daemon_threads = True

  def __init__(self, address: tuple[str, int], max_bytes: int):
    """Binds `address` (the model comes later, `attach`: a port in use fails at once)."""
    self.demo, self.max_bytes = None, int(max_bytes)
    self.lock = threading.Lock()
    self.examples_json, self.page = [], b''
    super().__init__(address, Handler)

  def attach(self, demo) -> None:
    """Serves `demo` (a `captioning.Demo`): its page and examples are made here, once."""
    from procap_jax.demo import page  # lazy: with captioning, after the port is bound
    self.demo = demo
    self.examples_json = [
        {'pair_id': e.pair_id, 'change_type': e.change_type, 'references': list(e.references),
         'before': png_data_url(e.before), 'after': png_data_url(e.after)}
        for e in demo.examples]
    self.page = page.render(demo, self.examples_json, self.max_bytes).encode('utf-8')

  def caption(self, before: bytes, after: bytes) -> dict:
    notices = []
    b = self.demo.image(before, 'the before image', notices.append)
    a = self.demo.image(after, 'the after image', notices.append)
    with self.lock:
      result = self.demo.run(b, a, tuple(notices))
    return result_json(result, self.demo.captioner.step)


class Handler(http.server.BaseHTTPRequestHandler):
  """`GET /`, `GET /examples`, `POST /caption` (module docstring)."""

  server: DemoServer
  protocol_version = 'HTTP/1.1'

  def _send(self, status: int, body: bytes, content_type: str, close: bool = False) -> None:
    self.send_response(status)
    self.send_header('Content-Type', content_type)
    self.send_header('Content-Length', str(len(body)))
    self.send_header('Cache-Control', 'no-store')
    if close:
      self.send_header('Connection', 'close')
      self.close_connection = True
    self.end_headers()
    self.wfile.write(body)

  def _json(self, status: int, obj, close: bool = False) -> None:
    self._send(status, json.dumps(obj).encode('utf-8'), 'application/json', close)

  def do_GET(self):  # noqa: N802 (http.server's name)
    path = urllib.parse.urlsplit(self.path).path
    if path in ('/', '/index.html'):
      self._send(200, self.server.page, 'text/html; charset=utf-8')
    elif path == '/examples':
      self._json(200, self.server.examples_json)
    else:
      self._json(404, {'error': f'no page {path}; the demo is at / and the service at '
                                'POST /caption'})

  def do_POST(self):  # noqa: N802
    path = urllib.parse.urlsplit(self.path).path
    if path != '/caption':
      self._json(404, {'error': f'no endpoint {path}; post the pair to /caption'})
      return
    limit = self.server.max_bytes
    try:
      length = int(self.headers.get('Content-Length', ''))
    except ValueError:
      self._json(411, {'error': 'the request has no Content-Length; send the images as a '
                                'normal form or JSON body'}, close=True)
      return
    if length > limit:
      # Read (and drop) a body of up to 4x the limit so the client sees the answer rather than
      # a reset connection; anything larger is not read at all.
      if length <= 4 * limit:
        remaining = length
        while remaining > 0:
          chunk = self.rfile.read(min(remaining, 1 << 16))
          if not chunk:
            break
          remaining -= len(chunk)
      self._json(413, {'error': f'the request is {length / 1e6:.1f} MB, above the limit of '
                                f'{limit / 1e6:g} MB; send smaller images'}, close=True)
      return
    body = self.rfile.read(length)
    try:
      before, after = parse_pair(self.headers.get('Content-Type', ''), body)
      self._json(200, self.server.caption(before, after))
    except errors.UserError as e:
      self._json(400, {'error': str(e)})
    except Exception as e:  # noqa: BLE001  a bug: the page says so, stderr has the traceback
      traceback.print_exc()
      self._json(500, {'error': f'internal error ({type(e).__name__}); the server\'s log has '
                                'the details'})

  def log_message(self, format, *args):  # noqa: A002  one line per request on stderr
    sys.stderr.write(f'{self.address_string()} {format % args}\n')


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m procap_jax.serve',
      description='A local demo page and JSON service (POST /caption) for a trained run.')
  parser.add_argument('--workdir', required=True, help='a finished training run')
  parser.add_argument('--port', type=int, default=8000, help='0 picks a free port')
  parser.add_argument('--host', default='127.0.0.1',
                      help='address to listen on (127.0.0.1: this machine only)')
  parser.add_argument('--which', default='best', choices=('best', 'latest'))
  parser.add_argument('--examples', type=int, default=6, help='test pairs offered on the page')
  parser.add_argument('--max_mb', type=float, default=10.0,
                      help='largest request body accepted, in MB (both images together)')
  return parser


def make_server(workdir: str, port: int = 8000, host: str = '127.0.0.1', which: str = 'best',
                examples: int = 6, max_mb: float = 10.0) -> DemoServer:
  """Checks the run, loads and compiles its model, and binds the server (not yet serving)."""
  if not 0 <= port <= 65535:
    raise errors.UserError(f'--port must be in 0..65535, got {port}')
  if max_mb <= 0:
    raise errors.UserError(f'--max_mb must be positive, got {max_mb:g}')
  if examples < 0:
    raise errors.UserError(f'--examples must be 0 or more, got {examples}')
  caption.check_run(workdir, which)  # a wrong --workdir fails before the slow part
  try:
    server = DemoServer((host, port), int(max_mb * 1e6))
  except OSError as e:
    if e.errno in (errno.EADDRINUSE, errno.EACCES):
      raise errors.UserError(f'cannot listen on port {port} of {host} ({e.strerror}); pass '
                             'another --port (0 picks a free one)') from None
    raise errors.UserError(f'cannot listen on {host} ({e.strerror}); pass --host 127.0.0.1 '
                           'or an address of this machine') from None
  try:
    from procap_jax.demo import captioning  # lazy: the port is bound before the model code loads
    demo = captioning.Demo(workdir, which, examples)
    blank = np.zeros((demo.image_size, demo.image_size, 3), np.uint8)
    demo.run(blank, blank)  # compiles now, so the first visitor does not wait
    server.attach(demo)
  except BaseException:
    server.server_close()
    raise
  return server


@errors.exit_on_user_error
def main(argv: list[str] | None = None) -> None:
  args = _parser().parse_args(argv)
  server = make_server(args.workdir, args.port, args.host, args.which, args.examples,
                       args.max_mb)
  host, port = server.server_address[:2]
  print(f'serving the demo of {args.workdir} at http://{host}:{port}/ (POST /caption for '
        'JSON); Ctrl-C stops', flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main(sys.argv[1:])
