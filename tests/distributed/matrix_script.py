"""The capability x strategy matrix (tests/distributed/test_matrix.py): one fit per capability, each from the
same weights and data, under one strategy; every result saved for the test to hold against the one-process
fit.

python tests/distributed/matrix_script.py OUT
    --strategy one|ddp|fsdp|plain|torchft|torchft_fsdp|tp|fsdp_tp|diloco [--only A,B]
'one': this process, `distrib_ctx(global_batch=64)` (the order the others are held against); 'ddp', 'fsdp':
two processes (learncb's `launch`, gloo); 'plain': two processes under a strategy registered with no override;
'torchft': two replica groups of one process under a lighthouse of their own (`launch_replicas`);
'torchft_fsdp': two replica groups of two ranks each, FSDP within a group; 'tp', 'fsdp_tp': four processes
under `ModelParallel`, a mesh of tp 4 and one of dp 2 x tp 2; 'diloco': one replica group of one process
under `TorchFT(sync='diloco')`, a sync after every inner step with an outer SGD of lr 1 (DiLoCo's loop that
is the plain one: each capability acts on the inner step, and the sync adds `global - (global - local)`,
float32's rounding). The compiled step compiles with the
'aot_eager' backend: what the matrix holds is the meaning of the callbacks in learncb's compiled step
(dynamo's trace of it, the backward AOTAutograd makes), not inductor's kernels, which test_compile.py, the
compiled resume and the compiled DDP step check, and whose C++ build would be most of each launch's time on
a machine without inductor's cache. Each process saves
OUT/<strategy><rank>.pt: `{capability: {'weights', 'steps', 'refused', 'train_iter', 'skipped', 'losses',
'graphs'}}`, where `refused` is the error of a fit refused before its first batch (else `None`)."""
import argparse, os
from functools import partial
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
from learncb.test_utils import TinyLM, padded_tokens

N_ITEMS,GLOBAL_BATCH,EPOCHS = 512,64,2

def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x @ torch.randn(8, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(n,
        generator=g))

class Plain(Strategy):
    """A strategy a user registers without overriding anything: the data sharded, the gradients averaged in
    the step"""

register_strategy('plain', Plain)

class StepCount(Callback):
    "The optimizer steps taken in the fit (counted after a compiled step)"
    order,deferred_events,n = Order.FINAL,('after_step',),0
    def before_fit(self): self.n = 0
    def after_step(self): self.n += bool(self.learn.stepped)

class Spikes(Callback):
    """Scripted spikes: the targets of batch (0, 3) made NaN, those of batch (1, 2) 100 times larger (then
    skipped)"""
    def before_batch(self):
        learn = self.learn
        at = (learn.epoch, learn.iter) if learn.training else None
        if at in ((0, 3), (1, 2)): learn.yb = (learn.yb[0] * (torch.nan if at == (0, 3) else 100.),)

def ckpt(folder): return [CheckpointCallback(folder, every_n_steps=5, background=False)]

capabilities = {       # name: the callbacks of the fit, given its checkpoint folder
    'none': lambda folder: [],
    'accumulation': lambda folder: [GradientAccumulation(128)],
    'clip': lambda folder: [GradientClip(0.05)],
    'precision': lambda folder: [MixedPrecision('bf16')],
    'terminate_on_nan': lambda folder: [TerminateOnNaNCallback()],
    'spike_guard': lambda folder: [SpikeGuard(check_every=4, snapshot_every=4), Spikes()],
    'spike_rows': lambda folder: [SpikeGuard(check_every=2, snapshot_every=2, warmup=2)],   # rows 37, 301
    'microbatch': lambda folder: [AutoMicrobatch()],
    'ema': lambda folder: [EMACallback(0.9)],
    'swa': lambda folder: [SWACallback(start_epoch=1, swa_lr=1e-3)],
    'schedule_by_step': lambda folder: [ParamScheduler({'lr': SchedCos(3e-3, 1e-4)}, by='step')],
    'checkpoint': ckpt, 'compiled_step': lambda folder: [],
    'several_optimizers': lambda folder: [],  # Adam for the body, SGD for the head: one step of both a batch
    'turns': lambda folder: [],  # the body's optimizer, then the head's, each on a forward of its own
    'closure': lambda folder: [],                  # LBFGS: the step computes the batch again in a closure
    'padded_lm': lambda folder: [GradientAccumulation(128)],   # an LM's rows of unequal length, by tokens
}

class AlternatingStep(Step):
    "The body's optimizer, then the head's, each on a forward, loss and backward of its own"
    turns = ('body', 'head')

class AlternatingLearner(Learner): step_class = AlternatingStep

body_and_head = {'splitter': lambda m: {'body': m[0].parameters(), 'head': m[1].parameters()},
                 'opt_func': {'body': torch.optim.Adam, 'head': partial(torch.optim.SGD, momentum=0.9)}}
learner_kwargs = {'several_optimizers': body_and_head, 'turns': {**body_and_head, 'cls': AlternatingLearner},
                  'closure': {'opt_func': partial(torch.optim.LBFGS, max_iter=4, history_size=4), 'lr': 0.5,
                              'double': True},
                  'padded_lm': {'lm': True}, 'spike_rows': {'poison': (37, 301)}}

class Body(nn.Module):
    """The model's first block, FSDP's unit: a class of the user's own, which torch.compile traces (not
    torch's)"""
    def __init__(self): super().__init__(); self.lin = nn.Linear(8, 32)
    def forward(self, x): return torch.relu(self.lin(x))

