from collections import Counter
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

def synth_dls(n_train=64, n_valid=32, bs=16, seed=0, shuffle=False):
    "A tiny separable problem: 2 features, label 1 when their sum is positive"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_valid, 2, generator=g); y = (x.sum(1) > 0).long()
    train = DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size=bs, shuffle=shuffle,
                       generator=torch.Generator().manual_seed(seed))
    valid = DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=bs) if n_valid else None
    return DataLoaders(train, valid)

def synth_learner(cbs=None, progress=False, seed=0, dls=None, **kw):
    "A learner on `synth_dls` with the default callbacks, the progress bar off unless asked for"
    torch.manual_seed(seed)
    kw.setdefault('lr', 0.1)
    learn = Learner(dls or synth_dls(), nn.Linear(2, 2), nn.CrossEntropyLoss(), cbs=cbs, device='cpu', **kw)
    if not progress: learn.remove_cb(ProgressCallback)
    learn.logger = lambda row: None
    return learn

class EventLog(Callback):
    "Writes down every event it sees, with the phase of batch events; order -100 runs it before other callbacks"
    order = -100
    def __init__(self): self.log = []
for _e in event:
    setattr(EventLog, _e, (lambda e: lambda self: self.log.append(e))(_e))

@pytest.fixture
def learner(): return synth_learner()

SYNCS = ('item', 'tolist', 'cpu', '__float__', '__bool__')

class SyncCounter:
    "Counts calls of the Tensor methods that copy data to the host (and so wait for the device)"
    def __init__(self): self.counts = Counter()
    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in SYNCS}
        for name, orig in self.saved.items():
            def counting(*args, _name=name, _orig=orig, **kw):
                self.counts[_name] += 1
                return _orig(*args, **kw)
            setattr(torch.Tensor, name, counting)
        return self
    def __exit__(self, *exc):
        for name, orig in self.saved.items(): setattr(torch.Tensor, name, orig)
