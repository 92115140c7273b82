"""Two processes started by `launch`, as from a notebook; rank 1 SIGKILLs itself in its third batch while rank
0 trains on (with a CheckpointCallback that holds SIGTERM). tests/checkpoint/test_preemption.py checks that
this ends, naming rank 1."""
import os, signal, tempfile
from learncb.all import *
from learncb.test_utils import synth_learner

def train(folder):
    learn = synth_learner(path=folder)
    def die(cb):
        if rank_distrib() == 1 and cb.train_iter == 2: os.kill(os.getpid(), signal.SIGKILL)
    with learn.distrib_ctx():  # the default timeout (30 minutes): the launcher, not the timeout, ends it
        learn.fit(50, cbs=[CheckpointCallback(every_n_steps=1), Callback(after_pred=die)])

if __name__ == '__main__': launch(train, tempfile.mkdtemp(), nprocs=2)
