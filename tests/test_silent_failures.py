"""The last silent failures, and three points where fastai's own tests expect otherwise.

Each mistake is refused with an error that names the bad value and the fix, before work is wasted (no batch,
or only the first one, has run), and leaves the learner usable: nothing the user had is lost."""
import builtins, errno, os, sys, warnings
import numpy as np
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
from learncb.test_utils import synth_dl, synth_dls, synth_learner

def counting(learn):
    "Count the batches `learn` runs from now on (training and validation)"
    seen = []
    learn.add_cb(Callback(before_batch=lambda self: seen.append((self.training, self.iter))))
    return seen

# ---------------------------------------------------------------- section 2

def test_fit_0_keeps_the_last_fits_history():
    learn = synth_learner()
    learn.fit(2)
    values, losses, lrs = [list(v) for v in (learn.recorder.values, learn.recorder.losses,
                                             learn.recorder.lrs)]
    w = learn.model.weight.clone()
    learn.fit(0)
    assert learn.recorder.values == values and len(values) == 2
    assert learn.recorder.losses == losses and learn.recorder.lrs == lrs
    assert torch.equal(learn.model.weight, w)
    learn.fit(1)                                              # the next real fit starts a history of its own
    assert len(learn.recorder.values) == 1

def test_no_loss_func_and_a_model_that_cannot_compute_one_is_refused_before_any_batch():
    learn = synth_learner()
    learn.loss_func = None
    seen = counting(learn)
    with pytest.raises(ValueError, match=r"no loss_func, and Linear.forward takes no 'labels' argument.*"
                                         r"loss_func=nn.CrossEntropyLoss\(\)"):
        learn.fit(1)
    assert seen == []
    learn.loss_func = nn.CrossEntropyLoss()
    learn.fit(1)                                              # the learner is usable
    assert len(seen) > 0

def test_a_model_that_takes_labels_may_have_no_loss_func():
    class OwnLoss(nn.Module):
        def __init__(self): super().__init__(); self.lin = nn.Linear(2, 2)
        def forward(self, x, labels=None):
            logits = self.lin(x)
            return {'logits': logits, 'loss': nn.functional.cross_entropy(logits, labels)}
    x, y = torch.randn(32, 2), torch.randint(0, 2, (32,))
    dl = DataLoader([{'x': a, 'labels': b} for a, b in zip(x, y)], batch_size=8)
    learn = Learner(DataLoaders(dl, dl), OwnLoss())
    with learn.no_logging(): learn.fit(1)
    assert learn.recorder.values[0][0] > 0

@pytest.mark.parametrize('make', [lambda dl: (b for b in dl), lambda dl: iter(dl), lambda dl: map(lambda b: b,
    dl)],
                         ids=['generator', 'iterator', 'map'])
def test_a_one_shot_iterator_is_refused_up_front(make):
    with pytest.raises(TypeError, match=r"the training dataloader is a \w+: it is an iterator, which can be "
                                        r"read only "
                                        r"once.*torch DataLoader"):
        Learner(DataLoaders(make(synth_dl()), None), nn.Linear(2, 2), nn.CrossEntropyLoss())
    learn = synth_learner()
    seen = counting(learn)
    learn.dls.train = make(synth_dl())                        # replaced after the learner was made
    with pytest.raises(TypeError, match='can be read only once'): learn.fit(2)
    assert seen == []

def test_tensors_where_dataloaders_belong_are_refused_at_construction():
    x, y = torch.randn(64, 2), torch.randint(0, 2, (64,))
    with pytest.raises(TypeError, match=r"training dataloader is a tensor of shape \(64, 2\).*"
                                        r"DataLoader\(TensorDataset\(x, y\), batch_size=64, shuffle=True\)"):
        DataLoaders(x, y)
    with pytest.raises(TypeError, match=r"validation dataloader is a tensor of shape \(64,\)"):
        DataLoaders(synth_dl(), y)
    with pytest.raises(TypeError, match=r"the dataset TensorDataset: a dataset gives single items"):
        Learner((TensorDataset(x, y), None), nn.Linear(2, 2), nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match=r"a numpy ndarray"): DataLoaders(x.numpy())

def test_a_model_on_the_meta_device_is_refused_when_the_fit_starts():
    with torch.device('meta'): model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
    learn = synth_learner(model=model)                        # made: a model may get its storage later
    seen = counting(learn)
    with pytest.raises(ValueError, match=r"\['0.weight', '0.bias', '2.weight', '2.bias'\] are on the meta "
                                         r"device.*"
                                         r"model.to_empty\(device='cpu'\).*load_state_dict"):
        learn.fit(1)
    assert seen == []
    model.to_empty(device='cpu')
    for m in (model[0], model[2]): m.reset_parameters()
    learn.fit(1)
    assert len(seen) > 0 and all(np.isfinite(v) for v in learn.recorder.values[-1])

