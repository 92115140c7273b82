"""`learn.summary()`: rows and totals, and that it changes nothing: model, optimizer, random generators, data
order"""
import random
from functools import partial
import numpy as np
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
from learncb.sampler import ResumableSampler, resumable_dataloader
from learncb.test_utils import synth_dls, synth_learner

class Tied(nn.Module):
    """A model with a tied weight, a learned scale of its own, a frozen layer, BatchNorm and a layer it never
    calls"""
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(2, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU())
        self.dec = nn.Linear(4, 4)
        self.dec.weight = self.body[0].weight                     # tied
        self.out,self.scale,self.unused = nn.Linear(4, 2),nn.Parameter(torch.ones(2)),nn.Dropout()
        self.emb.requires_grad_(False)
    def forward(self, x): return self.out(self.dec(self.body(self.emb(x)))) * self.scale

def _clone_state(model): return {k: v.clone() for k,v in model.state_dict().items()}

def _same_state(model, state):
    now = model.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[k], v) for k,v in state.items())

def _rngs(): return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()

def _same_rngs(a, b): return torch.equal(a[0], b[0]) and a[1] == b[1] and (a[2] == b[2]).all()

def test_totals_count_tied_parameters_once():
    learn = synth_learner(model=Tied())
    s = learn.summary()
    params = list(learn.model.parameters())
    assert s.total_params == sum(p.numel() for p in params) == 56
    assert s.trainable_params == sum(p.numel() for p in params if p.requires_grad) == 44
    assert s.non_trainable_params == 12
    rows = {r.name: r for r in s.rows}
    assert list(rows) == ['(model)', 'emb', 'body.0', 'body.1', 'body.2', 'dec', 'out', 'unused']
    assert rows['dec'].shared and rows['dec'].n_params == 20 and not rows['body.0'].shared
    assert sum(r.n_params for r in s.rows if not r.shared) + 4 == s.total_params      # dec's own bias: 4
    assert (rows['emb'].trainable, rows['body.0'].trainable, rows['body.2'].trainable) == (False, True, None)
    assert rows['unused'].shape == 'not called' and rows['(model)'].n_params == 2
    assert '20*' in s and 'counted once' in s

def test_partly_trainable_layer():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)
    s = synth_learner(model=model).summary()
    assert [r.trainable for r in s.rows] == [True, 'partly']
    assert (s.trainable_params, s.non_trainable_params) == (15, 2)

def test_shapes_of_a_known_model():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 2))
    dls = DataLoaders(DataLoader(TensorDataset(torch.randn(20, 1, 8, 8), torch.randint(0, 2, (20,))),
                                 batch_size=8))
    s = synth_learner(dls=dls, model=model).summary()
    assert [r.shape for r in s.rows] == ['8 x 4 x 6 x 6'] * 3 + ['8 x 4 x 1 x 1', '8 x 4', '8 x 2']
    assert [r.n_params for r in s.rows] == [40, 8, 0, 0, 0, 10]
    assert s.startswith('Sequential (input shape: 8 x 1 x 8 x 8)')

class TwoInputs(nn.Module):
    "Returns a dict and a tuple inside it; takes two inputs"
    def __init__(self):
        super().__init__(); self.lin,self.lstm = nn.Linear(2, 3),nn.LSTM(3, 5, batch_first=True)
    def forward(self, a, b):
        out,(h,c) = self.lstm(self.lin(a + b)[:, None])
        return {'out': out[:, 0], 'state': (h, c)}

def test_several_inputs_and_outputs():
    x = torch.randn(32, 2)
    dls = DataLoaders(DataLoader(TensorDataset(x, x, (x.sum(1) > 0).long()), batch_size=16))
    learn = synth_learner(dls=dls, model=TwoInputs(), n_inp=2)
    s = learn.summary()
    assert [r.shape for r in s.rows] == ['16 x 3', '16 x 1 x 5, (1 x 16 x 5, 1 x 16 x 5)']
    assert s.startswith('TwoInputs (input shape: 16 x 2, 16 x 2)')

def test_nothing_changes():
    learn = synth_learner(model=Tied(), dls=synth_dls(shuffle=True))
    learn.model.train(); learn.model.unused.eval()  # mixed modes come back as they were; BatchNorm trains
    state,modes = _clone_state(learn.model),[m.training for m in learn.model.modules()]
    attrs = {k: getattr(learn, k) for k in ('xb', 'yb', 'pred', 'batch', 'loss', 'dl', 'iter', 'training',
                                            'opt')}
    rngs,gen = _rngs(),learn.dls.train.generator.get_state()
    learn.summary()
    assert _same_state(learn.model, state)                           # BatchNorm running stats and counter too
    assert [m.training for m in learn.model.modules()] == modes
    assert all(getattr(learn, k) is v for k,v in attrs.items()) and learn.opt is None
    assert _same_rngs(rngs, _rngs()) and torch.equal(gen, learn.dls.train.generator.get_state())
    assert all(not m._forward_hooks for m in learn.model.modules())

def test_optimizer_untouched_after_fit():
    learn = synth_learner(model=nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2)),
                          opt_func=torch.optim.Adam)
    learn.fit(1)
    opt,state = learn.opt,learn.opt.state_dict()
    steps = [s['step'].clone() for s in state['state'].values()]
    s = learn.summary()
    assert learn.opt is opt
    after = learn.opt.state_dict()
    assert after['param_groups'] == state['param_groups']
    assert all(torch.equal(a, b) for k in state['state'] for a,b in zip(state['state'][k].values(),
                                                                        after['state'][k].values()))
    assert [s['step'] for s in after['state'].values()] == steps
    assert 'Optimizer: Adam, 1 param group\n  group 0: lr 0.1, wd 0 (22 params)' in s

