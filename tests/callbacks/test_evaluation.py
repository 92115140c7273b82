"Evaluation: the sanity check before training, EvaluateCallback's extra columns, torchmetrics metrics"
import copy
import pytest, torch
from torch import nn
from learncb.all import *
from learncb.callbacks.evaluation import *
from conftest import synth_learner, synth_dls, EventLog
from learncb.test_utils import synth_dl

def extra_dl(n=48, seed=5, bs=16): return synth_dl(n, bs=bs, seed=seed)

class CountBatches(Callback):
    def __init__(self): self.train = self.valid = 0
    def after_batch(self):
        if self.learn.training: self.train += 1
        else: self.valid += 1

# SanityCheckCallback

def test_sanity_check_fails_before_any_training_batch():
    calls = []
    def failing_metric(pred, targ):
        calls.append(pred.shape)
        raise RuntimeError('metric is broken')
    counter = CountBatches()
    learn = synth_learner(metrics=failing_metric, cbs=[SanityCheckCallback(), counter])
    w = learn.model.weight.clone()
    with pytest.raises(RuntimeError, match='metric is broken') as err:
        learn.fit(3)
    assert learn.train_iter == 0 and counter.train == 0 and len(calls) == 1
    assert torch.equal(learn.model.weight, w) and learn.recorder.values == []
    notes = '\n'.join(err.value.__notes__)
    assert ('sanity check' in notes and 'first 2 validation batches' in notes and 'training has not started'
            in notes)

def test_sanity_check_catches_a_callback_that_breaks_on_validation():
    def breaks(self): raise ValueError('bad validation batch')
    learn = synth_learner(cbs=SanityCheckCallback(), metrics=accuracy)
    with pytest.raises(ValueError, match='bad validation batch') as err:
        learn.fit(2, cbs=Callback(after_pred=breaks, run_train=False))
    assert learn.train_iter == 0 and any('sanity check' in n for n in err.value.__notes__)

def test_sanity_check_passes_without_a_trace(capsys):
    log, counter = EventLog(), CountBatches()
    learn = synth_learner(metrics=accuracy, cbs=[SanityCheckCallback(n_batches=2), log, counter])
    learn.logger = print
    capsys.readouterr()
    learn.fit(2)
    out = capsys.readouterr().out
    plain = synth_learner(metrics=accuracy)
    plain.logger = print
    plain.fit(2)
    plain_out = capsys.readouterr().out
    # but the time
    assert [l.split()[:-1] for l in out.splitlines()] == [l.split()[:-1] for l in plain_out.splitlines()]
    assert len(out.splitlines()) == 3
    assert learn.recorder.values == plain.recorder.values and learn.recorder.losses == plain.recorder.losses
    assert learn.recorder.iters == plain.recorder.iters and learn.train_iter == plain.train_iter
    assert counter.valid == 2 * 2 + 2 and counter.train == 2 * 4  # two more validation batches: the check
    before_first_epoch = log.log[:log.log.index('before_epoch')]
    assert before_first_epoch.count('before_validate') == 1 and before_first_epoch.count('after_batch') == 2
    assert len(learn.sanity_check.result) == 2

def test_sanity_check_result_is_the_first_batches_validation():
    learn = synth_learner(metrics=accuracy)
    expected = learn.validate(dl=FirstBatches(learn.dls.valid, 1))
    learn.fit(0, cbs=SanityCheckCallback(n_batches=1))
    learn.fit(1, cbs=(check := SanityCheckCallback(n_batches=1)))
    assert check.result == expected                          # validated with the weights of before training

def test_sanity_check_leaves_recorder_and_progress_alone():
    learn = synth_learner(progress=True, metrics=accuracy)
    learn.validate()
    last = learn.recorder.last_valid
    seen = []
    learn.fit(0, cbs=[SanityCheckCallback(), Callback(before_validate=lambda self: seen.append(
        [type(cb).__name__ for cb in self.learn.cbs]))])
    assert learn.recorder.last_valid == last
    # a fresh, temporary one
    assert seen and 'ProgressCallback' not in seen[0] and seen[0].count('Recorder') == 1
    assert isinstance(learn.recorder, Recorder) and isinstance(learn.progress, ProgressCallback)
    assert [type(cb).__name__ for cb in learn.cbs] == ['TrainEvalCallback', 'Recorder', 'ProgressCallback']

