"""Per-step overhead of learncb's loop against a hand-written PyTorch loop doing the same work.

Prints one line per configuration: microseconds per step, overhead per step, and the ratio to the raw loop.
`python tests/bench/loop_overhead.py` for the full run, `--short` for the quick one CI runs."""
import argparse, contextlib, cProfile, io, pstats, tempfile, time, warnings
from functools import partial
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from learncb.all import *
from procs import join_group, run_workers, write_figures

def make_data(n_batches, bs=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * bs, 16, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    # 10% of labels wrong: a loss with a floor, as real data has (on separable labels, fit after fit, the
    # loss fell to 1e-4 and SpikeGuard saw spikes in its noise)
    y = torch.where(torch.rand(len(y), generator=g) < 0.1, 1 - y, y)
    train = DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True,
                       generator=torch.Generator().manual_seed(seed))
    valid = DataLoader(TensorDataset(x[:n_batches * bs // 6], y[:n_batches * bs // 6]), batch_size=bs)
    return train, valid

def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))

def raw_loop(train, valid, n_epoch, with_metric=False, fused=None, opt_func=None):
    "The reference: what a careful hand-written loop does (losses kept on the device, read once per epoch)"
    model, loss_func = make_model(), nn.CrossEntropyLoss()
    opt = (opt_func or partial(torch.optim.Adam, fused=fused))(model.parameters(), lr=1e-3)
    for epoch in range(n_epoch):
        model.train(); losses = []
        for xb, yb in train:
            loss = loss_func(model(xb), yb)
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.detach())
        model.eval(); vlosses, accs = [], []
        with torch.no_grad():
            for xb, yb in valid:
                pred = model(xb); vlosses.append(loss_func(pred, yb))
                if with_metric: accs.append(accuracy(pred, yb))
        torch.stack(losses).mean().item(); torch.stack(vlosses).mean().item()
        if with_metric: torch.stack(accs).mean().item()

def learncb_loop(train, valid, n_epoch, progress=False, metrics=None, opt_func=torch.optim.Adam):
    """learncb's fit; with `torch.optim.Adam` (the raw loop's optimizer) unless `opt_func=fast_adam` (the
    default) is given"""
    learn = Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), metrics=metrics,
                    device='cpu', opt_func=opt_func)
    if not progress:
        learn.remove_cb(ProgressCallback)
        with learn.no_logging(): learn.fit(n_epoch)
    # bars and table are drawn as usual; the text goes to a buffer so that it does not mix with the figures
    else:
        with contextlib.redirect_stdout(io.StringIO()): learn.fit(n_epoch)

def toolbox_loop(train, valid, n_epoch, path):
    "learncb with the progress bar, SaveModelCallback, EarlyStoppingCallback and a one-cycle schedule"
    learn = Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), metrics=[accuracy],
                    device='cpu', path=path, opt_func=torch.optim.Adam)
    with contextlib.redirect_stdout(io.StringIO()):
        learn.fit_one_cycle(n_epoch, 1e-2, cbs=[SaveModelCallback(), EarlyStoppingCallback(patience=3)])

def compiled_us(train, valid, n_epoch, rounds):
    """Per-step times of fits of one learner compiled with `learn.compile()` and of one eager; compilation not
    counted"""
    import warnings
    learners = {k: Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), device='cpu')
                for k in ('eager', 'compiled')}
    learners['compiled'].compile()
    for learn in learners.values(): learn.remove_cb(ProgressCallback)
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as w, learners['compiled'].no_logging():
        warnings.simplefilter('always')
        learners['compiled'].fit(1)                      # compiles the training and the validation graphs
    compile_s = time.perf_counter() - t
    failed = learners['compiled'].compiler.compiled.failed
    fits = {k: (lambda learn=learn: learn.fit(n_epoch)) for k, learn in learners.items()}
    with learners['eager'].no_logging(), learners['compiled'].no_logging(): best = best_times(fits, rounds)
    return best, compile_s, failed

def guarded_step_us(train, valid, n_epoch, rounds):
    """Best times of the raw loop and of learncb's compiled step with SpikeGuard (torch.optim.Adam, default
    callbacks)"""
    learn = Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), device='cpu',
                    opt_func=torch.optim.Adam, cbs=SpikeGuard())
    learn.remove_cb(ProgressCallback)
    learn.compile(step=True, fallback=False)
    with learn.no_logging():
        learn.fit(1)                                      # compiles the training and the validation steps
        return best_times({'raw': lambda: raw_loop(train, valid, n_epoch),
                           'guarded': lambda: learn.fit(n_epoch)}, rounds)

