r"""Side by side in one run: the original ProCap (PyTorch) against ours, steps and inference.

  python bench/compare_original.py --original ORIG --size paper --rounds 1 --steps 2
  python bench/compare_original.py --original ORIG --size small --rounds 2 --steps 2

ORIG: the original's source tree (read only). Run by hand with a Python that has torch and the
original's small dependencies (never in CI); paper size takes about two hours with every row
(`--skip` leaves rows out: 80 minutes for 10 rows on a 2-core AMD EPYC), small size about 8
minutes a round. Every measurement is a fresh process, so its peak RSS (`getrusage`
high-water mark) is its own, and the two sides alternate within each round: the original's
stage-1 step, ours; the original's stage-2 step with anomaly detection (as train_stage2.py
ships it) and without, ours; the original's inference, ours; the original's image encode of
the inference batch alone (its share of inference), ours.
  - original: this file with `--child <what>` under this Python: the modules of `--original`
    built by `bench.original` at `--size`, random weights, torch.set_num_threads(--threads).
    Stage 1 is train_stage1.py's step (three forwards, the weighted losses, backward, clip 1.0,
    Adam, the DeepSpeed lr step) at batch 8; stage 2 is train_stage2.py's (16 change + 16
    no-change pairs, the summed loss, backward, clip 1.0, BertAdam in its four groups);
    inference is src/translator.py's greedy decode (encoder once, 24 full decoder passes, no
    no_grad: the original keeps autograd graphs) at the eval batch 32, timed as
    src/translate.py times TPS (spec section 7: batch x 24 / (t1 - t0 + 1e-6), change half);
    `tokenizer` is the VQGAN encoder call of dalle_beit.py on that batch's 64 images.
    Where a batch does not fit in memory (`--micro`, defaults in SIZES: at paper size stage 1
    in micro-batches of 4, stage 2 of 4 + 4 pairs, inference of 8), the step accumulates the
    gradients of its micro-batches before one update (stage 2's summed loss makes that exact;
    stage 1's means are averaged over its micro-batches), and inference decodes the chunks
    one after another inside one timed batch. Torch compiles nothing: the first step is timed
    (`--original_warmup` untimed steps before, 1 at small size).
  - ours: `python -m bench.train_step` (stage pretrain at batch 8, stage caption at batch 32
    pairs: 16 scenes' change and distractor pairs, the CLEVR presets' `caption.train.scene_pairs`,
    so each scene's before image is encoded once, as the trainer does; each also with
    `--feature_cache on`, the step as it runs on the tokenizer feature cache built once after
    stage 0: stage 1 encodes only the frames a corruption changed, stage
    2 encodes nothing; rows `stage1:cached`, `stage2:cached`, ratios `*_cached`; inference
    as evaluation runs it on the cache, row `infer:cached+bf16`; and with
    `--dtype bfloat16`, config.compute_dtype: the encoder's and decoder's matmuls take bfloat16
    operands accumulated in float32, and `tokenizer.frozen_dtype=bfloat16` since the commit
    adding it (the frozen tokenizer's convolutions in bfloat16, 3x3 ones in row bands); rows
    `*:bf16`, `*:cached+bf16`, ratios `*_bf16`; and stage 1 in bf16 with the features' input
    scale switched to the codes' (`tokenizer.model.feature_input_scale=signed`, off the
    original's quirk), so that one encoder pass gives a frame's features and codes: row
    `stage1:bf16+onescale`, ratio `stage1_bf16_onescale`, not the original's work), `python -m
    bench.caption_speed` (batch 32)
    and `python -m bench.tokenizer_speed --skip_convs --images 64` (rows `tokenizer`,
    `tokenizer:bf16`: the frozen tokenizer's `encode_features`), run by `--ours_python` (the system
    Python with procap_jax; torch never enters that process), XLA on all cores, from
    `--ours_tree` (default this checkout; a `git archive HEAD` copy keeps other people's
    uncommitted edits out of the measurement). Their first step (compilation) is not timed.

`--cap_isa avx2` (or `avx512`: AVX-512 without its BF16 and VNNI instructions) caps both sides'
children at that instruction set, to time an older CPU's code on a newer one: XLA_FLAGS gets
`--xla_cpu_max_isa=AVX2`, torch `ONEDNN_MAX_CPU_ISA=AVX2` and `ATEN_CPU_CAPABILITY=avx2`
(`procap_jax.cpu_info.ISA_CAPS`); the original's records say the capability ATen then ran
(`aten_cpu_capability`). XLA's flag caps the code XLA generates, not the matmuls it hands to
YNNPACK, which picks its kernels from the CPU itself: with jax 0.10.2 a bf16 dot ran at the same
rate per CPU-second with and without the cap on the AMD EPYC with AVX-512 BF16
(docs/performance.md, "Which path runs"), so our side's rows under a cap are not an AVX2 CPU's.

The first line names the CPU (`cpu`: model name, family, model, avx2 / avx512f / avx512_bf16 /
amx_bf16 flags, XLA's ISA cap) and the cap; then one JSON line per measurement (side, what,
batch, step_s = median seconds per step or per inference batch, peak_gib, cpu (one line of the
same), versions, threads, the micro-batching used), then one line of
ratios: ours throughput / the original's at the same batch (above 1: ours is faster), and
`ratios_after_first`, the same against the original's steps after its first where it ran no
untimed step and timed two or more (its first step is the slowest at paper size, while ours
are timed after a first call).
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from bench import original as original_lib  # pylint: disable=wrong-import-position
from procap_jax import cpu_info  # pylint: disable=wrong-import-position  (standard library only)

SMALL_VQGAN = dict(ch=32, ch_mult=(1, 2, 4), num_res_blocks=1, attn_resolutions=(),
                   resolution=32, z_channels=32, embed_dim=32, n_embed=64)
SIZES = {  # the original's sizes and our config for the same model; micro: see the docstring
    'small': dict(vqgan=SMALL_VQGAN, width=64, depth=2, heads=4, frames=4, text_len=24,
                  text_vocab=80, hidden=64, dec_heads=4, ffn=256, layers=2, vocab=80,
                  micro=dict(stage1=8, stage2=16, infer=32, tokenizer=32), warmup=1,
                  config='configs/clevr_change.py:cpu',
                  overrides=('tokenizer.model.ch=32',  # taming's GroupNorm has 32 groups
                             'pretrain.model.frame_difference=none',
                             'pretrain.model.embedding_std=1.0',
                             'pretrain.binary_inputs=masked')),
    'paper': dict(vqgan=original_lib.PAPER_VQGAN, width=768, depth=12, heads=12, frames=4,
                  text_len=24, text_vocab=49408, hidden=512, dec_heads=8, ffn=2048, layers=2,
                  vocab=80, micro=dict(stage1=4, stage2=4, infer=8, tokenizer=8), warmup=0,
                  config='configs/clevr_change.py:paper', overrides=()),
}
BATCH = dict(stage1=8, stage2=16, infer=32, tokenizer=32)  # train_stage1.sh, train_stage2 (x2
# halves), eval; tokenizer: the eval batch's image encode alone (2 x 32 images)
MAX_T_LEN = 24


# ----------------------------------------------------------------------------- original side


def _build(opts, size):
  """(vae, torch) with the stand-ins installed and threads set."""
  original_lib.install_stand_ins(opts.original)
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(opts.threads)
  torch.manual_seed(0)
  return original_lib.vae(original_lib.vqmodel(size['vqgan'])), torch


def _stage1(opts, size, micro):
  """train_stage1.py's step; returns a callable running one step."""
  vae, torch = _build(opts, size)
  args = original_lib.stage1_args(batch=BATCH['stage1'], text_len=size['text_len'],
                                  frames=size['frames'], image_size=vae.image_size,
                                  depth=size['depth'], width=size['width'])
  with original_lib.random_clip(size['width'], size['heads']):
    model = original_lib.bert(vae, args, size['text_vocab'])
  opt, scheduler_step = original_lib.stage1_optimizer(args, model)
  model.train()
  b, s = BATCH['stage1'], vae.image_size
  text = torch.randint(1, size['text_vocab'], (b, size['text_len']))
  frames = torch.rand(b, size['frames'], 3, s, s)

  def step():
    opt.zero_grad()
    for i in range(0, b, micro):
      *_, loss = original_lib.stage1_forward(model, args, text[i:i + micro],
                                             frames[i:i + micro, :args.num_targets])
      (loss * (min(micro, b - i) / b)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
    opt.step()
    scheduler_step(loss)
  return step


def _captions(torch, n, vocab):
  """Caption ids [n, 24] ([BOS] words [EOS] [PAD]...) and labels shifted left, -1 on padding."""
  ids = torch.zeros(n, MAX_T_LEN, dtype=torch.long)
  labels = torch.full((n, MAX_T_LEN), -1, dtype=torch.long)
  for i in range(n):
    length = int(torch.randint(6, 16, ()))
    ids[i, 0], ids[i, 1:length - 1], ids[i, length - 1] = 4, torch.randint(8, vocab, (
        length - 2,)), 5
    labels[i, :length - 1] = ids[i, 1:length]
  return ids, labels


def _mmvid(opts, size):
  vae, torch = _build(opts, size)
  cfg = original_lib.stage2_config(opts.original, size, size['vocab'])
  model = original_lib.mmvid_idc(cfg, vae, size['heads'])
  gen = model.intermediate_generator  # train_stage2.py loads the stage-1 table (spec 5.1)
  gen.text_emb.weight.data = torch.randn(size['text_vocab'] + gen.text_seq_len + 1,
                                         size['width'])
  return model, vae, torch


def _stage2(opts, size, micro, anomaly):
  """train_stage2.py's CLEVR step (change + no-change halves); returns the step callable."""
  model, vae, torch = _mmvid(opts, size)
  optimizer, _ = original_lib.stage2_optimizer(model, t_total=1000)
  model.train()
  b, s = BATCH['stage2'], vae.image_size
  clips = [torch.rand(b, 3, 2, s, s) for _ in range(2)]  # frames 0 and -1 are the ones read
  captions = [_captions(torch, b, size['vocab']) for _ in range(2)]
  vmask = torch.ones(b, size['frames'])
  torch.autograd.set_detect_anomaly(anomaly)  # train_epoch sets it for the whole epoch

  def step():
    optimizer.zero_grad()
    for i in range(0, b, micro):
      part = slice(i, i + micro)
      change, _ = model(clips[0][part], vmask[part], captions[0][0][part], None,
                        captions[0][1][part])
      no_change, _ = model(clips[1][part], vmask[part], captions[1][0][part], None,
                           captions[1][1][part], mtm=False)
      (change + no_change).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
  return step


def _infer(opts, size, micro):
  """src/translator.py's greedy decode of one eval batch (change half), timed as translate.py."""
  model, vae, torch = _mmvid(opts, size)
  from src import translator  # pylint: disable=import-outside-toplevel
  model.eval()
  b, s = BATCH['infer'], vae.image_size
  clip = torch.rand(b, 3, 2, s, s)
  ids, labels = _captions(torch, b, size['vocab'])
  vmask, tmask = torch.ones(b, size['frames']), torch.ones(b, MAX_T_LEN)

  def step():
    for i in range(0, b, micro):
      part = slice(i, i + micro)
      translator.Translator.translate_batch_single_sentence_untied_greedy(
          clip[part], vmask[part], ids[part], tmask[part], labels[part], model)
  return step


def _tokenizer(opts, size, micro):
  """The original's image encode in inference: `vae.model.encoder` (dalle_beit.py) on the eval
  batch's before and after images (2 x 32), `micro` pairs at a time, autograd on as shipped."""
  vae, torch = _build(opts, size)
  b, s = BATCH['infer'], vae.image_size
  images = torch.rand(2 * b, 3, s, s) * 2 - 1

  def step():
    for i in range(0, 2 * b, 2 * micro):
      vae.model.encoder(images[i:i + 2 * micro])
  return step


def child(opts) -> dict:
  """One measurement of the original in this process; returns its record."""
  size = SIZES[opts.size]
  what = opts.child
  micro = opts.micro or size['micro'][what.split(':')[0]]
  if what == 'stage1':
    step = _stage1(opts, size, micro)
  elif what.startswith('stage2'):
    step = _stage2(opts, size, micro, anomaly=what == 'stage2:anomaly')
  elif what == 'tokenizer':
    step = _tokenizer(opts, size, micro)
  else:
    step = _infer(opts, size, micro)
  warmup = size['warmup'] if opts.original_warmup is None else opts.original_warmup
  for _ in range(warmup):
    step()
  times = []
  for _ in range(opts.steps):
    t0 = time.time()  # translate.py's clock
    step()
    times.append(time.time() - t0)
  import torch  # pylint: disable=import-outside-toplevel
  batch = BATCH[what.split(':')[0]]
  capability = getattr(getattr(torch.backends, 'cpu', None), 'get_cpu_capability', None)
  record = dict(micro_batch=micro if micro < batch else None, warmup_steps=warmup,
                times_s=times, torch=torch.__version__, threads=torch.get_num_threads(),
                aten_cpu_capability=capability() if capability else None,
                onednn_max_cpu_isa=os.environ.get('ONEDNN_MAX_CPU_ISA'),
                peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
  if what == 'infer':  # translate.py: batch x 24 slots / (t1 - t0 + 1e-6) per batch
    record['tps'] = [batch * MAX_T_LEN / (t + 1e-6) for t in times]
  return record


# ----------------------------------------------------------------------------- driver


def _json_lines(text: str) -> list[dict]:
  out = []
  for line in text.splitlines():
    if line.startswith('{'):
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  return out


def child_env(cap_isa: str, tree: str = REPO, environ: dict | None = None) -> dict:
  """A child's environment: `environ` (default os.environ) with `tree` first on PYTHONPATH and,
  unless `cap_isa` is 'none', both sides' ISA caps (`cpu_info.cap_environment`)."""
  environ = dict(os.environ if environ is None else environ)
  environ['PYTHONPATH'] = os.pathsep.join(p for p in (tree, environ.get('PYTHONPATH')) if p)
  if cap_isa != 'none':
    environ.update(cpu_info.cap_environment(cap_isa, environ))
  return environ


def header(cap_isa: str, size: str, cpu: cpu_info.Cpu | None = None,
           environ: dict | None = None) -> dict:
  """The first line: the CPU (default this one), its instruction sets and the caps the children
  run under (XLA's from their XLA_FLAGS, so also one set by hand)."""
  cpu = cpu_info.read() if cpu is None else cpu
  env = child_env(cap_isa, environ=environ)
  xla_flags = env.get('XLA_FLAGS', '')
  caps = {k: env[k] for k in ('ONEDNN_MAX_CPU_ISA', 'ATEN_CPU_CAPABILITY') if env.get(k)}
  return dict(bench='compare_original', size=size, cap_isa=cap_isa, torch_caps=caps or None,
              cpu=cpu_info.describe(cpu, xla_flags), cpu_summary=cpu_info.summary(cpu, xla_flags))


def _run(cmd: list[str], timeout: float, tree: str = REPO,
         cap_isa: str = 'none') -> tuple[list[dict], str | None]:
  """Runs `cmd` in `tree` (first on PYTHONPATH) under `cap_isa`; (its JSON lines, an error
  sentence or None)."""
  env = child_env(cap_isa, tree)
  try:
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return [], f'timed out after {timeout:.0f} s'
  records = _json_lines(proc.stdout)
  if proc.returncode != 0 or not records:
    tail = [l for l in proc.stderr.strip().splitlines() if l.strip()] or ['(no stderr)']
    killed = ' (killed: out of memory?)' if proc.returncode == -9 else ''
    return records, f'exit {proc.returncode}{killed}: {tail[-1][:300]}'
  return records, None


def _original(opts, what: str) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), '--child', what, '--original',
         opts.original, '--size', opts.size, '--steps', str(opts.steps), '--threads',
         str(opts.threads)]
  if opts.original_warmup is not None:
    cmd += ['--original_warmup', str(opts.original_warmup)]
  if opts.micro:
    cmd += ['--micro', str(opts.micro)]
  records, error = _run(cmd, opts.timeout, REPO, opts.cap_isa)
  out = dict(records[-1]) if records else {}
  if error:
    out['error'] = error
  if out.get('times_s'):
    out['step_s'] = statistics.median(out['times_s'])
  return out


