"""Every cancel exception, raised from every event of its own stage and from every event outside it (DESIGN.md
2)"""
import pytest, torch
from torch import nn
from learncb.all import *
from conftest import synth_learner, EventLog

# The events a normal fit fires, with the phase of those that fire in both phases
BATCH_TRAIN = ['before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step',
               'after_step']
BATCH_VALID = ['before_batch', 'after_pred', 'after_loss']
FETCH = ['before_fetch', 'after_fetch']  # around taking a batch from the dataloader: outside the batch stage
ALL = ([('before_fit', None), ('before_epoch', None), ('before_train', None)] + [(e, 'train') for e
    in FETCH + BATCH_TRAIN]
       + [('after_batch', 'train'), ('after_train', None), ('before_validate', None)]
       + [(e, 'valid') for e in FETCH + BATCH_VALID]
       + [('after_batch', 'valid'), ('after_validate', None), ('after_epoch', None), ('after_fit', None)])

# Where each stage's `try` is: the events that are inside the stage (raising its exception there cancels it)
_train = {(e, 'train') for e in FETCH + BATCH_TRAIN} | {('after_batch', 'train'), ('before_train', None)}
_valid = {(e, 'valid') for e in FETCH + BATCH_VALID} | {('after_batch', 'valid'), ('before_validate', None)}
_epoch = _train | _valid | {('before_epoch', None), ('after_train', None), ('after_validate', None)}
INSIDE = {
    'batch':    ({(e, 'train') for e in BATCH_TRAIN} | {(e, 'valid') for e in BATCH_VALID},
                 CancelBatchException),
    'backward': ({('before_backward', 'train')}, CancelBackwardException),
    'step':     ({('before_step', 'train')}, CancelStepException),
    'train':    (_train, CancelTrainException),
    'validate': (_valid, CancelValidException),
    'epoch':    (_epoch, CancelEpochException),
    'fit':      (_epoch | {('before_fit', None), ('after_epoch', None)}, CancelFitException),
}
CASES = [(stage, ev, ph, ev_ph in inside) for stage, (inside, _) in INSIDE.items() for ev_ph in ALL for ev,
         ph in [ev_ph]]

class RaiseOnce(Callback):
    "Raises `exc` the first time `event_name` fires in `phase` (None: any phase)"
    def __init__(self, event_name, phase, exc):
        self.exc, self.phase, self.done = exc, phase, False
        setattr(self, event_name, self._maybe_raise)
    def _maybe_raise(self):
        if self.done: return
        if self.phase is not None and self.learn.training != (self.phase == 'train'): return
        self.done = True
        raise self.exc()

def run(stage, event_name, phase):
    log = EventLog()
    learn = synth_learner(cbs=log, progress=True)
    raiser = RaiseOnce(event_name, phase, INSIDE[stage][1])
    error = None
    try: learn.fit(2, cbs=raiser)
    except Exception as e: error = e
    return learn, log.log, error, raiser

def index_of_raise(log, event_name, phase):
    "Index in the log of the event occurrence where the exception was raised"
    for i, e in enumerate(log):
        if e != event_name: continue
        if phase is None: return i
        # phase of a batch event: the nearest before_train/before_validate above it
        start = max(j for j in range(i) if log[j] in ('before_train', 'before_validate'))
        if (log[start] == 'before_train') == (phase == 'train'): return i
    raise AssertionError(f'{event_name} ({phase}) not in log')

@pytest.mark.parametrize('stage,event_name,phase,inside', CASES,
                         ids=[f"{s}-{e}{'-' + p if p else ''}-{'inside' if i else 'outside'}" for s, e, p,
                              i in CASES])
def test_cancel(stage, event_name, phase, inside):
    learn, log, error, raiser = run(stage, event_name, phase)
    assert raiser.done, 'the exception was never raised'
    i = index_of_raise(log, event_name, phase)
    if inside:
        assert error is None, f'{type(error).__name__} escaped the fit'
        assert log[i + 1:i + 3] == [f'after_cancel_{stage}', f'after_{stage}']
        assert log[-1] == 'after_fit' and 'after_exception' not in log
        # the loop goes on
        assert log.count('before_epoch') == (0 if event_name == 'before_fit' else 1 if stage == 'fit' else 2)
    else:
        assert isinstance(error, INSIDE[stage][1]) and learn.exception is error
        expected_tail = ['after_exception'] if event_name == 'after_fit' else ['after_exception', 'after_fit']
        assert log[i + 1:] == expected_tail
        assert 'reached fit without a stage of its kind' in error.__notes__[-1]
    assert raiser not in learn.cbs and not learn.training
    learn.fit(1)    # the learner is usable afterwards

def test_cancel_batch_skips_rest_of_batch_and_continues():
    learn, log, error, _ = run('batch', 'after_pred', 'train')
    i = log.index('after_pred')
    assert log[i:i + 6] == ['after_pred', 'after_cancel_batch', 'after_batch', 'before_fetch', 'after_fetch',
                            'before_batch']
    assert log.count('before_step') == 2 * 4 - 1
    assert len(learn.recorder.losses) == 2 * 4 - 1      # the cancelled batch had no loss: not recorded

def test_cancel_step_leaves_weights_and_cancel_backward_leaves_grads():
    class NoStep(Callback):
        def before_step(self): raise CancelStepException()
    learn = synth_learner(cbs=NoStep())
    w = learn.model.weight.detach().clone()
    learn.fit(1)
    assert torch.equal(w, learn.model.weight)
    class NoBackward(Callback):
        def before_backward(self): raise CancelBackwardException()
        def before_step(self): self.grads = [p.grad for p in self.learn.model.parameters()]
    nb = NoBackward()
    synth_learner(cbs=nb).fit(1)
    assert all(g is None for g in nb.grads)

class CancellingModel(nn.Module):
    "A model that raises `exc` on its `when`-th call: cancel exceptions may come from the model too"
    def __init__(self, exc, when):
        super().__init__(); self.lin, self.exc, self.when, self.calls = nn.Linear(2, 2), exc, when, 0
    def forward(self, x):
        self.calls += 1
        if self.calls == self.when: raise self.exc()
        return self.lin(x)

@pytest.mark.parametrize('exc,stage', [(CancelBatchException, 'batch'), (CancelTrainException, 'train'),
                                       (CancelEpochException, 'epoch'), (CancelFitException, 'fit')])
def test_cancel_raised_by_model(exc, stage):
    log = EventLog()
    learn = synth_learner(cbs=log)
    learn.model = CancellingModel(exc, when=2)
    learn.fit(1)
    i = log.log.index('before_batch', log.log.index('before_batch') + 1)     # the second batch
    assert log.log[i + 1:i + 3] == [f'after_cancel_{stage}', f'after_{stage}']

def test_cancel_raised_by_loss_func():
    def loss_func(pred, y):
        if not torch.is_grad_enabled(): raise CancelValidException()
        return nn.functional.cross_entropy(pred, y)
    log = EventLog()
    learn = synth_learner(cbs=log)
    learn.loss_func = loss_func
    learn.fit(1)
    i = log.log.index('before_validate')
    assert log.log[i:i + 7] == ['before_validate', 'before_fetch', 'after_fetch', 'before_batch',
                                'after_pred', 'after_cancel_validate', 'after_validate']
    assert learn.recorder.values[0][1] is None      # no validation loss was computed
