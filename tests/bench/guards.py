"""What the guards cost: `SpikeGuard` at steady state on the tiny model of loop_overhead.py (checks every 25 batches,
a snapshot every 100), side by side with the same fit without it in one run.

`python tests/bench/guards.py` for the full run, `--short` for the quick one CI runs."""
import argparse, warnings
import torch
from torch import nn
from learncb.all import *
from loop_overhead import make_data, make_model, best_times

def fit(train, valid, n_epoch, cbs=()):
    learn = Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), device='cpu')
    learn.remove_cb(ProgressCallback)
    with learn.no_logging(): learn.fit(n_epoch, cbs=list(cbs))
    return learn

def spike_guard_us(n_batches, n_epoch, rounds):
    "Microseconds per step of a fit without a guard and with `SpikeGuard(snapshot_every=100)`, best of `rounds`"
    train, valid = make_data(n_batches)
    n_steps = n_epoch * (len(train) + len(valid))
    best = best_times({'plain': lambda: fit(train, valid, n_epoch),
                       'guarded': lambda: fit(train, valid, n_epoch, [SpikeGuard(snapshot_every=100)])}, rounds)
    return {k: v / n_steps * 1e6 for k, v in best.items()}

def main(short=False):
    torch.set_num_threads(1)
    n_batches, n_epoch, rounds = (200, 1, 3) if short else (600, 2, 7)
    us = spike_guard_us(n_batches, n_epoch, rounds)
    print(f"{n_batches} batches of 32, {n_epoch} epoch(s), train+validate, best of {rounds}, 1 thread")
    print(f"SpikeGuard (check every 25, snapshot every 100): {us['guarded']:7.1f} us/step, without {us['plain']:7.1f} "
          f"us/step, cost {us['guarded'] / us['plain'] - 1:+.2%}")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('--short', action='store_true', help='small run for CI')
    main(p.parse_args().short)
