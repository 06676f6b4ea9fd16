"""The demo's one HTML page (`procap_jax.serve`): hand-written HTML, CSS and script, no library.

The script posts the two images as multipart/form-data to `/caption` (an example's images too,
from their `data:` URLs) and shows the JSON answer, or its error sentence. `?example=N` in the
page's URL submits example N on load. Sizes are checked before sending, with the server's limit.
"""

import html
import json
import os

_STYLE = """
body{font-family:sans-serif;margin:16px 24px;max-width:980px;color:#222}
h1{font-size:22px;margin:0 0 4px} h2{font-size:16px;margin:18px 0 6px}
.run{color:#555;font-size:13px;margin:0 0 12px}
#pair{display:flex;gap:12px;align-items:stretch;flex-wrap:wrap}
.slot{width:200px;border:2px dashed #aaa;border-radius:6px;padding:8px;text-align:center;
  cursor:pointer;font-size:13px;background:#fafafa}
.slot.over{border-color:#e80;background:#fff4e6}
.slot img{display:block;width:180px;height:180px;object-fit:contain;margin:6px auto;
  image-rendering:pixelated;background:#eee}
.slot input{display:none}
#go{align-self:center;font-size:16px;padding:10px 18px}
#error{color:#b00;font-weight:bold;min-height:1em}
#result{border:1px solid #ddd;border-radius:6px;padding:10px;margin-top:6px}
#caption{font-size:20px;font-weight:bold}
#frames img{width:120px;height:120px;image-rendering:pixelated;margin:4px 6px 0 0}
#frames img.imagined{outline:2px solid #e80}
.note{color:#555;font-size:12px}
#examples button{border:1px solid #ccc;background:#fff;border-radius:4px;margin:0 6px 6px 0;
  padding:4px;cursor:pointer;font-size:11px}
#examples img{width:56px;height:56px;image-rendering:pixelated;display:inline-block}
"""

_SCRIPT = """
const EXAMPLES = __EXAMPLES__;
const MAX_BYTES = __MAX_BYTES__;
const picked = {before: null, after: null};
const $ = (id) => document.getElementById(id);

function showError(sentence) {
  $('error').textContent = sentence;
  $('status').textContent = '';
}

function setImage(which, blob, name) {
  picked[which] = {blob: blob, name: name};
  $('references').textContent = '';
  $('img-' + which).src = URL.createObjectURL(blob);
  $('name-' + which).textContent = name;
}

for (const which of ['before', 'after']) {
  const slot = $('slot-' + which), input = $('file-' + which);
  input.addEventListener('change', () => {
    if (input.files.length) setImage(which, input.files[0], input.files[0].name);
  });
  slot.addEventListener('dragover', (e) => { e.preventDefault(); slot.classList.add('over'); });
  slot.addEventListener('dragleave', () => slot.classList.remove('over'));
  slot.addEventListener('drop', (e) => {
    e.preventDefault();
    slot.classList.remove('over');
    if (e.dataTransfer.files.length) setImage(which, e.dataTransfer.files[0],
                                              e.dataTransfer.files[0].name);
  });
}

async function submit() {
  $('error').textContent = '';
  if (!picked.before || !picked.after) {
    showError('Choose or drop both images, before and after, or click an example.');
    return;
  }
  const total = picked.before.blob.size + picked.after.blob.size;
  if (total > MAX_BYTES) {
    showError('The two images are ' + (total / 1e6).toFixed(1) + ' MB together, above the ' +
              'limit of ' + (MAX_BYTES / 1e6) + ' MB; choose smaller images.');
    return;
  }
  const form = new FormData();
  form.append('before', picked.before.blob, picked.before.name);
  form.append('after', picked.after.blob, picked.after.name);
  $('status').textContent = 'captioning ...';
  let answer;
  try {
    const response = await fetch('/caption', {method: 'POST', body: form});
    answer = await response.json();
  } catch (err) {
    showError('The server did not answer (' + err.message + '); is it still running?');
    return;
  }
  if (answer.error) { showError(answer.error.charAt(0).toUpperCase() + answer.error.slice(1) +
                                (answer.error.endsWith('.') ? '' : '.')); return; }
  show(answer);
}

function percent(p) {  // small probabilities keep two significant digits
  return (p >= 0.001 ? (100 * p).toFixed(1) : (100 * p).toPrecision(2)) + ' %';
}

function picture(src, title, imagined) {
  const img = document.createElement('img');
  img.src = src; img.title = title; img.alt = title;
  if (imagined) img.className = 'imagined';
  return img;
}

function show(r) {
  $('status').textContent = '';
  $('caption').textContent = r.caption;
  $('decision').textContent = r.decision;
  $('probability').textContent = r.decision_probability === null
      ? '(no probability: the run knows no no-change sentence)'
      : 'with probability ' + percent(r.decision_probability) +
        ' (no change: ' + percent(r.no_change_probability) + ')';
  const note = r.frames_note.charAt(0).toUpperCase() + r.frames_note.slice(1) + '.';
  if (r.frames.length) {
    $('frames').replaceChildren(
        picture($('img-before').src, 'before', false),
        ...r.frames.map((src, i) => picture(src, 'imagined frame ' + (i + 1), true)),
        picture($('img-after').src, 'after', false));
    $('frames-note').textContent = 'Before, after and, in orange, ' + r.frames_note + '.';
  } else {
    $('frames').replaceChildren();
    $('frames-note').textContent = note;
  }
  $('notices').textContent = r.notices.join('; ');
  $('result').hidden = false;
}

async function useExample(i) {
  if (!(i >= 0 && i < EXAMPLES.length)) {
    showError('There is no example ' + i + '; this page has ' + EXAMPLES.length +
              ' (0 to ' + (EXAMPLES.length - 1) + ').');
    return;
  }
  const e = EXAMPLES[i];
  for (const which of ['before', 'after']) {
    const blob = await (await fetch(e[which])).blob();
    setImage(which, blob, e.pair_id + ' ' + which);
  }
  $('references').textContent = 'Example ' + i + ' (' + e.pair_id + ', ' + e.change_type +
      '), references: ' + e.references.join('; ');
  await submit();
}

EXAMPLES.forEach((e, i) => {
  const button = document.createElement('button');
  button.id = 'example-' + i;
  button.title = e.pair_id + ' (' + e.change_type + ')';
  for (const which of ['before', 'after']) {
    const img = document.createElement('img');
    img.src = e[which]; img.alt = which;
    button.appendChild(img);
  }
  button.appendChild(document.createElement('br'));
  button.appendChild(document.createTextNode(i + ': ' + e.change_type));
  button.addEventListener('click', () => useExample(i));
  $('examples').appendChild(button);
});
$('go').addEventListener('click', submit);

const wanted = new URLSearchParams(window.location.search).get('example');
if (wanted !== null) useExample(Number(wanted));
"""


