"What fastai's own tests and habits expect of a Learner: one test per compatibility point"
from functools import partial
import pytest, torch
from torch import nn
from learncb.all import *
from conftest import synth_learner, synth_dls, SyncCounter

class ReadsSmoothLoss(Callback):
    order = 60
    def before_fit(self): self.seen = []
    def after_batch(self):
        if self.training: self.seen.append(self.smooth_loss)

def test_smooth_loss_is_a_device_tensor_read_without_a_sync():
    learn = synth_learner(dls=synth_dls(n_train=16 * 30), opt_func=torch.optim.SGD)
    learn.fit(1)  # warm up, then count the syncs of a fit with and without reading
    with SyncCounter() as plain: learn.fit(1)
    learn.add_cb(ReadsSmoothLoss())
    with SyncCounter() as reading: learn.fit(1)
    assert plain.counts == reading.counts
    seen = learn.reads_smooth_loss.seen
    assert len(seen) == 30 and all(isinstance(t, torch.Tensor) and t.ndim == 0 for t in seen)
    assert torch.allclose(torch.stack(seen).double(), torch.tensor(learn.recorder.losses,
                                                                   dtype=torch.float64), atol=1e-6)

def test_smooth_loss_follows_fastai_debiased_average():
    learn = synth_learner(cbs=ReadsSmoothLoss())
    losses = []
    learn.add_cb(Callback(after_loss=lambda self: losses.append(self.loss.item()) if self.training else None))
    learn.fit(1)
    avg,expected = 0.,[]
    for i,l in enumerate(losses, 1):
        avg = 0.98 * avg + 0.02 * l
        expected.append(avg / (1 - 0.98 ** i))
    assert torch.allclose(torch.stack(learn.reads_smooth_loss.seen).double(), torch.tensor(expected,
        dtype=torch.float64), atol=1e-6)

def test_one_batch_outside_a_fit():
    learn = synth_learner(opt_func=torch.optim.SGD)
    b = next(iter(learn.dls.train))
    learn.one_batch(0, b)  # as fastai's tests do: no fit, not training: forward and loss
    assert learn.pred.shape == (16, 2) and learn.loss.ndim == 0 and learn.opt is None
    before = learn.model.weight.detach().clone()
    learn.training = True
    learn.model.train()
    learn.one_batch(0, b)                              # training: makes the optimizer and steps
    assert learn.opt is not None and not torch.equal(before, learn.model.weight)
    learn.training = False
    learn.fit(1)                                       # and fits as usual afterwards
    assert learn.train_iter == 4

def test_opt_func_partial_lr_is_the_default_lr():
    learn = Learner(synth_dls(), nn.Linear(2, 2), nn.CrossEntropyLoss(), opt_func=partial(torch.optim.Adam,
        lr=1e-2))
    assert learn.lr == 1e-2
    learn.create_opt()
    assert learn.opt.param_groups[0]['lr'] == 1e-2
    with pytest.warns(UserWarning, match="the opt_func's is used, as in fastai"):
        explicit = Learner(synth_dls(), nn.Linear(2, 2), nn.CrossEntropyLoss(),
                           opt_func=partial(torch.optim.Adam, lr=1e-2), lr=3e-3)
    assert explicit.lr == 1e-2  # the partial's lr, as fastai's create_opt, with a warning
    assert Learner(synth_dls(), nn.Linear(2, 2), nn.CrossEntropyLoss(), opt_func=partial(torch.optim.Adam,
        lr=1e-2),
                   lr=1e-2).lr == 1e-2                 # the same lr in both places: nothing to warn of
    assert Learner(synth_dls(), nn.Linear(2, 2), nn.CrossEntropyLoss()).lr == 1e-3

