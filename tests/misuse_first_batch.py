"""Errors in the first batch (and the Recorder's part of one run at a time): errors from the first batch speak
learncb, a learncb handler never crashes while the loop unwinds, a diverging loss warns once, a resumed run
prints its table header.

Each misuse asserts the exception type (torch's own, kept), that the notes name the bad value and the fix,
where in the run the error came (counted with a callback), and what the learner holds afterwards."""
import io, math, warnings
from collections import Counter
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from fastcore.basics import noop
from learncb.all import *
import learncb.progress
from conftest import synth_learner, synth_dls, SyncCounter

X = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
Y = (X.sum(1) > 0).long()

def notes(e): return '\n'.join(getattr(e, '__notes__', []))

class Count(Callback):
    "Counts batches begun and ended, per phase"
    order = -100
    def __init__(self): self.n = Counter()
    def before_batch(self): self.n['train' if self.learn.training else 'valid'] += 1
    def after_batch(self): self.n['train_done' if self.learn.training else 'valid_done'] += 1

def learner_on(ds, model=None, n_inp=1, metrics=None, valid=None, bs=16):
    dl = DataLoader(ds, batch_size=bs)
    count = Count()
    learn = synth_learner(cbs=count, dls=DataLoaders(dl, valid), model=model, metrics=metrics, n_inp=n_inp)
    return learn, count

def fails_at_first_batch(count):
    "The error came from the first training batch: one begun, none ended"
    return count.n['train'] == 1 and count.n['train_done'] == 0

def weights(learn): return [p.detach().clone() for p in learn.model.parameters()]
def same(a, b): return all(torch.equal(x, y) for x, y in zip(a, b))

class Items(Dataset):
    "64 items made by `fn(i)`"
    def __init__(self, fn): self.fn = fn
    def __len__(self): return 64
    def __getitem__(self, i): return self.fn(i)

# ---------------------------------------------------------------- batches that are not (inputs...,
# targets...)

def test_single_tensor_batch_says_what_xb_and_yb_are():
    learn, count = learner_on(Items(lambda i: X[i]))
    w = weights(learn)
    with pytest.raises(ValueError,
                       match=r'no targets for loss_func.*make it a tuple \(inputs, targets\)') as info:
        learn.fit(1)  # at the first batch, not an IndexError of the Recorder
    n = notes(info.value)
    assert 'the batch is a tensor of shape (16, 2), not a tuple or list' in n
    assert 'xb = batch[:n_inp]' in n and 'yb = batch[n_inp:]' in n and 'return (x, y) pairs' in n
    assert 'while handling this' not in n                    # the Recorder cleans up after itself
    assert fails_at_first_batch(count) and same(w, weights(learn))

def test_dict_batch_names_its_keys_and_a_collate_fn():
    learn, count = learner_on(Items(lambda i: {'x': X[i], 'y': Y[i]}))
    with pytest.raises(TypeError, match="unexpected keyword argument") as info: learn.fit(1)  # model(**batch)
    n = notes(info.value)
    assert "the batch is a dict with keys ['x', 'y']" in n and 'tuple(default_collate(items).values())' in n
    assert fails_at_first_batch(count)

def test_dict_batch_fixed_with_the_suggested_collate_fn():
    from torch.utils.data import default_collate
    dl = DataLoader(Items(lambda i: {'x': X[i], 'y': Y[i]}), batch_size=16,
                    collate_fn=lambda items: tuple(default_collate(items).values()))
    learn = synth_learner(dls=DataLoaders(dl))
    learn.fit(1)
    assert len(learn.recorder.losses) == 4

def test_single_tensor_in_get_preds_on_unlabelled_data_is_not_an_error():
    learn = synth_learner()
    preds, targs = learn.get_preds(dl=DataLoader(Items(lambda i: X[i]), batch_size=16))
    assert preds.shape == (64, 2) and targs is None

class TwoInputs(nn.Module):
    def __init__(self): super().__init__(); self.lin = nn.Linear(4, 2)
    def forward(self, a, b): return self.lin(torch.cat([a, b], 1))

