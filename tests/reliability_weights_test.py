"""The bad-input list for weight files: hostile and half-right files built here without torch
(tests/hostile_files.py), fed to the reader and to `python -m procap_jax.convert`.

Each refusal is one sentence (exit status 2 at the command, no traceback), nothing from the file
runs (a marker file the file's pickle would create stays absent) and nothing is written in the
workdir. docs/reliability.md lists every case with its observed outcome.
"""

import os
import pathlib
import pickle
import subprocess
import sys
import tracemalloc
import zipfile

import numpy as np
import pytest

import hostile_files as hf
import reliability_helpers
from procap_jax.convert import __main__ as convert_cli
from procap_jax.convert import common
from procap_jax.convert import torch_files

PARITY = pathlib.Path(__file__).parent / 'parity' / 'fixtures'
VQGAN = PARITY / 'vqgan.ckpt'


READER = 'weight file reader (init_from, convert)'
COMMAND = 'convert command'


def _shown(text: str) -> str:
  """A sentence as docs/reliability.md shows it: the fixtures' folder relative to the repo."""
  return text.replace(str(PARITY), 'tests/parity/fixtures')


def _refusal(path, **kwargs) -> str:
  """The reader's one sentence for `path`."""
  with pytest.raises(torch_files.FormatError) as e:
    torch_files.state_dict(str(path), **kwargs)
  message = str(e.value)
  assert '\n' not in message and str(path) in message, message
  return message


def _stride0_bomb(path) -> None:
  """The 498-byte file of the issue: one float32 value viewed as a 100000 x 100000 tensor."""
  hf.save(path, {'w': hf.tensor('0', 1, (100000, 100000), (0, 0))}, {'0': b'\0\0\0\0'})


def test_stride0_bomb_is_refused_before_anything_is_allocated(tmp_path, fault):
  path = tmp_path / 'bomb.pt'
  _stride0_bomb(path)
  assert os.path.getsize(path) < 600
  tracemalloc.start()
  try:
    message = _refusal(path)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert 'claims 37.3 GiB' in message and 'max_expansion 4' in message
  assert peak < 1 << 20, peak  # the claim is 40 GB; reading the archive itself takes ~64 KB
  fault(READER, f'a {os.path.getsize(path)}-byte zip whose float32 tensor has stride 0 and shape '
        '100000 x 100000', f'error: {message} (Python heap peak while refusing it: '
        f'{peak / 1024:.0f} KiB)')


def test_genuine_expansion_stays_under_the_limit_and_the_limit_is_overridable(tmp_path, fault):
  """An honest file expands to about 2 x its size (storage + tensor); a stride-0 tensor
  claiming 8 MiB from 4 bytes passes under the 16 MiB floor and is refused below it."""
  value = np.arange(5_000_000, dtype=np.float32)  # 20 MB: above the floor, so the factor counts
  hf.save_state(tmp_path / 'big.pt', {'w': value})
  np.testing.assert_array_equal(torch_files.state_dict(str(tmp_path / 'big.pt'))['w'], value)
  assert 'max_expansion 1.5' in _refusal(tmp_path / 'big.pt', max_expansion=1.5)
  hf.save(tmp_path / 'expand.pt', {'w': hf.tensor('0', 1, (2 << 20,), (0,))},
          {'0': np.float32(3).tobytes()})
  expanded = torch_files.state_dict(str(tmp_path / 'expand.pt'))['w']
  assert expanded.shape == (2 << 20,) and (expanded == 3).all()
  fault(READER, 'a genuine 20 MB float32 tensor; the same file read with max_expansion=1.5',
        'read, equal to what was saved; with max_expansion=1.5: error: '
        + _refusal(tmp_path / 'big.pt', max_expansion=1.5))
  fault(READER, 'a stride-0 tensor expanding 4 bytes to 8 MiB (under the 16 MiB floor)',
        'read: 2097152 equal values')


