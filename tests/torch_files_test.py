"""The torch-free reader against files written by torch itself (tests/parity/gen_reader.py)."""

import json
import os
import pathlib
import pickle
import struct
import zipfile

import numpy as np
import pytest

from procap_jax.convert import torch_files
from procap_jax.convert import torch_pickle

FIXTURES = pathlib.Path(__file__).parent / 'parity' / 'fixtures'
EXPECTED = np.load(FIXTURES / 'reader_expected.npz')


@pytest.mark.parametrize('name,filename', [('mixed', 'reader_mixed.pt'),
                                           ('lightning', 'reader_lightning.ckpt'),
                                           ('script', 'reader_script.pt')])
def test_state_dict_equals_what_torch_saved(name, filename):
  state = torch_files.state_dict(str(FIXTURES / filename))
  expected = {k.split('/', 1)[1]: EXPECTED[k] for k in EXPECTED.files if k.startswith(name + '/')}
  assert sorted(state) == sorted(expected)
  for key, want in expected.items():
    got = state[key]
    assert got.shape == want.shape, key
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64), err_msg=key)


def test_dtypes_views_and_shared_storage_are_kept():
  state = torch_files.state_dict(str(FIXTURES / 'reader_mixed.pt'))
  assert state['encoder.fp16'].dtype == np.float16
  assert state['encoder.bf16'].dtype.name == 'bfloat16'
  assert state['encoder.int64'].dtype == np.int64 and state['encoder.boolean'].dtype == np.bool_
  assert state['encoder.scalar'].shape == ()
  # The two halves of one storage, and a transposed view and a slice of another.
  np.testing.assert_array_equal(np.concatenate([state['encoder.shared_a'].ravel(),
                                                state['encoder.shared_b'].ravel()]), np.arange(24))
  np.testing.assert_array_equal(state['encoder.transposed'].T[2:5, 1:4], state['encoder.sliced'])


def test_key_selects_and_other_objects_stay_inert():
  tree = torch_files.load(str(FIXTURES / 'reader_mixed.pt'))
  assert isinstance(tree['args'], torch_pickle.Opaque)
  assert tree['args'].name == 'argparse.Namespace' and tree['args'].state == {'lr': 1e-4}
  optimizer = torch_files.state_dict(str(FIXTURES / 'reader_mixed.pt'), key='optimizer')
  assert list(optimizer) == ['state.0.exp_avg']
  with pytest.raises(torch_files.FormatError, match="no entry 'nothing'"):
    torch_files.state_dict(str(FIXTURES / 'reader_mixed.pt'), key='nothing')


def _zip_with_pickle(path, payload: bytes, records: dict | None = None):
  with zipfile.ZipFile(path, 'w') as z:
    z.writestr('archive/data.pkl', payload)
    for key, raw in (records or {}).items():
      z.writestr(f'archive/data/{key}', raw)


def test_dict_and_list_subclasses_are_filled_inertly(tmp_path):
  """A checkpoint holding an EasyDict config (train_stage2.py's `model_cfg`) or a list subclass:
  pickle fills them item by item, which the stand-in records instead of failing."""
  # {'cfg': easydict.EasyDict() with 'lr' = 1.0, 'seq': mylib.L() + [1, 2]} in protocol 2.
  payload = (b'\x80\x02}q\x00(X\x03\x00\x00\x00cfgq\x01ceasydict\nEasyDict\nq\x02)\x81q\x03'
             b'X\x02\x00\x00\x00lrq\x04G?\xf0\x00\x00\x00\x00\x00\x00sX\x03\x00\x00\x00seqq\x05'
             b'cmylib\nL\nq\x06)\x81q\x07(K\x01K\x02eu.')
  _zip_with_pickle(tmp_path / 'cfg.pt', payload)
  tree = torch_files.load(str(tmp_path / 'cfg.pt'))
  assert tree['cfg'].name == 'easydict.EasyDict' and tree['cfg'].items == {'lr': 1.0}
  assert tree['seq'].name == 'mylib.L' and tree['seq'].elements == [1, 2]