class Boom:
    "A metric function that fails (a typo in its code)"
    __name__ = 'boom'
    def __call__(self, pred, targ): return pred.argmax(-1).eq(targ).flaot().mean()

def test_a_failing_metric_is_found_on_the_first_training_batch():
    learn = synth_learner(metrics=[accuracy, Boom()])
    seen = counting(learn)
    with pytest.raises(AttributeError, match='flaot') as e:
        learn.fit(3)
    assert seen == [(True, 0)]                                # one batch, not an epoch
    notes = '\n'.join(e.value.__notes__)
    assert "metric 'boom' failed on batch 0" in notes and 'tried on the first training batch' in notes
    learn.metrics = [accuracy]
    learn.fit(1)                                              # nothing lost: the learner fits again
    assert len(learn.recorder.values) == 1

def test_a_metric_returning_nothing_is_found_on_the_first_training_batch():
    learn = synth_learner(metrics=lambda pred, targ: None)
    seen = counting(learn)
    with pytest.raises(TypeError, match="returned None on the first training batch.*end with a return"):
        learn.fit(2)
    assert seen == [(True, 0)]

def fit_metrics(metrics, check):
    """Host syncs and last row of a one-epoch fit with `metrics`, with the first-batch check of metrics or
    without it"""
    from conftest import SyncCounter
    learn = synth_learner(metrics=metrics)
    skip = Callback(before_fit=lambda self: setattr(self.learn.recorder, '_metrics_unchecked', False),
                    order=51)
    with SyncCounter() as syncs: learn.fit(1, cbs=[] if check else [skip])
    return syncs.counts, learn.recorder.values[-1]

def test_checking_metrics_on_the_first_batch_adds_no_host_sync():
    (checked, values), (unchecked, reference) = fit_metrics([accuracy], True), fit_metrics([accuracy], False)
    assert checked == unchecked and values == reference

def test_checking_metrics_on_the_first_batch_leaves_metric_objects_alone():
    torchmetrics = pytest.importorskip('torchmetrics')
    make = lambda: [torchmetrics.classification.MulticlassAccuracy(num_classes=2, average='micro')]
    (_, values), (_, reference) = fit_metrics(make(), True), fit_metrics(make(), False)
    assert values == reference           # the object itself saw the validation batches only

def test_removing_the_recorder_during_a_batch_says_who_when_and_what_to_do():
    learn = synth_learner()
    def drop(self):
        if self.iter == 1: self.learn.remove_cb(self.learn.recorder)
    dropper = Callback(after_batch=drop)
    with pytest.raises(RuntimeError, match=r"Recorder cannot be removed during a fit: .*removed it in "
                                           r"'after_batch' "
                                           r"\(epoch 0, iter 1\).*before the fit or after it.*removed_cbs"):
        learn.fit(1, cbs=dropper)
    assert isinstance(learn.recorder, Recorder) and learn.recorder.learn is learn
    learn.fit(1)
    learn.remove_cb(learn.recorder)                           # outside a fit it may go
    assert not any(isinstance(cb, Recorder) for cb in learn.cbs)

def test_a_callback_removed_during_an_event_finishes_that_event():
    calls = []
    class Second(Callback):
        order = 10
        # reads the learner: would fail with learn None
        def after_batch(self): calls.append(self.learn.train_iter)
    second = Second()
    def remove_second(self):
        if self.learn.train_iter == 2: self.learn.remove_cb(second)
    learn = synth_learner(cbs=[Callback(after_batch=remove_second, order=5), second])
    learn.fit(1)
    assert calls == [1, 2]                        # it ran in the after_batch that removed it, and never after
    assert second.learn is None and second not in learn.cbs

def test_load_of_a_directory_or_an_unreadable_file_says_so(tmp_path, monkeypatch):
    learn = synth_learner(path=tmp_path)
    learn.fit(1)
    path = learn.save('model')
    folder = tmp_path/'models'/'folder.pth'
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match=r"folder.pth is a directory, not a file"): learn.load(folder)
    with pytest.raises(IsADirectoryError, match=r"models is a directory, not a file: pass the path of a file "
                                                r"in it "
                                                r"\(model.pth\)"):
        learn.load(tmp_path/'models')
    real_open = builtins.open
    def denied(file, *args, **kwargs):
        if str(file) == str(path): raise PermissionError(errno.EACCES, 'Permission denied', str(file))
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(builtins, 'open', denied)
    with pytest.raises(PermissionError, match=r"permission denied: cannot read .*model.pth.*chmod u\+r") as e:
        learn.load('model')
    assert 'corrupt' not in str(e.value)
    monkeypatch.undo()
    if os.geteuid() != 0:  # root reads anything: the real case needs another user
        path.chmod(0)
        with pytest.raises(PermissionError, match='permission denied'): learn.load('model')
        path.chmod(0o644)
    (tmp_path/'models'/'bad.pth').write_bytes(b'not torch')
    with pytest.raises(CorruptFileError, match='truncated, corrupt or not a torch file'): learn.load('bad')
    learn.load('model')

