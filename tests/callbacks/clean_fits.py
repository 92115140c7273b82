"""Clean fits a user would leave `SpikeGuard` on in, for tests/callbacks/test_guard_alarms.py: the digits demo, a small
regression, a small language model; fresh and second fits; constant and one-cycle schedules; seeded."""
import contextlib, io
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
from learncb.demo import digits_dls, digits_model

def digits(seed):
    torch.manual_seed(seed)
    return Learner(digits_dls(seed=42 + seed), digits_model(), nn.CrossEntropyLoss(), lr=3e-3, device='cpu')

def regression(seed, n=512, bs=16):
    "Four features, a noisy linear target; dropout in the model, shuffled batches of 16"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.], [-2.], [.5], [3.]]) + .3 * torch.randn(n, 1, generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x[:448], y[:448]), batch_size=bs, shuffle=True, generator=g),
                      DataLoader(TensorDataset(x[448:], y[448:]), batch_size=bs))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    return Learner(dls, model, nn.MSELoss(), lr=1e-2, device='cpu')

class TinyLM(nn.Module):
    def __init__(self, vocab=24, dim=32):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(vocab, dim), nn.GRU(dim, dim, batch_first=True), nn.Linear(dim, vocab)
    def forward(self, x): return self.head(self.rnn(self.emb(x))[0])

def lm_loss(pred, y): return nn.functional.cross_entropy(pred.flatten(0, 1), y.flatten())

def language_model(seed, vocab=24, n=384, seq=32, bs=16):
    "Next-token prediction on sequences of a random Markov chain over `vocab` tokens"
    g = torch.Generator().manual_seed(seed)
    trans = torch.softmax(3 * torch.randn(vocab, vocab, generator=g), 1)
    toks = torch.zeros(n, seq + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(vocab, (n,), generator=g)
    for t in range(seq): toks[:, t + 1] = torch.multinomial(trans[toks[:, t]], 1, generator=g).squeeze(1)
    x, y = toks[:, :-1], toks[:, 1:]
    dls = DataLoaders(DataLoader(TensorDataset(x[:320], y[:320]), batch_size=bs, shuffle=True, generator=g),
                      DataLoader(TensorDataset(x[320:], y[320:]), batch_size=bs))
    torch.manual_seed(seed)
    return Learner(dls, TinyLM(vocab), lm_loss, lr=1e-2, device='cpu')

tasks = {'digits': digits, 'regression': regression, 'language model': language_model}

def clean_fit(task, seed, schedule='constant', second=False, epochs=3, cbs=()):
    "A learner of `task` fitted `epochs` epochs (after a first, unguarded fit if `second`) with `cbs`, quietly"
    learn = tasks[task](seed)
    learn.remove_cb(ProgressCallback)
    fit = learn.fit_one_cycle if schedule == 'one-cycle' else learn.fit
    with contextlib.redirect_stdout(io.StringIO()) as out:
        if second: fit(epochs)
        fit(epochs, cbs=list(cbs))
    learn.printed = out.getvalue()
    return learn

combinations = [(task, seed, schedule, second) for task in tasks for seed in (0, 1)
                for schedule in ('constant', 'one-cycle') for second in (False, True)]