def test_three_elements_with_n_inp_1_model_gets_one_input_too_few():
    learn, count = learner_on(TensorDataset(X, X, Y), model=TwoInputs())
    with pytest.raises(TypeError, match='missing 1 required positional argument') as info: learn.fit(1)
    n = notes(info.value)
    assert 'the batch has 3 elements and n_inp=1' in n and 'model got 1 input' in n
    assert 'pass Learner(..., n_inp=2)' in n and fails_at_first_batch(count)
    learn.n_inp = 2
    learn.fit(1)                                                # the fix the note gives works
    assert learn.recorder.values[0][0] is not None

def test_three_elements_with_n_inp_1_loss_gets_one_target_too_many():
    learn, count = learner_on(TensorDataset(X, X, Y))
    with pytest.raises(TypeError, match='positional arguments') as info: learn.fit(1)
    n = notes(info.value)
    assert 'the loss got pred and 2 targets, loss_func(pred, *batch[1:])' in n and 'n_inp=2' in n
    assert fails_at_first_batch(count)

def test_model_of_two_inputs_on_pairs_gets_the_general_n_inp_hint():
    learn, count = learner_on(TensorDataset(X, Y), model=TwoInputs())
    with pytest.raises(TypeError) as info: learn.fit(1)
    assert 'pass Learner(..., n_inp=k) for a model that takes k inputs' in notes(info.value)
    assert fails_at_first_batch(count)

def test_shape_error_in_the_model_gets_no_batch_note():
    "A plain mismatch of the model and the data is not a misuse of the loop: torch's error stands alone"
    learn = synth_learner(model=nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match='shapes cannot be multiplied') as info: learn.fit(1)
    assert 'learncb: the batch' not in notes(info.value)

# ---------------------------------------------------------------- losses that are not a tensor with a
# gradient

@pytest.mark.parametrize('ret, said', [
    (lambda p, y: 0.5, 'loss_func returned a float (0.5), not a tensor'),
    (lambda p, y: nn.functional.cross_entropy(p, y).item(), 'loss_func returned a float ('),
    (lambda p, y: (nn.functional.cross_entropy(p, y), p), 'returned a tuple of 2 tensors, not a tensor'),
    (lambda p, y: nn.functional.cross_entropy(p, y).detach().numpy(), 'loss_func returned a ndarray'),
], ids=['float', 'item', 'tuple', 'numpy'])
def test_loss_that_is_not_a_tensor(ret, said):
    learn, count = learner_on(TensorDataset(X, Y))
    learn.loss_func = ret
    w = weights(learn)
    with pytest.raises(AttributeError, match="has no attribute 'detach'") as info: learn.fit(1)
    n = notes(info.value)
    assert said in n and 'loss.backward()' in n and 'without .item(), float() or numpy' in n
    assert fails_at_first_batch(count) and same(w, weights(learn))

def test_loss_returning_a_tuple_is_told_to_return_the_loss_alone():
    learn, _ = learner_on(TensorDataset(X, Y))
    learn.loss_func = lambda p, y: (nn.functional.cross_entropy(p, y), 0)
    with pytest.raises(AttributeError) as info: learn.fit(1)
    assert 'return it alone as it is' in notes(info.value)

def test_frozen_model():
    learn, count = learner_on(TensorDataset(X, Y))
    for p in learn.model.parameters(): p.requires_grad_(False)
    with pytest.raises(RuntimeError, match='does not require grad') as info: learn.fit(1)
    n = notes(info.value)
    assert 'all its 2 parameter tensors have requires_grad=False (the model is frozen)' in n
    assert 'p.requires_grad_(True)' in n and fails_at_first_batch(count)

def test_detached_loss():
    learn, count = learner_on(TensorDataset(X, Y))
    learn.loss_func = lambda p, y: torch.tensor(nn.functional.cross_entropy(p, y).item())
    with pytest.raises(RuntimeError, match='does not require grad') as info: learn.fit(1)
    assert ('loss_func returned a tensor cut off from pred' in notes(info.value)
            and fails_at_first_batch(count))

def test_model_whose_forward_detaches():
    class Detaching(nn.Linear):
        def forward(self, x): return super().forward(x).detach()
    learn, count = learner_on(TensorDataset(X, Y), model=Detaching(2, 2))
    with pytest.raises(RuntimeError, match='does not require grad') as info: learn.fit(1)
    assert "the model's output has none: its forward detaches its result" in notes(info.value)

