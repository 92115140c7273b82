"""learncb's loop against a hand-written loop on a small CNN on the GPU: microseconds per step and their
ratio. `python tests/bench/gpu_cnn.py` (prints 'skipped' without CUDA); `--short` for a quick run."""
import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from loop_overhead import best_times

def make_data(n_batches, bs=128):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_batches * bs, 3, 32, 32, generator=g); y = torch.randint(0, 10, (n_batches * bs,),
        generator=g)
    train = DataLoader(TensorDataset(x, y), batch_size=bs, pin_memory=True)
    return train, DataLoader(TensorDataset(x[:bs * 8], y[:bs * 8]), batch_size=bs, pin_memory=True)

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).cuda()

def raw_loop(train, valid, n_epoch):
    model, loss_func = make_model(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(n_epoch):
        model.train()
        for xb, yb in train:
            xb, yb = xb.cuda(non_blocking=True), yb.cuda(non_blocking=True)
            loss = loss_func(model(xb), yb); loss.backward(); opt.step(); opt.zero_grad()
        model.eval()
        with torch.no_grad():
            tot = torch.zeros((), device='cuda')
            for xb, yb in valid:
                tot += loss_func(model(xb.cuda(non_blocking=True)), yb.cuda(non_blocking=True))
            tot.item()
    torch.cuda.synchronize()

def learncb_learner(train, valid, fused=False, compile=None):
    """learncb on the CNN: SGD with momentum (`fused=True` if asked), compiled as `learn.compile(**compile)`
    if given"""
    from learncb.all import Learner, DataLoaders, ProgressCallback
    learn = Learner(DataLoaders(train, valid), make_model(), nn.CrossEntropyLoss(), lr=0.01, device='cuda',
                    opt_func=lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, fused=fused or None))
    learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, ProgressCallback)])
    if compile is not None: learn.compile(**compile)
    return learn

def fit_of(learn, n_epoch):
    def fit():
        with learn.no_logging(): learn.fit(n_epoch)
        torch.cuda.synchronize()
    return fit

def learncb_loop(train, valid, n_epoch): fit_of(learncb_learner(train, valid), n_epoch)()

def main(short=False):
    if not torch.cuda.is_available(): return print('gpu cnn benchmark: skipped: no CUDA')
    n_batches, n_epoch, rounds = (50, 1, 2) if short else (200, 2, 3)
    train, valid = make_data(n_batches)
    n_steps = n_epoch * (len(train) + len(valid))
    best = best_times({'raw': lambda: raw_loop(train, valid, n_epoch),
                       # warms up cudnn first
                       'learncb': lambda: learncb_loop(train, valid, n_epoch)}, rounds)
    us = {k: v / n_steps * 1e6 for k, v in best.items()}
    print(f"small CNN on {torch.cuda.get_device_name()}, batches of 128 3x32x32, {n_batches} batches, "
          f"{n_epoch} epoch(s), best of {rounds}: raw loop {us['raw']:.1f} us/step, learncb "
          f"{us['learncb']:.1f} us/step, ratio {us['learncb'] / us['raw']:.3f}")
    # each warmed up (compiled) first
    fits = {'fused SGD': fit_of(learncb_learner(train, valid, fused=True), n_epoch),
            'learn.compile(step=True)': fit_of(learncb_learner(train, valid, compile={'step': True}),
                                               n_epoch),
            "learn.compile(step=True, mode='reduce-overhead')":
                fit_of(learncb_learner(train, valid, compile={'step': True, 'mode': 'reduce-overhead'}),
                       n_epoch)}
    for name, t in best_times(fits, rounds).items():
        print(f"learncb, {name}: {t / n_steps * 1e6:.1f} us/step, {us['raw'] / (t / n_steps * 1e6):.2f}x "
              f"faster than the raw loop")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('--short', action='store_true', help='small run')
    main(p.parse_args().short)
