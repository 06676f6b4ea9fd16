r"""The frozen tokenizer's convolutions and encode, float32 against bfloat16 (row bands).

  python -m bench.tokenizer_speed                        # paper tokenizer, 16 images, all shapes
  python -m bench.tokenizer_speed --images 64 --skip_convs
  python -m bench.tokenizer_speed --config configs/synthetic.py --images 64
  python -m bench.tokenizer_speed --workdir W --images 1024 --skip_convs   # a run's tokenizer
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m bench.tokenizer_speed \
      --skip_convs --frozen_dtypes bfloat16 --shard_images      # one device per core

Two parts, each alternating its forms over `--rounds` rounds (median and best seconds):
  - `conv`: one 3x3 convolution of each shape the paper encoder runs (224 px x 128 channels down
    to 14 px x 512, 8 images; stride 2 for the downsamples) as the library's float32
    convolution (`lax`, what float32 models run), the library's with bfloat16 operands, and
    `banded_conv.conv_general_dilated` with bfloat16 operands (row bands, Winograd products at 224
    and 112 px; the downsamples as the model runs them, a right/bottom zero pad then a 'VALID'
    stride-2 convolution), with GFLOP/s and the relative difference from float32.
  - `encode`: `encode_features` of `--images` random images through `vqgan.frozen(config,
    dtype)` for each of `--frozen_dtypes` (`config.tokenizer.frozen_dtype`), random parameters,
    with the features' relative difference (norm) from float32's and the codes' agreement,
    each call's minor page faults and system seconds (medians; `procap_jax/hostmem.py`), and
    the products the form runs: `product_gflop_per_image` (convolutions and matmuls summed
    over its jaxpr, loops times their trip counts: the direct convolutions' count in float32,
    fewer in bf16 where Winograd products replace them), their rate over the median call and
    that rate as a fraction of a matmul of the form's precision timed in the same process
    (`of_matmul_peak`, `common.matmul_peak_flops`); everything else the call does (norms,
    transforms, conversions, copies) is in the time but not in the count.
    `bench/compare_original.py`'s `tokenizer` rows run this part against the original's
    encoder on the same 64 images.
One JSON line per form (`peak_rss_gib`: the process's, over every form it ran so far). Random
values: speed does not depend on them.
"""

import argparse
import contextlib
import json
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench import train_step as bench_step
from procap_jax import hostmem
from procap_jax.diagnostics import stand_ins
from procap_jax.models import banded_conv
from procap_jax.models import vqgan
from procap_jax.models import vqgan_layers

# (images, side, channels in, channels out, stride): the paper encoder's convolutions.
PAPER_SHAPES = ((8, 224, 128, 128, 1), (8, 112, 128, 128, 1), (8, 56, 256, 256, 1),
                (8, 28, 256, 256, 1), (8, 14, 512, 512, 1), (8, 224, 128, 128, 2),
                (8, 112, 128, 128, 2), (8, 56, 256, 256, 2), (8, 28, 256, 256, 2))


