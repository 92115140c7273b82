"""The step as one seam: during a fit nothing callable is set on the learner or the model, whatever capability
runs; `learn.compile(step=True)` runs compiled with the guards (no fallback) and rolls back through its
graphs; the events a rollback and a checkpoint fire are declared."""
import os, subprocess, sys, warnings
from functools import partial
from types import FunctionType, MethodType
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
from learncb.callbacks.tricks import EMACallback
from conftest import synth_learner, synth_dls, child_pythonpath

# the arguments of Learner(...), and the logger
configuration = ('loss_func', 'opt_func', 'splitter', 'logger')

def functions_on(o):
    """The attributes of `o`'s instance that hold a function, a bound method or a partial, the configuration
    aside"""
    return sorted(k for k,v in vars(o).items() if isinstance(v, (FunctionType, MethodType, partial))
                  and k not in configuration)

class AtThirdBatch(Callback):
    "Notes, at the third training batch, what the learner's and the model's instances hold that is callable"
    order = Order.LAST
    def __init__(self): self.seen = None
    def before_batch(self):
        if self.training and self.learn.train_iter == 2:
            self.seen = (functions_on(self.learn), functions_on(self.learn.model),
                         type(self.learn.step).__name__)

def mlp(): return nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))

capabilities = {
    'compile()': lambda learn: learn.compile(backend='eager'),
    'compile(step=True)': lambda learn: learn.compile(step=True, fallback=False, backend='eager'),
    'AutoMicrobatch': lambda learn: learn.add_cb(AutoMicrobatch()),
    'SpikeGuard': lambda learn: learn.add_cb(SpikeGuard()),
    'TerminateOnNaN': lambda learn: learn.add_cb(TerminateOnNaNCallback()),
    'GradientAccumulation': lambda learn: learn.add_cb(GradientAccumulation(32)),
    'MixedPrecision': lambda learn: learn.add_cb(MixedPrecision('bf16')),     # bf16: the CPU has it too
    'EMA': lambda learn: learn.add_cb(EMACallback()),
    'CheckpointCallback': lambda learn: learn.add_cb(CheckpointCallback(every_n_steps=2)),
}

@pytest.mark.parametrize('name', capabilities)
def test_nothing_callable_is_set_on_the_learner_or_the_model(name, tmp_path):
    learn = synth_learner(model=mlp(), path=tmp_path)
    capabilities[name](learn)
    spy = AtThirdBatch()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')                 # bf16 autocast on the CPU, torch.compile's notes
        learn.fit(1, cbs=spy)
    learner_fns, model_fns, step = spy.seen
    assert learner_fns == [] and model_fns == [], (name, learner_fns, model_fns)
    assert step == ('CompiledStep' if name == 'compile(step=True)' else 'Step')

@pytest.mark.slow
@pytest.mark.parametrize('strategy,micro', [('ddp', False), ('ddp', True), ('fsdp', False)],
                         ids=['DDP', 'DDP+AutoMicrobatch', 'FSDP'])
def test_nothing_callable_is_set_under_ddp_and_fsdp(strategy, micro, tmp_path):
    "Two ranks: the same at the third batch of each"
    out = tmp_path/'seen.txt'
    r = subprocess.run([sys.executable, '-c', _ranks_script, strategy, str(int(micro)), str(out)],
                       capture_output=True,
                       text=True, timeout=300, env={**os.environ, 'PYTHONPATH': child_pythonpath()})
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.read_text() == '[]:[]:Step', out.read_text()

_ranks_script = '''
import sys, warnings
from learncb.all import *
from learncb.distributed.context import launch
from test_step import synth_learner, synth_dls, mlp, AtThirdBatch

def run(strategy, micro, out):
    cbs = [AutoMicrobatch()] if micro == '1' else []
    learn = synth_learner(model=mlp(), cbs=cbs, dls=synth_dls(n_train=256))
    spy = AtThirdBatch()
    with warnings.catch_warnings(), learn.distrib_ctx(strategy=strategy):
        warnings.simplefilter('ignore')
        learn.fit(1, cbs=spy)
        if rank_distrib() == 0: open(out, 'w').write(':'.join(map(str, spy.seen)).replace(' ', ''))

if __name__ == '__main__': launch(run, *sys.argv[1:], nprocs=2)
'''

def test_rollback_and_checkpoint_events_are_declared():
    assert 'after_rollback' in event and 'before_checkpoint' in event
    assert not issubclass(RollbackException, CancelException)        # a rollback goes back: it skips nothing
    learn = synth_learner()
    # accepted (it refuses unknown names)
    for name in ('after_rollback', 'before_checkpoint'): learn.on(name)(lambda learn: None)
    from io import StringIO
    from contextlib import redirect_stdout
    with redirect_stdout(StringIO()) as out: learn.show_training_loop()
    assert 'after_rollback' in out.getvalue() and 'before_checkpoint' in out.getvalue()

def regression_data(n=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return x, (x @ torch.tensor([1., -2., .5, 3.]) + 0.1 * torch.randn(n, generator=g))[:, None]

def regression(x, y, cbs=()):
    "A quiet CPU learner of a small MLP regression on `x`, `y` in batches of 16, in order, with torch's Adam"
    torch.manual_seed(0)
    learn = Learner(DataLoaders(DataLoader(TensorDataset(x, y), batch_size=16), None),
                    nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), nn.MSELoss(),
                    opt_func=torch.optim.Adam, lr=1e-2, cbs=list(cbs), device='cpu')
    learn.remove_cb(ProgressCallback)
    learn.logger = lambda row: None
    return learn

