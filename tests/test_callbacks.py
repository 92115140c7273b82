"Callback API: one-liners, delegation, names, order, run flags, learn.on, custom events"
import pytest, torch
from torch import nn
from learncb.all import *
from conftest import synth_learner, EventLog

def test_one_liner_receives_the_callback_and_reads_the_learner():
    seen = []
    learn = synth_learner()
    learn.fit(2, cbs=Callback(before_epoch=lambda self: seen.append((self.epoch, self.n_epoch,
                                                                     self is not self.learn))))
    assert seen == [(0, 2, True), (1, 2, True)]

def test_getattr_delegation_and_dir():
    cb = Callback(); learn = synth_learner(cbs=cb)
    assert cb.model is learn.model and cb.recorder is learn.recorder
    assert {'model', 'fit', 'name', 'order'} <= set(dir(cb))
    with pytest.raises(AttributeError, match="nor its learner has an attribute 'nope'"): cb.nope
    class Other: size = 3
    cb2 = Callback(); cb2.learn = Other()          # any object works as `learn`
    assert cb2.size == 3

def test_names_and_exposure():
    class ComplicatedNameCallback(Callback): pass
    class HTTPLogger(Callback): pass
    learn = synth_learner(cbs=[ComplicatedNameCallback(), HTTPLogger()])
    assert isinstance(learn.complicated_name, ComplicatedNameCallback) and isinstance(learn.http_logger,
        HTTPLogger)
    assert isinstance(learn.train_eval, TrainEvalCallback) and isinstance(learn.recorder, Recorder)
    class Model(Callback): pass
    with pytest.warns(UserWarning, match="learner already has a 'model' attribute"): learn.add_cb(Model())
    assert isinstance(learn.model, nn.Module)

def test_order_is_stable():
    calls = []
    cbs = [Callback(before_fit=(lambda i: lambda self: calls.append(i))(i), order=o) for i, o in enumerate([5,
        0, 5, -1, 0])]
    synth_learner(cbs=cbs).fit(1)
    assert calls == [3, 1, 4, 0, 2]

def test_changing_order_or_run_flags_rebuilds_dispatch():
    calls = []
    a, b = Callback(before_epoch=lambda self: calls.append('a')), Callback(
        before_epoch=lambda self: calls.append('b'))
    learn = synth_learner(cbs=[a, b])
    learn.fit(1); b.order = -1; learn.fit(1); b.run = False; learn.fit(1)
    assert calls == ['a', 'b', 'b', 'a', 'a']

def test_run_train_and_run_valid():
    phases = {'train': 0, 'valid': 0}
    def count(self): phases['train' if self.training else 'valid'] += 1
    learn = synth_learner()
    learn.fit(1, cbs=Callback(after_batch=count, run_valid=False))
    assert phases == {'train': 4, 'valid': 0}
    learn.fit(1, cbs=Callback(after_batch=count, run_train=False))
    assert phases == {'train': 4, 'valid': 2}
    # not a batch event: flags do not apply
    learn.fit(1, cbs=Callback(before_validate=count, run_valid=False))
    assert phases == {'train': 4, 'valid': 3}

def test_custom_event_from_a_learner_subclass():
    class VerifyingStep(Step):            # a learner's step is extended by subclassing `Step`
        def run(self):
            self.learn('verify_train_batch')
            super().run()
    class VerifyingLearner(Learner): step_class = VerifyingStep
    class Verify(Callback):
        def __init__(self): self.n = 0
        def verify_train_batch(self): self.n += 1
    torch.manual_seed(0)
    from conftest import synth_dls
    v = Verify()
    learn = VerifyingLearner(synth_dls(), nn.Linear(2, 2), nn.CrossEntropyLoss(), cbs=v, device='cpu')
    learn.remove_cb(ProgressCallback)
    learn.fit(1)
    assert v.n == 6
    assert v('verify_train_batch') is None and v.n == 7

@pytest.mark.parametrize('kw,expected', [({}, list(range(1, 9))), ({'every': 3}, [3, 6]), ({'once': 5}, [5]),
                                         ({'filter_fn': lambda f, learn: f.num_called % 2 == 0
                                           and f.num_executed < 2}, [2, 4])])
def test_learn_on(kw, expected):
    learn, seen = synth_learner(), []
    @learn.on(event.before_backward, **kw)
    def record(learn): seen.append(learn.train_iter + 1)
    learn.fit(2)
    assert seen == expected
    assert learn.record.num_called == 8 and learn.record.num_executed == len(expected)
    assert record(learn) is None     # the decorator returns the function itself

def test_training_counters():
    pcts = []
    learn = synth_learner()
    learn.fit(3, cbs=Callback(after_batch=lambda self: pcts.append(self.pct_train) if self.training
                              else None))
    assert (learn.epoch, learn.n_epoch, learn.n_iter, learn.train_iter) == (2, 3, 2, 12)
    assert pcts[0] == pytest.approx(1 / 12) and pcts[-1] == pytest.approx(1.0)
