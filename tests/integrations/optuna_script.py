"""One worker of a shared Optuna study: python optuna_script.py DB LR,LR,... (one trial per lr; the study
'search' must exist in DB)"""
import sys, warnings
import optuna, torch
from torch import nn
from learncb.all import *
from learncb.test_utils import synth_learner, synth_dls

LRS = [float(v) for v in sys.argv[2].split(',')]

def objective(trial):
    # each worker runs its own lrs: enqueue_trial's shared queue can hand one trial to two processes on SQLite
    lr = LRS.pop(0)
    trial.set_user_attr('lr', lr)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    learn = synth_learner(dls=synth_dls(n_train=128, bs=16), model=mlp, lr=lr, opt_func=torch.optim.SGD)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(4, cbs=OptunaPruningCallback(trial))
    return learn.recorder.values[-1][1]

if __name__ == '__main__':
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # the database keeps trials, not the pruner: every process passes its own (load_study's default has 5
    # startup trials)
    study = optuna.load_study(study_name='search', storage=f'sqlite:///{sys.argv[1]}',
                              pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0))
    study.optimize(objective, n_trials=len(LRS))
    print('DONE', len(study.trials))