@pytest.mark.parametrize('name, meant', [('batch_end', 'after_batch'), ('on_epoch_end', 'after_epoch'),
                                         ('train_begin', 'before_fit'), ('aftr_batch', 'after_batch')])
def test_learn_on_refuses_what_is_not_an_event(name, meant):
    learn = synth_learner()
    with pytest.raises(ValueError, match=rf"learn.on: '{name}' is not an event; did you mean '{meant}'"):
        learn.on(name)(lambda learn: None)
    assert not any(isinstance(cb, EventFilter) for cb in learn.cbs)

def test_learn_on_refuses_a_custom_name_saying_how_to_handle_one():
    with pytest.raises(ValueError, match=r"'verify_batch' is not an event.*pass one of `event`.*give a "
                                         r"Callback a "
                                         r"method of that name"):
        synth_learner().on('verify_batch')(print)

@pytest.mark.parametrize('cls, submodule', [('TensorBoardCallback', 'torch.utils.tensorboard.summary'),
                                            ('MLflowCallback', 'mlflow.tracking'),
                                            ('MLflowCallback', 'mlflow.entities')])
def test_a_missing_tracker_submodule_ends_in_an_install_hint(tmp_path, monkeypatch, cls, submodule):
    package = submodule.split('.')[0] if cls != 'TensorBoardCallback' else 'tensorboard'
    pytest.importorskip(package)
    # the package is imported, only this part is missing
    __import__(submodule.rpartition('.')[0] or submodule)
    monkeypatch.setitem(sys.modules, submodule, None)
    monkeypatch.chdir(tmp_path)
    learn = synth_learner(path=tmp_path)
    extra = {'TensorBoardCallback': 'tensorboard', 'MLflowCallback': 'mlflow'}[cls]
    with pytest.raises(ImportError, match=rf'{cls} needs the {package} package.*pip install '
                                          rf'"learncb\[{extra}\]"'):
        learn.fit(1, cbs=globals()[cls]())
    monkeypatch.undo()
    learn.fit(1)

# ---------------------------------------------------------------- section 3: fastai's expectations

def test_lr_0_evaluates_without_updating():
    learn = synth_learner(opt_func=torch.optim.SGD)
    w = learn.model.weight.clone()
    learn.fit(1, lr=0)
    assert torch.equal(learn.model.weight, w) and learn.recorder.values[0][0] > 0
    assert synth_learner(lr=0).lr == 0
    for bad in (-1e-3, float('nan'), float('inf')):
        with pytest.raises(ValueError, match=rf"fit: lr must be a number >= 0 \(not inf or nan\).*not {bad}"):
            learn.fit(1, lr=bad)

@pytest.mark.parametrize('value', [np.float32(0.25), np.float64(0.25), np.array(0.25), np.array(0.25,
    np.float32)],
                         ids=['float32', 'float64', '0-d array', '0-d float32 array'])
def test_a_metric_may_return_a_numpy_number(value):
    learn = synth_learner(metrics=lambda pred, targ: value)
    learn.fit(1)
    assert learn.recorder.values[0][2] == pytest.approx(0.25)

def test_a_metric_returning_a_numpy_vector_is_refused_naming_it():
    learn = synth_learner(metrics=lambda pred, targ: np.array([0.25, 0.5]))
    with pytest.raises(TypeError, match=r"returned array\(\[0.25, 0.5 \]\) on the first training batch"):
        learn.fit(1)

class BodyHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 2)
    def forward(self, x): return self.head(self.body(x))

def split(m): return [list(m.body.parameters()), list(m.head.parameters())]

@pytest.mark.parametrize('train_bn', [True, False])
def test_learner_train_bn_is_the_default_of_freeze(train_bn):
    learn = synth_learner(model=BodyHead(), splitter=split, train_bn=train_bn)
    assert learn.train_bn is train_bn
    learn.freeze()
    bn = learn.model.body[1]
    assert all(p.requires_grad is train_bn for p in bn.parameters())
    assert not learn.model.body[0].weight.requires_grad and learn.model.head.weight.requires_grad
    learn.freeze_to(1, train_bn=not train_bn)                 # an explicit argument still wins
    assert all(p.requires_grad is (not train_bn) for p in bn.parameters())
