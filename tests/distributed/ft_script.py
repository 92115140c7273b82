"""One replica group of a fault-tolerant run (tests/distributed/test_ft.py), or with --plain the same fit in
one process.

python tests/distributed/ft_script.py OUT [--plain] [--epochs E]
    [--kill-at K --kill-in forward|backward|allreduce|step|turn2|closure]
    [--slow-alone S] [--wait-for N] [--slow S] [--seed S] [--n-items N] [--ckpt] [--spike-at EPOCH,BATCH]
    [--within ddp|fsdp] [--kill-rank R] [--kill-group G] [--hold-when-killed] [--step one|turns|closure]
torchft's variables (TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS) say which replica this is (in a
Ray Train worker, Ray's context: `ray_replica_env`); under torchrun it is a replica group of many ranks
(`--within` says how they train). Rank --kill-rank of the replica (of group --kill-group only, if given)
SIGKILLs itself once (a marker file in OUT keeps a restart from doing it again) at committed step K, in the
stage named; with --hold-when-killed it makes OUT/hold first (the others wait for its restart).
With --wait-for N a replica in a quorum of fewer than N waits while OUT/hold exists (the test makes it before
it starts a replica; that replica removes it), then sleeps --slow-alone seconds a batch: it cannot finish
before the one started. With --spike-at the targets of that training batch are made 100 times larger, and a
SpikeGuard rolls the run back over it (its snapshot at the start of each epoch). With --ckpt each replica
writes checkpoints to OUT/ckpt{REPLICA_GROUP_ID} and resumes from them (resume='auto'). Each replica saves
OUT/result{REPLICA_GROUP_ID}.pt (each rank of a group of many: OUT/result{REPLICA_GROUP_ID}-{RANK}.pt):
weights, optimizer state, counters, the Recorder's values."""
import argparse, os, signal, time
from functools import partial
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

p = argparse.ArgumentParser()
p.add_argument('out'); p.add_argument('--plain', action='store_true'); p.add_argument('--epochs', type=int,
    default=3)
p.add_argument('--kill-at', type=int, default=None); p.add_argument('--kill-in', default='forward')
p.add_argument('--slow-alone', type=float, default=0.0); p.add_argument('--wait-for', type=int, default=0)
p.add_argument('--slow', type=float, default=0.0); p.add_argument('--seed', type=int, default=0)
p.add_argument('--n-items', type=int, default=64 * 12); p.add_argument('--ckpt', action='store_true')
p.add_argument('--spike-at', default=None); p.add_argument('--within', default='ddp')
p.add_argument('--kill-rank', type=int, default=0); p.add_argument('--kill-group', default=None)
p.add_argument('--hold-when-killed', action='store_true'); p.add_argument('--step', default='one')
args = p.parse_args()
out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(1)
on_ray = ray_replica_env()                           # a Ray Train worker under TorchftConfig: a group of one
replica = os.environ.get('REPLICA_GROUP_ID') or on_ray.get('REPLICA_GROUP_ID', 'plain')
group_rank = 0 if on_ray else int(os.environ.get('RANK', 0))          # in a group of many ranks: torchrun's
name = replica if on_ray or int(os.environ.get('WORLD_SIZE', 1)) == 1 else f'{replica}-{group_rank}'
marker = out / f'killed{replica}'
hold = out / 'hold'

def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x @ torch.randn(8, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(n,
        generator=g))

torch.manual_seed(args.seed)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1), nn.Flatten(0))
train,valid = data(args.n_items, 1),data(100, 2)

class TwoTurns(Step): turns = ('body', 'head')        # --step turns: the body's optimizer, then the head's
class TurnsLearner(Learner): step_class = TwoTurns

two_opts = {'splitter': lambda m: {'body': m[0].parameters(), 'head': m[2].parameters()},
            'opt_func': {'body': torch.optim.Adam, 'head': partial(torch.optim.SGD, momentum=0.9)}}
lbfgs = {'opt_func': partial(torch.optim.LBFGS, max_iter=4, history_size=4), 'lr': 0.5}
# --step closure: LBFGS, in float64 (it multiplies float32's rounding)
steps = {'one': (Learner, {}), 'turns': (TurnsLearner, two_opts), 'closure': (Learner, lbfgs)}
cls,kwargs = steps[args.step]
if args.step == 'closure':
    train,valid = (TensorDataset(*(t.double() for t in d.tensors)) for d in (train, valid))
    model = model.double()