@pytest.mark.parametrize('case,tree,records,message', [
    ('storage that claims more values than its record holds',
     {'w': hf.tensor('0', 1000, (10,), (1,))}, {'0': b'\0' * 40},
     'storage 0 claims 4000 bytes (1000 float32 values), holds 40'),
    ('tensor reaching past the end of its storage',
     {'w': hf.tensor('0', 10, (4, 4), (4, 1))}, {'0': b'\0' * 40},
     'claims 64 bytes of storage 0, which holds 40'),
    ('tensor at an offset past its storage',
     {'w': hf.tensor('0', 10, (2,), (1,), offset=9)}, {'0': b'\0' * 40},
     'claims 44 bytes of storage 0, which holds 40'),
    ('negative stride', {'w': hf.tensor('0', 10, (2,), (-1,))}, {'0': b'\0' * 40},
     'malformed shape'),
    ('shape and strides of different lengths', {'w': hf.tensor('0', 10, (2, 2), (1,))},
     {'0': b'\0' * 40}, 'malformed shape'),
    ('storage of a whole number of bytes but not of values',
     {'w': hf.tensor('0', 2, (2,), (1,))}, {'0': b'\0' * 9}, 'not a whole number'),
    ('storage record missing', {'w': hf.tensor('0', 10, (2,), (1,))}, {},
     'lacks the storage record data/0'),
    ('storage type that is a call (os.system)',
     {'w': hf.Call(hf.Global('torch._utils', '_rebuild_tensor_v2'),
                   (hf.PersistentId(('storage', hf.Call(hf.Global('os', 'system'), ('true',)),
                                     '0', 'cpu', 1)), 0, (1,), (1,)))},
     {'0': b'\0' * 4}, 'storage 0 has a type this reader does not know'),
], ids=['storage_short', 'past_the_end', 'offset_past_the_end', 'negative_stride',
        'rank_mismatch', 'partial_value', 'record_missing', 'storage_type_call'])
def test_tensors_that_claim_more_than_their_storage_holds(tmp_path, fault, case, tree, records,
                                                          message):
  hf.save(tmp_path / 'bad.pt', tree, records)
  got = _refusal(tmp_path / 'bad.pt')
  assert message in got
  fault(READER, case, f'error: {got}')


def test_compressed_storage_record_bomb(tmp_path, fault):
  """A deflated record of 64 MiB of zeros in a ~70 KB file: its declared size is checked against
  the limit before it is decompressed."""
  with zipfile.ZipFile(tmp_path / 'zip_bomb.pt', 'w', zipfile.ZIP_DEFLATED) as z:
    z.writestr('archive/data.pkl', hf.dumps({'w': hf.tensor('0', 16 << 20, (16 << 20,), (1,))}))
    z.writestr('archive/data/0', b'\0' * (64 << 20))
  assert os.path.getsize(tmp_path / 'zip_bomb.pt') < 200_000
  message = _refusal(tmp_path / 'zip_bomb.pt')
  assert 'storage 0 alone claims 64 MiB' in message
  fault(READER, f'a {os.path.getsize(tmp_path / "zip_bomb.pt") // 1024} KiB zip whose deflated '
        'storage record expands to 64 MiB', f'error: {message}')


def _marker_payloads(marker) -> dict[str, bytes]:
  """Nine malicious files: each would create `marker` if its pickle ran."""
  cmd = f'touch {marker}'.encode()
  sbytes = len(cmd).to_bytes(1, 'little')
  code = b'import os; os.system("' + cmd + b'")'
  return {
      'GLOBAL posix.system': b'cposix\nsystem\n(S\'' + cmd + b'\'\ntR.',
      'GLOBAL os.system': b'\x80\x02cos\nsystem\nq\x00X' + len(cmd).to_bytes(4, 'little')
                          + cmd + b'\x85R.',
      'STACK_GLOBAL os.system': b'\x80\x04\x8c\x02os\x94\x8c\x06system\x94\x93\x8c' + sbytes
                                + cmd + b'\x85R.',
      'INST os.system': b'(S\'' + cmd + b'\'\nios\nsystem\n.',
      'builtins.exec': b'\x80\x02cbuiltins\nexec\nX' + len(code).to_bytes(4, 'little') + code
                       + b'\x85R.',
  }


@pytest.mark.parametrize('name', ['GLOBAL posix.system', 'GLOBAL os.system',
                                  'STACK_GLOBAL os.system', 'INST os.system', 'builtins.exec'],
                         ids=lambda name: name.replace(' ', '_'))
