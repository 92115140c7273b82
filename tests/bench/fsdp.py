"""FSDP2 on the CPU (gloo, 2 processes): the memory each rank holds, and learncb's time per step against a
hand-written FSDP2 loop doing the same work (shard the model, train, validate, reduce the epoch's means).

`python tests/bench/fsdp.py` for the full run, `--short` for the quick one CI runs (without the compiled
step's line, whose first fit compiles). Prints figures; asserts nothing."""
import argparse, time
import torch, torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from learncb.all import *
from procs import join_group, run_workers, write_figures

D, N_BLOCKS, BS = 256, 4, 32

class Block(nn.Module):
    "The unit FSDP shards"
    def __init__(self): super().__init__(); self.lin = nn.Linear(D, D)
    def forward(self, x): return torch.relu(self.lin(x))

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, D), *[Block() for _ in range(N_BLOCKS)], nn.Linear(D, 10))

def make_data(n_train, n_valid=512):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n_train + n_valid, 16, generator=g), torch.randint(0, 10, (n_train + n_valid,),
        generator=g)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])

def local_bytes(model, opt):
    "Bytes this rank holds of parameters, gradients and optimizer state (its shards under FSDP)"
    local = lambda t: t.to_local() if hasattr(t, 'to_local') else t
    ts = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
          *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))]
    return sum(local(t).numel() * t.element_size() for t in ts)

def raw_fsdp_loop(train_ds, valid_ds, n_epoch, sizes=None):
    """A careful hand-written FSDP2 loop: shard each block, then the root; train; validate; one all_reduce per
    epoch"""
    from torch.distributed.fsdp import fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    train = DataLoader(train_ds, batch_size=BS, sampler=DistributedSampler(train_ds, world, rank,
        shuffle=False))
    valid = DataLoader(valid_ds, batch_size=BS, sampler=DistributedSampler(valid_ds, world, rank,
        shuffle=False))
    model, loss_func = make_model(), nn.CrossEntropyLoss()
    for m in model:
        if isinstance(m, Block): fully_shard(m)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(n_epoch):
        model.train(); losses = []
        for xb, yb in train:
            loss = loss_func(model(xb), yb)
            loss.backward(); opt.step()
            # gradients and Adam's state
            if sizes is not None and not sizes: sizes['fsdp'] = local_bytes(model, opt)
            opt.zero_grad()
            losses.append(loss.detach())
        model.eval(); vlosses = []
        with torch.no_grad():
            for xb, yb in valid: vlosses.append(loss_func(model(xb), yb) * len(yb))
        sums = torch.stack([torch.stack(losses).sum(), torch.tensor(float(len(losses))),
                            torch.stack(vlosses).sum(), torch.tensor(float(len(valid.sampler)))]).double()
        dist.all_reduce(sums); sums.tolist()

def learncb_fsdp_loop(train_ds, valid_ds, n_epoch, learn=None):
    """learncb, default callbacks less the progress bar, under `distrib_ctx(strategy='fsdp', shard=Block)`; or
    `learn`'s fit (the compiled one, kept from fit to fit)"""
    if learn is None: learn = fsdp_learner(train_ds, valid_ds)
    with learn.no_logging(), learn.distrib_ctx(strategy='fsdp', shard=Block): learn.fit(n_epoch)

def fsdp_learner(train_ds, valid_ds, compiled=False):
    """The learner of `learncb_fsdp_loop`; `compiled`: `learn.compile(step=True)`, its blocks compiled in the
    step"""
    dls = DataLoaders(DataLoader(train_ds, batch_size=BS), DataLoader(valid_ds, batch_size=BS))
    learn = Learner(dls, make_model(), nn.CrossEntropyLoss(), device='cpu')
    learn.remove_cb(ProgressCallback)
    if compiled: learn.compile(step=True)
    return learn

def one_process_bytes():
    "What one process holds without sharding: parameters, gradients and Adam's state after a step"
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(BS, 16)).sum().backward()
    opt.step()
    return local_bytes(model, opt)

def worker(rank, world, port, n_batches, n_epoch, rounds, with_compiled, out):
    """One rank: the bytes it holds under FSDP, and the best time of each loop over `rounds` (the compiled
    step's too if `with_compiled`); rank 0 writes them to `out`"""
    join_group(rank, world, port)  # one group for the run: distrib_ctx joins it, rendezvous not counted
    try:
        train_ds, valid_ds = make_data(n_batches * BS * world)
        sizes = {}
        raw_fsdp_loop(train_ds, valid_ds, 1, sizes)            # warm-up, and what each rank holds
        learncb_fsdp_loop(train_ds, valid_ds, 1)
        fns,first = {'raw': lambda: raw_fsdp_loop(train_ds, valid_ds, n_epoch),
                     'learncb': lambda: learncb_fsdp_loop(train_ds, valid_ds, n_epoch)},None
        if with_compiled:
            compiled = fsdp_learner(train_ds, valid_ds, compiled=True)
            t = time.perf_counter()
            learncb_fsdp_loop(train_ds, valid_ds, 1, compiled)         # compiles
            first = time.perf_counter() - t
            fns['compiled'] = lambda: learncb_fsdp_loop(train_ds, valid_ds, n_epoch, compiled)
        best = dict.fromkeys(fns, float('inf'))
        for _ in range(rounds):
            for name, f in fns.items():
                dist.barrier(); t = time.perf_counter()
                f(); dist.barrier()
                best[name] = min(best[name], time.perf_counter() - t)
        n_steps = n_epoch * (n_batches + -(-len(valid_ds) // (BS * world)))
        per_rank = [None] * world
        dist.all_gather_object(per_rank, sizes['fsdp'])
        if rank == 0: write_figures({**{k: v / n_steps * 1e6 for k, v in best.items()}, 'bytes': per_rank,
                                     'first': first}, out)
    finally: dist.destroy_process_group()

def main(short=False):
    torch.set_num_threads(1)
    n_batches, n_epoch, rounds = (60, 1, 2) if short else (300, 2, 3)
    alone = one_process_bytes()
    res = run_workers(worker, (n_batches, n_epoch, rounds, not short), 2, timeout=120 if short else 600)
    if isinstance(res, str):
        print(f"FSDP, 2 processes (gloo)              : skipped: {res}")
        return
    per_rank = ', '.join(f'{b / 2**20:.2f} MiB ({b / alone:.2f}x)' for b in res['bytes'])
    print(f"FSDP bytes per rank (params+grads+Adam): 1 process {alone / 2**20:.2f} MiB; 2 processes: "
          f"{per_rank}")
    print(f"FSDP, 2 processes (gloo)              : learncb {res['learncb']:7.1f} us/step, hand-written "
          f"FSDP2 loop {res['raw']:7.1f} us/step, ratio {res['learncb'] / res['raw']:.3f} ({n_batches} "
          f"batches of {BS} per rank, {N_BLOCKS} blocks of {D}x{D}, {n_epoch} epoch(s), best of {rounds}, 1 "
          f"thread per process)")
    if short: return                  # the compiled step's line: in the full run (its compile is most of it)
    print(f"FSDP, learn.compile(step=True)        : {res['compiled']:7.1f} us/step (the blocks compiled "
          f"inside the eager step), eager learncb {res['learncb']:7.1f} us/step, "
          f"{res['learncb'] / res['compiled']:.2f}x; first fit (compiles) {res['first']:.1f} s")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('--short', action='store_true', help='small run for CI')
    main(p.parse_args().short)