def best_times(fns, rounds):
    """Best wall time of each function over `rounds` rounds, run round-robin so that machine drift hits all
    alike"""
    for f in fns.values(): f()   # warm-up: first-call imports and allocator growth
    best = dict.fromkeys(fns, float('inf'))
    for _ in range(rounds):
        for name, f in fns.items():
            t = time.perf_counter(); f(); best[name] = min(best[name], time.perf_counter() - t)
    return best

def dispatch_us(n_cbs, n_calls):
    "Microseconds to fire an event that no callback handles, with `n_cbs` callbacks registered"
    train, valid = make_data(2)
    learn = Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), device='cpu',
                    cbs=[Callback(after_batch=lambda self: None) for _ in range(n_cbs - 1)])
    learn('before_step')
    t = time.perf_counter()
    for _ in range(n_calls): learn('before_step')
    return (time.perf_counter() - t) / n_calls * 1e6

def python_calls(fn):
    "Python function calls (cProfile's total, builtins included) made by `fn()`"
    prof = cProfile.Profile()
    prof.enable(); fn(); prof.disable()
    return pstats.Stats(prof).total_calls

def raw_loop_rows_out(train, valid, n_epoch, rows, opt_func=torch.optim.Adam):
    """The raw loop leaving `rows` of the training set out: its dataset gives each row's index, and a batch
    drops the rows left out (the mean of the loss is over the rows kept, as learncb's)"""
    x, y = train.dataset.tensors
    indexed = DataLoader(TensorDataset(x, y, torch.arange(len(x))), batch_size=train.batch_size, shuffle=True,
                         generator=torch.Generator().manual_seed(0))
    out = torch.tensor(sorted(rows))
    model, loss_func = make_model(), nn.CrossEntropyLoss()
    opt = opt_func(model.parameters(), lr=1e-3)
    for epoch in range(n_epoch):
        model.train(); losses = []
        for xb, yb, ib in indexed:
            keep = ~torch.isin(ib, out)
            loss = loss_func(model(xb[keep]), yb[keep])
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.detach())
        model.eval(); vlosses = []
        with torch.no_grad():
            for xb, yb in valid: vlosses.append(loss_func(model(xb), yb))
        torch.stack(losses).mean().item(); torch.stack(vlosses).mean().item()

def learncb_rows_out(train, valid, n_epoch, rows, opt_func=torch.optim.Adam):
    """learncb's default fit (no bar) with `rows` of the training set left out (`learn.skipped_items`, as a
    guard leaves the rows it found bad out of the fits after)"""
    learn = Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), device='cpu',
                    opt_func=opt_func)
    learn.remove_cb(ProgressCallback)
    with learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')            # the fit says which rows it left out
        learn.fit(0)                               # the fit that ties the rows left out to this training set
        learn.skipped_items = sorted(rows)
        learn.fit(n_epoch)

def calls_per_step(train, valid, n_epoch, n_steps, opt_func=torch.optim.Adam, rows=None):
    """Python calls per step of the raw loop, and how many more learncb's loop (default callbacks) makes; with
    `rows`, both leave those rows of the training set out"""
    if rows is None:
        raw = python_calls(lambda: raw_loop(train, valid, n_epoch, opt_func=opt_func)) / n_steps
        ours = python_calls(lambda: learncb_loop(train, valid, n_epoch, opt_func=opt_func)) / n_steps
    else:
        raw = python_calls(lambda: raw_loop_rows_out(train, valid, n_epoch, rows, opt_func)) / n_steps
        ours = python_calls(lambda: learncb_rows_out(train, valid, n_epoch, rows, opt_func)) / n_steps
    return raw, ours - raw

def print_calls(train, valid, n_epoch, n_steps):
    """Python calls per step (cProfile's count) of learncb's default fit without the bar over the same loop by
    hand: on the plain fit (SGD) and on this bench's (Adam), with and without rows left out"""
    rows = range(5, len(train.dataset), 97)                # about 1% of the rows, in most batches
    for what, opt_func in [('plain fit, SGD', torch.optim.SGD), ("this bench's, Adam", torch.optim.Adam)]:
        for out in (None, rows):
            raw, extra = calls_per_step(train, valid, n_epoch, n_steps, opt_func, out)
            name = f"python calls per step, {what}" + (', rows left out' if out else '')
            print(f"{name:<56}: loop by hand {raw:6.1f}, learncb default cbs {extra:+5.1f} over it")

