"""A regression whose batch `bad` holds targets in the wrong unit, for tests/callbacks/test_guards.py: trained
in one process or several (torchrun: DDP, gloo), with `SpikeGuard` or without, on the poisoned data or on the
data without that batch; checkpointed, killed after a rollback and resumed.

python tests/callbacks/guard_script.py OUT [--poison scale|inf|none] [--poison-rank R] [--drop] [--guard]
                                       [--ckpt] [--kill-at K] [--epochs E] [--strategy ddp|fsdp] [--rows R,..]
`--rows`: those rows' targets 1e4 times too large instead, the data shuffled.
Rank 0 saves OUT/result.pt: the weights, learn.skipped_batches, train_iter, each rank's skipped_items."""
import argparse, os, signal
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

N, BS, BAD = 320, 8, 5

def regression(world=1, poison='scale', poison_rank=None, drop=False, bad=BAD, n=N, bs=BS):
    """`DataLoaders` of a regression whose global batch `bad` (each rank's batch `bad` of `bs` items, ranks
    taking every `world`-th item) has its targets times 1e4 (`scale`) or infinite (`inf`), on rank
    `poison_rank` only if given; `drop`: the data without that global batch"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.], [-2.], [.5], [3.]]) + .1 * torch.randn(n, 1, generator=g)
    lo, hi = bad * bs * world, (bad + 1) * bs * world            # the items of the global batch `bad`
    if drop: x, y = torch.cat([x[:lo], x[hi:]]), torch.cat([y[:lo], y[hi:]])
    elif poison != 'none':
        rows = torch.arange(lo, hi)
        if poison_rank is not None: rows = rows[rows % world == poison_rank]
        y[rows] = y[rows] * 1e4 if poison == 'scale' else float('inf')
    return DataLoaders(DataLoader(TensorDataset(x, y), batch_size=bs))

def poisoned_rows(rows, n=N, bs=BS):
    "`DataLoaders` of the regression, shuffled, whose `rows` have targets 1e4 times too large"
    dl = regression(poison='none', n=n, bs=bs).train
    x, y = dl.dataset.tensors
    y = y.clone(); y[rows] *= 1e4
    return DataLoaders(DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True,
                                  generator=torch.Generator().manual_seed(1)))

def regression_learner(dls, path='.', opt_func=torch.optim.Adam, dropout=0.1):
    "A small seeded network for `regression`, with dropout (so a replay must redraw exactly)"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1))
    learn = Learner(dls, model, nn.MSELoss(), lr=1e-2, device='cpu', path=path, opt_func=opt_func)
    learn.remove_cb(ProgressCallback)
    learn.logger = lambda row: None
    return learn

class KillAfterRollback(Callback):
    """SIGKILLs this process at training batch `k` of the fit once a rollback happened (its checkpoints
    written)"""
    order = Order.LAST + 100
    def __init__(self, k): self.k = k
    def after_batch(self):
        if self.learn.skipped_batches and self.train_iter == self.k:
            self.learn.checkpoint.wait()
            os.kill(os.getpid(), signal.SIGKILL)

def main():
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--poison', default='scale'); p.add_argument('--poison-rank',
        type=int)
    p.add_argument('--drop', action='store_true'); p.add_argument('--guard', action='store_true')
    p.add_argument('--ckpt', action='store_true'); p.add_argument('--kill-at', type=int)
    p.add_argument('--epochs', type=int, default=3); p.add_argument('--strategy', default='ddp')
    p.add_argument('--rows', type=lambda s: [int(r) for r in s.split(',')])
    p.add_argument('--global-batch', type=int); p.add_argument('--dropout', type=float, default=.1)
    args = p.parse_args()
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    world = int(os.environ.get('WORLD_SIZE', '1'))
    dls = (regression(world, args.poison, args.poison_rank, args.drop) if args.rows is None else
           poisoned_rows(args.rows))
    learn = regression_learner(dls, path=out, dropout=args.dropout)
    cbs = [SpikeGuard(check_every=4, snapshot_every=4, warmup=4)] if args.guard else []
    if args.ckpt: cbs.append(CheckpointCallback(every_n_steps=5))
    if args.kill_at is not None: cbs.append(KillAfterRollback(args.kill_at))
    gb = {} if args.global_batch is None else {'global_batch': args.global_batch}
    one = world == 1 and gb                       # the one-process fit of the global batch
    with learn.distrib_ctx(**gb) if one else learn.distrib_ctx(strategy=args.strategy, timeout=60, **gb):
        learn.fit(args.epochs, cbs=cbs, resume='auto' if args.ckpt else None)
        state = whole_state(learn.model.state_dict())  # FSDP: the whole tensors, gathered (every rank)
        items = gather_objects(learn.skipped_items)
    if is_rank0():
        torch.save({'model': state, 'skipped': [tuple(b) for b in learn.skipped_batches],
                    'train_iter': learn.train_iter, 'items': items}, out/'result.pt')

if __name__ == '__main__': main()
