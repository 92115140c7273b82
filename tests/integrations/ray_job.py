"""What tests/integrations/test_ray.py gives the Ray recipe of the cluster page: transparent_script's learner,
whose rank 1 fails once after a given step, and whose rank 0 saves its weights and history when the fit
ends.

`torchrun --nproc_per_node=2 ray_job.py OUT [--fsdp]`: the recipe's fit without Ray (nothing to report to),
the run in which no worker failed that the tests compare Ray's runs with."""
import os, sys
from pathlib import Path
import torch
from learncb.all import *
from transparent_script import make_learner, SaveAtEnd

class FailOnce(Callback):
    """Rank 1 (rank 0 alone) raises after training batch `k` of the run, the first time only (a file in `out`
    remembers it)"""
    order = Order.LAST
    def __init__(self, out, k): self.flag,self.k = Path(out)/'failed',k
    def after_batch(self):
        rank = rank_distrib()
        if self.training and self.train_iter == self.k and rank == min(1,
                num_distrib() - 1) and not self.flag.exists():
            self.flag.touch()
            raise RuntimeError(f'rank {rank} fails after step {self.k}')

def job_learner(out, fail_at=None):
    "The learner of one worker of the Ray run; its folder is the worker's own, as on nodes that share no disk"
    torch.set_num_threads(1)
    learn = make_learner(Path(out)/f'worker{os.getpid()}')
    learn.add_cbs([SaveAtEnd(out)] + ([FailOnce(out, fail_at)] if fail_at is not None else []))
    return learn

def torchft_train_func(config):
    "A replica group of one worker under Ray Train's `TorchftConfig`: the command of ft_script.py"
    import runpy, sys
    sys.argv = [config['script'], config['out'], *config['args']]
    runpy.run_path(config['script'], run_name='__main__')

def fsdp_train_func(config):
    """The cluster page's recipe under FSDP, on a global batch of 16 whatever the number of workers (2: 8
    items each)"""
    import ray.train
    from learncb.integrations.ray import RayTrainReportCallback, ray_checkpoint
    learn = config['make_learner']()
    with learn.distrib_ctx(strategy='fsdp', global_batch=16):
        learn.fit(config['n_epoch'], resume=ray_checkpoint(config.get('checkpoint')),
                  cbs=[CheckpointCallback(every_n_steps=5, signals=()), RayTrainReportCallback()])

def fit_without_ray(out, fsdp=False):
    """The recipe's fit (`fsdp`: `fsdp_train_func`'s) on the ranks torchrun started, its checkpoints reported
    to none"""
    learn = job_learner(out)
    with learn.distrib_ctx(**(dict(strategy='fsdp', global_batch=16) if fsdp else {})):
        learn.fit(3, cbs=[CheckpointCallback(every_n_steps=5, signals=())])

if __name__ == '__main__': fit_without_ray(sys.argv[1], fsdp='--fsdp' in sys.argv)
