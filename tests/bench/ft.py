"""The cost of fault tolerance per step: the same fit under DDP (2 processes, gloo) and under
`strategy='torchft'` (2 replica groups, gloo, a lighthouse on this machine), global batch 64, for a small and
a larger MLP. Then across a slow link (a delay added to each exchange between the groups): the bytes each
group puts into the exchange per inner step and the time per inner step of TorchFT syncing every step, of
DiLoCo (`sync='diloco'`, H = 8), of DiLoCo whose exchange runs while the group takes 7 steps, and of streaming
DiLoCo (H = 8 in 2 fragments, each exchange running over 3 steps), against the same two groups training at
once with no exchange (each alone on its share).

`python tests/bench/ft.py` for the full run (DDP and torchft in turn, twice each: the best epoch of each, on a
machine whose other work comes and goes), `--short` for the quick one CI runs. Prints figures; asserts
nothing."""
import argparse, json, os, statistics, sys, tempfile, time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
from procs import join_group, run_workers, write_figures

def make_learner(width, n_items):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_items, 32, generator=g)
    ds = TensorDataset(x, x.sum(1, keepdim=True))
    model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 1))
    learn = Learner(DataLoaders(DataLoader(ds, batch_size=64), None), model, loss_func=nn.MSELoss(),
                    opt_func=torch.optim.Adam, lr=1e-3)
    learn.logger = lambda *a: None            # figures only
    return learn

class StepTimer(Callback):
    "Seconds per training step of each epoch"
    def before_fit(self): self.per_step = []
    def before_train(self): self.start = time.perf_counter()
    def after_train(self): self.per_step.append((time.perf_counter() - self.start) / self.learn.n_iter)

def timed_fit(learn, n_epoch, **ctx):
    timer = StepTimer()
    with learn.distrib_ctx(global_batch=64, **ctx): learn.fit(n_epoch, cbs=timer)
    return min(timer.per_step[1:])  # the first epoch warms up (and, under torchft, forms the first quorums)

def ddp_worker(rank, world, port, width, n_items, n_epoch, out):
    join_group(rank, world, port)
    per_step = timed_fit(make_learner(width, n_items), n_epoch)
    if rank == 0: write_figures({'per_step': per_step}, out)

class SlowLink(TorchFT):
    """TorchFT whose exchange between groups ends `delay` seconds later (a slow link: its latency, which an
    exchange that runs while the group trains hides), and counts the bytes this group puts into it"""
    def __init__(self, delay=0., **kwargs):
        super().__init__(**kwargs)
        self.delay,self.sent = delay,0
    def _start_sum(self, flat):
        self.sent += flat.numel() * flat.element_size()
        wait,ends = super()._start_sum(flat),time.monotonic() + self.delay
        def slow_wait():
            time.sleep(max(0., ends - time.monotonic()))
            wait()
        return slow_wait

def ft_worker(width, n_items, n_epoch, out, delay=None, sync_kw=None):
    "A replica group: plain `strategy='torchft'`, or with `delay` a `SlowLink` (`sync_kw`: DiLoCo's)"
    learn = make_learner(width, n_items)
    strategy = 'torchft' if delay is None else SlowLink(delay, **(sync_kw or {}))
    per_step = timed_fit(learn, n_epoch, strategy=strategy)
    sent = 0 if delay is None else strategy.sent / (n_epoch * learn.n_iter)
    if os.environ['REPLICA_GROUP_ID'] == '0': write_figures({'per_step': per_step, 'sent': sent}, out)

def torchft_figures(width, n_items, n_epoch, timeout, *extra):
    out = os.path.join(tempfile.mkdtemp(), 'figures.json')
    # min_replicas=2: the first quorum waits for both (else on a loaded machine one trains alone while the
    # other starts)
    try:
        with Lighthouse(min_replicas=2) as lighthouse:
            launch_replicas(ft_worker, width, n_items, n_epoch, out, *extra, n=2, lighthouse=lighthouse,
                            timeout=timeout)
    except Exception as e: return f'{type(e).__name__}: {e}'
    with open(out) as fh: return json.load(fh)

def main():
    p = argparse.ArgumentParser()
    p.add_argument('--short', action='store_true')
    args = p.parse_args()
    try: import_torchft()
    except ImportError as e:
        print(f'torchft: skipped ({e})')
        return
    n_items,n_epoch,rounds = (64 * 30, 3, 1) if args.short else (64 * 100, 4, 2)
    for width in (64, 512):
        ddp,ft = [],[]
        for _ in range(rounds):
            ddp.append(run_workers(ddp_worker, (width, n_items, n_epoch), world=2, timeout=300))
            ft.append(torchft_figures(width, n_items, n_epoch, timeout=300))
        failed = [r for r in ddp + ft if isinstance(r, str)]
        if failed:
            print(f'MLP width {width}: no figures ({failed[0]})')
            continue
        d,f = [min(r['per_step'] for r in runs) * 1e3 for runs in (ddp, ft)]
        best = (n_epoch - 1) * rounds
        print(f"MLP width {width}, global batch 64, 2 processes, gloo, best epoch of {best}: "
              f"DDP {d:.2f} ms/step, torchft {f:.2f} ms/step: +{f - d:.2f} ms/step ({f / d:.2f}x)")
    slow_link(512, n_items, n_epoch, delay=0.01, rounds=rounds)

ALONE = {'sync': 'diloco', 'sync_every': 10**9}          # each group on its own: no sync in the fit
SYNCS = [('torchft, a sync each step', None),
         ('DiLoCo, a sync every 8 steps', {'sync': 'diloco', 'sync_every': 8}),
         ('DiLoCo, each exchange over 7 steps', {'sync': 'diloco', 'sync_every': 8, 'fragment_sync_delay': 7,
                                                 'fragment_update_alpha': 0.5}),
         ('streaming, 2 fragments, over 3 steps', {'sync': 'diloco', 'sync_every': 8, 'num_fragments': 2,
                                                   'fragment_sync_delay': 3, 'fragment_update_alpha': 0.5})]

def slow_link(width, n_items, n_epoch, delay, rounds):
    """TorchFT, DiLoCo (H = 8), DiLoCo whose exchange runs while the group takes 7 steps, and streaming
    DiLoCo (H = 8 in 2 fragments, each exchange running over 3 steps) over a link `delay` seconds slower per
    exchange, against the same two groups training alone at once (on this machine they share its cores: a
    group alone on all of them is no measure of what the exchange costs); the best of `rounds` runs of each"""
    runs = {name: [torchft_figures(width, n_items, n_epoch, 300, 0. if kw is ALONE else delay, kw or {})
                   for _ in range(rounds)] for name,kw in [('alone', ALONE)] + SYNCS}
    failed = [r for rs in runs.values() for r in rs if isinstance(r, str)]
    if failed:
        print(f'slow link: no figures ({failed[0]})')
        return
    best = {name: min(rs, key=lambda r: r['per_step']) for name,rs in runs.items()}
    alone = best.pop('alone')['per_step'] * 1e3
    for name,r in best.items():
        ms = r['per_step'] * 1e3
        print(f"MLP width {width}, a link {delay * 1e3:.0f} ms slower per exchange, {name:<36}: "
              f"{r['sent'] / 2**10:7.1f} KiB per inner step, {ms:6.2f} ms per inner step, "
              f"{ms / alone:.2f}x the groups alone ({alone:.2f} ms/step)")

if __name__ == '__main__': main()