def render(demo, examples: list[dict], max_bytes: int) -> str:
  """The page for a `captioning.Demo`, its examples (as `GET /examples` lists them) and the
  request size limit."""
  config = demo.config
  run = os.path.basename(os.path.normpath(demo.workdir)) or demo.workdir
  probability = (
      'The decision is the caption\'s: "no change" when it is one of the run\'s '
      f'{len(demo.no_change_sentences)} no-change sentences (from its test split), else '
      '"change". Its probability is the model\'s probability of writing a caption with that '
      'decision (for "no change": the sum of the probabilities it gives each no-change '
      'sentence, word by word, sampling at temperature 1), not a separate decision head.'
      if demo.no_change_sentences else
      'The decision is the caption\'s; this run\'s test split has no no-change pair, so the '
      'page shows no probability.')
  script = (_SCRIPT.replace('__EXAMPLES__', json.dumps(examples).replace('</', '<\\/'))
            .replace('__MAX_BYTES__', str(int(max_bytes))))
  slots = ''.join(
      f'<label class="slot" id="slot-{w}"><b>{w}</b><img id="img-{w}" alt="{w} image">'
      f'<span id="name-{w}">choose or drop an image</span>'
      f'<input type="file" id="file-{w}" accept="image/*"></label>' for w in ('before', 'after'))
  return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>procap-jax demo: {html.escape(run)}</title>
<style>{_STYLE}</style></head><body>
<h1>procap-jax change captioning demo</h1>
<p class="run">Workdir <code>{html.escape(run)}</code>: {html.escape(config.data.name)}
({html.escape(config.data.builder_config)}), {html.escape(demo.kind)} captioner, caption
checkpoint step {demo.captioner.step}; images are resized to {demo.image_size} x
{demo.image_size} px.</p>
<div id="pair">{slots}<button id="go">Caption</button></div>
<p id="status" class="note"></p>
<p id="error" role="alert"></p>
<div id="result" hidden>
<div>Caption: <span id="caption"></span></div>
<div>Decision: <b id="decision"></b> <span id="probability"></span></div>
<h2>Imagined procedure</h2>
<div id="frames"></div><p id="frames-note" class="note"></p>
<p id="notices" class="note"></p>
<p id="references" class="note"></p>
</div>
<h2>Examples from the run's test split (click one)</h2>
<div id="examples"></div>
<p class="note">{html.escape(probability)} Service: <code>curl -F before=@b.png -F
after=@a.png http://HOST:PORT/caption</code> answers the same as JSON.</p>
<script>{script}</script>
</body></html>
"""
