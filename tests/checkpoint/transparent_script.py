"""A seeded run for tests/checkpoint/test_transparent.py: the same training with checkpoints or without,
killed and resumed, on one process or several (torchrun: `distrib_ctx`, gloo).

python tests/checkpoint/transparent_script.py OUT [--ckpt] [--kill-at K] [--workers W] [--bs B] [--fits F]
[--dropout P]
                                       [--strategy ddp|fsdp] [--global-batch N] [--ckpt-path P]
With --ckpt the fit checkpoints every 5 steps and resumes with resume='auto' from OUT/checkpoints (or
--ckpt-path, a folder or a URL). Rank 0 saves OUT/result.pt: weights, each fit's recorded losses and table,
and every rank's next torch.rand(3)."""
import argparse, os, signal
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

N_TRAIN, N_VALID = 96, 32

def make_learner(path, bs=8, workers=0, dropout=0.25):
    """A classifier on 96 shuffled items, seeded: the model's weights and everything after come from the
    global generator"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_VALID, 4, generator=g)
    y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).long()
    extra = dict(num_workers=workers) if workers else {}
    train = DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=bs, shuffle=True, **extra)
    valid = DataLoader(TensorDataset(x[N_TRAIN:], y[N_TRAIN:]), batch_size=8)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 2))
    learn = Learner(DataLoaders(train, valid), model, nn.CrossEntropyLoss(), metrics=accuracy, path=path,
                    lr=0.05, device='cpu')
    learn.remove_cb(ProgressCallback)
    learn.logger = lambda row: None
    return learn

class KillAt(Callback):
    "SIGKILLs this process (rank 1 of several) after training batch `k` of the fit, its checkpoint asked for"
    order = 99
    def __init__(self, k): self.k = k
    def after_batch(self):
        if self.training and self.train_iter == self.k and rank_distrib() == min(1, num_distrib() - 1):
            os.kill(os.getpid(), signal.SIGKILL)

class SaveAtEnd(Callback):
    "Rank 0 saves the weights and the history to `out/final.pt` when the fit ends without an error"
    def __init__(self, out): self.out = Path(out)
    def after_fit(self):
        if self.learn.exception is None and is_rank0():
            torch.save({'model': self.learn.model.state_dict(), 'losses': self.learn.recorder.losses,
                        'values': self.learn.recorder.values, 'train_iter': self.learn.train_iter},
                       self.out/'final.pt')

def run_fits(learn, n_fits=1, ckpt=False, kill_at=None, epochs=3, ckpt_path='checkpoints'):
    """Fit `n_fits` times (the first with checkpoints if `ckpt`, resumed with resume='auto'); what each fit
    recorded"""
    fits = []
    for i in range(n_fits):
        cbs = [CheckpointCallback(ckpt_path, every_n_steps=5)] if ckpt and i == 0 else []
        if kill_at is not None and i == 0: cbs.append(KillAt(kill_at))
        learn.fit(epochs, cbs=cbs, resume='auto' if ckpt and i == 0 else None)
        fits.append({'losses': list(learn.recorder.losses), 'values': [list(v) for v
            in learn.recorder.values]})
    return fits

def main():
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--ckpt', action='store_true'); p.add_argument('--kill-at',
        type=int)
    p.add_argument('--workers', type=int, default=0); p.add_argument('--bs', type=int, default=8)
    p.add_argument('--fits', type=int, default=1); p.add_argument('--dropout', type=float, default=0.25)
    p.add_argument('--strategy', default='ddp'); p.add_argument('--global-batch', type=int)
    p.add_argument('--ckpt-path', default='checkpoints')
    a = p.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    learn = make_learner(out, a.bs, a.workers, a.dropout)
    if int(os.environ.get('WORLD_SIZE', '1')) > 1 or a.global_batch:
        with learn.distrib_ctx(strategy=a.strategy, timeout=60, global_batch=a.global_batch):
            fits = run_fits(learn, a.fits, a.ckpt, a.kill_at, ckpt_path=a.ckpt_path)
            rands,rank = gather_objects(torch.rand(3)),rank_distrib()
    else:
        fits,rands,rank = run_fits(learn, a.fits, a.ckpt, a.kill_at, ckpt_path=a.ckpt_path),[torch.rand(3)],0
    if rank == 0:
        torch.save({'model': learn.model.state_dict(), 'fits': fits, 'rands': rands, 'world': len(rands)},
                   out/'result.pt')

if __name__ == '__main__': main()
