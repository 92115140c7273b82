"""A replica group of tests/distributed/test_diloco.py: `python diloco_script.py OUT SYNC SYNC_EVERY [ROLE]`
fits the test's learner under `TorchFT(sync=SYNC, sync_every=SYNC_EVERY)` (the lighthouse and group from the
environment, as `replica_env` gives them) and saves its weights and losses to OUT/group{g}.pt (in a group of
many ranks started by torchrun, OUT/group{g}-{rank}.pt). With a ROLE, a fit of `FAULT_EPOCHS` in which a
group is lost: 'dies' SIGKILLs itself after its second step (the middle of a period; in a group of many
ranks, its rank 1), 'restarted' is that group started again, 'steady' the other. Each role saves, per step,
its share and the syncs rolled back so far to OUT/{role}.pt (OUT/{role}-{rank}.pt). Options: streaming
DiLoCo's `--fragments`, `--delay`, `--alpha`; `--within fsdp` for a group of many ranks."""
import argparse, os, signal, sys
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

def rank_of_group(): return int(os.environ.get('RANK', 0))

def result_name(name): return f"{name}-{rank_of_group()}" if 'LOCAL_WORLD_SIZE' in os.environ else name

def strategy(args, **kw):
    return TorchFT(connect_timeout=10, sync=args.sync, sync_every=args.sync_every, within=args.within,
                   num_fragments=args.fragments, fragment_sync_delay=args.delay,
                   fragment_update_alpha=args.alpha, **kw)

def fit_group(args):
    torch.set_num_threads(1)
    learn,ft = make_learner(),strategy(args)
    with learn.distrib_ctx(strategy=ft): learn.fit(EPOCHS)
    torch.save({'model': learn.model.state_dict(), 'losses': learn.recorder.losses,
                'train_iter': learn.train_iter, 'sharded': ft.sharded},
               f"{args.out}/{result_name('group' + os.environ['REPLICA_GROUP_ID'])}.pt")

class Fault(Callback):
    """A group's part in a fit that loses one: what each training step was (`train_iter`, the group's rank
    and the number of groups it shared the batch with, the syncs rolled back after it), and its death (in
    a group of many ranks, of its rank 1)"""
    def __init__(self, out, role): self.out,self.role,self.steps = out,role,[]
    def after_batch(self):
        if not self.training: return
        semi = self.strategy.semi
        self.steps.append((self.train_iter, *semi.groups, semi.rolled_back))
        dies = self.role == 'dies' and len(self.steps) == 2
        if dies and rank_of_group() == (1 if 'LOCAL_WORLD_SIZE' in os.environ else 0):
            torch.save({'steps': self.steps}, self.out/'dies.pt')
            os.kill(os.getpid(), signal.SIGKILL)

def fit_with_a_fault(args):
    torch.set_num_threads(1)
    learn,fault = make_learner(),Fault(Path(args.out), args.role)
    with learn.distrib_ctx(strategy=strategy(args, timeout=10, quorum_every=0)):
        learn.fit(FAULT_EPOCHS, cbs=fault)
    torch.save({'model': learn.model.state_dict(), 'steps': fault.steps, 'train_iter': learn.train_iter},
               f"{args.out}/{result_name(args.role)}.pt")

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('sync'); p.add_argument('sync_every', type=int)
    p.add_argument('role', nargs='?')
    p.add_argument('--fragments', type=int, default=1); p.add_argument('--delay', type=int, default=0)
    p.add_argument('--alpha', type=float, default=0.); p.add_argument('--within', default='ddp')
    args = p.parse_args()
    if args.role: fit_with_a_fault(args)
    else: fit_group(args)