def _times(fns: dict, args: tuple, rounds: int, faults: dict | None = None) -> tuple[dict, dict]:
  """Seconds of each call per function, and the outputs; `faults` (when given) collects each
  call's (minor page faults, system seconds) per function, from `resource.getrusage`."""
  outs = {name: jax.block_until_ready(fn(*args)) for name, fn in fns.items()}  # compiles
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      before = resource.getrusage(resource.RUSAGE_SELF)
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - t0)
      after = resource.getrusage(resource.RUSAGE_SELF)
      if faults is not None:
        faults.setdefault(name, []).append((after.ru_minflt - before.ru_minflt,
                                            after.ru_stime - before.ru_stime))
  return times, outs


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def convs(rounds: int) -> None:
  for n, side, cin, cout, stride in PAPER_SHAPES:
    x = jax.random.normal(jax.random.key(0), (n, side, side, cin))
    k = jax.random.normal(jax.random.key(1), (3, 3, cin, cout)) / np.sqrt(9 * cin)
    if stride == 2:  # the downsample: right/bottom zero pad, then 'VALID'
      x = vqgan_layers.pad_right_bottom(x)
    padding = 'SAME' if stride == 1 else 'VALID'
    dims = jax.lax.conv_dimension_numbers(x.shape, k.shape, ('NHWC', 'HWIO', 'NHWC'))

    def library(a, w):
      return jax.lax.conv_general_dilated(a, w, (stride, stride), padding,
                                          dimension_numbers=dims)

    def ours(a, w):
      return banded_conv.conv_general_dilated(a.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                        (stride, stride), padding, dimension_numbers=dims)

    fns = {'library_f32': jax.jit(library),
           'library_bf16': jax.jit(lambda a, w: library(a.astype(jnp.bfloat16),
                                                        w.astype(jnp.bfloat16))),
           'ours_bf16': jax.jit(ours)}
    times, outs = _times(fns, (x, k), rounds)
    out_side = side // stride
    flops = 2 * n * out_side * out_side * 9 * cin * cout
    for name, ts in times.items():
      print(json.dumps({
          'bench': 'tokenizer_speed', 'part': 'conv', 'form': name,
          'shape': [n, side, side, cin, cout], 'stride': stride,
          'step_s': float(np.median(ts)), 'step_s_best': float(np.min(ts)),
          'gflops': flops / float(np.median(ts)) / 1e9,
          'rel_diff': _rel(outs[name], outs['library_f32']), 'rounds': rounds}), flush=True)


def _product_flops(jaxpr) -> float:
  """FLOPs of the convolutions and matmuls of a (closed) jaxpr: 2 per multiply-add, the bodies
  of `scan`s (what `lax.map` lowers to) times their length, a `shard_map`'s body times its
  mesh's devices, other sub-jaxprs once (a `cond`'s largest branch); a `while` raises (no
  static trip count)."""
  total = 0.0
  for eqn in jaxpr.jaxpr.eqns if hasattr(jaxpr, 'jaxpr') else jaxpr.eqns:
    name, params = eqn.primitive.name, eqn.params
    if name == 'dot_general':
      (contract, _), _ = params['dimension_numbers']
      lhs = eqn.invars[0].aval.shape
      k = int(np.prod([lhs[d] for d in contract]))
      total += 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * k
    elif name == 'conv_general_dilated':
      rhs = eqn.invars[1].aval.shape
      spec = params['dimension_numbers'].rhs_spec  # (out, in, spatial...)
      per_output = float(np.prod([rhs[d] for d in spec[1:]]))
      total += 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * per_output
    elif name == 'while':
      raise ValueError('a while loop without a static trip count: its products cannot be counted')
    elif name == 'cond':
      total += max(_product_flops(b) for b in params['branches'])
    elif name == 'shard_map':  # the body's shapes are one device's: every device runs it
      total += _product_flops(params['jaxpr']) * params['mesh'].size
    else:
      subs = [v for v in params.values() if hasattr(v, 'eqns') or hasattr(v, 'jaxpr')]
      inner = sum(_product_flops(v) for v in subs)
      total += inner * (params['length'] if name == 'scan' else 1)
  return total


def _trained(workdir: str, images: int) -> tuple:
  """(config, tokenizer params, the first `images` test keyframes in [0, 1]) of a run."""
  from procap_jax import caption
  from procap_jax import checkpointing
  from procap_jax.data import pipeline
  from procap_jax.models import encodings
  config = caption.load_run_config(workdir)
  params = checkpointing.load_stage_variables(workdir, 'tokenizer')['params']
  frames = []
  for batch in pipeline.make_eval_iterator(config, 'test', workdir, 64):
    frames.extend(batch['keyframes'].reshape((-1,) + batch['keyframes'].shape[2:]))
    if len(frames) >= images:
      break
  return config, params, encodings.images01(np.stack(frames[:images]))