def test_fit_inside_no_grad():
    learn, count = learner_on(TensorDataset(X, Y))
    with torch.no_grad(), pytest.raises(RuntimeError, match='does not require grad') as info: learn.fit(1)
    assert 'fit was called inside torch.no_grad()' in notes(info.value) and fails_at_first_batch(count)
    learn.fit(1)                                               # outside, it trains

def test_loss_of_shape_1_trains_like_a_scalar():
    a = synth_learner(); a.fit(1)
    b = synth_learner(); b.loss_func = lambda p, y: nn.functional.cross_entropy(p, y).reshape(1)
    b.fit(1)
    assert b.recorder.values == a.recorder.values and b.recorder.losses == a.recorder.losses

def test_non_scalar_loss_leaves_history_readable_and_learner_usable():
    learn = synth_learner()
    learn.fit(1)
    history = [list(v) for v in learn.recorder.values]
    learn.loss_func = nn.CrossEntropyLoss(reduction='none')
    with pytest.raises(ValueError, match='loss must be a scalar') as info: learn.fit(1)
    assert 'while handling this' not in notes(info.value)      # the Recorder's after_fit no longer fails
    assert learn.recorder.losses == [] and learn.recorder.lrs == []
    learn.loss_func = nn.CrossEntropyLoss()
    learn.fit(1)
    assert len(learn.recorder.values) == 1 and len(history) == 1

# ---------------------------------------------------------------- BatchNorm on a last batch of one item

def test_batchnorm_on_a_last_batch_of_one_item():
    bn = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    learn, count = learner_on(TensorDataset(X[:33], Y[:33]), model=bn)
    with pytest.raises(ValueError, match='Expected more than 1 value per channel') as info: learn.fit(1)
    n = notes(info.value)
    assert 'batch 3 of 3: 33 items in batches of 16 leave 1 for the last one' in n and 'drop_last=True' in n
    assert count.n['train'] == 3 and count.n['train_done'] == 2
    learn.dls.train = DataLoader(TensorDataset(X[:33], Y[:33]), batch_size=16, drop_last=True)
    learn.fit(1)

# ---------------------------------------------------------------- model outputs that a metric or get_preds
# cannot take

class Pair(nn.Linear):
    def forward(self, x): return super().forward(x), x
class Named(nn.Linear):
    def forward(self, x): return {'logits': super().forward(x)}
class PairLoss(nn.CrossEntropyLoss):
    def forward(self, pred, targ): return super().forward(pred[0], targ)
class NamedLoss(nn.CrossEntropyLoss):
    def forward(self, pred, targ): return super().forward(pred['logits'], targ)

@pytest.mark.parametrize('model, loss, said, pick', [
    (Pair, PairLoss, 'a tuple of 2 tensors', 'pred[0]'),
    (Named, NamedLoss, "a dict with keys ['logits']", "pred['logits']")], ids=['tuple', 'dict'])
def test_metric_on_a_model_output_that_is_not_a_tensor(model, loss, said, pick):
    learn = synth_learner(model=model(2, 2), metrics=accuracy, cbs=Count())
    learn.loss_func = loss()
    with pytest.raises(AttributeError, match="has no attribute 'argmax'") as info: learn.fit(1)
    n = notes(info.value)
    assert f"metric 'accuracy' failed on batch 0 with pred {said}" in n
    assert f'def my_accuracy(pred, *yb): return accuracy({pick}, *yb)' in n
    assert dict(learn.count.n) == {'train': 1}           # metrics are tried on the first training batch

def test_get_preds_of_a_dict_output():
    learn = synth_learner(model=Named(2, 2))
    learn.loss_func = NamedLoss()
    with pytest.raises(AttributeError) as info: learn.get_preds()
    n = notes(info.value)
    assert "the model returned a dict with keys ['logits']" in n and 'with_preds=False' in n