dls = DataLoaders(DataLoader(train, batch_size=16, shuffle=True), DataLoader(valid, batch_size=50))
learn = cls(dls, model, loss_func=nn.MSELoss(), **{'opt_func': torch.optim.Adam, 'lr': 3e-3, **kwargs},
            metrics=[lambda p, y: (p - y).abs().mean()],
            cbs=TerminateOnNaNCallback())      # a guard that runs under torchft (it changes nothing here)

def wait_alone():
    """Short of replicas: wait while OUT/hold is there (the test is starting one; it removes the file), then
    slow down"""
    deadline = time.monotonic() + 240
    while hold.exists() and time.monotonic() < deadline: time.sleep(0.05)
    time.sleep(args.slow_alone)

def die():
    marker.write_text('killed')
    if args.hold_when_killed: hold.touch()         # the others wait for this group to start again (Ray)
    os.kill(os.getpid(), signal.SIGKILL)

class Chaos(Callback):
    """Kill this replica once, at committed step `--kill-at`, in the stage `--kill-in`; slow the run while it
    is short of replicas"""
    order = Order.FINAL
    healed_at,batches,tries = None,0,0
    def after_batch(self):
        if not self.learn.training: return
        Chaos.batches,Chaos.tries = Chaos.batches + 1,self.learn.step.tries
        (out/f'step{replica}').write_text(str(self.learn.train_iter))

    def before_batch(self):
        learn,ft = self.learn,self.learn.strategy
        if self.healed_at is None and learn.training: Chaos.healed_at = learn.train_iter
        if args.slow: time.sleep(args.slow)
        if args.wait_for and ft.manager.num_participants() < args.wait_for: wait_alone()
        if not learn.training or args.kill_at is None or marker.exists() or learn.train_iter != args.kill_at:
            return
        if group_rank != args.kill_rank or args.kill_group not in (None, replica): return
        if args.kill_in == 'forward': learn.model.register_forward_hook(lambda *a: die())
        elif args.kill_in == 'backward': learn.model[0].weight.register_hook(lambda g: die())
        elif args.kill_in == 'allreduce':         # the sum over the quorum started, its data on its way
            reduce = ft._pg.allreduce
            def reduce_then_die(*args, **kw):
                work = reduce(*args, **kw)
                die()
            ft._pg.allreduce = reduce_then_die
        elif args.kill_in == 'step': learn.opt.register_step_post_hook(lambda *a: die())
        elif args.kill_in == 'turn2':            # the backward of the head's turn: the body's turn committed
            learn.model[0].weight.register_hook(lambda g: die() if learn.turn == 'head' else None)
        elif args.kill_in == 'closure':          # the backward of a closure's call inside LBFGS's step
            learn.model[0].weight.register_hook(lambda g: die() if learn.step._in_step else None)

class Spike(Callback):
    """The targets of training batch `--spike-at` made 100 times larger: a spike that SpikeGuard rolls back
    over"""
    at = tuple(map(int, args.spike_at.split(','))) if args.spike_at else None
    def before_batch(self):
        learn = self.learn
        if learn.training and (learn.epoch, learn.iter) == self.at: learn.yb = (learn.yb[0] * 100,)

guards = [SpikeGuard(check_every=4, snapshot_every=100), Spike()] if args.spike_at else []

def result():
    return {'model': learn.model.state_dict(), 'opt': learn.opt.state_dict(), 'values': learn.recorder.values,
            'counters': [learn.epoch, learn.iter, learn.train_iter], 'n_losses': len(learn.recorder.losses),
            'healed_at': Chaos.healed_at, 'after_batch': Chaos.batches, 'tries': Chaos.tries,
            'skipped': learn.skipped_batches}

if args.plain:
    with learn.distrib_ctx(global_batch=64): learn.fit(args.epochs, cbs=guards)
else:
    with learn.distrib_ctx(strategy=TorchFT(args.within, timeout=30, quorum_timeout=120), global_batch=64):
        hold.unlink(missing_ok=True)  # its manager is up: the replicas that waited for it go on, and meet it
        ckpt = [CheckpointCallback(out/f'ckpt{replica}', every_n_steps=4,
                                   background=False)] if args.ckpt else []
        learn.fit(args.epochs, cbs=[Chaos(), *ckpt, *guards], resume='auto' if args.ckpt else None)
    assert isinstance(learn.model, nn.Sequential)
    assert args.step != 'one' or type(learn.opt).__name__ == 'Adam'
torch.save(result(), out / f'result{name}.pt')
