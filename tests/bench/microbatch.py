"""What `AutoMicrobatch` costs: the time to recover from an out-of-memory error (the batch that ran out, split
and stepped), the steps after it (micro-batches), and a batch that fits (on the tiny model of
loop_overhead.py, side by side with the same fit without it in one run, by CPU time as tests/bench/guards.py
measures).

The error is injected (a model that raises on a training batch over a size, in its forward or in its
backward), so the figures are the library's own work, not the allocator's. `python tests/bench/microbatch.py`
for the full run, `--short` for the quick one CI runs."""
import argparse, statistics, time, warnings
import torch
from torch import nn
from learncb.all import *
from loop_overhead import make_data, make_model
from guards import paired_cpu_times

class Boom(torch.autograd.Function):
    "The identity, whose backward runs out of memory"
    @staticmethod
    def forward(ctx, x): return x.view_as(x)
    @staticmethod
    def backward(ctx, g): raise torch.OutOfMemoryError("injected: out of memory in the backward")

class Wide(nn.Module):
    """A wide MLP that runs out of memory on a training batch over `limit` items, in its forward or its
    backward (`where`)"""
    def __init__(self, limit=None, where='forward', hidden=2048):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, hidden),
                                  nn.ReLU())
        self.head = nn.Linear(hidden, 10)
        self.limit = limit
        self.where = where
    def forward(self, x):
        over = self.limit is not None and torch.is_grad_enabled() and x.shape[0] > self.limit
        if over and self.where == 'forward':
            raise torch.OutOfMemoryError("injected: out of memory in the forward")
        h = self.body(x)
        return self.head(Boom.apply(h) if over else h)

class BatchTimes(Callback):
    "Wall seconds of each training batch"
    order = Order.FIRST
    def before_fit(self): self.times = []
    def before_batch(self):
        if self.training: self.start = time.perf_counter()
    def after_batch(self):
        if self.training: self.times.append(time.perf_counter() - self.start)

def timed_fit(n_batches, bs, cbs, **kw):
    torch.manual_seed(0)
    x, y = torch.randn(n_batches * bs, 256), torch.randint(0, 10, (n_batches * bs,))
    learn = Learner(DataLoaders(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                                            batch_size=bs)),
                    Wide(**kw), nn.CrossEntropyLoss(), device='cpu')
    learn.remove_cb(ProgressCallback)
    times = BatchTimes()
    with learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(1, cbs=[times, *cbs])
    return times.times

def recovery(n_batches, bs, limit, where):
    """Milliseconds: the batch that ran out (and recovered), a split batch after it, a whole batch with the
    memory"""
    whole = statistics.median(timed_fit(n_batches, bs, [])[1:])
    t = timed_fit(n_batches, bs, [AutoMicrobatch(grow_every=10**9)], limit=limit, where=where)
    return t[0] * 1e3, statistics.median(t[1:]) * 1e3, whole * 1e3

def fitting_cost(n_batches, rounds):
    """Microseconds per step of the best fit without and with `AutoMicrobatch` when every batch fits, and the
    median ratio"""
    train, valid = make_data(n_batches)
    n_steps = len(train) + len(valid)
    def fit(cbs):
        learn = Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), device='cpu')
        learn.remove_cb(ProgressCallback)
        with learn.no_logging(): learn.fit(1, cbs=cbs)
    times = paired_cpu_times({'plain': lambda: fit([]), 'auto': lambda: fit([AutoMicrobatch()])}, rounds)
    best = {k: min(t[k] for t in times) / n_steps * 1e6 for k in ('plain', 'auto')}
    return best, statistics.median(t['auto'] / t['plain'] for t in times)

def main(short=False):
    torch.set_num_threads(1)
    n_batches, rounds = (6, 3) if short else (20, 15)
    bs, limit = 512, 64
    for where in ('forward', 'backward'):
        first, split, whole = recovery(n_batches, bs, limit, where)
        print(f"AutoMicrobatch, out of memory in the {where} of a batch of {bs} (fits {limit}): the batch "
              f"that ran out {first:.1f} ms, then {split:.1f} ms per split batch; {whole:.1f} ms per whole "
              f"batch with the memory")
    best, ratio = fitting_cost(200 if short else 600, rounds)
    print(f"AutoMicrobatch on batches that fit (tiny model, {rounds} rounds, CPU time): {best['auto']:7.1f} "
          f"us/step, without {best['plain']:7.1f} us/step (best of each); cost "
          f"{best['auto'] / best['plain'] - 1:+.2%} best to best, {ratio - 1:+.2%} median of the rounds")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('--short', action='store_true', help='small run for CI')
    main(p.parse_args().short)