def ddp_raw_loop(train_ds, valid_ds, n_epoch, bs=32):
    "The reference for DDP: a careful hand-written loop, each rank training and validating on its own share"
    rank, world = dist.get_rank(), dist.get_world_size()
    train = DataLoader(train_ds, batch_size=bs, sampler=DistributedSampler(train_ds, world, rank,
        shuffle=False))
    valid = DataLoader(valid_ds, batch_size=bs, sampler=list(range(rank, len(valid_ds), world)))
    model, loss_func = DistributedDataParallel(make_model()), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(n_epoch):
        train.sampler.set_epoch(epoch)
        model.train(); losses = []
        for xb, yb in train:
            loss = loss_func(model(xb), yb)
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.detach())
        model.eval(); vlosses = []
        with torch.no_grad():
            for xb, yb in valid: vlosses.append(loss_func(model(xb), yb) * len(yb))
        # the epoch's means over every rank: one all_reduce, one read
        sums = torch.stack([torch.stack(losses).sum(), torch.tensor(float(len(losses))),
                            torch.stack(vlosses).sum(), torch.tensor(float(len(valid.sampler)))]).double()
        dist.all_reduce(sums); sums.tolist()

def ddp_learncb_loop(train_ds, valid_ds, n_epoch, bs=32):
    "learncb, default callbacks less the progress bar, in `distrib_ctx` (DDP, sharded data, reduced means)"
    dls = DataLoaders(DataLoader(train_ds, batch_size=bs), DataLoader(valid_ds, batch_size=bs))
    # the raw loop's
    learn = Learner(dls, make_model(), nn.CrossEntropyLoss(), device='cpu', opt_func=torch.optim.Adam)
    learn.remove_cb(ProgressCallback)
    with learn.no_logging(), learn.distrib_ctx(): learn.fit(n_epoch)

def ddp_worker(rank, world, port, n_batches, n_epoch, rounds, out):
    """One rank of the 2-process benchmark: best time of each loop over `rounds` rounds; rank 0 writes them to
    `out`"""
    # One group for the whole run, started here: `distrib_ctx` joins it rather than starting its own, so that
    # neither
    # loop's time counts the rendezvous, and both use the same gloo connections
    join_group(rank, world, port)
    try:
        train, valid = make_data(n_batches * world)
        train_ds, valid_ds = train.dataset, valid.dataset
        fns = {'raw': lambda: ddp_raw_loop(train_ds, valid_ds, n_epoch),
               'learncb': lambda: ddp_learncb_loop(train_ds, valid_ds, n_epoch)}
        for f in fns.values(): f()   # warm-up
        best = dict.fromkeys(fns, float('inf'))
        for _ in range(rounds):
            for name, f in fns.items():
                dist.barrier(); t = time.perf_counter()
                f(); dist.barrier()          # until the slower rank is done
                best[name] = min(best[name], time.perf_counter() - t)
        per_rank = lambda n_items: -(-n_items // 32)      # batches of 32, the last one partial
        n_steps = n_epoch * (per_rank(-(-len(train_ds) // world)) + per_rank(len(range(rank, len(valid_ds),
            world))))
        if rank == 0: write_figures({k: v / n_steps * 1e6 for k, v in best.items()}, out)
    finally: dist.destroy_process_group()

def ddp_us(n_batches, n_epoch, rounds, timeout, world=2):
    """Microseconds per step of the raw DDP loop and learncb's, in `world` CPU processes (gloo); or why there
    are none"""
    return run_workers(ddp_worker, (n_batches, n_epoch, rounds), world, timeout)

# The compile table, the step alone: batches made ahead, so that the figures time the step, not the
# DataLoader's collate
def premade(n_batches, shape, n_classes, bs=32, seed=0):
    "Training and validation batches, made once: lists of `(x, y)` (a list is a dataloader to learncb too)"
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(bs, *shape, generator=g), torch.randint(0, n_classes, (bs,), generator=g))
               for _ in range(n_batches + n_batches // 6)]
    return batches[:n_batches], batches[n_batches:]

def wide_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 2))

def cnn_model():
    "gpu_cnn.py's CNN, on the CPU"
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

def raw_epoch(model, step, vstep, train, valid):
    "One epoch of a hand-written loop: `step` trains on a batch, `vstep` gives a validation loss"
    model.train(); losses = [step(xb, yb) for xb, yb in train]
    model.eval()
    with torch.no_grad(): vlosses = [vstep(xb, yb) for xb, yb in valid]
    torch.stack(losses).mean().item(); torch.stack(vlosses).mean().item()

