"""What the guards cost: `SpikeGuard` at steady state on the tiny model of loop_overhead.py (checks every 25
batches, a snapshot every 100), side by side with the same fit without it in one run: over whole fits, and at
steady state (the epochs after the first, without what the guard costs once per fit).

Each round fits both, in alternating order, and times each fit by the process's CPU time, which the other work
on a loaded machine disturbs less than wall time; the figures are the median of the rounds' ratios and the
ratio of the best times. `python tests/bench/guards.py` for the full run, `--short` for the quick one CI
runs."""
import argparse, statistics, time
import torch
from torch import nn
from learncb.all import *
from loop_overhead import make_data, make_model, python_calls

def fit(train, valid, n_epoch, cbs=()):
    learn = Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), device='cpu')
    learn.remove_cb(ProgressCallback)
    with learn.no_logging(): learn.fit(n_epoch, cbs=list(cbs))
    return learn

def paired_cpu_times(fns, rounds):
    "CPU seconds of each function in each round, the two run in alternating order; after one warm-up round"
    for f in fns.values(): f()
    times = []
    for i in range(rounds):
        t = {}
        for name, f in (list(fns.items()) if i % 2 else list(fns.items())[::-1]):
            start = time.process_time(); f(); t[name] = time.process_time() - start
        times.append(t)
    return times

def spike_guard_cost(n_batches, n_epoch, rounds):
    """Microseconds per step of the best fit without and with `SpikeGuard(snapshot_every=100)`, and the median
    ratio"""
    train, valid = make_data(n_batches)
    n_steps = n_epoch * (len(train) + len(valid))
    times = paired_cpu_times({'plain': lambda: fit(train, valid, n_epoch),
                              'guarded': lambda: fit(train, valid, n_epoch,
                                                     [SpikeGuard(snapshot_every=100)])}, rounds)
    best = {k: min(t[k] for t in times) / n_steps * 1e6 for k in ('plain', 'guarded')}
    return best, statistics.median(t['guarded'] / t['plain'] for t in times)

def steady_state_cost(n_batches, rounds):
    """Microseconds per step of the epochs after the first (a 3-epoch fit's time less a 1-epoch fit's, over
    the 2 epochs between): what the guard costs a long fit, without what it costs once per fit (its first
    snapshot's memory, the dataloader's order); the median over the rounds of each, and their ratio"""
    train, valid = make_data(n_batches)
    guard = lambda: [SpikeGuard(snapshot_every=100)]
    times = paired_cpu_times({'plain 1': lambda: fit(train, valid, 1), 'plain 3': lambda: fit(train, valid,
        3),
                              'guarded 1': lambda: fit(train, valid, 1, guard()),
                              'guarded 3': lambda: fit(train, valid, 3, guard())}, rounds)
    n_steps = 2 * (len(train) + len(valid))
    per_step = {k: statistics.median((t[f'{k} 3'] - t[f'{k} 1']) / n_steps * 1e6 for t in times) for k
                in ('plain', 'guarded')}
    return per_step, per_step['guarded'] / per_step['plain']

def calls_per_step(n_batches):
    """Python calls per step of a fit without the guard, and how many more with it: a count that the machine's
    load does not change"""
    train, valid = make_data(n_batches)
    n_steps = 2 * (len(train) + len(valid))
    plain = python_calls(lambda: fit(train, valid, 2)) / n_steps
    return plain, python_calls(lambda: fit(train, valid, 2,
                                           [SpikeGuard(snapshot_every=100)])) / n_steps - plain

def main(short=False):
    torch.set_num_threads(1)
    n_batches, n_epoch, rounds = (200, 1, 5) if short else (600, 2, 30)
    best, ratio = spike_guard_cost(n_batches, n_epoch, rounds)
    print(f"{n_batches} batches of 32, {n_epoch} epoch(s), train+validate, {rounds} rounds, CPU time, 1 "
          f"thread")
    print(f"SpikeGuard (check every 25, snapshot every 100): {best['guarded']:7.1f} us/step, without "
          f"{best['plain']:7.1f} us/step (best of each); cost {best['guarded'] / best['plain'] - 1:+.2%} "
          f"best to best, {ratio - 1:+.2%} median of the rounds")
    per_step, ratio = steady_state_cost(n_batches, rounds)
    print(f"SpikeGuard at steady state (the epochs after the first, median of the rounds): "
          f"{per_step['guarded']:7.1f} us/step, without {per_step['plain']:7.1f} us/step; cost "
          f"{ratio - 1:+.2%}")
    plain, more = calls_per_step(n_batches)
    print(f"Python calls per step (2 epochs): {plain:.1f} without SpikeGuard, {more:+.1f} with it")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('--short', action='store_true', help='small run for CI')
    main(p.parse_args().short)