def test_no_global_of_the_file_is_executed(tmp_path):
  marker = tmp_path / 'ran'
  # GLOBAL os.system, called with a shell command: the reader must not resolve it.
  payload = b'cos\nsystem\n(S\'touch ' + str(marker).encode() + b'\'\ntR.'
  _zip_with_pickle(tmp_path / 'evil.pt', payload)
  obj = torch_files.load(str(tmp_path / 'evil.pt'))
  assert isinstance(obj, torch_pickle.Opaque) and obj.name == 'os.system'
  assert not marker.exists()


@pytest.mark.parametrize('content,message', [
    (b'', 'is empty'),
    (b'hello world, not weights', 'not a weight file this reader knows'),
    (pickle.dumps({'w': [1.0]}, protocol=2), 'plain Python pickle'),
])
def test_bad_files_get_one_sentence(tmp_path, content, message):
  path = tmp_path / 'bad.pt'
  path.write_bytes(content)
  with pytest.raises(torch_files.FormatError, match=message):
    torch_files.state_dict(str(path))


def test_legacy_missing_and_foreign_zip_files(tmp_path):
  with pytest.raises(torch_files.FormatError, match='legacy'):
    torch_files.state_dict(str(FIXTURES / 'reader_legacy.pt'))
  with pytest.raises(torch_files.FormatError, match='does not exist'):
    torch_files.state_dict(str(tmp_path / 'absent.pt'))
  with zipfile.ZipFile(tmp_path / 'other.zip', 'w') as z:
    z.writestr('readme.txt', 'no weights')
  with pytest.raises(torch_files.FormatError, match='without a data.pkl'):
    torch_files.state_dict(str(tmp_path / 'other.zip'))


def test_truncated_and_damaged_archives(tmp_path):
  raw = (FIXTURES / 'reader_lightning.ckpt').read_bytes()
  (tmp_path / 'cut.ckpt').write_bytes(raw[:len(raw) // 2])
  with pytest.raises(torch_files.FormatError):
    torch_files.state_dict(str(tmp_path / 'cut.ckpt'))
  # A tensor whose storage record is missing from the archive.
  with zipfile.ZipFile(FIXTURES / 'reader_lightning.ckpt') as z:
    root = z.namelist()[0].split('/')[0]
    pkl = z.read(f'{root}/data.pkl')
  _zip_with_pickle(tmp_path / 'nostorage.ckpt', pkl)
  with pytest.raises(torch_files.FormatError, match='lacks the storage record'):
    torch_files.state_dict(str(tmp_path / 'nostorage.ckpt'))


def _write_safetensors(path, arrays: dict):
  header, body, offset = {}, b'', 0
  names = {np.dtype(np.float32): 'F32', np.dtype(np.int64): 'I64', np.dtype(np.float16): 'F16'}
  for name, a in arrays.items():
    raw = np.ascontiguousarray(a).astype(a.dtype.newbyteorder('<')).tobytes()
    header[name] = {'dtype': names[a.dtype], 'shape': list(a.shape),
                    'data_offsets': [offset, offset + len(raw)]}
    body += raw
    offset += len(raw)
  text = json.dumps(header).encode()
  path.write_bytes(struct.pack('<Q', len(text)) + text + body)


def test_safetensors(tmp_path):
  arrays = {'a.weight': np.arange(6, dtype=np.float32).reshape(2, 3),
            'b': np.array([1, -2], np.int64), 'c': np.ones(3, np.float16)}
  _write_safetensors(tmp_path / 'w.safetensors', arrays)
  state = torch_files.state_dict(str(tmp_path / 'w.safetensors'))
  for k, v in arrays.items():
    np.testing.assert_array_equal(state[k], v)
    assert state[k].dtype == v.dtype
  raw = (tmp_path / 'w.safetensors').read_bytes()
  (tmp_path / 'cut.safetensors').write_bytes(raw[:-4])
  with pytest.raises(torch_files.FormatError, match='truncated'):
    torch_files.state_dict(str(tmp_path / 'cut.safetensors'))


def test_the_reader_never_imports_torch():
  import subprocess
  import sys
  code = ('import sys; from procap_jax.convert import torch_files; '
          f'torch_files.state_dict({str(FIXTURES / "reader_script.pt")!r}); '
          'sys.exit(1 if "torch" in sys.modules else 0)')
  assert subprocess.run([sys.executable, '-c', code], env=dict(os.environ)).returncode == 0