def test_malicious_pickles_in_an_archive_run_nothing(tmp_path, fault, name):
  marker = tmp_path / 'ran'
  with zipfile.ZipFile(tmp_path / 'evil.pt', 'w') as z:
    z.writestr('archive/data.pkl', _marker_payloads(marker)[name])
  message = _refusal(tmp_path / 'evil.pt')
  assert 'holds no tensors' in message
  strict = _refusal(tmp_path / 'evil.pt', strict=True)
  assert 'strict mode refuses it' in strict
  assert not marker.exists()
  fault(READER, f'a torch zip whose pickle calls {name} (touch a marker file)',
        f'nothing ran (no marker); error: {message}; with strict: error: {strict}')


def test_malicious_files_outside_an_archive_are_refused_unread(tmp_path, fault):
  marker = tmp_path / 'ran'
  cases = {
      'plain.pkl': (pickle.dumps({'w': [1.0]}, protocol=2), 'plain Python pickle',
                    'a plain pickle (not a torch zip)'),
      'legacy.pt': ((PARITY / 'reader_legacy.pt').read_bytes(), 'legacy (pre-1.6, non-zip)',
                    'a legacy (pre-1.6) torch file'),
      'protocol0.pt': (_marker_payloads(marker)['GLOBAL posix.system'],
                       'not a weight file this reader knows',
                       'a protocol-0 pickle calling posix.system, not in a zip'),
      'empty.pt': (b'', 'is empty', 'an empty file'),
      'text.pt': (b'these are not weights\n' * 4, 'not a weight file this reader knows',
                  'a text file'),
  }
  for name, (content, message, what) in cases.items():
    (tmp_path / name).write_bytes(content)
    got = _refusal(tmp_path / name)
    assert message in got, name
    fault(READER, what, f'error: {got}')
  assert 'does not exist' in _refusal(tmp_path / 'absent.pt')
  assert not marker.exists()


@pytest.mark.parametrize('cut', [100, 0.5, -30], ids=['100_bytes', 'half', 'end_missing'])
def test_truncated_archives_are_called_truncated(tmp_path, fault, cut):
  raw = VQGAN.read_bytes()
  end = int(len(raw) * cut) if isinstance(cut, float) else cut
  (tmp_path / 'cut.ckpt').write_bytes(raw[:end])
  message = _refusal(tmp_path / 'cut.ckpt')
  assert 'truncated' in message and 'not a weight file' not in message
  kept = len(raw[:end])
  fault(READER, f'the fixture VQGAN checkpoint cut to its first {kept} of {len(raw)} bytes',
        f'error: {message}')


def test_truncated_and_hostile_safetensors(tmp_path, fault):
  import struct
  (tmp_path / 'short.safetensors').write_bytes(struct.pack('<Q', 10_000) + b'{"a": ')
  message = _refusal(tmp_path / 'short.safetensors')
  assert 'header claims 10000 bytes' in message
  fault(READER, 'a safetensors file cut inside its header', f'error: {message}')
  header = b'{"w": {"dtype": "F32", "shape": [100000, 100000], "data_offsets": [0, 4]}}'
  (tmp_path / 'big.safetensors').write_bytes(struct.pack('<Q', len(header)) + header + b'\0' * 4)
  message = _refusal(tmp_path / 'big.safetensors')
  assert 'claims 40000000000 bytes, holds 4' in message
  fault(READER, 'a safetensors tensor of 100000 x 100000 float32 over 4 bytes', f'error: {message}')


def test_foreign_globals_beside_real_tensors_warn_once_and_strict_refuses(tmp_path, capsys,
                                                                         fault):
  """A real VQGAN state dict with a posix.system call beside it: its tensors are read, one
  warning line names the call, nothing runs; strict refuses the file."""
  marker = tmp_path / 'ran'
  honest = torch_files.state_dict(str(VQGAN))
  hf.save_state(tmp_path / 'poisoned.ckpt', honest,
                {'hook': hf.Call(hf.Global('posix', 'system'), (f'touch {marker}',))},
                key='state_dict')
  capsys.readouterr()
  state = torch_files.state_dict(str(tmp_path / 'poisoned.ckpt'))
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('warning: ') and '(posix.system)' in err[0]
  assert sorted(state) == sorted(honest) and state.foreign == ['posix.system']
  for key, value in honest.items():
    np.testing.assert_array_equal(state[key], value)
  strict = _refusal(tmp_path / 'poisoned.ckpt', strict=True)
  assert '(posix.system); strict mode refuses it' in strict
  assert not marker.exists()
  fault(READER, 'the fixture VQGAN state dict with a posix.system call beside it',
        f'tensors read, equal to the clean file\'s; nothing ran; one line: {err[0]}; with strict: '
        f'error: {strict}')
  capsys.readouterr()
  torch_files.state_dict(str(VQGAN))  # only torch's own rebuild functions: no warning
  assert capsys.readouterr().err == ''


