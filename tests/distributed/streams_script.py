"""Per-rank streams and a loss of the prediction alone, for tests/distributed/test_streams.py; launched
with torchrun (2 processes, gloo) or alone.

python tests/distributed/streams_script.py OUT [--mode stream|same|pred-loss] [--kill-at K] [--resume]

`stream`: a `StatefulDataLoader` over an `IterableDataset` whose every rank yields its part of each global
batch of 16 (one process: all of it); `same`: every rank yields the whole stream (refused); `pred-loss`: a
sized dataset of inputs alone and `loss_func(pred)`; `tp-then-fsdp`: a model made tensor parallel, then
given to FSDP (refused). Rank 0 saves OUT/result.pt: weights, losses, table,
preds."""
import argparse, os, signal
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from learncb.all import *

p = argparse.ArgumentParser()
p.add_argument('out'); p.add_argument('--mode', default='stream')
p.add_argument('--epochs', type=int, default=3)
p.add_argument('--kill-at', type=int, default=None); p.add_argument('--resume', action='store_true')
args = p.parse_args()
out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(1)

class Shares(IterableDataset):
    """Batches of a pass over `x, y` in an order drawn from the pass's number: each global batch of `gbs`
    items split among the ranks (`own=False`: every rank reads all of it, as one process). Its state: the
    pass, the batches of it done, and its rank (a rank given another's refuses it)"""
    def __init__(self, x, y, gbs=16, own=True, shuffle=True):
        self.x, self.y, self.gbs, self.own, self.shuffle = x, y, gbs, own, shuffle
        self.epoch, self.done = 0, 0
    def __len__(self): return len(self.x) // self.gbs
    def __iter__(self):
        rank, world = (rank_distrib(), num_distrib()) if self.own else (0, 1)
        n, bs = len(self.x), self.gbs // world
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.epoch)) if self.shuffle \
            else torch.arange(n)
        for k in range(self.done, len(self)):
            idx = order[k * self.gbs + rank * bs:k * self.gbs + (rank + 1) * bs]
            self.done = k + 1
            yield self.x[idx], self.y[idx]
        self.epoch, self.done = self.epoch + 1, 0
    def state_dict(self): return {'epoch': self.epoch, 'done': self.done, 'rank': rank_distrib()}
    def load_state_dict(self, state):
        if state['rank'] != rank_distrib():
            raise ValueError(f"rank {rank_distrib()} was given rank {state['rank']}'s state")
        self.epoch, self.done = state['epoch'], state['done']

g = torch.Generator().manual_seed(0)
x = torch.randn(96, 4, generator=g)
y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).long() + (x[:, 3] > 1).long()
if args.mode == 'pred-loss':
    world = int(os.environ.get('WORLD_SIZE', '1'))
    dls = DataLoaders(DataLoader(TensorDataset(x[:64]), batch_size=16 // world),
                      DataLoader(TensorDataset(x[64:]), batch_size=8))
    loss_func, metrics = (lambda out: (out ** 2).mean() - out[:, 0].mean()), []
else:
    own = args.mode != 'same'
    dls = DataLoaders(StatefulDataLoader(Shares(x[:64], y[:64], own=own), batch_size=None),
                      StatefulDataLoader(Shares(x[64:], y[64:], own=own, shuffle=False), batch_size=None))
    loss_func, metrics = nn.CrossEntropyLoss(), accuracy

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
if args.mode == 'tp-then-fsdp':                 # a model parallelized already, then given to FSDP: refused
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.distributed.init_process_group('gloo')
    parallelize_module(model, init_device_mesh('cpu', (num_distrib(),)), {'0': ColwiseParallel(),
                                                                         '2': RowwiseParallel()})
learn = Learner(dls, model, loss_func, metrics=metrics, opt_func=torch.optim.SGD, lr=0.05, path=out)
learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, ProgressCallback)])

class Kill(Callback):
    "SIGKILL on the last rank at training batch `at`, after that batch's checkpoint"
    order = 99
    def after_batch(self):
        if self.training and self.train_iter == args.kill_at and rank_distrib() == num_distrib() - 1:
            os.kill(os.getpid(), signal.SIGKILL)

cbs = [CheckpointCallback(every_n_steps=1)] if args.kill_at is not None or args.resume else []
if args.kill_at is not None: cbs.append(Kill())
with learn.distrib_ctx(strategy='fsdp' if args.mode == 'tp-then-fsdp' else 'ddp', timeout=60):
    learn.fit(args.epochs, cbs=cbs, resume=True if args.resume else None)
    preds, targs = learn.get_preds()
    rank, world = rank_distrib(), num_distrib()
if rank == 0:
    torch.save({'model': learn.model.state_dict(), 'losses': learn.recorder.losses, 'world': world,
                'values': learn.recorder.values, 'preds': preds, 'targs': targs}, out/'result.pt')
