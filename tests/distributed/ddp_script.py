"""A small training run for tests/distributed/test_distributed.py, launched with torchrun (2 processes, gloo)
or alone.

python tests/distributed/ddp_script.py OUT [--bs B] [--epochs E] [--shuffle] [--ckpt] [--resume] [--kill-at K]
[--fail-rank R]
                               [--early] [--count-writes] [--n-valid N] [--dropout P] [--device D]
                               [--dist-order]
Rank 0 saves the result in OUT/result.pt: final weights, optimizer state, recorder losses and values,
get_preds."""
import argparse, builtins, os, signal, sys, tempfile, time
from collections import Counter
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from functools import partial
from learncb.all import *

p = argparse.ArgumentParser()
p.add_argument('out'); p.add_argument('--bs', type=int, default=8); p.add_argument('--epochs', type=int,
    default=3)
p.add_argument('--shuffle', action='store_true'); p.add_argument('--ckpt', action='store_true')
p.add_argument('--resume', action='store_true'); p.add_argument('--kill-at', type=int, default=None)
p.add_argument('--fail-rank', type=int, default=None); p.add_argument('--early', action='store_true')
p.add_argument('--count-writes', action='store_true'); p.add_argument('--n-valid', type=int, default=33)
p.add_argument('--timeout', type=int, default=60); p.add_argument('--dropout', type=float, default=0.)
p.add_argument('--device', default='cpu'); p.add_argument('--acc', type=int, default=None)
p.add_argument('--clip-bf16', action='store_true'); p.add_argument('--stop-rank', type=int, default=None)
p.add_argument('--nan-rank', type=int, default=None); p.add_argument('--torchmetrics', action='store_true')
p.add_argument('--strategy', default='ddp'); p.add_argument('--blocks', action='store_true')
p.add_argument('--adam', action='store_true'); p.add_argument('--export', action='store_true')
p.add_argument('--clip', action='store_true'); p.add_argument('--save-best', action='store_true')
p.add_argument('--term-at', type=int, default=None); p.add_argument('--kill-once', default=None)
p.add_argument('--auto', action='store_true'); p.add_argument('--ema', action='store_true')
p.add_argument('--prune-at', type=int, default=None); p.add_argument('--dist-order', action='store_true')
p.add_argument('--compile-step', action='store_true')
args = p.parse_args()
out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(1)

writes = Counter()
if args.count_writes:                   # count the files this process writes, to check that rank 0 alone does
    _open, _replace = builtins.open, os.replace
    def counting_open(f, mode='r', *a, **kw):
        if any(c in mode for c in 'wax+'): writes[str(f)] += 1
        return _open(f, mode, *a, **kw)
    def counting_replace(src, dst, *a, **kw):
        writes[str(dst)] += 1
        return _replace(src, dst, *a, **kw)
    builtins.open, os.replace = counting_open, counting_replace

g = torch.Generator().manual_seed(0)
x = torch.randn(64 + args.n_valid, 4, generator=g)
y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).long() + (x[:, 3] > 1).long()
train_ds = TensorDataset(x[:64], y[:64])
# one process, in the order of a distributed run
if args.dist_order and int(os.environ.get('WORLD_SIZE', '1')) == 1:
    train = DataLoader(train_ds, batch_size=args.bs, sampler=DistributedSampler(train_ds, 1, 0,
        shuffle=args.shuffle))
else: train = DataLoader(train_ds, batch_size=args.bs, shuffle=args.shuffle)
valid = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=4)
class Block(nn.Module):
    "A unit FSDP shards: linear, ReLU, dropout"
    def __init__(self, n):
        super().__init__(); self.lin, self.act, self.drop = nn.Linear(n,
                                                                      n), nn.ReLU(), nn.Dropout(args.dropout)
    def forward(self, x): return self.drop(self.act(self.lin(x)))

torch.manual_seed(0)
if args.blocks: model = nn.Sequential(nn.Linear(4, 16), Block(16), Block(16), Block(16), nn.Linear(16, 3))
else: model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(16, 3))
metrics = accuracy
if args.torchmetrics:
    from torchmetrics.classification import MulticlassAccuracy
    metrics = [accuracy, MulticlassAccuracy(num_classes=3, average='macro')]
learn = Learner(DataLoaders(train, valid), model, nn.CrossEntropyLoss(), metrics=metrics, path=out,
                opt_func=partial(torch.optim.AdamW, weight_decay=0.01) if args.adam
                else partial(torch.optim.SGD, momentum=0.9),
                lr=(1e-2 if args.adam else 0.05) if not args.early else 1e-9, device=args.device)
learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, ProgressCallback)])

class Chaos(Callback):
    "Kills this process (SIGKILL) at training batch `kill_at`, or raises on rank `fail_rank`"
    def after_pred(self):
        if not self.training: return
        if args.kill_at is not None and self.train_iter == args.kill_at and rank_distrib() == min(1,
                num_distrib() - 1):
            os.kill(os.getpid(), signal.SIGKILL)
        at_term = args.term_at is not None and self.train_iter == args.term_at
        if at_term and rank_distrib() == 1 and not args.auto:
            print(f'SIGTERM AT {time.time()}', flush=True)
            os.kill(os.getpid(), signal.SIGTERM)                 # as a scheduler would, to one process
        if (args.kill_once and self.train_iter == 5 and rank_distrib() == min(1, num_distrib() - 1)
            and not os.path.exists(args.kill_once)):
            open(args.kill_once, 'w').close()                    # once: the restarted run goes on
            os.kill(os.getpid(), signal.SIGKILL)
        if args.fail_rank is not None and rank_distrib() == args.fail_rank and self.train_iter == 2:
            raise RuntimeError(f'boom on rank {rank_distrib()}')