def test_missing_key_hints_name_only_the_same_module(fault):
  state = {'encoder.conv_in.weight': 0, 'decoder.conv_out.weight': 0, 'mlp.0.bias': 0}
  with pytest.raises(common.ConversionError) as e:
    common.take(state, 'text_decoder.decoder.out.weight')
  assert 'conv_in' not in str(e.value) and 'keys with the same ending' not in str(e.value)
  with pytest.raises(common.ConversionError, match=r"module 'mlp.0' has bias\)"):
    common.take(state, 'mlp.0.weight')
  with pytest.raises(common.ConversionError, match="it has 'model.mlp.0.bias': another prefix"):
    common.take({'model.mlp.0.bias': 0}, 'mlp.0.bias')
  with pytest.raises(common.ConversionError) as e:
    common.take(state, 'mlp.0.weight')
  fault('converters (a missing parameter)', 'a file lacking mlp.0.weight, with mlp.0.bias and '
        'unrelated *.weight keys', f'error: {e.value}')


# --- the converters: wrong-kind files, half conversions, nothing written -----------------------

def _config():
  from configs import synthetic
  return synthetic.get_config('tiny')


@pytest.mark.parametrize('kind,path,stage1,message', [
    # the two exit-0 cases
    ('procap', 'stage2_small_model.pt', 'clip_small.pt',
     'clip_small.pt is an OpenAI CLIP file, not a ProCap stage-1 checkpoint as convert procap '
     '--stage1 takes; CLIP gives only the stage-1 encoder\'s blocks, so no stage is finished'),
    ('clip', 'stage1_small_init.pt', '',
     'stage1_small_init.pt is a ProCap stage-1 checkpoint, not an OpenAI CLIP file as convert '
     'clip takes; convert it with python -m procap_jax.convert procap STAGE2 --stage1'),
    # every other wrong kind for each conversion
    ('clip', 'vqgan.ckpt', '', 'convert it with python -m procap_jax.convert taming'),
    ('clip', 'stage2_small_model.pt', '', 'is a ProCap stage-2 checkpoint, not an OpenAI CLIP'),
    ('taming', 'clip_small.pt', '', 'is an OpenAI CLIP file, not a taming VQGAN checkpoint'),
    ('taming', 'reader_mixed.pt', '', 'is a file of none of the kinds the converters take'),
    ('procap', 'vqgan.ckpt', '', 'not a ProCap stage-2 checkpoint as convert procap takes; '
     'convert it with python -m procap_jax.convert taming'),
    ('procap', 'stage1_small_init.pt', '', 'is a ProCap stage-1 checkpoint, not a ProCap stage-2'),
    ('procap', 'clip_small.pt', '', 'is an OpenAI CLIP file, not a ProCap stage-2 checkpoint'),
    ('procap', 'stage2_small_model.pt', 'vqgan.ckpt',
     'is a taming VQGAN checkpoint, not a ProCap stage-1 checkpoint as convert procap --stage1'),
], ids=['procap_stage1_clip', 'clip_stage1', 'clip_vqgan', 'clip_stage2', 'taming_clip',
        'taming_other', 'procap_vqgan', 'procap_stage1', 'procap_clip', 'procap_stage1_vqgan'])
def test_wrong_kind_files_are_one_sentence_and_write_nothing(tmp_path, capsys, fault, kind, path,
                                                             stage1, message):
  config = _config()
  config.data.word2idx_file = f'{PARITY}/stage2_small_word2idx.json'
  config.data.data_dir = str(tmp_path / 'data')
  workdir = tmp_path / 'run'
  err = reliability_helpers.exit_message(
      capsys, convert_cli.convert, config, str(workdir), kind, str(PARITY / path),
      str(PARITY / stage1) if stage1 else '')
  assert message in err
  assert not workdir.exists() and not (tmp_path / 'data').exists()
  fault(COMMAND, f'convert {kind} {path}' + (f' --stage1 {stage1}' if stage1 else ''),
        _shown(err) + ' (nothing written)')