def test_text_names_optimizer_loss_and_callbacks():
    class Late(Callback): order = 50
    class Early(Callback): order = -50
    learn = synth_learner(cbs=[Late(), Early()], opt_func=partial(torch.optim.SGD, momentum=0.9), wd=0.01)
    s = learn.summary()
    assert isinstance(s, str) and repr(s) == str(s)
    assert "Optimizer: none yet: made at the first fit by partial(SGD, momentum=0.9) (lr 0.1, wd 0.01)" in s
    assert 'Loss function: CrossEntropyLoss()' in s
    assert s.endswith('Callbacks:\n  - Early\n  - TrainEvalCallback\n  - Recorder\n  - Late')
    learn.opt = torch.optim.SGD([{'params': learn.model.weight}, {'params': learn.model.bias, 'lr': 0.5}],
                                lr=0.1)
    groups = 'SGD, 2 param groups\n  group 0: lr 0.1, wd 0 (4 params)\n  group 1: lr 0.5, wd 0 (2 params)'
    assert groups in learn.summary()
    learn.loss_func = nn.functional.cross_entropy
    assert 'Loss function: cross_entropy' in learn.summary()

def _order(dl): return [b[1].tolist() for b in dl]

_ds = TensorDataset(torch.randn(64, 2), torch.arange(64))
_loaders = {
    'global rng': lambda: DataLoader(_ds, batch_size=16, shuffle=True),
    'own generator': lambda: DataLoader(_ds, batch_size=16, shuffle=True,
                                        generator=torch.Generator().manual_seed(3)),
    'workers': lambda: DataLoader(_ds, batch_size=16, shuffle=True, num_workers=2),
    'persistent workers': lambda: DataLoader(_ds, batch_size=16, shuffle=True, num_workers=2,
                                             persistent_workers=True,
                                             generator=torch.Generator().manual_seed(3)),
    'resumable sampler': lambda: resumable_dataloader(DataLoader(_ds, batch_size=16, shuffle=True))}

def _orders_after(make, summary):
    dl = make()
    learn = synth_learner(dls=(dl, None))  # seeds torch's generator: before `manual_seed` below
    if isinstance(dl.sampler, ResumableSampler): dl.sampler.start = 16  # resuming part-way through an epoch
    torch.manual_seed(5)
    if summary: learn.summary()
    return _order(dl), _order(dl)

@pytest.mark.parametrize('kind', _loaders)
def test_data_order_unchanged(kind):
    "The next two epochs see the batches they would have seen without the summary"
    assert _orders_after(_loaders[kind], True) == _orders_after(_loaders[kind], False)

@pytest.mark.parametrize('part_way', [False, True])
def test_stateful_dataloader_unchanged(part_way):
    sdl = pytest.importorskip('torchdata.stateful_dataloader')
    def make():
        torch.manual_seed(5)
        dl = sdl.StatefulDataLoader(_ds, batch_size=16, shuffle=True,
                                    generator=torch.Generator().manual_seed(1))
        if part_way:
            src = sdl.StatefulDataLoader(_ds, batch_size=16, shuffle=True,
                                         generator=torch.Generator().manual_seed(1))
            it = iter(src); next(it)
            dl.load_state_dict(src.state_dict())
        return dl
    dl = make()
    synth_learner(dls=(dl, None)).summary()
    ref = make()
    assert (_order(dl), _order(dl)) == (_order(ref), _order(ref))

def test_same_fit_with_or_without_summary():
    """A summary before the fit and one inside it (from a callback) leave the trained weights bit for bit the
    same"""
    def train(summary):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.5), nn.Linear(8, 2))
        learn = synth_learner(model=model, dls=synth_dls(shuffle=True), seed=1)
        if summary:
            learn.summary()
            learn.add_cb(Callback(after_epoch=lambda cb: cb.learn.summary()))
        learn.fit(2)
        return learn.model.state_dict(), learn.recorder.values
    (w1,v1),(w2,v2) = train(False),train(True)
    assert all(torch.equal(w1[k], w2[k]) for k in w1) and v1 == v2

def test_errors():
    with pytest.raises(ValueError, match='there is none: pass one in DataLoaders'):
        synth_learner(dls=(None, None)).summary()
    with pytest.raises(ValueError, match='yielded no batches'):
        synth_learner(dls=(DataLoader(TensorDataset(torch.zeros(0, 2))), None)).summary()
    learn = synth_learner(model=nn.Sequential(nn.Linear(3, 2)))
    with pytest.raises(RuntimeError) as e: learn.summary()
    assert any('learn.summary() ran the model once' in n for n in e.value.__notes__)
    assert learn.model.training and not learn.model[0]._forward_hooks

@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cuda():
    learn = synth_learner(model=nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)),
                          dls=synth_dls(shuffle=True))
    learn.model.cuda()
    state,rngs,cuda_rng = _clone_state(learn.model),_rngs(),torch.cuda.get_rng_state()
    s = learn.summary()
    assert [r.shape for r in s.rows] == ['16 x 4', '16 x 4', '16 x 2']
    assert _same_state(learn.model, state) and _same_rngs(rngs, _rngs())
    assert torch.equal(cuda_rng, torch.cuda.get_rng_state())
