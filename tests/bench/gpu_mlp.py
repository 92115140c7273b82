"""The tiny MLP of `loop_overhead.py` on the GPU at batch sizes 1 to 64: microseconds per training step of a
hand-written loop, a hand-written step under `torch.compile(mode='reduce-overhead')` (CUDA graphs), and
learncb eager, compiled and compiled as CUDA graphs. `python tests/bench/gpu_mlp.py` (prints 'skipped' without
CUDA); `--short` for a quick run."""
import argparse, time, warnings
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)).cuda()

def make_data(n_batches, bs):
    "Batches already on the GPU (the tiny MLP would time the host-to-device copies otherwise)"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_batches * bs, 16, generator=g).cuda()
    y = (x[:, 0] + x[:, 1] > 0).long()
    ds = TensorDataset(x, y)     # each batch one indexing of each tensor, not `bs` items stacked
    return DataLoader(ds, sampler=BatchSampler(SequentialSampler(ds), bs, drop_last=False), batch_size=None)

def raw_loop(dl):
    model, loss_func = make_model(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    def fit():
        for xb, yb in dl:
            loss = loss_func(model(xb), yb); loss.backward(); opt.step(); opt.zero_grad()
    return fit

def raw_graphs(dl):
    "A hand-written step under torch.compile(mode='reduce-overhead'): the model, and a capturable Adam's step"
    model, loss_func = make_model(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3, device='cuda'), capturable=True)
    fwd = torch.compile(lambda xb, yb: loss_func(model(xb), yb), mode='reduce-overhead')
    step = torch.compile(opt.step, mode='reduce-overhead')
    def fit():
        for xb, yb in dl:
            torch.compiler.cudagraph_mark_step_begin()
            loss = fwd(xb, yb); loss.backward(); step(); opt.zero_grad()
    return fit

def learncb_fit(dl, **compile):
    from learncb.all import Learner, DataLoaders, ProgressCallback
    learn = Learner(DataLoaders(dl, None), make_model(), nn.CrossEntropyLoss(), device='cuda',
                    opt_func=torch.optim.Adam, lr=1e-3)
    learn.remove_cb(ProgressCallback)
    if compile: learn.compile(**compile)
    def fit():
        with learn.no_logging(): learn.fit(1)
    return fit

def timed(make, dl, rounds):
    """Best microseconds per step of `make(dl)`'s fit over `rounds`, after a warm-up fit (compilation, graph
    capture)"""
    try: fit = make(dl)
    except Exception as e: return f'failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}'
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        try: fit(); fit()
        except Exception as e: return f'failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}'
        best = float('inf')
        for _ in range(rounds):
            torch.cuda.synchronize(); t = time.perf_counter(); fit(); torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
    note = ' (warned: ' + str(w[0].message)[:100] + ')' if w else ''
    return f'{best / len(dl) * 1e6:.1f}{note}'

def main(short=False):
    if not torch.cuda.is_available(): return print('gpu mlp benchmark: skipped: no CUDA')
    sizes, n_batches, rounds = ((1, 64), 50, 2) if short else ((1, 8, 64), 200, 3)
    ways = {'hand-written loop': raw_loop, "hand-written step, reduce-overhead": raw_graphs,
            'learncb': learncb_fit, 'learncb compile(step=True)': lambda dl: learncb_fit(dl, step=True),
            "learncb compile(step=True, mode='reduce-overhead')": lambda dl: learncb_fit(dl, step=True,
        mode='reduce-overhead')}
    print(f"tiny MLP on {torch.cuda.get_device_name()}, torch {torch.__version__}, {n_batches} batches, best "
          f"of {rounds}, us per training step")
    for bs in sizes:
        dl = make_data(n_batches, bs)
        for name, make in ways.items():
            print(f"  bs {bs:>2}  {name:<50} {timed(make, dl, rounds)}", flush=True)

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('--short', action='store_true', help='small run')
    main(p.parse_args().short)
