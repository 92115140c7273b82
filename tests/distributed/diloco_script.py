"""A replica group of tests/distributed/test_diloco.py: `python diloco_script.py OUT SYNC SYNC_EVERY [ROLE]`
fits the test's learner under `TorchFT(sync=SYNC, sync_every=SYNC_EVERY)` (the lighthouse and group from the
environment, as `replica_env` gives them) and saves its weights and losses to OUT/group{g}.pt. With a ROLE, a
fit of `FAULT_EPOCHS` in which a group is lost: 'dies' SIGKILLs itself after its second step (the middle of a
period), 'restarted' is that group started again, 'steady' the other. Each role saves, per step, its share
and the syncs rolled back so far to OUT/{role}.pt."""
import os, signal, sys
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

N, BS, LR, EPOCHS = 96, 16, 1e-2, 2      # 6 batches an epoch, 12 steps
FAULT_EPOCHS = 4                         # 24 steps

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

class Fault(Callback):
    """A group's part in a fit that loses one: what each training step was (`train_iter`, the group's rank
    and the number of groups it shared the batch with, the syncs rolled back after it), and its death"""
    def __init__(self, out, role): self.out,self.role,self.steps = out,role,[]
    def after_batch(self):
        if not self.training: return
        semi = self.strategy.semi
        self.steps.append((self.train_iter, *semi.groups, semi.rolled_back))
        if self.role == 'dies' and len(self.steps) == 2:
            torch.save({'steps': self.steps}, self.out/'dies.pt')
            os.kill(os.getpid(), signal.SIGKILL)

def fit_with_a_fault(out, sync, sync_every, role):
    torch.set_num_threads(1)
    learn,fault = make_learner(),Fault(Path(out), role)
    ft = TorchFT(connect_timeout=10, timeout=10, sync=sync, sync_every=sync_every, quorum_every=0)
    with learn.distrib_ctx(strategy=ft): learn.fit(FAULT_EPOCHS, cbs=fault)
    torch.save({'model': learn.model.state_dict(), 'steps': fault.steps, 'train_iter': learn.train_iter},
               f"{out}/{role}.pt")

if __name__ == '__main__':
    if len(sys.argv) > 4: fit_with_a_fault(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else: fit_group(sys.argv[1], sys.argv[2], int(sys.argv[3]))
