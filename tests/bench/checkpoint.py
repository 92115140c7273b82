"""Cost of checkpoints on the core benchmark's learner: the time of one checkpoint (written atomically, with
fsync), and the overhead per step of CheckpointCallback(every_n_steps=100) on the loop benchmark. `python
tests/bench/checkpoint.py` for the full run, `--short` for the quick one CI runs."""
import argparse, statistics, sys, tempfile, time
from functools import partial
from pathlib import Path
import torch
from torch import nn
sys.path.insert(0, str(Path(__file__).parent))
from loop_overhead import make_data, make_model, best_times
from learncb.all import *

def bench_learner(train, valid, path):
    learn = Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), device='cpu', path=path)
    learn.remove_cb(ProgressCallback)
    return learn

def checkpoint_ms(n_batches, repeats):
    "Median and best milliseconds of one `save_checkpoint` after a fit (history and optimizer state included)"
    train, valid = make_data(n_batches)
    with tempfile.TemporaryDirectory() as d:
        learn = bench_learner(train, valid, d)
        with learn.no_logging(): learn.fit(2)
        times,copies,before = [],[],[]
        for i in range(repeats):
            t = time.perf_counter()
            learn.save_checkpoint(Path(d)/f'c{i % 2}.pt')
            times.append(time.perf_counter() - t)
            t = time.perf_counter(); StateSnapshot(learn.state_dict()); copies.append(time.perf_counter() - t)
            t = time.perf_counter(); serialized(
                with_checksum(learn.state_dict())); before.append(time.perf_counter() - t)
        size = (Path(d)/'c0.pt').stat().st_size
    ms = lambda ts: statistics.median(ts) * 1e3
    return ms(times), min(times) * 1e3, size, ms(copies), ms(before)

def big_snapshot_ms(mb, repeats):
    """Median milliseconds to snapshot a state of `mb` MB into new memory, and into the memory of the snapshot
    before"""
    state = {'model': {f'w{i}': torch.randn(mb * 2**20 // 64) for i in range(16)}}
    fresh,reused,buffer = [],[],None
    for _ in range(repeats):
        t = time.perf_counter(); StateSnapshot(state); fresh.append(time.perf_counter() - t)
        t = time.perf_counter(); buffer = StateSnapshot(state,
                                                        buffer).buffer; reused.append(time.perf_counter() - t)
    return statistics.median(fresh[1:]) * 1e3, statistics.median(reused[1:]) * 1e3

def fit_with(train, valid, cbs, path):
    "One fit in a fresh folder under `path`: each run writes its own checkpoints, as a user's runs should"
    learn = bench_learner(train, valid, tempfile.mkdtemp(dir=path))
    with learn.no_logging(): learn.fit(2 if len(train) > 100 else 1, cbs=cbs)

class WriteOnly(Callback):
    """Every 100 training batches, writes `size` bytes atomically (fsync) on a `BackgroundWriter`: the file
    system's share"""
    def __init__(self, size, folder):
        self.data,self.folder,self.writer = bytes(size),folder,BackgroundWriter()
    def after_batch(self):
        if self.learn.training and self.learn.train_iter % 100 == 0:
            self.writer.submit(partial(atomic_write, self.data,
                                       Path(self.folder)/f'w{self.learn.train_iter % 300}.pt'))
    def after_fit(self): self.writer.wait(); self.writer.close()

class SnapshotOnly(Callback):
    """Every 100 training batches, takes the snapshot a checkpoint takes at the batch boundary, and writes
    nothing"""
    def after_batch(self):
        if self.learn.training and self.learn.train_iter % 100 == 0: StateSnapshot(self.learn.state_dict())

def main(short=False):
    torch.set_num_threads(1)
    n_batches, rounds, repeats = (100, 2, 10) if short else (600, 5, 50)
    med, best, size, copy, before = checkpoint_ms(n_batches, repeats)
    print(f"one checkpoint of the loop benchmark's learner ({size / 1024:.0f} KiB, with fsync): median "
          f"{med:.2f} ms, best {best:.2f} ms")
    print(f"its cost on the training thread (state_dict + StateSnapshot): median {copy:.2f} ms "
          f"(state_dict + torch.save + with_checksum, as before snapshots: {before:.2f} ms)")
    mb = 16 if short else 256
    fresh, reused = big_snapshot_ms(mb, 3 if short else 6)
    print(f"the snapshot of a {mb} MB state: {fresh:.0f} ms into new memory, {reused:.0f} ms into the memory "
          f"of the one before (as CheckpointCallback does)")
    train, valid = make_data(n_batches)
    n_epoch = 2 if n_batches > 100 else 1
    n_steps = n_epoch * (len(train) + len(valid))
    with tempfile.TemporaryDirectory() as d:
        t = best_times({'plain': lambda: fit_with(train, valid, None, d),
                        'ckpt': lambda: fit_with(train, valid, CheckpointCallback(every_n_steps=100), d),
                        'io': lambda: fit_with(train, valid, WriteOnly(size, d), d),
                        'snap': lambda: fit_with(train, valid, SnapshotOnly(), d)}, rounds)
    plain, ckpt, io_only, snap = (t[k] / n_steps * 1e6 for k in ('plain', 'ckpt', 'io', 'snap'))
    print(f"loop benchmark, default cbs: {plain:.1f} us/step; with CheckpointCallback(every_n_steps=100): "
          f"{ckpt:.1f} us/step ({ckpt - plain:+.1f} us/step, {ckpt / plain:.3f}x)")
    print(f"the file writes alone (same size and times, same writer thread, no state copied): {io_only:.1f} "
          f"us/step ({io_only - plain:+.1f} us/step, {io_only / plain:.3f}x)")
    print(f"the snapshot alone (state_dict + StateSnapshot at the same batches, nothing written): {snap:.1f} "
          f"us/step ({snap - plain:+.1f} us/step, {snap / plain:.3f}x)")
    n_saves = n_epoch * (len(train) // 100 + 1)          # every 100 training batches, and at each epoch's end
    print(f"the 1.02x budget: {0.02 * plain:.1f} us/step, {0.02 * plain * n_steps / n_saves / 1e3:.2f} ms "
          f"per checkpoint ({n_saves} checkpoints in {n_steps} steps); spent: "
          f"{(ckpt - plain) * n_steps / n_saves / 1e3:.2f} ms per checkpoint")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('--short', action='store_true', help='small run for CI')
    main(p.parse_args().short)