def test_sanity_check_skips_quietly_without_validation_set(capsys):
    learn = synth_learner(dls=synth_dls(n_valid=0), cbs=(check := SanityCheckCallback()))
    learn.fit(1)
    assert check.result is None and learn.train_iter == 4 and capsys.readouterr().out == ''

def test_sanity_check_bad_n_batches():
    for bad in (-1, 1.5, '2'):
        with pytest.raises(ValueError, match='n_batches must be'): SanityCheckCallback(bad)

def test_first_batches():
    dl = extra_dl()
    assert len(FirstBatches(dl, 2)) == 2 and len(FirstBatches(dl, 9)) == 3
    assert [torch.equal(a[0], b[0]) for a, b in zip(FirstBatches(dl, 2), dl)] == [True, True]
    assert len(list(FirstBatches(dl, 2))) == 2
    # a length only when the dataloader has one
    with pytest.raises(TypeError): len(FirstBatches((b for b in dl), 2))
    assert len(list(FirstBatches((b for b in dl), 2))) == 2

# EvaluateCallback

def manual_eval(state, dl):
    "Loss and accuracy of a Linear(2, 2) with weights `state` on the whole of `dl`"
    x, y = dl.dataset.tensors
    with torch.no_grad(): pred = nn.functional.linear(x, state['weight'], state['bias'])
    return [nn.functional.cross_entropy(pred, y).item(), (pred.argmax(1) == y).float().mean().item()]

def test_evaluate_every_2_fills_the_right_epochs_with_the_right_values():
    states = []
    keep = Callback(after_epoch=lambda self: states.append(copy.deepcopy(self.learn.model.state_dict())),
                    order=30)
    dl = extra_dl()
    learn = synth_learner(metrics=accuracy, cbs=[EvaluateCallback(dl, every=2), keep])
    learn.fit(4)
    rec = learn.recorder
    assert rec.metric_names == ['epoch', 'train_loss', 'valid_loss', 'accuracy', 'extra_loss',
                                'extra_accuracy', 'time']
    assert [v[3:] for v in rec.values][0::2] == [[None, None]] * 2
    for e in (1, 3):
        assert rec.values[e][3:] == pytest.approx(manual_eval(states[e], dl), abs=1e-6)
    assert rec.values[3][3:] == learn.validate(dl=dl)                            # the same as learn.validate
    assert [(e, v) for e, v in learn.extra.history] == [(1, rec.values[1][3:]), (3, rec.values[3][3:])]

def test_evaluate_does_not_disturb_the_fit():
    learn = synth_learner(metrics=accuracy, cbs=EvaluateCallback(extra_dl()))
    learn.fit(3)
    plain = synth_learner(metrics=accuracy)
    plain.fit(3)
    rec = learn.recorder
    assert [v[:3] for v in rec.values] == plain.recorder.values
    assert (rec.losses == plain.recorder.losses and rec.iters == plain.recorder.iters
            and rec.lrs == plain.recorder.lrs)
    assert (learn.epoch, learn.train_iter, learn.pct_train) == (plain.epoch, plain.train_iter,
                                                                plain.pct_train)
    assert rec.last_valid == plain.recorder.last_valid

def test_evaluate_columns_can_be_monitored_by_a_tracker():
    seen = []
    def watch(self):
        row = dict(zip(self.learn.recorder.metric_names[1:-1], self.learn.recorder.values[-1]))
        seen.append(row['extra_accuracy'])
    learn = synth_learner(metrics=accuracy, cbs=[EvaluateCallback(extra_dl()), Callback(after_epoch=watch,
        order=60)])
    learn.fit(2)
    assert seen == [v[4] for v in learn.recorder.values] and None not in seen