def _ours(opts, what: str, versions: dict) -> dict:
  size = SIZES[opts.size]
  sets = [f'--set={s}' for s in size['overrides']]
  base, _, variant = what.partition(':')
  variants = set(variant.split('+')) - {''}
  if 'bf16' in variants and base != 'tokenizer':  # bfloat16 matmuls accumulated in float32
    sets.append('--dtype=bfloat16')  # (config.compute_dtype), and the frozen tokenizer's
    sets.append('--set=tokenizer.frozen_dtype=bfloat16')  # convolutions in bfloat16
  elif base != 'tokenizer':  # float32 rows in float32 whatever 'auto' would choose here
    sets.append('--set=tokenizer.frozen_dtype=float32')
  if 'onescale' in variants:  # features from [-1, 1] images like the codes: one encoder pass
    sets.append('--set=tokenizer.model.feature_input_scale=signed')
  if base == 'infer':
    cmd = ['-m', 'bench.caption_speed', '--config', size['config'], '--batch',
           str(BATCH['infer']), '--repeats', str(opts.steps), *sets]
    if 'cached' in variants:  # evaluation on the feature cache: no image encodes
      cmd += ['--feature_cache', 'on']
  elif base == 'tokenizer':
    cmd = ['-m', 'bench.tokenizer_speed', '--config', size['config'], '--skip_convs',
           '--images', str(2 * BATCH['tokenizer']), '--rounds', str(opts.steps),
           '--frozen_dtypes', 'float32,bfloat16' if 'bf16' in variants else 'float32']
  else:
    stage, batch = ('pretrain', BATCH['stage1']) if base == 'stage1' else (
        'caption', 2 * BATCH['stage2'])
    cmd = ['-m', 'bench.train_step', '--config', size['config'], '--stage', stage, '--batch',
           str(batch), '--steps', str(opts.steps), *sets]
    if 'cached' in variants:  # the tokenizer feature cache (data.feature_cache): no image encodes
      cmd += ['--feature_cache', 'on']
  records, error = _run([opts.ours_python, *cmd], opts.timeout, opts.ours_tree, opts.cap_isa)
  rec = records[-1] if records else {}
  out = dict(jax=versions.get('jax'), threads=os.cpu_count(), command=' '.join(cmd),
             tree=opts.ours_tree)
  if error or rec.get('error'):
    out['error'] = error or rec['error']
    return out
  out['peak_gib'] = rec.get('peak_rss_gib')
  if base == 'infer':
    out.update(step_s=rec['batch_s'], tps=rec['tps'], first_call_s=rec['first_call_s'])
  elif base == 'tokenizer':  # the last line is the bf16 one when both ran
    out.update(step_s=rec['step_s'], features_rel_diff=rec['features_rel_diff'],
               codes_equal_fraction=rec['codes_equal_fraction'])
  else:
    out.update(step_s=rec['step_s'], first_step_s=rec['first_step_s'],
               compile_s=rec['compile_s'], mfu=rec.get('mfu'))
  return out


