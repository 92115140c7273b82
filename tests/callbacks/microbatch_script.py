"""A classifier whose batches run out of memory, for tests/callbacks/test_microbatch.py: in one process or
several (torchrun: DDP or `--strategy fsdp`, gloo), with `AutoMicrobatch` or without.

python tests/callbacks/microbatch_script.py OUT [--auto] [--inject N] [--inject-rank R] [--cap] [--cap-rank R]
    [--epochs E] [--strategy ddp|fsdp] [--turns]

--inject N: the model raises `torch.OutOfMemoryError` on a training batch of more than N items (on rank R
only, if given). --cap: the process's address space is capped (`RLIMIT_AS`, on rank R only, if given) after a
warm-up fit (in one process) or after its first training batch (under DDP), so that the CPU allocator itself
fails on a whole batch and not on a quarter of one. The cap is measured, not a number of MiB: the least room a
forward and backward of one item and of the whole batch fit in, each probed under caps (`room_for`), whatever
the machine maps and allocates. Each rank saves OUT/rank{r}.pt: the weights, the steps, the split history, the
rooms measured; an error is saved as OUT/error{r}.txt (and the exit status is 3). --turns: an optimizer for
the body, one for the head, in turn."""
import argparse, os, resource, sys, traceback
from functools import partial
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

N, BS, HIDDEN = 2048, 512, 4096

class Classifier(nn.Module):
    """A wide two-layer network: its activations, not its weights, fill memory (no dropout: micro-batches sum
    exactly)"""
    def __init__(self, inject=None):
        super().__init__()
        self.body,self.head,self.inject = nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU()),nn.Linear(HIDDEN,
            10),inject
    def forward(self, x):
        if self.inject is not None and torch.is_grad_enabled() and x.shape[0] > self.inject:
            raise torch.OutOfMemoryError(f"injected: a batch of {x.shape[0]} items is over {self.inject}: "
                                         f"out of memory")
        return self.head(self.body(x))

def data(world=1):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 64, generator=g), torch.randint(0, 10, (N,), generator=g)
    return DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS // world, shuffle=True,
                                  generator=torch.Generator().manual_seed(1)),
                       DataLoader(TensorDataset(x, y), batch_size=N // world))

class TwoTurns(Step): turns = ('body', 'head')         # --turns: the body's optimizer, then the head's
class TurnsLearner(Learner): step_class = TwoTurns
# Adam's eps not tiny: a gradient as small as rounding (a sum split in micro-batches, on another CPU) would
# take a step of lr either way by its sign, so that no two CPUs agree to 1e-5
two_opts = {'splitter': lambda m: {'body': m.body.parameters(), 'head': m.head.parameters()},
            'opt_func': {'body': partial(torch.optim.Adam, eps=1e-5),
                         'head': partial(torch.optim.SGD, momentum=0.9)}}

def learner(inject=None, world=1, path='.', turns=False):
    torch.manual_seed(0)
    cls,kwargs = (TurnsLearner, two_opts) if turns else (Learner, {})
    learn = cls(data(world), Classifier(inject), nn.CrossEntropyLoss(), lr=1e-3, device='cpu', path=path,
                **kwargs)
    learn.remove_cb(ProgressCallback)
    learn.logger = lambda row: None
    return learn

def mapped_bytes():
    "The address space this process maps now (VmSize)"
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith('VmSize:'): return int(line.split()[1]) * 1024

def set_room(mib):
    "Cap the address space `mib` MiB above what this process maps now (`None`: no cap, the hard limit)"
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (hard if mib is None else mapped_bytes() + mib * 2**20, hard))

def fits(model, n, mib):
    "Whether a forward and backward of `n` items fit in `mib` MiB above what is mapped now"
    x, y = torch.randn(n, 64), torch.randint(0, 10, (n,))
    set_room(mib)
    try: nn.functional.cross_entropy(model(x), y).backward()
    except RuntimeError as e:           # torch.OutOfMemoryError too
        if "can't allocate memory" not in str(e) and 'out of memory' not in str(e): raise
        return False
    finally:
        set_room(None)
        model.zero_grad(set_to_none=True)
    return True

def room_for(model, n):
    """The least room (MiB above what is mapped now) a forward and backward of `n` items fit in: a search
    under caps"""
    lo, hi = 0, 1
    while not fits(model, n, hi): lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(model, n, mid): hi = mid
        else: lo = mid
    return hi

def cap_between(model, bs):
    """Measure the room of one item and of a batch of `bs`, then cap the address space between them: a quarter
    of a batch fits with room to spare, a half does not, nor the whole one. `(one, whole, cap)` in MiB"""
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    one, whole = room_for(model, 1), room_for(model, bs)
    for p, g in zip(model.parameters(), grads): p.grad = g
    cap = one + int(0.4 * (whole - one))
    set_room(cap)
    return one, whole, cap

def cap_memory():
    """Warm up (a fit of the same shapes, on tiny batches), then cap the address space between one item and a
    batch"""
    warm = learner()
    warm.dls = DataLoaders(DataLoader(TensorDataset(torch.randn(8, 64), torch.randint(0, 10, (8,))),
                                      batch_size=4))
    warm.fit(1)
    model = warm.model
    del warm
    return cap_between(model, BS)

class CapMemory(Callback):
    """Under DDP: caps the address space after the first training batch, once its step made what every step
    keeps (the gradients, DDP's buckets, the optimizer's state), between the room of one item and of this
    rank's batch"""
    order,rooms = Order.LAST,None
    def after_batch(self):
        if not self.training or self.learn.train_iter != 1: return
        learn = self.learn
        plain = hasattr(learn.model, 'module')    # DDP's plain model; FSDP's: the one it was copied from
        model = learn.model.module if plain else learn.strategy.user_model(learn.model)
        self.rooms = cap_between(model, find_bs(learn.yb))

def main():
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--auto', action='store_true'); p.add_argument('--inject', type=int)
    p.add_argument('--inject-rank', type=int); p.add_argument('--cap', action='store_true')
    p.add_argument('--cap-rank', type=int)
    p.add_argument('--epochs', type=int, default=2); p.add_argument('--strategy', default='ddp')
    p.add_argument('--turns', action='store_true')
    args = p.parse_args()
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    world, rank = int(os.environ.get('WORLD_SIZE', '1')), int(os.environ.get('RANK', '0'))
    inject = args.inject if args.inject_rank in (None, rank) else None
    capped = args.cap and args.cap_rank in (None, rank)
    rooms = cap_memory() if capped and world == 1 else None
    learn = learner(inject, world, out, args.turns)
    auto,cap = AutoMicrobatch(grow_every=3),CapMemory()
    cbs = ([auto] if args.auto else []) + ([cap] if capped and world > 1 else [])
    try:
        with learn.distrib_ctx(strategy=args.strategy, timeout=60) if world > 1 else contextlib.nullcontext():
            learn.fit(args.epochs, cbs=cbs)
    except Exception as e:
        (out/f'error{rank}.txt').write_text(''.join(traceback.format_exception(e)) + f'rooms: '
                                            f'{rooms or cap.rooms}')
        sys.exit(3)
    weights = {k: v.clone() for k,v in learn.model.state_dict().items()}
    torch.save({'model': weights, 'train_iter': learn.train_iter, 'history': auto.history,
                'halvings': auto.halvings, 'valid_halvings': auto.valid_halvings,
                'values': learn.recorder.values,
                'rooms': rooms or cap.rooms}, out/f'rank{rank}.pt')

if __name__ == '__main__':
    import contextlib
    main()
