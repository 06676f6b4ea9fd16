"""The compute path chosen for the CPU ('auto' bf16 switches) and the benches' CPU naming and ISA
caps. The CPU is injected (/proc/cpuinfo texts written here), so no test depends on this
machine's CPU; compare_original's driver is imported with a stand-in for its torch module."""

import importlib
import json
import sys
import types

import pytest

from configs import clevr_change
from configs import image_editing_request
from configs import spot_the_diff
from configs import synthetic
from procap_jax import config_lib
from procap_jax import cpu_info
from procap_jax import errors
from procap_jax import main

_BLOCK = """processor\t: {n}
vendor_id\t: {vendor}
cpu family\t: {family}
model\t\t: {model}
model name\t: {name}
flags\t\t: fpu sse sse2 {flags}
"""


def _cpuinfo(name='AMD EPYC', family='25', model='17', flags='avx2', vendor='AuthenticAMD'):
  """Two processors' blocks, as /proc/cpuinfo lists them."""
  return '\n'.join(_BLOCK.format(n=n, vendor=vendor, family=family, model=model, name=name,
                                 flags=flags) for n in range(2))


ZEN4 = cpu_info.parse(_cpuinfo(flags='avx2 avx512f avx512_bf16'))
ZEN3 = cpu_info.parse(_cpuinfo(model='1', flags='avx2 fma'))
SKYLAKE = cpu_info.parse(_cpuinfo('Intel(R) Xeon(R)', '6', '85', 'avx2 avx512f', 'GenuineIntel'))
SAPPHIRE = cpu_info.parse(_cpuinfo('Intel(R) Xeon(R) Platinum 8480+', '6', '143',
                                   'avx2 avx512f avx512_bf16 amx_bf16 amx_tile', 'GenuineIntel'))
AMX_ONLY = cpu_info.parse(_cpuinfo(flags='avx2 amx_bf16'))


def test_parse_reads_the_first_processor_and_arm_features(tmp_path):
  text = _cpuinfo(flags='avx2') + '\n' + _BLOCK.format(
      n=2, vendor='x', family='1', model='2', name='another', flags='avx512_bf16')
  cpu = cpu_info.parse(text)
  assert (cpu.model_name, cpu.family, cpu.model) == ('AMD EPYC', '25', '17')
  assert 'avx2' in cpu.flags and 'avx512_bf16' not in cpu.flags
  arm = cpu_info.parse('processor\t: 0\nFeatures\t: fp asimd bf16\nCPU part\t: 0xd40\n')
  assert arm.flags == {'fp', 'asimd', 'bf16'} and arm.model_name == 'unknown'
  path = tmp_path / 'cpuinfo'
  path.write_text(_cpuinfo(flags='avx512_bf16'))
  assert cpu_info.read(str(path)).flags >= {'avx512_bf16'}
  assert cpu_info.read(str(tmp_path / 'absent')) == cpu_info.UNKNOWN


@pytest.mark.parametrize('cpu,xla_flags,want', [
    (ZEN4, '', 'bfloat16'),                                 # AVX-512 BF16
    (SAPPHIRE, '', 'bfloat16'),                             # AMX and AVX-512 BF16
    (AMX_ONLY, '', 'bfloat16'),                             # either flag is enough
    (SKYLAKE, '', 'float32'),                               # AVX-512 without BF16
    (ZEN3, '', 'float32'),                                  # AVX2 only
    (cpu_info.UNKNOWN, '', 'float32'),                      # no /proc/cpuinfo
    (ZEN4, '--xla_cpu_max_isa=AVX2', 'float32'),            # a cap below bf16 dots
    (ZEN4, '--xla_cpu_use_onednn=false --xla_cpu_max_isa=avx512', 'float32'),
    (SAPPHIRE, '--xla_cpu_max_isa=AVX512_VNNI', 'float32'),
    (ZEN4, '--xla_cpu_max_isa=AVX512_BF16', 'bfloat16'),    # a cap that keeps them
    (SAPPHIRE, '--xla_cpu_max_isa=AMX', 'bfloat16'),
    (ZEN4, '--xla_cpu_max_isa=AVX2 --xla_cpu_max_isa=AMX_FP16', 'bfloat16'),  # the last counts
    (ZEN3, '--xla_cpu_max_isa=AMX', 'float32'),             # a cap adds nothing
    (ZEN4, '--xla_cpu_max_isa=NEWEST', 'float32'),          # a value XLA does not know
])
def test_auto_is_bfloat16_only_with_bf16_dot_products_not_capped_away(cpu, xla_flags, want):
  got, why = cpu_info.choose(cpu, xla_flags)
  assert got == want
  if 'max_isa' in xla_flags and cpu.flags & set(cpu_info.BF16_DOT_FLAGS) and want == 'float32':
    assert 'XLA_FLAGS caps XLA:CPU at' in why
  elif want == 'float32':
    assert 'no bf16 dot products' in why
  else:
    assert 'bf16' in why and cpu.model_name in why


