"Trackers change training the way they say: early stopping, best model reloaded, NaN stop, lr on plateau"
import warnings
import pytest, torch
from learncb.all import *
from learncb.callbacks.monitors import *
from conftest import synth_learner

def scripted(values):
    "A monitor function returning `values[epoch]`"
    def scripted_metric(learn): return values[learn.epoch]
    return scripted_metric

@pytest.mark.parametrize('values,patience,min_delta,expected_stop', [
    ([5, 4, 3, 2, 1, 0], 1, 0., None),            # always improving: never stops
    ([5, 4, 4.5, 4.2, 3, 2], 2, 0., 3),           # epochs 2 and 3 do not beat 4
    ([5, 4, 3.95, 3.92, 3.91, 1], 3, 0.1, 4),     # improvements smaller than min_delta do not count
    ([5, 6, 7, 8, 9, 10], 1, 0., 1)])
def test_early_stopping_epoch(values, patience, min_delta, expected_stop):
    stopper = EarlyStoppingCallback(monitor=scripted(values), greater_is_better=False, patience=patience,
                                    min_delta=min_delta)
    logged = []
    learn = synth_learner(cbs=[stopper, Callback(after_epoch=lambda self: logged.append(self.epoch),
                                                 order=70)])
    learn.fit(6)
    assert stopper.stopped_epoch == expected_stop
    last = 5 if expected_stop is None else expected_stop
    # loggers saw the last epoch
    assert logged == list(range(last + 1)) and len(learn.recorder.values) == last + 1

def test_early_stopping_greater_is_better_by_name():
    stopper = EarlyStoppingCallback(monitor='accuracy', patience=1)
    learn = synth_learner(metrics=accuracy, cbs=stopper)
    learn.fit(2)
    assert stopper._greater is True and stopper.best == max(v[2] for v in learn.recorder.values)

def test_best_model_is_reloaded_and_equals_the_saved_one(tmp_path):
    values = [0.9, 0.5, 0.7, 0.6]
    weights = []
    save = SaveModelCallback(monitor=scripted(values), greater_is_better=False, fname='best', with_opt=True)
    learn = synth_learner(path=tmp_path, cbs=[save, Callback(after_epoch=lambda self: weights.append(
        {k: v.clone() for k, v in self.model.state_dict().items()}), order=70)])
    learn.fit(4)
    assert save.best_epoch == 1
    saved = torch.load(tmp_path/'models'/'best.pth', weights_only=True)
    for k, v in learn.model.state_dict().items():
        assert torch.equal(v, saved['model'][k]) and torch.equal(v, weights[1][k])
    assert not torch.equal(weights[3]['weight'], weights[1]['weight'])
    assert 'opt' in saved

def test_save_model_after_an_error_keeps_current_weights(tmp_path):
    class Boom(Callback):
        def after_epoch(self):
            if self.epoch == 2: raise RuntimeError('boom')
    learn = synth_learner(path=tmp_path, cbs=[SaveModelCallback(monitor=scripted([1, 2, 3]),
                                                                greater_is_better=False), Boom()])
    with pytest.raises(RuntimeError), pytest.warns(UserWarning, match=r'keeps its current weights.*epoch '
                                                                      r'0.*model.pth'):
        learn.fit(3)
    current = {k: v.clone() for k, v in learn.model.state_dict().items()}
    best = torch.load(tmp_path/'models'/'model.pth', weights_only=True)['model']
    assert not torch.equal(current['weight'], best['weight'])

def test_save_every_epoch_and_at_end(tmp_path):
    learn = synth_learner(path=tmp_path)
    learn.fit(4, cbs=SaveModelCallback(every_epoch=2, fname='e'))
    assert sorted(p.name for p in (tmp_path/'models').iterdir()) == ['e_0.pth', 'e_2.pth']
    learn.fit(1, cbs=SaveModelCallback(at_end=True, fname='final'))
    saved = torch.load(tmp_path/'models'/'final.pth', weights_only=True)['model']
    assert torch.equal(saved['weight'], learn.model.weight.detach())
    with pytest.raises(ValueError, match='exclusive'): SaveModelCallback(every_epoch=True, at_end=True)

