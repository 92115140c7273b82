"""What tests/checkpoint/test_submitit.py gives the recipe of the cluster page: a learner
(transparent_script's) that counts its starts, holds a batch of its first starts until the job's time-limit
signal has come, and saves its weights and history when its fit ends."""
import os, signal, time
from pathlib import Path
import torch
from learncb.all import *
from transparent_script import make_learner, SaveAtEnd

class HoldForSignal(Callback):
    """On the `start`-th start of the job (the first is 1), holds training batch `every*start` until SIGUSR2
    has been caught"""
    def __init__(self, start, every=12, timeout=120): self.start,self.every,self.timeout = start,every,timeout
    def after_batch(self):
        if not self.training or self.train_iter != self.every * self.start: return
        # the checkpoint's handler: it steps aside once it has caught one
        held = signal.getsignal(signal.SIGUSR2)
        deadline = time.monotonic() + self.timeout
        while signal.getsignal(signal.SIGUSR2) == held and time.monotonic() < deadline: time.sleep(0.05)

def job_learner(out, n_held):
    """The learner of one start of one task of the job: its first `n_held` starts wait for the time limit's
    signal in the fit"""
    torch.set_num_threads(1)
    out = Path(out)
    start = (out/'starts.txt').read_text().count('start') if (out/'starts.txt').exists() else 0
    if int(os.environ.get('RANK', 0)) > 0: start -= 1                    # rank 0's start, counted already
    else:
        with open(out/'starts.txt', 'a') as f: f.write('start\n')
    learn = make_learner(out)
    every = 12 // int(os.environ.get('WORLD_SIZE', 1))  # a third of the fit's steps on each rank
    learn.add_cbs([SaveAtEnd(out)] + ([HoldForSignal(start + 1, every)] if start < n_held else []))
    return learn