def learner(cls=Learner, lm=False, double=False, poison=(), **kwargs):
    """The regression learner, or (`lm`) a tiny language model on padded rows of 2 to 24 tokens, its loss over
    tokens; `double`: in float64 (LBFGS multiplies float32's rounding by about 500 over this fit)"""
    torch.manual_seed(0)
    model = TinyLM(dim=16) if lm else nn.Sequential(Body(), nn.Linear(32, 1), nn.Flatten(0))
    make = padded_tokens if lm else data
    train,valid = make(N_ITEMS, seed=1),make(128, seed=2)
    if poison:                      # those rows' targets 1e4 times too large: the rows SpikeGuard finds
        x,y = train.tensors
        y = y.clone(); y[list(poison)] *= 1e4
        train = TensorDataset(x, y)
    if double: model,train,valid = model.double(),*(TensorDataset(*(t.double() for t in d.tensors))
                                                    for d in (train, valid))
    dls = DataLoaders(DataLoader(train, batch_size=GLOBAL_BATCH, shuffle=True),
                      DataLoader(valid, batch_size=64))
    return cls(dls, model, loss_func=CrossEntropyLossFlat() if lm else nn.MSELoss(), default_cbs=False,
               cbs=[TrainEvalCallback(), Recorder()], **{'opt_func': torch.optim.Adam, 'lr': 3e-3, **kwargs})

def tensor_parallel(model, mesh):
    """The matrix's models cut over the mesh's `tp` dimension: the body's linear by columns, the head by rows
    (its output whole); the language model's head by columns, its logits whole"""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
    plan = ({'head': ColwiseParallel(output_layouts=Replicate())} if isinstance(model, TinyLM) else
            {'0.lin': ColwiseParallel(), '1': RowwiseParallel()})
    return parallelize_module(model, mesh['tp'], plan)

model_parallel = {'tp': {'tp': 4}, 'fsdp_tp': {'dp': 2, 'tp': 2}}     # 4 processes: the meshes

def fit(cap, strategy, out, rank):
    "One fit with capability `cap`: what it computed, or why it was refused"
    learn,steps = learner(**learner_kwargs.get(cap, {})),StepCount()
    if cap == 'compiled_step': learn.compile(step=True, fallback=False, backend='aot_eager')
    folder = out/'ckpt'/strategy/(str(rank) if strategy.startswith('torchft') else '')/cap
    refused,before = None,{k: v.clone() for k,v in learn.model.state_dict().items()}
    graphs = torch._dynamo.utils.counters['stats']['unique_graphs']
    ft = {'torchft': TorchFT(timeout=30), 'torchft_fsdp': TorchFT('fsdp', timeout=30),
          **{k: ModelParallel(mesh=m, parallelize=tensor_parallel) for k,m in model_parallel.items()},
          'diloco': TorchFT(timeout=30, sync='diloco', sync_every=1,
                            outer_opt=partial(torch.optim.SGD, lr=1.))}
    ctx = learn.distrib_ctx(global_batch=GLOBAL_BATCH) if strategy == 'one' else learn.distrib_ctx(
        strategy=ft.get(strategy, strategy), global_batch=GLOBAL_BATCH)
    try:
        with ctx: learn.fit(EPOCHS, cbs=[steps, *capabilities[cap](folder)])
    except ValueError as e:
        refused = str(e)
        assert all(torch.equal(v, learn.model.state_dict()[k]) for k,v in before.items()), cap  # nothing lost
    return {'weights': {k: v.detach().clone() for k,v in learn.model.state_dict().items()}, 'steps': steps.n,
            'refused': refused, 'train_iter': learn.train_iter, 'skipped': learn.skipped_batches,
            'skipped_items': sorted(learn.skipped_items), 'losses': [float(l) for l in learn.recorder.losses],
            'graphs': torch._dynamo.utils.counters['stats']['unique_graphs'] - graphs}

def run_all(out, strategy, caps):
    rank = int(os.environ.get('REPLICA_GROUP_ID', os.environ.get('RANK', 0)))
    torch.set_num_threads(1)
    # one process group for all the fits
    group = strategy in ('ddp', 'fsdp', 'plain', 'torchft_fsdp', *model_parallel)
    if group: torch.distributed.init_process_group('gloo')
    try: results = {cap: fit(cap, strategy, out, rank) for cap in caps}
    finally:
        if group: torch.distributed.destroy_process_group()
    torch.save(results, out/f'{strategy}{rank}.pt' if os.environ.get('RANK', '0') == '0' else
               out/f'{strategy}{rank}-{os.environ["RANK"]}.pt')

# a fit's replicas leave and the next fit's join at once: the lighthouse need not wait long for those gone
quick = {'join_timeout': 2., 'heartbeat_timeout': 2.}

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--strategy', default='one'); p.add_argument('--only', default=None)
    args = p.parse_args()
    out,caps = Path(args.out),args.only.split(',') if args.only else list(capabilities)
    out.mkdir(parents=True, exist_ok=True)
    if args.strategy == 'one': run_all(out, 'one', caps)
    elif args.strategy == 'torchft':
        with Lighthouse(min_replicas=2, **quick) as lh:
            launch_replicas(run_all, out, 'torchft', caps, n=2, lighthouse=lh, timeout=900)
    elif args.strategy == 'diloco':
        with Lighthouse(min_replicas=1, **quick) as lh:
            launch_replicas(run_all, out, 'diloco', caps, n=1, lighthouse=lh, timeout=900)
    elif args.strategy == 'torchft_fsdp':
        with Lighthouse(min_replicas=2, **quick) as lh:
            launch_replicas(run_all, out, 'torchft_fsdp', caps, n=2, ranks=2, lighthouse=lh, timeout=900)
    else: launch(run_all, out, args.strategy, caps, nprocs=4 if args.strategy in model_parallel else 2)