@pytest.mark.parametrize('check_every', [1, 3, 32])
def test_nan_stops_and_says_where(check_every):
    class NaNFrom(Callback):
        def after_loss(self):
            if self.training and self.train_iter >= 5: self.learn.loss = self.learn.loss + float('inf')
    stop = TerminateOnNaNCallback(check_every=check_every)
    learn = synth_learner(cbs=[stop, NaNFrom()])
    learn.fit(4)
    assert learn.stop_reason == stop.found == ('training loss is NaN or infinite at epoch 1, batch 1: the '
                                               'fit stopped before it, so the weights are those from before '
                                               'batch 1')
    assert learn.epoch == 1 and len(learn.recorder.values) == 1           # epoch 1 never finished
    assert learn.train_iter == 5  # stopped at the bad batch, before it ran, whatever check_every

def test_nan_in_validation():
    class NaNValid(Callback):
        def after_loss(self):
            if not self.training and self.epoch == 2 and self.iter == 1:
                self.learn.loss = self.learn.loss * float('nan')
    stop = TerminateOnNaNCallback()
    learn = synth_learner(cbs=[stop, NaNValid()])
    learn.fit(5)
    assert learn.stop_reason == stop.found == ('validation loss is NaN or infinite at epoch 2, batch 1: the '
                                               'fit stopped after that validation, with the weights of the '
                                               'epoch\'s last step')

def test_nan_check_does_not_sync_per_batch():
    from conftest import SyncCounter, synth_dls
    counts = []
    for n in (64, 256):
        learn = synth_learner(dls=synth_dls(n_train=n * 16), cbs=TerminateOnNaNCallback(check_every=1000),
                              opt_func=torch.optim.SGD)
        with SyncCounter() as c: learn.fit(1)
        counts.append(sum(c.counts.values()))
    assert counts[0] == counts[1]

def test_reduce_lr_on_plateau():
    lrs = []
    learn = synth_learner(cbs=[ReduceLROnPlateau(monitor=scripted([3, 2, 2.5, 2.4, 1, 1.5, 1.6]),
                                                 greater_is_better=False, patience=2, factor=4, min_lr=0.001),
                               Callback(after_epoch=lambda self: lrs.append(self.opt.param_groups[0]['lr']),
                                        order=70)])
    learn.fit(7)
    assert lrs == pytest.approx([0.1, 0.1, 0.1, 0.025, 0.025, 0.025, 0.00625])

def test_monitor_errors():
    with pytest.raises(ValueError, match=r"'f1' is not a column of the recorder's table \['train_loss', "
                                         r"'valid_loss', 'accuracy'\]"):
        synth_learner(metrics=accuracy).fit(1, cbs=EarlyStoppingCallback(monitor='f1'))
    with pytest.raises(ValueError, match='has no Recorder'):
        learn = synth_learner(); learn.remove_cb(Recorder); learn.fit(1, cbs=EarlyStoppingCallback())
    with pytest.raises(TypeError, match='monitor must be'): EarlyStoppingCallback(monitor=3)
    with pytest.raises(ValueError, match='patience'): EarlyStoppingCallback(patience=0)

def test_missing_value_warns_and_is_skipped():
    """A value missing at some epoch warns and that epoch is not compared (no validation set at all is refused
    up front)"""
    def valid_loss(learn): return None
    learn = synth_learner(cbs=EarlyStoppingCallback(monitor=valid_loss, patience=5))
    with pytest.warns(UserWarning, match='valid_loss has no value at epoch 0'): learn.fit(2)

def test_save_best_model_alias():
    assert SaveBestModelCallback is SaveModelCallback