PLAN = (  # (side, what, batch as the original counts it); what = row[:variant[+variant]]
    ('original', 'stage1', 8), ('ours', 'stage1', 8), ('ours', 'stage1:cached', 8),
    ('ours', 'stage1:bf16', 8), ('ours', 'stage1:cached+bf16', 8),
    ('ours', 'stage1:bf16+onescale', 8),
    ('original', 'stage2:anomaly', 32), ('original', 'stage2', 32), ('ours', 'stage2', 32),
    ('ours', 'stage2:cached', 32), ('ours', 'stage2:bf16', 32),
    ('ours', 'stage2:cached+bf16', 32),
    ('original', 'infer', 32), ('ours', 'infer', 32), ('ours', 'infer:bf16', 32),
    ('ours', 'infer:cached+bf16', 32),
    ('original', 'tokenizer', 64), ('ours', 'tokenizer', 64), ('ours', 'tokenizer:bf16', 64),
)


def drive(opts) -> None:
  """Runs the PLAN `--rounds` times, printing a JSON line per measurement, then the ratios."""
  head = header(opts.cap_isa, opts.size)
  print(json.dumps(head), flush=True)
  cpu = head['cpu_summary']
  version = subprocess.run([opts.ours_python, '-c', 'import jax; print(jax.__version__)'],
                           capture_output=True, text=True, check=False).stdout.strip()
  versions = {'jax': version or None}
  results = []
  for r in range(opts.rounds):
    for side, what, batch in PLAN:
      if opts.only and what.split(':')[0] not in opts.only.split(','):
        continue
      if what in opts.skip.split(',') or f'{side}/{what}' in opts.skip.split(','):
        continue
      t0 = time.time()
      rec = _original(opts, what) if side == 'original' else _ours(opts, what, versions)
      rec = dict(side=side, what=what, size=opts.size, round=r, batch=batch, cpu=cpu,
                 cap_isa=opts.cap_isa, wall_s=time.time() - t0, **rec)
      results.append(rec)
      print(json.dumps(rec), flush=True)
  print(json.dumps(dict(ratios=_ratios(results),
                        ratios_after_first=_ratios(results, after_first=True), size=opts.size,
                        cpu=cpu, cap_isa=opts.cap_isa, date=time.strftime('%Y-%m-%d %H:%M'))),
        flush=True)