syncs, sizes = [], {}
reduced = [0]                           # gradient reductions FSDP made (reduce-scatters), counted
if args.strategy == 'fsdp':
    import torch.distributed as dist
    for name in ('reduce_scatter_single', 'reduce_scatter_tensor'):
        def counting(*a, _f=getattr(dist, name), **kw):
            reduced[0] += 1
            return _f(*a, **kw)
        setattr(dist, name, counting)

def local_numel(ts): return sum((t.to_local() if hasattr(t, 'to_local') else t).numel() for t in ts)

class Probe(Callback):
    """Writes down whether the gradients are reduced in each backward, and what each rank holds; stops or
    poisons one rank"""
    def before_backward(self): self._before = reduced[0]
    def after_backward(self):
        if args.strategy == 'fsdp': syncs.append(reduced[0] > self._before)
        else: syncs.append(getattr(self.learn.model, 'require_backward_grad_sync', None))
    def after_step(self):
        if sizes: return
        opt = self.learn.opt
        sizes.update(params=local_numel(self.learn.model.parameters()),
                     opt=local_numel(v for s in opt.state.values() for v in s.values() if v.ndim > 0),
                     units=[sum(p.numel() for p in m.parameters()) for m in self.learn.model.children()])
    def after_loss(self):
        if args.nan_rank == rank_distrib() and self.training and self.train_iter == 5:
            self.learn.loss = self.learn.loss * float('nan')
    def after_epoch(self):
        if args.stop_rank == rank_distrib() and self.epoch == 0: self.learn.stop_fit('asked on one rank')

# their handlers are Python: they would make a compiled fit eager
cbs = [] if args.compile_step else [Chaos(), Probe()]
if args.compile_step: learn.compile(step=True, fallback=False)
if args.acc: cbs.append(GradientAccumulation(args.acc))
if args.clip_bf16: cbs += [GradientClip(0.5), MixedPrecision('bf16')]
if args.clip: cbs.append(GradientClip(0.05))                  # small: every step is clipped
if args.save_best: cbs.append(SaveModelCallback(fname='epoch', every_epoch=True, with_opt=True))  # in the fit
if args.nan_rank is not None: cbs.append(TerminateOnNaNCallback(check_every=2))
if args.ckpt: cbs.append(CheckpointCallback(every_n_steps=1))
if args.early: cbs.append(EarlyStoppingCallback(monitor='accuracy', patience=1))
if args.count_writes: cbs += [SaveModelCallback(monitor='accuracy', fname='best'), CSVLogger()]
if args.ema: cbs.append(EMACallback(0.9))
if args.prune_at is not None:
    import optuna
    class FakeTrial:
        "Rank 0's trial: its pruner says stop from epoch `prune_at` on"
        def report(self, value, step): self.step = step
        def should_prune(self): return self.step >= args.prune_at
    # the group is not up yet
    cbs.append(OptunaPruningCallback(FakeTrial() if os.environ.get('RANK', '0') == '0' else None))

with learn.distrib_ctx(strategy=args.strategy, timeout=args.timeout):
    try: learn.fit(args.epochs, cbs=cbs, resume='auto' if args.auto else True if args.resume else None)
    except SignalStop:
        print(f'STOPPED RANK {rank_distrib()} AT {learn.train_iter}', flush=True)
        raise
    except Exception as e:
        if type(e).__name__ != 'TrialPruned': raise
        print(f'PRUNED RANK {rank_distrib()} AT EPOCH {learn.epoch}', flush=True)
    preds, targs = learn.get_preds()
    rank, world = rank_distrib(), num_distrib()
    all_sizes = gather_objects(sizes)
    if args.export: learn.export(out/'export.pkl')
    print(f'RANK {rank} OF {world} EPOCHS {learn.epoch + 1} WRITES {sum(writes.values())} {sorted(writes)}',
          flush=True)
gloo_left = sum(open(t/'comm').read().startswith(('gloo', 'pt_gloo')) for t
                in Path('/proc/self/task').iterdir())
# the group ended with its threads, before the interpreter's teardown
print(f'RANK {rank} GLOO THREADS LEFT {gloo_left}', flush=True)
if rank == 0:
    alone = learn.get_preds()[0]  # the group is over: one process, the whole validation set, same weights
    opt = learn.opt.state_dict()
    torch.save({'alone': alone, 'model': learn.model.state_dict(), 'opt': opt,
                'losses': learn.recorder.losses,
                'values': learn.recorder.values, 'preds': preds, 'targs': targs, 'world': world,
                'syncs': syncs, 'sizes': all_sizes, 'x_valid': x[64:],
                'is_plain': not isinstance(learn.model, torch.nn.parallel.DistributedDataParallel),
                'graphs': torch._dynamo.utils.counters['stats']['unique_graphs']},
               out/'result.pt')
