"Errors a user can cause, exceptions and KeyboardInterrupt during a fit, and what is left afterwards"
import warnings
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
from conftest import synth_learner, synth_dls, EventLog

class RaiseAt(Callback):
    "Raises `exc` at `event_name` on training batch `at` (or the first time for non-batch events)"
    def __init__(self, event_name, exc, at=3):
        self.exc, self.at = exc, at
        setattr(self, event_name, self._maybe_raise)
    def _maybe_raise(self):
        if self.learn.train_iter == self.at: raise self.exc

@pytest.mark.parametrize('exc', [KeyboardInterrupt(), RuntimeError('boom'), ValueError('bad value')])
def test_exception_mid_fit_fires_after_exception_then_after_fit_and_reraises(exc):
    log, fit_only = EventLog(), RaiseAt('after_backward', exc)
    learn = synth_learner(cbs=log, progress=True)
    w_before = learn.model.weight.detach().clone()
    with pytest.raises(type(exc)) as info:
        learn.fit(3, cbs=[fit_only, Callback(before_fit=lambda self: None, name='tmp')])
    assert info.value is exc and learn.exception is exc
    assert log.log[-3:] == ['after_backward', 'after_exception', 'after_fit']
    assert fit_only not in learn.cbs and not hasattr(learn, 'tmp') and not hasattr(learn, 'raise_at')
    assert not torch.equal(w_before, learn.model.weight)           # the weights trained so far are kept
    assert len(learn.recorder.losses) == 4                         # and the history
    learn.fit(1)                                                   # the learner is usable
    assert learn.exception is None and len(learn.recorder.values) == 1

def test_keyboard_interrupt_from_model_forward():
    class Interrupting(nn.Linear):
        calls = 0
        def forward(self, x):
            Interrupting.calls += 1
            if Interrupting.calls == 3: raise KeyboardInterrupt
            return super().forward(x)
    log = EventLog()
    learn = synth_learner(cbs=log)
    learn.model = Interrupting(2, 2)
    with pytest.raises(KeyboardInterrupt): learn.fit(1)
    assert log.log[-3:] == ['before_batch', 'after_exception', 'after_fit']

def test_handler_errors_while_handling_are_attached_not_masking():
    def bad_after_exception(self): raise RuntimeError('after_exception handler broke')
    def bad_after_fit(self): raise OSError('cleanup broke')
    learn = synth_learner(cbs=[Callback(after_exception=bad_after_exception),
                               Callback(after_fit=bad_after_fit)])
    with pytest.raises(ZeroDivisionError) as info:
        learn.fit(1, cbs=RaiseAt('after_step', ZeroDivisionError('div'), at=1))
    notes = '\n'.join(info.value.__notes__)
    assert 'after_exception raised RuntimeError: after_exception handler broke' in notes
    assert 'after_fit raised OSError: cleanup broke' in notes

def test_error_in_after_fit_fires_after_exception_once():
    log = EventLog()
    def broken(self): raise RuntimeError('in after_fit')
    learn = synth_learner(cbs=[log, Callback(after_fit=broken)])
    with pytest.raises(RuntimeError, match='in after_fit'): learn.fit(1)
    assert log.log[-2:] == ['after_fit', 'after_exception'] and log.log.count('after_fit') == 1

def test_run_false_is_reset_after_fit_even_after_error():
    class SitOut(Callback):
        calls = 0
        def after_batch(self):
            self.calls += 1
            self.run = False
    cb = SitOut()
    learn = synth_learner(cbs=cb)
    learn.fit(2)
    assert cb.calls == 1 and cb.run
    with pytest.raises(ValueError): learn.fit(1, cbs=RaiseAt('after_step', ValueError(), at=2))
    assert cb.run and cb.calls == 2

def test_callback_error_names_callback_and_event():
    class Faulty(Callback):
        def after_loss(self): raise KeyError('missing')
    learn = synth_learner(cbs=Faulty())
    with pytest.raises(KeyError) as info: learn.fit(1)
    assert "raised by Faulty in 'after_loss'" in info.value.__notes__[0]