def raw_runner(make_model, opt_cls, train, valid, compiled):
    """A hand-written loop (its optimizer as it comes), with its whole step in one `torch.compile` if
    `compiled`"""
    model, loss_func = make_model(), nn.CrossEntropyLoss()
    opt = opt_cls(model.parameters(), lr=1e-3)
    def step(xb, yb):
        loss = loss_func(model(xb), yb); loss.backward(); opt.step(); opt.zero_grad()
        return loss.detach()
    def vstep(xb, yb): return loss_func(model(xb), yb)
    if compiled: step, vstep = torch.compile(step), torch.compile(vstep)
    return lambda: raw_epoch(model, step, vstep, train, valid)

def learncb_runner(make_model, opt_func, train, valid, compile=None):
    "learncb's fit (default callbacks, no bar), compiled as `learn.compile(**compile)` if given"
    learn = Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), lr=1e-3, device='cpu',
                    opt_func=opt_func)
    learn.remove_cb(ProgressCallback)
    if compile is not None: learn.compile(**compile)
    def fit():
        with learn.no_logging(): learn.fit(1)
    return fit, learn

def default_opt(opt_cls):
    "learncb's default for `opt_cls`: its default `fast_adam` for Adam, else the class as given"
    return fast_adam if opt_cls is torch.optim.Adam else opt_cls

def compile_rows(make_model, shape, n_classes, opt_cls, n_batches, rounds):
    "us/step of each way to run the step, and the seconds of each first (compiling) epoch"
    train, valid = premade(n_batches, shape, n_classes)
    runners = {'raw': raw_runner(make_model, opt_cls, train, valid, False),
               'raw_compiled': raw_runner(make_model, opt_cls, train, valid, True),
               'default': learncb_runner(make_model, default_opt(opt_cls), train, valid)[0],
               'model': learncb_runner(make_model, opt_cls, train, valid, {})[0]}
    runners['step'], learn = learncb_runner(make_model, opt_cls, train, valid, {'step': True})
    runners['step_engine'] = learncb_runner(make_model, opt_cls, train, valid, {'step': True,
        'trace_backward': False})[0]
    first = {}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for k, f in runners.items():
            t = time.perf_counter(); f(); first[k] = time.perf_counter() - t
    n_steps = len(train) + len(valid)
    best = best_times(runners, rounds)
    return {k: v / n_steps * 1e6 for k, v in best.items()}, first, learn.compiler.fell_back

def compile_table():
    """Side by side: the hand-written loop eager and compiled, learncb eager (fused), `learn.compile()`,
    `(step=True)`, each first compile without inductor's cache (a minute and more: the full run only)"""
    import torch._dynamo
    torch._dynamo.config.recompile_limit = 64  # every learner here compiles its own graphs: no eager fallback
    torch._inductor.config.force_disable_caches = True  # the first compile's time as in a new environment
    models = [('16-16-2 MLP', make_model, (16,), 2, 300), ('16-512-512-2 MLP', wide_model, (16,), 2, 150),
              ('CNN (gpu_cnn.py), CPU', cnn_model, (3, 32, 32), 10, 12)]
    opts,rounds = [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW],5
    print(f"compiling, side by side: batches of 32 made ahead (a list), an epoch of training and validation, "
          f"best of {rounds}, 1 thread; x: times faster than the hand-written eager loop (its optimizer as "
          f"it comes); first: the first epoch, which compiles")
    for name, make, shape, n_classes, n in models:
        for opt_cls in opts:
            us, first, fell_back = compile_rows(make, shape, n_classes, opt_cls, n, rounds)
            cell = lambda k: f"{us[k]:7.0f} us {us['raw'] / us[k]:4.2f}x"
            print(f"{name:<22} {opt_cls.__name__:<5}: hand-written {us['raw']:7.0f} us | its step compiled "
                  f"{cell('raw_compiled')} "
                  f"(first {first['raw_compiled']:.1f} s) | learncb default {cell('default')} | "
                  f"learn.compile() {cell('model')} (first {first['model']:.1f} s) | "
                  f"learn.compile(step=True) {cell('step')} "
                  f"(first {first['step']:.1f} s) | (step=True, trace_backward=False) "
                  f"{cell('step_engine')}"
                  + (f" FELL BACK: {fell_back}" if fell_back else ''))

