"""What tests/integrations/test_ray.py gives the Ray recipe of the cluster page: transparent_script's learner, whose rank 1 fails once
after a given step, and whose rank 0 saves its weights and history when the fit ends."""
import os
from pathlib import Path
import torch
from learncb.all import *
from transparent_script import make_learner, SaveAtEnd

class FailOnce(Callback):
    "Rank 1 raises after training batch `k` of the run, the first time only (a file in `out` remembers it)"
    order = Order.LAST
    def __init__(self, out, k): self.flag,self.k = Path(out)/'failed',k
    def after_batch(self):
        if self.training and self.train_iter == self.k and rank_distrib() == 1 and not self.flag.exists():
            self.flag.touch()
            raise RuntimeError(f'rank 1 fails after step {self.k}')

def job_learner(out, fail_at=None):
    "The learner of one worker of the Ray run; its folder is the worker's own, as on nodes that share no disk"
    torch.set_num_threads(1)
    learn = make_learner(Path(out)/f'worker{os.getpid()}')
    learn.add_cbs([SaveAtEnd(out)] + ([FailOnce(out, fail_at)] if fail_at is not None else []))
    return learn