def test_a_real_tracker_monitors_an_evaluate_column():
    from learncb.callbacks.monitors import TrackerCallback
    tracker = TrackerCallback('extra_loss')
    learn = synth_learner(metrics=accuracy, cbs=[EvaluateCallback(extra_dl(), every=2), tracker])
    with pytest.warns(UserWarning, match='extra_loss has no value at epoch 0'): learn.fit(4)
    assert tracker.best == min(v[3] for v in learn.recorder.values
                               if v[3] is not None) and tracker.best_epoch in (1, 3)

def test_evaluate_with_own_metrics_and_name_restores_learner_metrics():
    dl = extra_dl()
    learn = synth_learner(metrics=accuracy, cbs=EvaluateCallback(dl, name='test', metrics=[error_rate,
        accuracy]))
    learn.fit(1)
    assert learn.recorder.metric_names[4:7] == ['test_loss', 'test_error_rate', 'test_accuracy']
    loss, err, acc = learn.recorder.values[0][3:]
    assert err == pytest.approx(1 - acc) and learn.metrics == [accuracy] and isinstance(learn.test,
        EvaluateCallback)
    assert [loss, acc] == pytest.approx(learn.validate(dl=dl))

def test_evaluate_failure_restores_learner_metrics_and_callbacks():
    def broken(pred, targ): raise RuntimeError('broken metric')
    learn = synth_learner(metrics=accuracy)
    with pytest.raises(RuntimeError, match='broken metric'):
        learn.fit(2, cbs=EvaluateCallback(extra_dl(), metrics=broken))
    assert learn.metrics == [accuracy]
    assert [type(cb).__name__ for cb in learn.cbs] == ['TrainEvalCallback', 'Recorder']
    learn.fit(1)                                             # usable again
    assert learn.recorder.metric_names == ['epoch', 'train_loss', 'valid_loss', 'accuracy', 'time']

def test_evaluate_without_validation_set():
    learn = synth_learner(dls=synth_dls(n_valid=0), cbs=EvaluateCallback(extra_dl()))
    learn.fit(2)
    assert [v[1] is None and v[2] is not None for v in learn.recorder.values] == [True, True]

def test_evaluate_two_sets_and_bad_arguments():
    learn = synth_learner(metrics=accuracy, cbs=[EvaluateCallback(extra_dl(seed=1), name='a'),
                                                 EvaluateCallback(extra_dl(seed=2), name='b', every=2)])
    learn.fit(2)
    assert learn.recorder.metric_names[4:8] == ['a_loss', 'a_accuracy', 'b_loss', 'b_accuracy']
    assert learn.recorder.values[0][5:] == [None, None] and None not in learn.recorder.values[1]
    with pytest.raises(ValueError, match=r"adds the columns \['valid_loss'\]"):
        learn.fit(1, cbs=EvaluateCallback(extra_dl(), name='valid'))
    with pytest.raises(ValueError, match='every must be'): EvaluateCallback(extra_dl(), every=0)
    with pytest.raises(ValueError, match='name must be'): EvaluateCallback(extra_dl(), name='my set')

# torchmetrics

def test_torchmetrics_metrics_match_a_manual_computation():
    tm = pytest.importorskip('torchmetrics.classification')
    metrics = [tm.MulticlassAccuracy(num_classes=2, average='micro'), tm.MulticlassPrecision(num_classes=2,
        average='macro'),
               tm.MulticlassF1Score(num_classes=2, average='macro')]
    dl = extra_dl(n=40, bs=16)                 # a smaller last batch: a mean of batch values would be off
    learn = synth_learner(metrics=metrics, cbs=EvaluateCallback(dl, name='extra'))
    learn.fit(2)
    for values, data in ((learn.recorder.values[-1][2:5], learn.dls.valid), (learn.recorder.values[-1][6:9],
            dl)):
        _, targs, dec = learn.get_preds(dl=data, with_decoded=True)
        prec = [((dec == c) & (targs == c)).sum() / (dec == c).sum() for c in (0, 1)]
        rec = [((dec == c) & (targs == c)).sum() / (targs == c).sum() for c in (0, 1)]
        f1 = [2 * p * r / (p + r) for p, r in zip(prec, rec)]
        assert values == pytest.approx([(dec == targs).float().mean().item(), torch.stack(prec).mean().item(),
                                        torch.stack(f1).mean().item()], abs=1e-6)
