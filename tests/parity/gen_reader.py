"""Writes the torch-file reader's fixtures. Run by hand, in an environment WITH torch:

  python tests/parity/gen_reader.py --out tests/parity/fixtures

Files (a few KB): reader_mixed.pt (dtypes, views, shared storage, nesting, opaque objects),
reader_lightning.ckpt (a Lightning-style checkpoint), reader_script.pt (a TorchScript module),
reader_legacy.pt (the pre-1.6 format the reader must refuse) and reader_expected.npz (the arrays
the reader must return, bfloat16 widened to float32, names as `torch_files.state_dict` gives).
Never collected by pytest; tests/torch_files_test.py reads the outputs without torch.
"""

import argparse
import collections
import os

import numpy as np
import torch


class Inner(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.lin = torch.nn.Linear(3, 2)
    self.register_buffer('scale', torch.arange(4, dtype=torch.float16))

  def forward(self, x):
    return self.lin(x) * self.scale[:2]


class Outer(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.inner = Inner()
    self.blocks = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    self.table = torch.nn.Parameter(torch.randn(5, 2))

  def forward(self, x):
    return self.blocks(self.inner(x)) + self.table[0]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', required=True)
  out = parser.parse_args().out
  os.makedirs(out, exist_ok=True)
  torch.manual_seed(0)
  expected = {}

  base = torch.randn(6, 5)
  shared = torch.arange(24, dtype=torch.int64)
  weights = collections.OrderedDict(
      fp32=torch.randn(3, 4), fp16=torch.randn(2, 3).half(), bf16=torch.randn(4).bfloat16(),
      int64=torch.arange(7), int32=torch.arange(3, dtype=torch.int32) - 1,
      boolean=torch.tensor([True, False, True]), scalar=torch.tensor(2.5),
      transposed=base.t(), sliced=base[2:5, 1:4], shared_a=shared[:12].view(3, 4),
      shared_b=shared[12:].view(4, 3), param=torch.nn.Parameter(torch.randn(2, 2)),
      empty=torch.zeros(0, 3))
  nested = {'model': {'encoder': weights, 'step': 3}, 'args': argparse.Namespace(lr=1e-4),
            'optimizer': {'state': {0: {'exp_avg': torch.ones(2)}}, 'param_groups': [{'lr': 1}]}}
  torch.save(nested, os.path.join(out, 'reader_mixed.pt'))
  for k, v in weights.items():
    expected[f'mixed/encoder.{k}'] = v.detach().float().numpy() if v.dtype == torch.bfloat16 \
        else v.detach().numpy()

  model = Outer()
  lightning = {'epoch': 2, 'global_step': 10, 'pytorch-lightning_version': '2.5.0',
               'state_dict': model.state_dict(), 'hyper_parameters': {'n_embed': 16},
               'optimizer_states': [{'state': {}, 'param_groups': []}]}
  torch.save(lightning, os.path.join(out, 'reader_lightning.ckpt'))
  for k, v in model.state_dict().items():
    expected[f'lightning/{k}'] = v.detach().float().numpy() if v.dtype == torch.bfloat16 \
        else v.detach().numpy()

  scripted = torch.jit.script(model)
  scripted.save(os.path.join(out, 'reader_script.pt'))
  for k, v in scripted.state_dict().items():
    expected[f'script/{k}'] = v.detach().numpy()

  torch.save({'w': torch.ones(2)}, os.path.join(out, 'reader_legacy.pt'),
             _use_new_zipfile_serialization=False)
  np.savez(os.path.join(out, 'reader_expected.npz'), **expected)
  print(f'wrote reader fixtures to {out} ({len(expected)} arrays)')


if __name__ == '__main__':
  main()