def test_callback_call_override_is_called():
    class Verbose(Callback):
        def __init__(self): self.seen = []
        def __call__(self, event_name):
            self.seen.append(event_name)
            super().__call__(event_name)
        def after_batch(self): self.batches = getattr(self, 'batches', 0) + 1
    cb = Verbose()
    learn = synth_learner(cbs=cb)
    learn.fit(1)
    assert cb.seen[:5] == ['after_create', 'before_fit', 'before_epoch', 'before_train', 'before_fetch']
    assert cb.seen[-1] == 'after_fit' and cb.seen.count('after_batch') == 6 and cb.batches == 6
    assert not any(e.startswith('_') for e in cb.seen)         # learncb's private events are not passed on

def test_callbacks_without_override_keep_the_table():
    "A plain callback's handlers are its bound methods in the dispatch table (no wrapper per call)"
    learn = synth_learner()
    handlers = learn._tables[True]['after_batch']
    assert handlers == tuple(getattr(cb, 'after_batch') for cb in learn.ordered_cbs('after_batch'))

class CorrectCount:
    "fastai's Metric protocol: reset, accumulate(learn), value, name"
    name = 'n_correct'
    def reset(self): self.total = 0
    def accumulate(self, learn): self.total += (learn.pred.argmax(1) == learn.yb[0]).sum()
    @property
    def value(self): return self.total

def test_fastai_metric_protocol_next_to_functions():
    learn = synth_learner(metrics=[accuracy, CorrectCount()])
    learn.fit(1)
    x,y = learn.dls.valid.dataset.tensors
    with torch.no_grad(): pred = learn.model(x)
    assert learn.recorder.metric_names[1:-1] == ['train_loss', 'valid_loss', 'accuracy', 'n_correct']
    assert learn.recorder.values[-1][3] == (pred.argmax(1) == y).sum().item()
    assert learn.validate()[2] == learn.recorder.values[-1][3]

def test_torchmetrics_style_and_fastai_style_together():
    class Positives:                   # torchmetrics' protocol
        def reset(self): self.n = 0
        def update(self, pred, targ): self.n += (pred.argmax(1) == 1).sum()
        def compute(self): return self.n
    learn = synth_learner(metrics=[Positives(), CorrectCount()])
    learn.fit(1)
    x,y = learn.dls.valid.dataset.tensors
    with torch.no_grad(): pred = learn.model(x)
    assert learn.recorder.values[-1][2:] == [(pred.argmax(1) == 1).sum().item(),
                                             (pred.argmax(1) == y).sum().item()]

def test_recorder_train_metrics_columns():
    dls = synth_dls(n_train=64, n_valid=32)
    learn = synth_learner(dls=dls, metrics=[accuracy, CorrectCount()], cbs=Recorder(train_metrics=True))
    assert sum(isinstance(cb, Recorder) for cb in learn.cbs) == 1  # it took the place of the default one
    def frozen_lr(self): self.opt.param_groups[0]['lr'] = 0.  # weights fixed: the training metrics are exact
    learn.fit(1, cbs=Callback(before_fit=frozen_lr))
    rec = learn.recorder
    assert rec.value_names == ['train_loss', 'train_accuracy', 'train_n_correct', 'valid_loss',
                               'valid_accuracy', 'valid_n_correct']
    x,y = dls.train.dataset.tensors
    with torch.no_grad(): pred = learn.model(x)
    row = rec.values[-1]
    assert abs(row[0] - nn.functional.cross_entropy(pred, y).item()) < 1e-5
    assert abs(row[1] - accuracy(pred, y).item()) < 1e-6
    assert row[2] == (pred.argmax(1) == y).sum().item()

def test_train_metrics_survive_a_monitor_by_fastai_name(tmp_path):
    learn = synth_learner(metrics=accuracy, path=tmp_path,
                          cbs=[Recorder(train_metrics=True), SaveModelCallback(monitor='valid_accuracy',
        fname='best')])
    learn.fit(2)
    accs = [row[learn.recorder.value_names.index('valid_accuracy')] for row in learn.recorder.values]
    assert learn.save_model.saved is not None and learn.save_model.best == max(accs)
