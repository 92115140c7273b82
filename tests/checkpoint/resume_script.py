"""A training run for the resume tests: shuffled data, dropout, one-cycle, gradient accumulation, a checkpoint
after every batch. It can kill itself with SIGKILL at a chosen point, stall inside a checkpoint write, or
resume.

python resume_script.py PATH [--kill EVENT,EPOCH,ITER,PHASE] [--term EPOCH,ITER] [--every N] [--stall-save N]
                             [--resume] [--out FILE] [--signal NAME] [--requeue]"""
import argparse, os, signal, sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

N_EPOCH = 3

def make_learner(path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(112, 6, generator=g); y = (x[:, :3].sum(1) > x[:, 3:].sum(1)).long()
    dls = DataLoaders(DataLoader(TensorDataset(x[:80], y[:80]), batch_size=8, shuffle=True),    # 10 batches
                      DataLoader(TensorDataset(x[80:], y[80:]), batch_size=8))                  # 4 batches
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 2))
    learn = Learner(dls, model, nn.CrossEntropyLoss(), metrics=accuracy, path=path, device='cpu')
    learn.remove_cb(ProgressCallback)
    learn.logger = lambda row: None
    return learn

class KillAt(Callback):
    "SIGKILLs this process at `event` of epoch `epoch`, batch `iter`, in `phase` ('train', 'valid' or '-')"
    order = 99    # after the checkpoint of that batch, if any, was taken (its write may still be in flight)
    def __init__(self, event, epoch, it, phase):
        self.epoch_, self.iter_, self.phase_ = epoch, it, phase
        setattr(self, event, self.maybe_kill)
    def maybe_kill(self):
        learn = self.learn
        if learn.epoch != self.epoch_: return
        if self.phase_ != '-' and (learn.training != (self.phase_ == 'train') or learn.iter != self.iter_):
            return
        os.kill(os.getpid(), signal.SIGKILL)

class TermAt(Callback):
    "Sends `sig` (SIGTERM) to this process after the forward pass of training batch `iter` of epoch `epoch`"
    def __init__(self, epoch, it, sig=signal.SIGTERM): self.epoch_, self.iter_, self.sig = epoch, it, sig
    def after_pred(self):
        if self.training and (self.learn.epoch, self.learn.iter) == (self.epoch_, self.iter_):
            print(f'{signal.Signals(self.sig).name} AT {time.time()}', flush=True)
            os.kill(os.getpid(), self.sig)

def stall_save(n):
    "Make the `n`-th file write hang inside fsync (after the data is written to the temporary file)"
    calls, real_fsync = [0], os.fsync
    def fsync(fd):
        calls[0] += 1
        if calls[0] == n:
            print('STALLED', flush=True)
            time.sleep(600)
        real_fsync(fd)
    os.fsync = fsync

def main():
    p = argparse.ArgumentParser()
    p.add_argument('path'); p.add_argument('--kill'); p.add_argument('--stall-save', type=int)
    p.add_argument('--resume', action='store_true'); p.add_argument('--out')
    p.add_argument('--term'); p.add_argument('--every', type=int, default=1)
    p.add_argument('--signal', default='SIGTERM'); p.add_argument('--requeue', action='store_true')
    p.add_argument('--compile-step', action='store_true')
    a = p.parse_args()
    learn = make_learner(a.path)
    if a.compile_step: learn.compile(step=True, fallback=False)
    cbs = [CheckpointCallback(every_n_steps=a.every or None, keep_last=3, signals=(a.signal,),
                              requeue=a.requeue),
           GradientAccumulation(n_acc=16)]
    if a.term: cbs.append(TermAt(*map(int, a.term.split(',')), signal.Signals[a.signal]))
    if a.kill:
        event, epoch, it, phase = a.kill.split(',')
        cbs.append(KillAt(event, int(epoch), int(it), phase))
    if a.stall_save: stall_save(a.stall_save)
    before = signal.getsignal(signal.SIGTERM)
    try: learn.fit_one_cycle(N_EPOCH, lr_max=1e-2, cbs=cbs, resume='auto' if a.resume else None)
    # a write in flight at the kill may be lost: the one before, or none
    finally: print(f'SIGTERM HANDLER BACK {signal.getsignal(signal.SIGTERM) is before}', flush=True)
    if a.out:
        torch.save({'model': learn.model.state_dict(), 'opt': learn.opt.state_dict(),
                    'losses': learn.recorder.losses,
                    'values': learn.recorder.values, 'lrs': learn.recorder.lrs}, a.out)

if __name__ == '__main__': main()