def test_empty_dataloaders():
    empty = DataLoader(TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)), batch_size=4)
    learn = synth_learner(dls=DataLoaders(empty, None))
    with pytest.raises(ValueError, match='training dataloader is empty.*batch_size'): learn.fit(1)
    learn = synth_learner(dls=DataLoaders(synth_dls().train, empty))
    with pytest.raises(ValueError, match='validation dataloader is empty'): learn.fit(1)
    class NoLen:
        def __iter__(self): return iter([])
    learn = synth_learner(dls=DataLoaders(NoLen()))
    with pytest.raises(ValueError, match='yielded no batches'): learn.fit(1)

def test_non_scalar_loss():
    learn = synth_learner()
    learn.loss_func = nn.CrossEntropyLoss(reduction='none')
    with pytest.raises(ValueError, match=r"loss must be a scalar.*shape \(16,\).*reduction='mean'"):
        learn.fit(1)
    learn = synth_learner()      # in validation only (no backward): the Recorder reports it
    def loss_func(pred, y):
        return nn.functional.cross_entropy(pred, y, reduction='mean' if pred.requires_grad else 'none')
    learn.loss_func = loss_func
    with pytest.raises(ValueError, match=r"the loss gave a tensor of shape \(16,\)"): learn.fit(1)

def test_device_mismatch_is_explained(monkeypatch):
    class HalfOnMeta(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.extra = nn.Parameter(torch.zeros(2, device='meta'))
        def forward(self, x): return self.lin(x) + self.extra
    learn = synth_learner()
    learn.model = HalfOnMeta()
    with pytest.raises(ValueError, match=r"\['extra'\] are on the meta device"): learn.fit(1)  # refused first
    import learncb.learner
    # as a model split over two GPUs is
    monkeypatch.setattr(learncb.learner, 'check_materialized', lambda m: m)
    with pytest.raises(RuntimeError) as info: learn.fit(1)
    note = info.value.__notes__[-1]
    assert ('the model failed with the batch on meta' in note and 'the model is split over cpu, meta: put '
                                                                  'all of it on one device' in note)

def test_unknown_event_names():
    learn = synth_learner()
    with pytest.raises(ValueError, match="unknown event 'after_bacth'; did you mean 'after_batch'"):
        learn('after_bacth')
    with pytest.raises(ValueError, match="did you mean 'before_fit'"): learn.on('befor_fit')
    with pytest.raises(TypeError, match="unknown keyword 'afterbatch'; did you mean 'after_batch'"):
        Callback(afterbatch=print)
    with pytest.raises(AttributeError, match="did you mean 'before_step'"): event.befor_step
    class Typo(Callback):
        def after_epcoh(self): pass
    with pytest.warns(UserWarning, match=r"Typo.after_epcoh is not an event.*'after_epoch'"):
        learn.add_cb(Typo())
    learn('verify_train_batch')     # a custom event nobody handles is not an error

def test_failing_metric_is_named():
    def f1(pred, targ): raise RuntimeError('metric broke')
    learn = synth_learner(metrics=[accuracy, f1])
    with pytest.raises(RuntimeError, match='metric broke') as info: learn.fit(1)
    assert any("metric 'f1' failed on batch 0" in n for n in info.value.__notes__)

def test_bad_arguments():
    with pytest.raises(TypeError, match=r'DataLoaders\(train_dl, valid_dl\)'): Learner(42, nn.Linear(2, 2))
    with pytest.raises(ValueError, match='no loss_func'):
        Learner(synth_dls(), nn.Linear(2, 2), device='cpu').fit(1)
    with pytest.raises(ValueError, match='n_epoch must be an int'): synth_learner().fit('3')
    with pytest.raises(ValueError, match='exclusive'): synth_learner().on('after_batch', every=2, once=1)
    with pytest.raises(ValueError, match='positive int'): synth_learner().on('after_batch', every=0)
    with pytest.raises(ValueError, match='ds_idx must be 0'): synth_learner().get_preds(ds_idx=2)
    with pytest.raises(TypeError, match='not a Callback'): synth_learner().add_cb(lambda learn: None)

def test_shadowing_warning():
    class SetLr(Callback):
        def before_fit(self): self.lr = 1.0
    learn = synth_learner(cbs=SetLr())
    with pytest.warns(UserWarning, match=r'shadows learn\.lr.*self\.learn\.lr = '): learn.fit(1)
    assert learn.lr == 0.1
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        class Fine(Callback):
            def before_fit(self): self.count = 0; self.count += 1; self.learn.lr = 0.2
        synth_learner(cbs=Fine()).fit(1)