def test_get_preds_of_a_tuple_output_and_the_activation():
    learn = synth_learner(model=Pair(2, 2))
    learn.loss_func = PairLoss()
    with pytest.raises(TypeError) as info: learn.get_preds()
    assert 'act=lambda preds: preds[0].softmax(-1)' in notes(info.value)
    preds, _ = learn.get_preds(act=lambda p: p[0].softmax(-1))
    assert preds.shape == (32, 2)
    (out, x), _ = learn.get_preds(act=noop)                    # as they are
    assert torch.equal(x, learn.dls.valid.dataset.tensors[0])
    with pytest.raises(AttributeError) as info: learn.get_preds(act=noop, with_decoded=True)
    assert 'with_decoded=False' in notes(info.value)

def test_get_preds_with_loss_and_a_loss_without_reduction():
    learn = synth_learner()
    learn.loss_func = lambda p, y: nn.functional.cross_entropy(p, y)
    with pytest.raises(TypeError, match='reduction') as info: learn.get_preds(with_loss=True)
    assert "calls loss_func(pred, *yb, reduction='none')" in notes(info.value)

def test_get_preds_with_loss_and_a_loss_that_ignores_reduction():
    class Mean(nn.Module):
        reduction = 'mean'
        def forward(self, p, y): return nn.functional.cross_entropy(p, y)      # ignores self.reduction
    learn = synth_learner()
    learn.loss_func = Mean()
    with pytest.raises(RuntimeError) as info: learn.get_preds(with_loss=True)
    assert 'returned a tensor of shape () for a batch of 16 items' in notes(info.value)

def test_get_preds_skips_cancelled_batches():
    def skip_first(self):
        if self.iter == 0: raise CancelBatchException()
    learn = synth_learner()
    preds, targs = learn.get_preds(cbs=Callback(after_pred=skip_first))
    x, y = learn.dls.valid.dataset.tensors
    assert torch.equal(targs, y[16:])                          # not the last batch's pred twice
    with torch.no_grad(): torch.testing.assert_close(preds, learn.model(x[16:]).softmax(-1))

# ---------------------------------------------------------------- metrics that do not return a number

@pytest.mark.parametrize('value, err, said', [
    (None, TypeError, "metric 'bad' returned None on the first training batch"),
    ('good', TypeError, "metric 'bad' returned 'good'"),
    ('0.5', TypeError, "return the number, not its text"),
    (torch.ones(3), ValueError, "metric 'bad' gave a tensor of shape (3,)"),
], ids=['none', 'string', 'number-as-text', 'not-scalar'])
def test_metric_that_does_not_return_a_number(value, err, said):
    def bad(pred, targ): return value
    learn = synth_learner(metrics=[accuracy, bad], cbs=Count())
    with pytest.raises(err) as info: learn.fit(2)
    assert said in str(info.value) and "raised by Recorder in 'after_loss'" in notes(info.value)
    assert dict(learn.count.n) == {'train': 1}          # tried on the first training batch, before an epoch

def test_metric_returning_numbers_and_shape_1_tensors_is_fine():
    def as_float(pred, targ): return float(accuracy(pred, targ))
    def as_vec(pred, targ): return accuracy(pred, targ).reshape(1)
    learn = synth_learner(metrics=[accuracy, as_float, as_vec])
    learn.fit(1)
    v = learn.recorder.values[0]
    assert v[2] == pytest.approx(v[3]) == pytest.approx(v[4])

# ---------------------------------------------------------------- nothing crashes while the loop unwinds

@pytest.fixture
def bars(monkeypatch):
    "Progress bars drawn as in a terminal"
    monkeypatch.setattr(learncb.progress, 'can_draw_bars', lambda: True)

def raise_at(event_name):
    def boom(self):
        if not self.learn.validating_aside: raise RuntimeError(f'boom in {event_name}')
    return Callback(**{event_name: boom}, name='boom')

EVENTS = ['before_fit', 'before_epoch', 'before_train', 'before_batch', 'after_pred', 'after_loss',
          'after_backward',
          'after_step', 'after_batch', 'after_train', 'before_validate', 'after_validate', 'after_epoch',
          'after_fit']

