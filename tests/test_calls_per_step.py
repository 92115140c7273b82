"""The default fit's loop makes no more Python calls per batch than the same loop written by hand: cProfile's
count (builtins included, deterministic), per batch, the fixed cost of a fit (making the learner, its first
batch) taken out by counting two fits of different lengths. `tests/bench/loop_overhead.py` prints the figures
of whole fits."""
import cProfile, pstats, warnings
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

def data(n_batches, bs=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_batches * bs, 16, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    train = DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    return train, DataLoader(TensorDataset(x[:bs * 4], y[:bs * 4]), batch_size=bs)

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))

def by_hand(train, valid, rows):
    "The loop by hand; `rows`: those of the training set left out of its batches (a dataset that tells them)"
    if rows:
        x, y = train.dataset.tensors
        train = DataLoader(TensorDataset(x, y, torch.arange(len(x))), batch_size=train.batch_size,
                           shuffle=True, generator=torch.Generator().manual_seed(0))
        out = torch.tensor(sorted(rows))
    m, loss_func = model(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.train(); losses = []
    for b in train:
        xb, yb = b[:2]
        if rows:
            keep = ~torch.isin(b[2], out)
            xb, yb = xb[keep], yb[keep]
        loss = loss_func(m(xb), yb)
        loss.backward(); opt.step(); opt.zero_grad()
        losses.append(loss.detach())
    m.eval(); vlosses = []
    with torch.no_grad():
        for xb, yb in valid: vlosses.append(loss_func(m(xb), yb))
    torch.stack(losses).mean().item(); torch.stack(vlosses).mean().item()

def with_learncb(train, valid, rows):
    learn = Learner(DataLoaders(train, valid), model(), nn.CrossEntropyLoss(), opt_func=torch.optim.SGD,
                    lr=0.1, device='cpu')
    learn.remove_cb(ProgressCallback)
    with learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        if rows:
            learn.fit(0)
            learn.skipped_items = sorted(rows)
        learn.fit(1)

def calls(fn):
    prof = cProfile.Profile()
    prof.enable(); fn(); prof.disable()
    return pstats.Stats(prof).total_calls

def calls_per_batch(loop, rows):
    "Python calls of each training batch more: the fit of 60 training batches against the fit of 30"
    counts = {}
    for n in (30, 60):
        train, valid = data(n)
        loop(train, valid, rows and range(5, n * 32, 97))       # warm: first-call imports and caches
        counts[n] = calls(lambda: loop(train, valid, rows and range(5, n * 32, 97)))
    return (counts[60] - counts[30]) / 30

def test_calls_are_counted():
    assert calls(lambda: [len(()) for _ in range(10)]) >= 10

@pytest.mark.parametrize('rows', [False, True], ids=['all_rows', 'rows_left_out'])
def test_the_default_fit_makes_no_more_calls_per_batch_than_the_loop_by_hand(rows):
    mine, theirs = calls_per_batch(with_learncb, rows), calls_per_batch(by_hand, rows)
    assert theirs > 100 and mine <= theirs, f'learncb {mine:.1f} Python calls per batch, by hand {theirs:.1f}'
