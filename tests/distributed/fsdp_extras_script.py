"""lr_find, then fine_tune (a frozen body, then all of it), of a model with BatchNorm under FSDP: launched by
tests/distributed/test_fsdp.py with torchrun (2 processes, gloo). Each rank saves what it ends with in
OUT/rank<r>.pt.

python tests/distributed/fsdp_extras_script.py OUT"""
import sys
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

torch.set_num_threads(1)
out = Path(sys.argv[1])
torch.manual_seed(0)

class Block(nn.Module):
    def __init__(self): super().__init__(); self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)
    def forward(self, x): return torch.relu(self.bn(self.lin(x)))

x = torch.randn(64, 4); y = (x[:, 0] > 0).long()
dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True),
                  DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8))
model = nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 2))
learn = Learner(dls, model, nn.CrossEntropyLoss(), metrics=accuracy,
                splitter=lambda m: [list(m[:3].parameters()), list(m[3].parameters())])
learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, ProgressCallback)])
with learn.distrib_ctx(strategy='fsdp', shard=Block, timeout=60):
    found = learn.lr_find(show_plot=False, num_it=20)
    learn.fine_tune(1, 1e-2)
    torch.save({'lr': found.valley, 'finder_losses': learn.lr_finder.losses, 'values': learn.recorder.values,
                'model': learn.model.state_dict(), 'plain': type(learn.model) is nn.Sequential,
                'frozen_idx': learn.frozen_idx}, out/f'rank{rank_distrib()}.pt')
