"""The CPU's instruction sets, and whether bfloat16 dot products pay on it.

`config.compute_dtype` and `config.tokenizer.frozen_dtype` take 'auto' (the paper presets' value):
bfloat16 where the CPU has bf16 dot products (the `avx512_bf16` or `amx_bf16` flag of
/proc/cpuinfo), float32 elsewhere: on CPUs without them the bf16 operands are converted and the
switches are slower than float32 (docs/performance.md, "Which path runs"). `config_lib` resolves
'auto' once at start-up with `choose`; the benchmarks name the CPU with `describe` / `summary`
and cap both sides' instruction sets with `cap_environment`.

Standard library only: `bench/compare_original.py` imports this module under a Python that has
torch and maybe no JAX.
"""

import dataclasses
import os

# /proc/cpuinfo flags of bf16 dot-product instructions (AVX-512 BF16: Zen 4, Cooper Lake and
# later Xeons; AMX-BF16: Sapphire Rapids and later).
BF16_DOT_FLAGS = ('avx512_bf16', 'amx_bf16')
NAMED_FLAGS = ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16')
# XLA:CPU's `--xla_cpu_max_isa` values, oldest first; bf16 dot instructions from AVX512_BF16 on.
XLA_ISAS = ('SSE4_2', 'AVX', 'AVX2', 'AVX512', 'AVX512_VNNI', 'AVX512_BF16', 'AMX', 'AMX_FP16')
_FIRST_BF16_ISA = XLA_ISAS.index('AVX512_BF16')
# The benches' `--cap_isa` -> each library's own cap: XLA's flag, oneDNN's and ATen's variables.
ISA_CAPS = {
    'avx2': dict(xla='AVX2', ONEDNN_MAX_CPU_ISA='AVX2', ATEN_CPU_CAPABILITY='avx2'),
    'avx512': dict(xla='AVX512', ONEDNN_MAX_CPU_ISA='AVX512_CORE', ATEN_CPU_CAPABILITY='avx512'),
}


@dataclasses.dataclass(frozen=True)
class Cpu:
  """What /proc/cpuinfo says of the first processor ('' where it says nothing)."""
  model_name: str
  family: str
  model: str
  flags: frozenset


UNKNOWN = Cpu('unknown', '', '', frozenset())


def parse(text: str) -> Cpu:
  """A Cpu from the text of /proc/cpuinfo (its first processor block)."""
  fields = {}
  for line in text.splitlines():
    if not line.strip():
      if fields:
        break  # the end of the first processor's block
      continue
    key, sep, value = line.partition(':')
    if sep:
      fields.setdefault(key.strip().lower(), value.strip())
  flags = fields.get('flags') or fields.get('features') or ''  # x86 | ARM
  return Cpu(model_name=fields.get('model name', 'unknown'), family=fields.get('cpu family', ''),
             model=fields.get('model', ''), flags=frozenset(flags.split()))


def read(path: str = '/proc/cpuinfo') -> Cpu:
  """This machine's CPU (UNKNOWN where `path` cannot be read, e.g. off Linux)."""
  try:
    with open(path, encoding='utf-8', errors='replace') as f:
      return parse(f.read())
  except OSError:
    return UNKNOWN


def xla_isa_cap(xla_flags: str | None = None) -> str | None:
  """The `--xla_cpu_max_isa` value in `xla_flags` (default: $XLA_FLAGS; the last one counts),
  upper-case, or None without a cap."""
  flags = os.environ.get('XLA_FLAGS', '') if xla_flags is None else xla_flags
  cap = None
  for item in flags.split():
    name, _, value = item.partition('=')
    if name == '--xla_cpu_max_isa':
      cap = value.strip('\'"').upper() or None
  return cap


def bf16_dots(cpu: Cpu, xla_flags: str | None = None) -> tuple[bool, str]:
  """(whether bf16 dot products pay here, the reason as a clause) for `cpu` under `xla_flags`
  (default $XLA_FLAGS). A cap below AVX512_BF16 counts as a CPU without them: it asks for code as
  an older CPU would run (see `choose` on what it caps)."""
  have = [f for f in BF16_DOT_FLAGS if f in cpu.flags]
  if not have:
    return False, (f'this CPU ({cpu.model_name}) has no bf16 dot products (no '
                   f'{" or ".join(BF16_DOT_FLAGS)} flag)')
  cap = xla_isa_cap(xla_flags)
  if cap is not None and (cap not in XLA_ISAS or XLA_ISAS.index(cap) < _FIRST_BF16_ISA):
    return False, f'this CPU has {have[0]} but XLA_FLAGS caps XLA:CPU at {cap}'
  return True, f'this CPU ({cpu.model_name}) has {" and ".join(have)}'


def choose(cpu: Cpu, xla_flags: str | None = None, platform: str = 'cpu') -> tuple[str, str]:
  """('bfloat16' | 'float32', why) for a config value 'auto' on `platform` (JAX's backend).

  On the CPU: bfloat16 where `bf16_dots` says so. On an accelerator float32, as before 'auto'
  existed: the rule is measured on CPUs only, and a value in the config still forces bfloat16.
  """
  if platform != 'cpu':
    return 'float32', (f'auto chooses by CPU only and this is a {platform} backend; set the value '
                       'to force bfloat16')
  fast, why = bf16_dots(cpu, xla_flags)
  return ('bfloat16' if fast else 'float32'), why


def describe(cpu: Cpu, xla_flags: str | None = None) -> dict:
  """The CPU as a benchmark names it: model name, family, model, the NAMED_FLAGS (yes/no) and
  XLA's ISA cap (None without one)."""
  out = {'model_name': cpu.model_name, 'family': cpu.family, 'model': cpu.model}
  out.update({flag: flag in cpu.flags for flag in NAMED_FLAGS})
  out['xla_max_isa'] = xla_isa_cap(xla_flags)
  return out


def summary(cpu: Cpu, xla_flags: str | None = None) -> str:
  """One line, e.g. 'AMD EPYC, family 25 model 17, avx2 yes, avx512f yes, avx512_bf16 yes,
  amx_bf16 no' (and ', XLA capped at AVX2' under a cap)."""
  d = describe(cpu, xla_flags)
  parts = [cpu.model_name]
  if cpu.family or cpu.model:
    parts.append(f'family {cpu.family or "?"} model {cpu.model or "?"}')
  parts += [f'{flag} {"yes" if d[flag] else "no"}' for flag in NAMED_FLAGS]
  if d['xla_max_isa']:
    parts.append(f'XLA capped at {d["xla_max_isa"]}')
  return ', '.join(parts)


def cap_environment(cap: str, environ: dict | None = None) -> dict:
  """The environment entries that cap both sides of a benchmark at `cap` (a key of ISA_CAPS):
  XLA_FLAGS (`environ`'s, default os.environ, with `--xla_cpu_max_isa` appended), and oneDNN's
  and ATen's variables for torch. Read when each library starts: set them for a new process.

  Raises:
    ValueError: `cap` is not one of ISA_CAPS.
  """
  if cap not in ISA_CAPS:
    raise ValueError(f'unknown ISA cap {cap!r}; choose one of {", ".join(ISA_CAPS)}')
  environ = os.environ if environ is None else environ
  spec = ISA_CAPS[cap]
  flags = [f for f in environ.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_cpu_max_isa=')]
  out = {k: v for k, v in spec.items() if k != 'xla'}
  out['XLA_FLAGS'] = ' '.join(flags + [f'--xla_cpu_max_isa={spec["xla"]}'])
  return out
