"""The training script of tests/distributed/test_elastic.py, for torchrun's elastic agent:
transparent_script's learner with a global batch and no dropout, checkpoints every 2 steps and resume='auto',
so that one command runs on any number of nodes.

torchrun ... tests/distributed/elastic_script.py OUT [--secs S] [--hold]
Rank 0 appends `world train_iter time` to OUT/progress.txt after each training batch (each batch lasts S
seconds more), and saves OUT/result.pt (the weights) when the fit ends. With --hold, a process alone in its
world waits after its 4th batch until a node joins (torchrun's SIGTERM), so that the run cannot end before the
world grows again."""
import argparse, signal, time
from pathlib import Path
import torch
from learncb.all import *
from transparent_script import make_learner

class Progress(Callback):
    "Rank 0 notes the world and the step after each training batch, which it makes last `secs` more"
    order = 99
    def __init__(self, path, secs, hold=False): self.path,self.secs,self.hold,self.alone = path,secs,hold,0
    def after_batch(self):
        if not self.training: return
        time.sleep(self.secs)
        if is_rank0():
            with open(self.path, 'a') as f: f.write(f'{num_distrib()} {self.train_iter} {time.time()}\n')
        if self.hold and num_distrib() == 1:
            self.alone += 1
            if self.alone == 4: hold_until_sigterm()

def hold_until_sigterm(timeout=120):
    """Wait until SIGTERM has been caught (the agent's, when a node joins): the checkpoint's handler then
    steps aside"""
    held,deadline = signal.getsignal(signal.SIGTERM),time.monotonic() + timeout
    while signal.getsignal(signal.SIGTERM) == held and time.monotonic() < deadline: time.sleep(0.05)

def main():
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--secs', type=float, default=0.0); p.add_argument('--hold',
        action='store_true')
    a = p.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    learn = make_learner(out, dropout=0)                # dropout's masks would differ with the world
    with learn.distrib_ctx(timeout=60, global_batch=8):
        learn.fit(3, cbs=[CheckpointCallback(every_n_steps=2), Progress(out/'progress.txt', a.secs, a.hold)],
                  resume='auto')
        if is_rank0():
            torch.save({'model': learn.model.state_dict(), 'world': num_distrib()}, out/'result.pt')

if __name__ == '__main__': main()