def encode(config_spec: str, images: int, rounds: int, dtypes: tuple[str, ...],
           workdir: str = '', shard_images: bool = False) -> None:
  if workdir:
    from procap_jax import errors
    try:
      config, params, x = _trained(workdir, images)
    except errors.UserError as e:
      raise SystemExit(f'error: {e}') from None
  else:
    config = bench_step.load_config(config_spec, [])
    params = stand_ins.random_tokenizer(config)
    side = int(config.tokenizer.model.resolution)
    x = jax.random.uniform(jax.random.key(0), (images, side, side, 3))
  side = x.shape[1]
  tokenizers = {d: vqgan.frozen(config.tokenizer.model, d) for d in dtypes}
  devices, on_mesh = 1, contextlib.nullcontext()
  if shard_images:  # data-parallel over every visible device, the parameters replicated
    from procap_jax import sharding
    mesh = sharding.make_mesh()
    devices = mesh.size
    x = jax.device_put(x, sharding.batch_sharding(mesh, x.ndim))
    params = jax.device_put(params, sharding.replicated(mesh))
    # Traced under the mesh, as the tasks' steps are: the chunked (bf16) encode then runs each
    # device's own images (`vqgan.Frozen`), the float32 one is split by the partitioner.
    on_mesh = jax.set_mesh(mesh)
  fns = {d: jax.jit(t.encode_features) for d, t in tokenizers.items()}
  faults = {}
  with on_mesh:
    times, outs = _times(fns, (params, x), rounds, faults)
    codes = {d: np.asarray(jax.jit(t.encode_tokens)(params, x)) for d, t in tokenizers.items()}
    flops = {d: _product_flops(jax.make_jaxpr(t.encode_features)(params, x))
             for d, t in tokenizers.items()}  # traced as timed (under the mesh if any)
  ref = 'float32' if 'float32' in outs else None
  # The matmul runs on the first device; CPU host devices share the cores, and one device's
  # matmul already uses all of them.
  per = 1 if jax.default_backend() == 'cpu' else devices
  peak = {d: common.matmul_peak_flops(d) * per for d in tokenizers}
  for name, ts in times.items():
    rate = flops[name] / float(np.median(ts))
    print(json.dumps({
        'bench': 'tokenizer_speed', 'part': 'encode', 'config': workdir or config_spec,
        'frozen_dtype': name, 'images': images, 'side': side, 'devices': devices,
        'step_s': float(np.median(ts)), 'step_s_best': float(np.min(ts)),
        'features_rel_diff': _rel(outs[name], outs[ref]) if ref else None,
        'codes_equal_fraction': float(np.mean(codes[name] == codes[ref])) if ref else None,
        'minor_faults_per_call': float(np.median([f for f, _ in faults[name]])),
        'system_s_per_call': float(np.median([s for _, s in faults[name]])),
        'product_gflop_per_image': flops[name] / images / 1e9,
        'product_gflop_per_s': rate / 1e9, 'of_matmul_peak': rate / peak[name],
        'rounds': rounds, 'peak_rss_gib': common.peak_rss_gib()}), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default='configs/clevr_change.py:paper')
  parser.add_argument('--images', type=int, default=16)
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--skip_convs', action='store_true')
  parser.add_argument('--workdir', default='',
                      help="a run's workdir: its trained tokenizer on its first --images test "
                           'keyframes instead of random weights and images (--config unused)')
  parser.add_argument('--frozen_dtypes', default='float32,bfloat16',
                      help='comma-separated, in this order (float32 first for the differences)')
  parser.add_argument('--shard_images', action='store_true',
                      help='encode data-parallel over every host device, each its own images '
                           '(as on a training mesh; set their number with '
                           'XLA_FLAGS=--xla_force_host_platform_device_count=N)')
  args = parser.parse_args()
  if not args.skip_convs:
    convs(args.rounds)
  encode(args.config, args.images, args.rounds, tuple(args.frozen_dtypes.split(',')),
         args.workdir, args.shard_images)


if __name__ == '__main__':
  hostmem.reexec_with_hugepages()  # before anything starts: see hostmem
  main()
