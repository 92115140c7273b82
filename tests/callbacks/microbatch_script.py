"""A classifier whose batches run out of memory, for tests/callbacks/test_microbatch.py: in one process or several
(torchrun: DDP, gloo), with `AutoMicrobatch` or without.

python tests/callbacks/microbatch_script.py OUT [--auto] [--inject N] [--inject-rank R] [--cap-mb M] [--epochs E]

--inject N: the model raises `torch.OutOfMemoryError` on a training batch of more than N items (on rank R only, if
given). --cap-mb M: the process's address space is capped M MiB above what it maps after a warm-up fit (in one
process) or after its first training batch (under DDP), so that the CPU allocator itself fails (`RLIMIT_AS`): the
cap leaves M MiB for what a batch allocates, whatever the machine maps before. Each rank saves OUT/rank{r}.pt: the weights, the steps, the split history;
an error is saved as OUT/error{r}.txt (and the exit status is 3)."""
import argparse, os, resource, sys, traceback
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

N, BS, HIDDEN = 2048, 512, 4096

class Classifier(nn.Module):
    "A wide two-layer network: its activations, not its weights, fill memory (no dropout: micro-batches sum exactly)"
    def __init__(self, inject=None):
        super().__init__()
        self.body,self.head,self.inject = nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU()),nn.Linear(HIDDEN, 10),inject
    def forward(self, x):
        if self.inject is not None and torch.is_grad_enabled() and x.shape[0] > self.inject:
            raise torch.OutOfMemoryError(f"injected: a batch of {x.shape[0]} items is over {self.inject}: out of memory")
        return self.head(self.body(x))

def data(world=1):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 64, generator=g), torch.randint(0, 10, (N,), generator=g)
    return DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS // world, shuffle=True,
                                  generator=torch.Generator().manual_seed(1)),
                       DataLoader(TensorDataset(x, y), batch_size=N // world))

def learner(inject=None, world=1, path='.'):
    torch.manual_seed(0)
    learn = Learner(data(world), Classifier(inject), nn.CrossEntropyLoss(), lr=1e-3, device='cpu', path=path)
    learn.remove_cb(ProgressCallback)
    learn.logger = lambda row: None
    return learn

def mapped_bytes():
    "The address space this process maps now (VmSize)"
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith('VmSize:'): return int(line.split()[1]) * 1024

def cap_memory(mb):
    "Warm up (a fit of the same shapes, on tiny batches), then cap the address space `mb` MiB above what is mapped"
    warm = learner()
    warm.dls = DataLoaders(DataLoader(TensorDataset(torch.randn(8, 64), torch.randint(0, 10, (8,))), batch_size=4))
    warm.fit(1)
    del warm
    limit = mapped_bytes() + mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

class CapMemory(Callback):
    """Under DDP: caps the address space `mb` MiB above what is mapped after the first training batch, once its step made
    what every step keeps (the gradients, DDP's buckets, the optimizer's state): what is left is the batch's own"""
    order = Order.LAST
    def __init__(self, mb): self.mb = mb
    def after_batch(self):
        if not self.training or self.learn.train_iter != 1: return
        limit = mapped_bytes() + self.mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

def main():
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--auto', action='store_true'); p.add_argument('--inject', type=int)
    p.add_argument('--inject-rank', type=int); p.add_argument('--cap-mb', type=int); p.add_argument('--cap-rank', type=int)
    p.add_argument('--epochs', type=int, default=2)
    args = p.parse_args()
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    world, rank = int(os.environ.get('WORLD_SIZE', '1')), int(os.environ.get('RANK', '0'))
    inject = args.inject if args.inject_rank in (None, rank) else None
    capped = args.cap_mb and args.cap_rank in (None, rank)
    if capped and world == 1: cap_memory(args.cap_mb)
    learn = learner(inject, world, out)
    auto = AutoMicrobatch(grow_every=3)
    cbs = ([auto] if args.auto else []) + ([CapMemory(args.cap_mb)] if capped and world > 1 else [])
    try:
        with learn.distrib_ctx(timeout=60) if world > 1 else contextlib.nullcontext():
            learn.fit(args.epochs, cbs=cbs)
    except Exception as e:
        (out/f'error{rank}.txt').write_text(''.join(traceback.format_exception(e)))
        sys.exit(3)
    torch.save({'model': learn.model.state_dict(), 'train_iter': learn.train_iter, 'history': auto.history,
                'halvings': auto.halvings, 'valid_halvings': auto.valid_halvings, 'values': learn.recorder.values}, out/f'rank{rank}.pt')

if __name__ == '__main__':
    import contextlib
    main()
