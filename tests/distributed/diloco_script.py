"""A replica group of tests/distributed/test_diloco.py: `python diloco_script.py OUT SYNC SYNC_EVERY` fits
the test's learner under `TorchFT(sync=SYNC, sync_every=SYNC_EVERY)` (the lighthouse and group from the
environment, as `replica_env` gives them) and saves its weights and losses to OUT/group{g}.pt."""
import os, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

N, BS, LR, EPOCHS = 96, 16, 1e-2, 2      # 6 batches an epoch, 12 steps

def batches():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return x, (x[:, 0] + x[:, 1] * x[:, 2] > 0).long()

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))

def make_learner(path='.'):
    "Batches in order (no shuffle), AdamW as torch has it: what the hand-written loop does alike"
    x, y = batches()
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS),
                      DataLoader(TensorDataset(x, y), batch_size=32))
    learn = Learner(dls, make_model(), nn.CrossEntropyLoss(), lr=LR, opt_func=torch.optim.AdamW, device='cpu',
                    path=path)
    learn.remove_cb(ProgressCallback)
    learn.logger = lambda row: None
    return learn

def fit_group(out, sync, sync_every):
    torch.set_num_threads(1)
    learn = make_learner()
    with learn.distrib_ctx(strategy=TorchFT(connect_timeout=10, sync=sync, sync_every=sync_every)):
        learn.fit(EPOCHS)
    torch.save({'model': learn.model.state_dict(), 'losses': learn.recorder.losses,
                'train_iter': learn.train_iter}, f"{out}/group{os.environ['REPLICA_GROUP_ID']}.pt")

if __name__ == '__main__': fit_group(sys.argv[1], sys.argv[2], int(sys.argv[3]))