def close(a, b, tol):
    "Each tensor of `b` within `tol` of `a`'s, relative to the tensor's largest value"
    for (k, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert (p - q).abs().max() <= tol * max(p.abs().max(), 1e-12), (k, (p - q).abs().max())

guards = {'SpikeGuard': lambda: [SpikeGuard(check_every=4)],
          'TerminateOnNaN': lambda: [TerminateOnNaNCallback()],
          'SpikeGuard(grad_norm=True)': lambda: [SpikeGuard(check_every=4, grad_norm=True)],
          'AutoMicrobatch': lambda: [AutoMicrobatch()],
          'all three': lambda: [SpikeGuard(check_every=4), TerminateOnNaNCallback(), AutoMicrobatch()]}

@pytest.mark.parametrize('name', guards)
def test_compiled_step_with_guards_runs_compiled_and_equals_eager(name):
    x, y = regression_data()
    fits = {}
    for compiled in (False, True):
        learn = regression(x, y, cbs=guards[name]())
        if compiled: learn.compile(step=True, fallback=False)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            learn.fit(3)
        fits[compiled] = learn
    assert fits[True].compiler.fell_back is None
    close(fits[False].model, fits[True].model, 1e-5)

class Poison(Callback):
    """From epoch 1 on, batch 6's targets 1e4 times too large (SpikeGuard's spike); `skip=True`: that batch
    skipped instead"""
    order = Order.FIRST
    def __init__(self, skip=False): self.skip = skip
    def before_batch(self):
        if not (self.training and self.epoch >= 1 and self.iter == 6): return
        if self.skip: raise CancelBatchException()
        self.learn.yb = (self.learn.yb[0] * 1e4,)

class Graphs(Callback):
    "torch.compile's count of distinct graphs at the end of each epoch"
    def __init__(self): self.counts = []
    def after_epoch(self): self.counts.append(torch._dynamo.utils.counters['stats']['unique_graphs'])

def test_a_spike_rolls_back_through_the_compiled_step():
    """A spike in epoch 1 rolls back and replays compiled, with no new graph; the run ends as the one without
    that batch"""
    x, y = regression_data()
    learn = regression(x, y, cbs=[SpikeGuard(check_every=4), Poison(), graphs := Graphs()])
    learn.compile(step=True, fallback=False)
    told = []
    learn.on('after_rollback')(lambda learn: told.append((learn.epoch, learn.iter)))
    learn.fit(3)
    assert learn.compiler.fell_back is None and learn.skipped_batches == ((1, 6), (2, 6)) and told == [(1,
        -1)]
    assert graphs.counts[0] == graphs.counts[-1], graphs.counts
    clean = regression(x, y, cbs=[Poison(skip=True)])
    clean.compile(step=True, fallback=False)
    clean.fit(3)
    close(clean.model, learn.model, 1e-6)

@pytest.mark.parametrize('compiled,fused', [(False, True), (True, True), (True, False)],
                         ids=['eager', 'compiled step', 'compiled step, torch Adam'])
def test_a_fit_on_torchs_public_api_alone_gets_the_same_weights(compiled, fused):
    """learncb.internals' private paths switched off: the same run (the guards' flag and norms, the
    optimizer's step)"""
    from contextlib import nullcontext
    from learncb.internals import public_only
    x, y = regression_data()
    def fit(private):
        with (nullcontext() if private else public_only()):
            learn = regression(x, y, cbs=[SpikeGuard(check_every=4, grad_norm=True, skip_on_device=True)])
            learn.opt_func = partial(torch.optim.Adam, fused=fused)
            if compiled: learn.compile(step=True, fallback=False)
            learn.fit(2)
        return learn
    private, public = fit(True), fit(False)
    if compiled: close(private.model, public.model, 1e-5)       # the backward traced into the graph, or not
    else:
        for p, q in zip(private.model.parameters(), public.model.parameters()): assert torch.equal(p, q)

def step_event_calls(path):
    "`(line, what)` for each place in `path` that fires a step event by name or calls a handler of one"
    import ast
    names = set(step_events) | {e for s in ('backward', 'step') for e in stage_events[s]}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call): continue
        f = node.func
        calls_super = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and getattr(f.value.func,
            'id', '') == 'super'
        if isinstance(f, ast.Attribute) and f.attr in names and not calls_super:
            found.append((node.lineno, f'.{f.attr}()'))
        literals = [a.value for a in ast.walk(node) if isinstance(a, ast.Constant) and a.value in names]
        if literals and (isinstance(f, ast.Name) and f.id in ('learn', 'self') or
                         isinstance(f, ast.Attribute) and f.attr in ('fire', '_fire', 'learn')):
            found.append((node.lineno, f'fires {literals}'))
    return found

def test_no_step_variant_restates_the_order_of_the_step_events():
    """Only learncb/step.py fires the step's events: a variant of the step (compiled, fault-tolerant)
    overrides computations"""
    import learncb
    from pathlib import Path
    pkg = Path(learncb.__file__).parent
    assert step_event_calls(pkg/'step.py'), 'the check finds the step firing its events'
    elsewhere = {str(p.relative_to(pkg)): c for p in pkg.rglob('*.py') if p.name != 'step.py'
                 and (c := step_event_calls(p))}
    assert elsewhere == {}
