"""What tests/test_submitit.py gives the recipe of the cluster page: a learner (transparent_script's) that counts its
starts, takes a little longer per batch, and saves its weights and history when its fit ends."""
import time
from pathlib import Path
import torch
from learncb.all import *
from transparent_script import make_learner

class Slow(Callback):
    "Makes each training batch last `secs` more, so that the job's time limit falls in the middle of the fit"
    def __init__(self, secs): self.secs = secs
    def after_batch(self):
        if self.training: time.sleep(self.secs)

class SaveAtEnd(Callback):
    "Saves the weights and the history when the fit ends without an error"
    def __init__(self, out): self.out = out
    def after_fit(self):
        if self.learn.exception is None:
            torch.save({'model': self.learn.model.state_dict(), 'losses': self.learn.recorder.losses,
                        'values': self.learn.recorder.values, 'train_iter': self.learn.train_iter}, self.out/'final.pt')

def job_learner(out, secs):
    "The learner of one start of the job"
    torch.set_num_threads(1)
    out = Path(out)
    with open(out/'starts.txt', 'a') as f: f.write('start\n')
    learn = make_learner(out)
    learn.add_cbs([Slow(secs), SaveAtEnd(out)])
    return learn