def assert_clean_after_failure(learn, capsys):
    prog = learn.progress
    assert prog.mbar is None and prog.pbar is None and learn.logger is print_row
    capsys.readouterr()
    with learn.no_bar(): learn.fit(1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ['epoch', 'train_loss', 'valid_loss', 'time'] and lines[1].split()[0] == '0'

@pytest.mark.parametrize('event_name', EVENTS)
def test_bars_closed_and_logger_back_after_an_error_at_any_event(event_name, bars, capsys):
    learn = synth_learner(progress=True, logger=print_row)
    with pytest.raises(RuntimeError, match='boom') as info: learn.fit(2, cbs=raise_at(event_name))
    assert 'while handling this' not in notes(info.value)
    assert_clean_after_failure(learn, capsys)

def test_the_issue_case_non_scalar_loss_with_bars(bars, capsys):
    learn = synth_learner(progress=True, logger=print_row)
    learn.loss_func = nn.CrossEntropyLoss(reduction='none')
    with pytest.raises(ValueError, match='loss must be a scalar') as info: learn.fit(1)
    assert 'TypeError' not in notes(info.value)
    learn.loss_func = nn.CrossEntropyLoss()
    assert_clean_after_failure(learn, capsys)

def test_a_broken_after_fit_before_the_progress_bar_does_not_keep_it_open(bars, capsys):
    def broken(self): raise OSError('cleanup broke')
    learn = synth_learner(progress=True, logger=print_row)
    with pytest.raises(OSError) as info: learn.fit(1, cbs=Callback(after_fit=broken, order=10))
    assert learn.progress.mbar is None and learn.logger is print_row
    with pytest.raises(ZeroDivisionError) as info:               # failing again, in the middle of a fit
        learn.fit(1, cbs=[Callback(after_fit=broken, order=10), raise_at_zero()])
    assert 'after_fit raised OSError: cleanup broke (in Callback)' in notes(info.value)
    assert_clean_after_failure(learn, capsys)

def raise_at_zero():
    def boom(self): 1 / 0
    return Callback(after_step=boom)

def test_every_after_exception_handler_runs_even_if_one_fails():
    seen = []
    def broken(self): raise RuntimeError('handler broke')
    cbs = [Callback(after_exception=broken, order=-5),
           Callback(after_exception=lambda self: seen.append('later'))]
    learn = synth_learner(cbs=cbs)
    with pytest.raises(ZeroDivisionError) as info: learn.fit(1, cbs=raise_at_zero())
    assert seen == ['later'] and 'after_exception raised RuntimeError: handler broke' in notes(info.value)

def test_keyboard_interrupt_with_bars(bars, capsys):
    def interrupt(self):
        if self.iter == 2: raise KeyboardInterrupt
    learn = synth_learner(progress=True, logger=print_row)
    with pytest.raises(KeyboardInterrupt): learn.fit(2, cbs=Callback(after_batch=interrupt))
    assert len(learn.recorder.losses) == 3                     # the batches done are kept
    assert_clean_after_failure(learn, capsys)

def test_cancel_fit_in_the_middle_of_a_phase_closes_the_batch_bar(bars, capsys):
    def stop(self):
        if self.iter == 1: raise CancelFitException()
    learn = synth_learner(progress=True, logger=print_row)
    learn.fit(2, cbs=Callback(after_batch=stop))
    assert_clean_after_failure(learn, capsys)

def test_failed_validate_and_get_preds_close_their_bar(bars):
    learn = synth_learner(progress=True, logger=print_row)
    bad = DataLoader(Items(lambda i: {'x': X[i]}), batch_size=16)
    with pytest.raises(TypeError) as info: learn.validate(dl=bad)
    assert "the batch is a dict with keys ['x']" in notes(info.value)
    assert learn.progress.pbar is None
    with pytest.raises(TypeError): learn.get_preds(dl=bad)
    assert learn.progress.pbar is None and learn.recorder._valid_stack == []

def test_validate_failing_inside_a_validation_leaves_its_values_alone():
    "A callback validates another loader in the middle of the epoch's validation, and handles its error"
    bad = DataLoader(Items(lambda i: {'x': X[i]}), batch_size=16)
    errors = []
    def validate_bad(self):
        if self.iter != 1: return
        try: self.learn.validate(dl=bad)
        except TypeError as e: errors.append(e)
    clean = synth_learner(metrics=accuracy); clean.fit(1)
    learn = synth_learner(metrics=accuracy, cbs=Callback(after_loss=validate_bad, run_train=False))
    learn.fit(1)
    assert len(errors) == 1 and learn.recorder.values == clean.recorder.values
    assert learn.recorder._valid_stack == []

def test_html_bars_are_removed_after_a_failed_fit(monkeypatch):
    """Jupyter's bars (fastprogress's HTML ones) with a stand-in for IPython's display: the last update shows
    no bar"""
    import IPython.display
    from fastprogress.fastprogress import NBMasterBar, NBProgressBar
    shown = {}
    class Handle:
        def __init__(self, i): self.i = i
        def update(self, obj): shown[self.i] = str(obj)
    def display(obj, display_id=None, **kw):
        shown[len(shown)] = str(obj)
        return Handle(len(shown) - 1)
    monkeypatch.setattr(IPython.display, 'display', display)
    monkeypatch.setattr(learncb.progress, 'master_bar', NBMasterBar)
    monkeypatch.setattr(learncb.progress, 'progress_bar', NBProgressBar)
    monkeypatch.setattr(learncb.progress, 'can_draw_bars', lambda: True)
    learn = synth_learner(progress=True, logger=print_row)
    learn.loss_func = nn.CrossEntropyLoss(reduction='none')
    with pytest.raises(ValueError): learn.fit(1)
    assert shown and not any('<progress' in html for html in shown.values())

# ---------------------------------------------------------------- a diverging loss, a resumed table

@pytest.mark.parametrize('bad', [float('nan'), float('inf')], ids=['nan', 'inf'])
def test_non_finite_training_loss_warns_once_per_fit(bad):
    learn = synth_learner()
    learn.loss_func = lambda p, y: nn.functional.cross_entropy(p, y) + bad     # the gradients stay finite
    for _ in range(2):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            learn.fit(3)
        msgs = [str(m.message) for m in w if m.category is RuntimeWarning]
        assert len(msgs) == 1 and msgs[0].startswith(f'the training loss of epoch 0 is {bad}')
        assert 'TerminateOnNaNCallback()' in msgs[0] and 'lower learning rate (it went up to 0.1' in msgs[0]

def test_finite_loss_does_not_warn():
    learn = synth_learner()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        learn.fit(2)

def test_nan_check_adds_no_host_sync():
    def syncs(factor):
        learn = synth_learner(opt_func=torch.optim.SGD)
        learn.loss_func = lambda p, y: nn.functional.cross_entropy(p, y) * factor
        with warnings.catch_warnings(), SyncCounter() as counter:
            warnings.simplefilter('ignore')
            learn.fit(2)
        return counter.counts
    assert syncs(float('nan')) == syncs(1.)

def test_a_resumed_run_prints_the_header_again(tmp_path):
    rows = []
    learn = synth_learner(path=tmp_path, logger=rows.append)
    def boom(self):
        if self.epoch == 1 and self.iter == 2: raise RuntimeError('boom')
    with pytest.raises(RuntimeError):
        learn.fit(3, cbs=[CheckpointCallback(every_epoch=True), Callback(after_batch=boom)])
    assert rows[0][0] == 'epoch' and len(rows) == 2
    rows.clear()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # resuming from the middle of a batch is not exact
        learn.fit(3, cbs=CheckpointCallback(every_epoch=True), resume=True)
    assert rows[0] == ['epoch', 'train_loss', 'valid_loss', 'time'] and [r[0] for r in rows[1:]] == ['1', '2']

def test_recorder_state_ignores_an_old_header_flag():
    learn = synth_learner()
    learn.fit(1)
    state = learn.recorder.state_dict()
    assert '_header_logged' not in state
    rows = []
    other = synth_learner(logger=rows.append)
    other.recorder.load_state_dict({**state, '_header_logged': True})      # as older checkpoints hold
    assert other.recorder.values == learn.recorder.values and not other.recorder._header_logged

def test_validate_cancelled_before_the_recorder_began():
    """A callback that runs before the Recorder cancels a validate(): no values, and nothing of another
    validation popped"""
    def cancel(self): raise CancelValidException()
    learn = synth_learner()
    learn.fit(1)
    values = [list(v) for v in learn.recorder.values]
    assert learn.validate(cbs=Callback(before_validate=cancel, order=-1)) is None
    assert learn.recorder.values == values and learn.recorder._valid_stack == []
    assert learn.validate() is not None