def test_auto_on_an_accelerator_is_float32():
  got, why = cpu_info.choose(ZEN4, '', platform='gpu')
  assert got == 'float32' and 'gpu backend' in why


def test_xla_isa_cap_reads_xla_flags_by_default(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=avx2')
  assert cpu_info.xla_isa_cap() == 'AVX2'
  assert cpu_info.choose(ZEN4)[0] == 'float32'
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  assert cpu_info.xla_isa_cap() is None and cpu_info.choose(ZEN4)[0] == 'bfloat16'


def _auto(config):
  config.compute_dtype = config.tokenizer.frozen_dtype = 'auto'
  return config


def test_resolve_compute_path_auto_follows_the_cpu_and_the_cap():
  config = _auto(synthetic.get_config('tiny'))
  config_lib.validate(config)  # 'auto' is a valid value
  line = config_lib.resolve_compute_path(config, cpu=ZEN4, xla_flags='', platform='cpu')
  assert (config.compute_dtype, config.tokenizer.frozen_dtype) == ('bfloat16', 'bfloat16')
  assert line.startswith('compute path: bfloat16 for compute_dtype and tokenizer.frozen_dtype')
  assert 'avx512_bf16' in line
  config_lib.validate(config)
  capped = _auto(synthetic.get_config('tiny'))
  line = config_lib.resolve_compute_path(capped, cpu=ZEN4, xla_flags='--xla_cpu_max_isa=AVX2',
                                         platform='cpu')
  assert (capped.compute_dtype, capped.tokenizer.frozen_dtype) == ('float32', 'float32')
  assert 'caps XLA:CPU at AVX2' in line


@pytest.mark.parametrize('cpu,forced,auto_gives', [(ZEN3, 'bfloat16', 'float32'),
                                                   (ZEN4, 'float32', 'bfloat16')])
def test_a_value_in_the_config_forces_the_path(cpu, forced, auto_gives):
  config = synthetic.get_config('tiny')
  config.compute_dtype, config.tokenizer.frozen_dtype = forced, 'auto'
  line = config_lib.resolve_compute_path(config, cpu=cpu, xla_flags='', platform='cpu')
  assert (config.compute_dtype, config.tokenizer.frozen_dtype) == (forced, auto_gives)
  assert f'{forced} for compute_dtype (set in the config)' in line
  assert f'{auto_gives} for tokenizer.frozen_dtype (auto: ' in line
  both = synthetic.get_config('tiny')  # float32 in both: nothing to choose, nothing asked
  line = config_lib.resolve_compute_path(both, cpu=cpu, xla_flags='', platform=None)
  assert line == ('compute path: float32 for compute_dtype and tokenizer.frozen_dtype (set in '
                  'the config)')


def test_a_resumed_run_keeps_the_path_its_config_json_recorded(tmp_path):
  """A run started on a CPU without bf16 dots, resumed on one with them, stays float32; the
  config.json written at start-up holds resolved values, never 'auto'."""
  workdir = str(tmp_path / 'run')
  first = _auto(synthetic.get_config('tiny'))
  config_lib.resolve_compute_path(first, workdir, cpu=ZEN3, xla_flags='', platform='cpu')
  config_lib.check_workdir(first, workdir)
  saved = json.loads((tmp_path / 'run' / 'config.json').read_text(encoding='utf-8'))
  assert (saved['compute_dtype'], saved['tokenizer']['frozen_dtype']) == ('float32', 'float32')

  resumed = _auto(synthetic.get_config('tiny'))
  line = config_lib.resolve_compute_path(resumed, workdir, cpu=ZEN4, xla_flags='',
                                         platform='cpu')
  assert (resumed.compute_dtype, resumed.tokenizer.frozen_dtype) == ('float32', 'float32')
  assert 'kept from' in line and 'config.json' in line
  forced = synthetic.get_config('tiny')  # a value in the config still wins over the saved one
  forced.compute_dtype, forced.tokenizer.frozen_dtype = 'bfloat16', 'auto'
  config_lib.resolve_compute_path(forced, workdir, cpu=ZEN3, xla_flags='', platform='cpu')
  assert (forced.compute_dtype, forced.tokenizer.frozen_dtype) == ('bfloat16', 'float32')

  # A config.json from before frozen_dtype existed was float32 there; a damaged one is ignored.
  del saved['tokenizer']['frozen_dtype']
  saved['compute_dtype'] = 'bfloat16'
  (tmp_path / 'run' / 'config.json').write_text(json.dumps(saved), encoding='utf-8')
  old = _auto(synthetic.get_config('tiny'))
  config_lib.resolve_compute_path(old, workdir, cpu=ZEN3, xla_flags='', platform='cpu')
  assert (old.compute_dtype, old.tokenizer.frozen_dtype) == ('bfloat16', 'float32')
  (tmp_path / 'run' / 'config.json').write_text('{not json', encoding='utf-8')
  damaged = _auto(synthetic.get_config('tiny'))
  config_lib.resolve_compute_path(damaged, workdir, cpu=ZEN4, xla_flags='', platform='cpu')
  assert damaged.compute_dtype == 'bfloat16'


def test_paper_presets_choose_by_cpu_and_the_others_keep_float32():
  for module in (clevr_change, spot_the_diff, image_editing_request):
    paper, cpu = module.get_config('paper'), module.get_config('cpu')
    assert (paper.compute_dtype, paper.tokenizer.frozen_dtype) == ('auto', 'auto')
    assert (cpu.compute_dtype, cpu.tokenizer.frozen_dtype) == ('float32', 'float32')
  for preset in ('tiny', 'quick', 'default', 'large', 'ablation'):
    config = synthetic.get_config(preset)
    assert (config.compute_dtype, config.tokenizer.frozen_dtype) == ('float32', 'float32')
  config = synthetic.get_config('tiny')
  config.compute_dtype = 'bf16'
  with pytest.raises(errors.UserError, match="config.compute_dtype is 'bf16'; choose one of "
                     'float32, bfloat16, auto'):
    config_lib.validate(config)


def test_main_resolves_auto_at_start_up_and_says_so(tmp_path, capsys):
  """`main.run` resolves 'auto' before anything else (here an evaluation of a missing run, which
  then stops with its one sentence) and prints one line naming the path."""
  config = _auto(synthetic.get_config('tiny'))
  with pytest.raises(SystemExit):
    main.run(config, str(tmp_path / 'none'), mode='evaluate')
  out = capsys.readouterr()
  assert config.compute_dtype in ('float32', 'bfloat16')
  assert config.tokenizer.frozen_dtype == config.compute_dtype
  lines = [l for l in out.out.splitlines() if l.startswith('compute path: ')]
  assert len(lines) == 1 and f'{config.compute_dtype} for compute_dtype' in lines[0]
  assert 'does not exist' in out.err


def test_cap_environment_caps_xla_onednn_and_aten():
  env = cpu_info.cap_environment('avx2', {'XLA_FLAGS': '--xla_cpu_max_isa=AMX '
                                          '--xla_force_host_platform_device_count=2'})
  assert env == {'XLA_FLAGS': '--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX2',
                 'ONEDNN_MAX_CPU_ISA': 'AVX2', 'ATEN_CPU_CAPABILITY': 'avx2'}
  env = cpu_info.cap_environment('avx512', {})
  assert env['XLA_FLAGS'] == '--xla_cpu_max_isa=AVX512'
  assert cpu_info.choose(SAPPHIRE, env['XLA_FLAGS'])[0] == 'float32'
  assert env['ONEDNN_MAX_CPU_ISA'] == 'AVX512_CORE' and env['ATEN_CPU_CAPABILITY'] == 'avx512'
  with pytest.raises(ValueError, match='unknown ISA cap'):
    cpu_info.cap_environment('avx3')


@pytest.fixture
def compare_original(monkeypatch):
  """bench/compare_original.py's driver, its torch-side module replaced by a stand-in."""
  monkeypatch.setitem(sys.modules, 'bench.original', types.SimpleNamespace(PAPER_VQGAN={}))
  monkeypatch.delitem(sys.modules, 'bench.compare_original', raising=False)
  module = importlib.import_module('bench.compare_original')
  yield module
  sys.modules.pop('bench.compare_original', None)


def test_compare_original_names_the_cpu_and_caps_both_sides(compare_original):
  environ = {'XLA_FLAGS': '--xla_force_host_platform_device_count=2', 'PYTHONPATH': 'x'}
  head = compare_original.header('none', 'paper', cpu=SKYLAKE, environ=environ)
  assert head['cpu'] == {'model_name': 'Intel(R) Xeon(R)', 'family': '6', 'model': '85',
                         'avx2': True, 'avx512f': True, 'avx512_bf16': False,
                         'amx_bf16': False, 'xla_max_isa': None}
  assert head['cpu_summary'].startswith('Intel(R) Xeon(R), family 6 model 85, avx2 yes')
  assert head['torch_caps'] is None
  plain = compare_original.child_env('none', 'TREE', environ)
  assert plain['PYTHONPATH'].split(':')[0] == 'TREE'
  assert 'ONEDNN_MAX_CPU_ISA' not in plain and 'max_isa' not in plain['XLA_FLAGS']

  capped = compare_original.child_env('avx2', 'TREE', environ)
  assert capped['XLA_FLAGS'].endswith('--xla_cpu_max_isa=AVX2')
  assert (capped['ONEDNN_MAX_CPU_ISA'], capped['ATEN_CPU_CAPABILITY']) == ('AVX2', 'avx2')
  head = compare_original.header('avx2', 'paper', cpu=ZEN4, environ=environ)
  assert head['cpu']['avx512_bf16'] and head['cpu']['xla_max_isa'] == 'AVX2'
  assert head['cpu_summary'].endswith('amx_bf16 no, XLA capped at AVX2')
  assert head['torch_caps'] == {'ONEDNN_MAX_CPU_ISA': 'AVX2', 'ATEN_CPU_CAPABILITY': 'avx2'}