def test_every_hostile_file_is_one_sentence_at_the_converter(tmp_path, capsys, fault):
  """The reader's refusals reach the command as its one error line, for each conversion."""
  _stride0_bomb(tmp_path / 'bomb.pt')
  raw = VQGAN.read_bytes()
  (tmp_path / 'cut.ckpt').write_bytes(raw[:len(raw) // 2])
  (tmp_path / 'empty.pt').write_bytes(b'')
  (tmp_path / 'text.pt').write_text('not weights')
  config = _config()
  config.data.word2idx_file = f'{PARITY}/stage2_small_word2idx.json'
  config.data.data_dir = str(tmp_path / 'data')
  for name, message, what in (
      ('bomb.pt', 'claims 37.3 GiB', 'the stride-0 bomb'),
      ('cut.ckpt', 'truncated zip archive', 'the fixture VQGAN cut in half'),
      ('empty.pt', 'is empty', 'an empty file'), ('text.pt', 'not a weight file', 'a text file')):
    for kind in convert_cli.KINDS:
      err = reliability_helpers.exit_message(capsys, convert_cli.convert, config,
                                             str(tmp_path / 'run'), kind, str(tmp_path / name))
      assert message in err, (kind, name, err)
    fault(COMMAND, f'convert taming, clip and procap given {what}',
          f'{err} (the same line for each; nothing written)')
  assert not (tmp_path / 'run').exists()


def test_a_stage_is_finished_only_when_every_parameter_came_from_the_file(tmp_path, capsys,
                                                                          fault):
  """A tokenizer with a discriminator: the VQGAN file has no weights for it, so the stage is not
  written unless --allow_init, which names them."""
  import init_from_test
  from procap_jax import train
  config = init_from_test._fixture_tokenizer_config(_config())  # pylint: disable=protected-access
  config.tokenizer.train.gan_weight = 0.1
  workdir = tmp_path / 'run'
  err = reliability_helpers.exit_message(capsys, convert_cli.convert, config, str(workdir),
                                         'taming', str(VQGAN))
  assert 'would keep their fresh initialisation: disc/' in err
  assert '(the discriminator, which only tokenizer training uses)' in err and '--allow_init' in err
  assert not workdir.exists()
  assert convert_cli.convert(config, str(workdir), 'taming', str(VQGAN),
                             allow_init=True) == ['tokenizer']
  warning = capsys.readouterr().err
  assert 'written as finished because of --allow_init' in warning
  assert os.path.exists(train.stage_done_path(str(workdir), 'tokenizer'))
  fault(COMMAND, 'convert taming vqgan.ckpt into a tokenizer config that trains a discriminator '
        '(gan_weight 0.1)', f'{_shown(err)} (nothing written); with --allow_init: the stage is '
        'written and one warning line names the same parameters')


def test_the_command_refuses_the_bomb_and_strict_refuses_foreign_code(tmp_path, fault):
  """The two cases as a user meets them: `python -m procap_jax.convert` in its own process,
  exit status 2, one `error:` line, no traceback, no workdir."""
  _stride0_bomb(tmp_path / 'bomb.pt')
  hf.save_state(tmp_path / 'poisoned.ckpt', {'encoder.conv_in.weight': np.zeros((2, 3, 3, 3))},
                {'hook': hf.Call(hf.Global('posix', 'system'), (f'touch {tmp_path}/ran',))})
  env = reliability_helpers.subprocess_env(str(tmp_path / 'cache'))
  for args, message in (([str(tmp_path / 'bomb.pt')], 'claims 37.3 GiB'),
                        ([str(tmp_path / 'poisoned.ckpt'), '--strict'],
                         '(posix.system); strict mode refuses it')):
    run = subprocess.run(
        [sys.executable, '-m', 'procap_jax.convert', 'taming', *args,
         '--config', 'configs/synthetic.py:tiny', '--workdir', str(tmp_path / 'run')],
        cwd=reliability_helpers.REPO, env=env, capture_output=True, text=True, timeout=300,
        check=False)
    err = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2, run.stderr
    assert len(err) == 1 and err[0].startswith('error: ') and message in err[0], run.stderr
    fault(COMMAND + ' (own process)', f'python -m procap_jax.convert taming {" ".join(args)}'
          .replace(str(tmp_path) + '/', ''), f'exit status 2, one stderr line: {err[0]}')
  assert not (tmp_path / 'run').exists() and not (tmp_path / 'ran').exists()