def main(short=False):
    torch.set_num_threads(1)
    n_batches, n_epoch, rounds = (200, 1, 3) if short else (600, 2, 5)
    train, valid = make_data(n_batches)
    n_steps = n_epoch * (len(train) + len(valid))
    tmp = tempfile.mkdtemp()
    best = best_times({'raw': lambda: raw_loop(train, valid, n_epoch),
                       'raw_fused': lambda: raw_loop(train, valid, n_epoch, fused=True),
                       'raw_metric': lambda: raw_loop(train, valid, n_epoch, with_metric=True),
                       'default': lambda: learncb_loop(train, valid, n_epoch),
                       'fast_adam': lambda: learncb_loop(train, valid, n_epoch, opt_func=fast_adam),
                       'progress_metric': lambda: learncb_loop(train, valid, n_epoch, True, [accuracy]),
                       'toolbox': lambda: toolbox_loop(train, valid, n_epoch, tmp)}, rounds)
    us = {k: v / n_steps * 1e6 for k, v in best.items()}
    print(f"{n_batches} batches of 32, {n_epoch} epoch(s), train+validate, best of {rounds}, 1 thread")
    print(f"raw PyTorch loop                      : {us['raw']:7.1f} us/step")
    print(f"raw PyTorch loop + accuracy           : {us['raw_metric']:7.1f} us/step")
    print(f"raw PyTorch loop, Adam(fused=True)    : {us['raw_fused']:7.1f} us/step, "
          f"{us['raw'] / us['raw_fused']:.2f}x faster than raw")
    print(f"learncb's default fit (fast_adam)     : {us['fast_adam']:7.1f} us/step, "
          f"{us['raw'] / us['fast_adam']:.2f}x faster than raw, "
          f"{us['fast_adam'] / us['raw_fused']:.3f}x the raw loop with the fused Adam")
    print("below: learncb with the raw loop's optimizer, torch.optim.Adam as it comes (the same work as the "
          "raw loop)")
    for name, key, ref in [('learncb default cbs, progress off     ', 'default', 'raw'),
                           ('learncb + ProgressCallback + accuracy ', 'progress_metric', 'raw_metric'),
                           ('learncb + progress, accuracy, SaveModel, EarlyStopping, one-cycle', 'toolbox',
                            'raw_metric')]:
        print(f"{name}: {us[key]:7.1f} us/step, overhead {us[key] - us[ref]:+6.1f} us/step, "
              f"{us[key] / us[ref]:.3f}x raw")
    print_calls(train, valid, n_epoch, n_steps)
    n_calls = 20_000 if short else 200_000
    d1, d50 = dispatch_us(1, n_calls), dispatch_us(50, n_calls)
    print(f"dispatch, unhandled event             : {d1:.3f} us with 1 callback, {d50:.3f} us with 50 "
          f"({d50 / d1:.2f}x)")
    best_c, compile_s, failed = compiled_us(train, valid, n_epoch, rounds)
    c, e = best_c['compiled'] / n_steps * 1e6, best_c['eager'] / n_steps * 1e6
    print(f"torch.compile (inductor), default cbs : compiled {c:7.1f} us/step, eager {e:7.1f} us/step, ratio "
          f"{c / e:.3f} (compiling took {compile_s:.1f} s, "
          f"not counted)" + (f"; FELL BACK TO EAGER: {failed}" if failed
                             else ''))
    n_ddp, n_epoch_ddp, rounds_ddp = (150, 1, 3) if short else (600, 2, 5)
    res = ddp_us(n_ddp, n_epoch_ddp, rounds_ddp, timeout=60 if short else 300)
    if isinstance(res, str): print(f"2 processes (gloo, DDP)               : skipped: {res}")
    else:
        print(f"2 processes (gloo, DDP)               : learncb {res['learncb']:7.1f} us/step, hand-written "
              f"DDP loop {res['raw']:7.1f} us/step, ratio {res['learncb'] / res['raw']:.3f} ({n_ddp} batches "
              f"of 32 per rank, {n_epoch_ddp} epoch(s), best of {rounds_ddp}, 1 thread per process)")
    g = {k: v / n_steps * 1e6 for k, v in guarded_step_us(train, valid, n_epoch, rounds).items()}
    print(f"learn.compile(step=True) + SpikeGuard  : {g['guarded']:7.1f} us/step, hand-written loop (torch "
          f"Adam) {g['raw']:7.1f} us/step: {g['raw'] / g['guarded']:.2f}x faster than the hand-written loop")
    if short: print("compiling, side by side (each way, without inductor's cache): the full run only")
    else: compile_table()

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('--short', action='store_true', help='small run for CI')
    main(p.parse_args().short)