def _step_s(record: dict, after_first: bool) -> float | None:
  """A record's step seconds; with `after_first`, an original record that ran no untimed step
  and timed two or more gives the median of the steps after its first."""
  times = record.get('times_s') or []
  if (after_first and record['side'] == 'original' and not record.get('warmup_steps')
      and len(times) >= 2):
    return statistics.median(times[1:])
  return record.get('step_s')


def _ratios(results: list[dict], after_first: bool = False) -> dict:
  """Ours throughput / the original's: original step seconds / ours (same batch), medians over
  rounds; stage 2 against the original with and without anomaly detection."""
  def median(side, what):
    times = [_step_s(r, after_first) for r in results if r['side'] == side
             and r['what'] == what and r.get('step_s')]
    return statistics.median(times) if times else None
  out = {}
  for name, what, ours in (('stage1', 'stage1', 'stage1'),
                           ('stage1_cached', 'stage1', 'stage1:cached'),
                           ('stage2_anomaly', 'stage2:anomaly', 'stage2'),
                           ('stage2', 'stage2', 'stage2'),
                           ('stage2_cached', 'stage2', 'stage2:cached'),
                           ('infer', 'infer', 'infer'),
                           ('stage1_bf16', 'stage1', 'stage1:bf16'),
                           ('stage1_cached_bf16', 'stage1', 'stage1:cached+bf16'),
                           ('stage1_bf16_onescale', 'stage1', 'stage1:bf16+onescale'),
                           ('stage2_bf16', 'stage2', 'stage2:bf16'),
                           ('stage2_cached_bf16', 'stage2', 'stage2:cached+bf16'),
                           ('infer_bf16', 'infer', 'infer:bf16'),
                           ('infer_cached_bf16', 'infer', 'infer:cached+bf16'),
                           ('tokenizer', 'tokenizer', 'tokenizer'),
                           ('tokenizer_bf16', 'tokenizer', 'tokenizer:bf16')):
    a, b = median('original', what), median('ours', ours)
    out[name] = round(a / b, 2) if a and b else None
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--original', required=True, help='the ProCap source tree (read only)')
  parser.add_argument('--size', choices=tuple(SIZES), default='small')
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--steps', type=int, default=2, help='timed steps per measurement')
  parser.add_argument('--threads', type=int, default=os.cpu_count(),
                      help="torch's threads (XLA uses every core)")
  parser.add_argument('--ours_python', default=shutil.which('python') or 'python',
                      help='the Python with procap_jax installed')
  parser.add_argument('--ours_tree', default=REPO,
                      help='the checkout our side runs from (e.g. `git archive HEAD` unpacked, '
                      'so that edits in progress in this one do not enter the measurement)')
  parser.add_argument('--original_warmup', type=int, default=None,
                      help='untimed original steps first (default per size)')
  parser.add_argument('--micro', type=int, default=0,
                      help="the original's micro-batch for every measurement (default per "
                      'size and measurement)')
  parser.add_argument('--only', default='',
                      help='comma-separated: stage1,stage2,infer,tokenizer')
  parser.add_argument('--skip', default='',
                      help='comma-separated rows to leave out, e.g. stage2:anomaly,ours/stage1 '
                      '(what, both sides; side/what, one side)')
  parser.add_argument('--cap_isa', default='none', choices=('none',) + tuple(cpu_info.ISA_CAPS),
                      help="cap both sides' children at this instruction set (XLA_FLAGS, "
                      'ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY); see the docstring')
  parser.add_argument('--timeout', type=float, default=4 * 3600)
  parser.add_argument('--child', default=None, help=argparse.SUPPRESS)
  opts = parser.parse_args()
  if opts.child:
    print(json.dumps(child(opts)), flush=True)
  else:
    drive(opts)


if __name__ == '__main__':
  main()
