"""Failing fast, a replaced model and one run at a time: misuse is reported before the first batch,
naming the bad value and the fix; the optimizer follows the model; a fit cannot run inside or beside
another."""
import re, threading, warnings
import numpy as np
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from learncb.all import *
from learncb.core import foreign_events
from conftest import synth_learner, synth_dls, EventLog

class TrainBatches(Callback):
    "Counts the training batches that ran"
    order, run_valid = -100, False
    def __init__(self): self.n = 0
    def before_batch(self): self.n += 1

def counted(**kw):
    "A learner with a `TrainBatches` counter (`learn.train_batches.n`)"
    return synth_learner(cbs=[TrainBatches(), *kw.pop('cbs', [])], **kw)

def message(info):
    "The message of a caught exception with its notes"
    return '\n'.join([str(info.value), *getattr(info.value, '__notes__', [])])

def empty_dl():
    return DataLoader(TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)), batch_size=4)

class Stream(IterableDataset):
    "The synthetic items as a stream: a dataloader over it has no len"
    def __iter__(self): return iter(synth_dls().train.dataset)

def stream_dls(): return DataLoaders(DataLoader(Stream(), batch_size=16), None)

def two_groups(params, **kw):
    "An opt_func that puts the weight and the bias in two param groups"
    ps = list(params)
    return torch.optim.SGD([{'params': ps[:1]}, {'params': ps[1:]}], **kw)

def weights(learn): return [p.detach().clone() for p in learn.model.parameters()]

# ---------------------------------------------------------------- 1. arguments

@pytest.mark.parametrize('bad', [2.5, '3', True, None, np.float64(2.0), torch.tensor(2.0), torch.tensor(True),
                                 [2]])
def test_n_epoch_of_the_wrong_type(bad):
    learn = counted()
    with pytest.raises(TypeError) as info: learn.fit(bad)
    msg = message(info)
    assert f'n_epoch must be an int >= 0, not {bad!r}' in msg and 'a number of epochs, e.g. 3' in msg
    assert isinstance(info.value, ValueError)  # what learncb raised before: `except ValueError` still works
    assert learn.train_batches.n == 0 and learn.opt is None

def test_negative_n_epoch():
    learn = counted()
    with pytest.raises(ValueError, match=r'fit: n_epoch must be an int >= 0, not -1'): learn.fit(-1)
    assert learn.train_batches.n == 0

@pytest.mark.parametrize('n', [np.int64(2), np.int32(2), torch.tensor(2), 2])
def test_integral_n_epoch_accepted(n):
    learn = counted()
    learn.fit(n)
    assert type(learn.n_epoch) is int and learn.n_epoch == 2 and learn.train_batches.n == 8

FITS = {'fit': lambda learn, **kw: learn.fit(1, **kw),
        'fit_one_cycle': lambda learn, lr=None, **kw: learn.fit_one_cycle(1, lr_max=lr, **kw),
        'fit_flat_cos': lambda learn, **kw: learn.fit_flat_cos(1, **kw)}

@pytest.mark.parametrize('entry', ['Learner', *FITS])
@pytest.mark.parametrize('bad', [-1e-3, float('inf'), float('nan'), [0.1, -0.1]])
def test_lr_must_be_finite_and_not_negative(entry, bad):
    learn = counted()
    with pytest.raises(ValueError) as info:
        if entry == 'Learner': counted(lr=bad)
        else: FITS[entry](learn, lr=bad)
    msg = message(info)
    assert f'not {bad!r}' in msg and 'must be a number >= 0 (not inf or nan)' in msg
    assert 'learn.lr_find() suggests one' in msg
    assert learn.train_batches.n == 0 and learn.opt is None

@pytest.mark.parametrize('entry', ['Learner', *FITS])
def test_lr_0_trains_nothing(entry):
    "As in PyTorch and fastai, lr=0 runs the loop (losses, metrics, callbacks) without changing the weights"
    learn = counted(lr=0,
                    opt_func=torch.optim.SGD) if entry == 'Learner' else counted(opt_func=torch.optim.SGD)
    w = learn.model.weight.clone()
    if entry == 'Learner': learn.fit(1)
    else: FITS[entry](learn, lr=0)
    assert learn.train_batches.n > 0 and torch.equal(learn.model.weight, w)

@pytest.mark.parametrize('entry', ['Learner', *FITS])
def test_lr_of_the_wrong_type(entry):
    learn = counted()
    with pytest.raises(TypeError, match=r"lr(_max)? must be a number >= 0.*not '1e-3'"):
        if entry == 'Learner': counted(lr='1e-3')
        else: FITS[entry](learn, lr='1e-3')
    assert learn.train_batches.n == 0

@pytest.mark.parametrize('entry', ['Learner', *FITS])
@pytest.mark.parametrize('bad', [-0.01, float('inf'), 'l2'])
def test_wd_must_be_finite_and_not_negative(entry, bad):
    learn = counted()
    with pytest.raises((ValueError, TypeError)) as info:
        if entry == 'Learner': counted(wd=bad)
        else: FITS[entry](learn, wd=bad)
    msg = message(info)
    assert (f'wd must be a number >= 0' in msg and f'not {bad!r}' in msg and 'a weight decay such as 0.01'
            in msg)
    assert learn.train_batches.n == 0 and learn.opt is None

def test_learner_lr_replaced_by_hand_is_checked_at_fit():
    learn = counted()
    learn.lr = -1
    with pytest.raises(ValueError, match=r'fit: learn.lr must be a number >= 0.*not -1'): learn.fit(1)
    assert learn.train_batches.n == 0

def test_one_lr_per_param_group():
    learn = counted(opt_func=two_groups, lr=[0.1, 0.01], wd=[0., 0.1])
    learn.fit(1)
    assert [(pg['lr'], pg['weight_decay']) for pg in learn.opt.param_groups] == [(0.1, 0.), (0.01, 0.1)]
    learn.fit(1, lr=[0.2, 0.02])
    assert [pg['lr'] for pg in learn.opt.param_groups] == [0.2, 0.02]

def test_lr_list_longer_than_the_param_groups():
    log = EventLog()
    learn = counted(cbs=[log])
    with pytest.raises(ValueError) as info: learn.fit(1, lr=[0.1, 0.01])
    msg = message(info)
    assert ('lr=[0.1, 0.01] gives 2 values, but Adam has 1 param group' in msg and 'pass one lr, or one per'
            in msg)
    assert learn.train_batches.n == 0 and 'before_fit' not in log.log

def test_loss_func_class_instead_of_instance():
    with pytest.raises(TypeError) as info:
        Learner(synth_dls(), nn.Linear(2, 2), nn.CrossEntropyLoss, device='cpu')
    assert 'not the class CrossEntropyLoss: call it, loss_func=nn.CrossEntropyLoss()' in message(info)
    learn = counted()
    learn.loss_func = nn.MSELoss
    with pytest.raises(TypeError, match=r'not the class MSELoss: call it, loss_func=nn.MSELoss\(\)'):
        learn.fit(1)
    assert learn.train_batches.n == 0

def test_loss_func_not_callable():
    with pytest.raises(TypeError, match=r"loss_func must be a function loss_func\(pred, \*yb\).*not "
                                        r"'cross_entropy'"):
        Learner(synth_dls(), nn.Linear(2, 2), 'cross_entropy', device='cpu')

def test_model_class_instead_of_instance():
    with pytest.raises(TypeError, match=r'not the class Linear: make one, model=Linear\(...\)'):
        Learner(synth_dls(), nn.Linear, nn.CrossEntropyLoss(), device='cpu')

@pytest.mark.parametrize('name, fix', [('accuracy', 'from learncb.metrics import accuracy; metrics=accuracy'),
                                       ('error_rate', 'from learncb.metrics import error_rate; '
                                                      'metrics=error_rate'),
                                       ('f1_score_macro', 'pass the function itself')])
def test_metric_given_as_a_string(name, fix):
    with pytest.raises(TypeError) as info: counted(metrics=[name])
    assert f'not the string {name!r}' in message(info) and fix in message(info)

def test_metric_replaced_by_a_string_is_checked_at_fit():
    learn = counted()
    learn.metrics = 'accuracy'
    with pytest.raises(TypeError, match="not the string 'accuracy'.*import accuracy"): learn.fit(1)
    assert learn.train_batches.n == 0

def test_metric_class_and_non_callable():
    class Acc:
        def update(self, pred, targ): pass
        def compute(self): return 1.
        def reset(self): pass
    with pytest.raises(TypeError, match=r'not the class Acc: pass an instance, Acc\(...\)'):
        counted(metrics=Acc)
    with pytest.raises(TypeError, match=r'not 0.5'): counted(metrics=[accuracy, 0.5])
    learn = counted(metrics=[Acc(), accuracy])                 # a metric object need not be callable
    learn.fit(1)
    assert learn.recorder.valid_names == ['valid_loss', 'acc', 'accuracy']

def test_single_metric_set_by_hand_is_a_list_at_fit():
    learn = counted()
    learn.metrics = accuracy
    learn.fit(1)
    assert learn.metrics == [accuracy] and learn.recorder.valid_names == ['valid_loss', 'accuracy']

def after_batch(self): pass
def log_lr(learn): pass

@pytest.mark.parametrize('bad, named, fix', [
    ('early_stopping', "the string 'early_stopping'", 'Callback(after_batch=fn)'),
    (log_lr, 'the function log_lr', 'learn.on(event.after_batch)(fn)'),
    (after_batch, 'the function after_batch', 'Callback(after_batch=fn)'),
    (dict, 'the class dict', 'subclass Callback'),
    (torch.optim.SGD, 'the class SGD', 'Callback(after_batch=fn)')])
def test_cbs_that_are_not_callbacks(bad, named, fix):
    good = Callback(before_fit=lambda self: None, name='good')
    learn = counted()
    before = list(learn.cbs)
    with pytest.raises(TypeError) as info: learn.fit(1, cbs=[good, bad])
    assert f'{named} is not a Callback' in message(info) and fix in message(info)
    assert learn.cbs == before and not hasattr(learn, 'good')        # none of the fit's callbacks stayed
    assert learn.train_batches.n == 0
    with pytest.raises(TypeError, match='is not a Callback'): synth_learner(cbs=[good, bad])
    with pytest.raises(TypeError, match='is not a Callback'): learn.add_cbs([Callback(name='other'), bad])
    assert learn.cbs == before

def test_function_named_like_an_event_is_pointed_to_that_event():
    def after_epoch(self): pass
    with pytest.raises(TypeError, match=r'Callback\(after_epoch=fn\).*learn.on\(event.after_epoch\)\(fn\)'):
        synth_learner(cbs=after_epoch)

def test_callback_class_that_needs_arguments():
    with pytest.raises(TypeError) as info: synth_learner().fit(1, cbs=WarmupCallback)
    assert 'the class WarmupCallback was given as a callback' in message(info)
    assert 'pass an instance, WarmupCallback(...)' in message(info)

@pytest.mark.parametrize('bad', ['last', None, 1.5, True])
def test_callback_order_must_be_an_int(bad):
    class Late(Callback): order = bad
    learn = counted()
    with pytest.raises(TypeError) as info: learn.fit(1, cbs=Late)
    assert (f'Late: order must be an int, not {bad!r}' in message(info) and 'TrainEvalCallback is -10'
            in message(info))
    assert learn.train_batches.n == 0
    with pytest.raises(TypeError, match=f"Callback\\('mine'\\): order must be an int, not {bad!r}"):
        Callback(name='mine', order=bad)
    cb = Callback(name='set_later')
    with pytest.raises(TypeError, match="Callback\\('set_later'\\): order must be an int"): cb.order = bad
    assert cb.order == 0

def test_callback_order_numpy_int_accepted():
    cb = Callback(after_fit=lambda self: None, order=np.int64(7))
    assert cb.order == 7 and type(cb.order) is int

def test_opt_func_given_an_optimizer_instance():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError) as info: Learner(synth_dls(), model, nn.CrossEntropyLoss(), opt_func=opt)
    msg = message(info)
    assert ('not the optimizer SGD already made' in msg and 'opt_func=torch.optim.SGD' in msg
            and 'learn.opt =' in msg)

def test_opt_func_not_callable_or_not_making_an_optimizer():
    with pytest.raises(TypeError, match="opt_func must be a function that makes an optimizer.*not 'adam'"):
        synth_learner(opt_func='adam')
    learn = counted(opt_func=lambda params, lr: list(params))
    with pytest.raises(TypeError, match='returned list, not an optimizer'): learn.fit(1)
    assert learn.train_batches.n == 0 and learn.opt is None

# ---------------------------------------------------------------- 1. data

@pytest.mark.parametrize('which', ['training', 'validation'])
def test_empty_dataloader_reported_when_fit_starts(which):
    log = EventLog()
    train, valid = synth_dls()
    dls = DataLoaders(empty_dl(), valid) if which == 'training' else DataLoaders(train, empty_dl())
    learn = counted(dls=dls, cbs=[log])
    with pytest.raises(ValueError) as info: learn.fit(1)
    assert f'the {which} dataloader is empty (len 0)' in message(info) and 'drop_last=True' in message(info)
    assert learn.train_batches.n == 0 and log.log == ['after_create']       # not even before_fit
    assert learn.opt is None

def test_drop_last_larger_than_the_validation_set():
    small = DataLoader(TensorDataset(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long)), batch_size=4,
                       drop_last=True)
    learn = counted(dls=DataLoaders(synth_dls().train, small))
    with pytest.raises(ValueError, match='validation dataloader is empty'): learn.fit(1)
    assert learn.train_batches.n == 0

def test_no_training_dataloader():
    learn = counted(dls=DataLoaders(None, synth_dls().valid))
    with pytest.raises(ValueError, match=r'there is no training dataloader: pass one in DataLoaders\(train, '
                                         r'valid\)'):
        learn.fit(1)

SCHEDULED = {'fit_one_cycle': lambda learn: learn.fit_one_cycle(1),
             'fit_flat_cos': lambda learn: learn.fit_flat_cos(1),
             'ParamScheduler': lambda learn: learn.fit(1, cbs=ParamScheduler({'lr': SchedLin(0.1, 0.01)}))}

@pytest.mark.parametrize('who', SCHEDULED)
def test_schedule_on_a_dataloader_without_len(who):
    learn = counted(dls=stream_dls())
    with pytest.raises(ValueError) as info: SCHEDULED[who](learn)
    msg = message(info)
    assert f'{who}: the training dataloader (DataLoader) has no len()' in msg
    assert 'give it a length' in msg and 'LRSchedulerCallback or WarmupCallback' in msg
    assert learn.train_batches.n == 0
    if who != 'ParamScheduler': assert learn.opt is None
    learn.fit(1)                                              # without a schedule, a stream trains
    assert learn.train_batches.n == 4

def test_step_based_schedule_on_a_dataloader_without_len():
    learn = counted(dls=stream_dls())
    learn.fit(1, cbs=WarmupCallback(2))
    assert learn.train_batches.n == 4

# ---------------------------------------------------------------- 1. callbacks that cannot work

@pytest.mark.parametrize('tracker', [EarlyStoppingCallback, SaveModelCallback, ReduceLROnPlateau])
@pytest.mark.parametrize('monitor', ['valid_loss', 'accuracy'])
def test_tracker_of_a_validation_value_without_validation(tracker, monitor, tmp_path):
    learn = counted(dls=synth_dls(n_valid=0), metrics=accuracy, path=tmp_path)
    w = weights(learn)
    with pytest.raises(ValueError) as info: learn.fit(2, cbs=tracker(monitor=monitor))
    msg = message(info)
    assert f"{tracker.__name__} monitors {monitor!r}, a value of the validation" in msg
    assert ('no validation dataloader' in msg and 'DataLoaders(train, valid)' in msg
            and "monitor 'train_loss'" in msg)
    assert "raised by" in msg and "'before_fit'" in msg
    assert learn.train_batches.n == 0 and all(torch.equal(a, b) for a, b in zip(w, weights(learn)))
    assert not (tmp_path/'models').exists()

def test_tracker_of_the_training_loss_without_validation():
    learn = counted(dls=synth_dls(n_valid=0))
    learn.fit(2, cbs=EarlyStoppingCallback(monitor='train_loss', patience=5))
    assert learn.train_batches.n == 8

# ---------------------------------------------------------------- 1. handler names from other libraries

FOREIGN = [('on_train_epoch_end', 'after_epoch', 'Lightning'), ('on_epoch_end', 'after_epoch', 'Keras'),
           ('on_train_epoch_end', 'after_train', 'pytorch-accelerated'), ('on_epoch_end', 'after_train',
    'Hugging Face'),
           ('on_train_epoch_start', 'before_train', 'pytorch-accelerated'), ('on_train_epoch_begin',
    'before_train', 'fastNLP'),
           ('on_train_batch_end', 'after_batch', 'Keras'), ('on_fit_start', 'before_fit', 'Lightning'),
           ('on_train_begin', 'before_fit', 'fastNLP'), ('on_batch_end', 'after_batch', 'fastai v1'),
           ('on_training_run_start', 'before_fit', 'pytorch-accelerated'),
           ('on_train_step_end', 'after_batch', 'pytorch-accelerated'),
           ('on_fetch_data_begin', 'before_fetch', 'fastNLP'),
           ('on_validation_epoch_end', 'after_validate', 'Lightning')]

@pytest.mark.parametrize('name, ev, lib', FOREIGN)
def test_method_named_like_another_librarys_event_warns_when_added(name, ev, lib):
    Foreign = type('Foreign', (Callback,), {name: lambda self: None})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn = synth_learner(cbs=Foreign())
    msgs = [str(o.message) for o in w if issubclass(o.category, UserWarning)]
    said = (rf"Foreign.{name} is not an event and will never be called; did you mean .*{ev!r}\??( \(where)? "
            rf"[^)]*{lib}")
    # the event, then in parentheses the libraries firing it there
    assert any(re.search(said, m) for m in msgs), msgs
    assert learn.foreign in learn.cbs                                      # added all the same: a warning

@pytest.mark.parametrize('name, ev, lib', FOREIGN)
def test_learn_on_with_another_librarys_event_raises(name, ev, lib):
    learn = synth_learner()
    with pytest.raises(ValueError, match=rf"learn.on: {name!r} is not an event; did you mean .*{ev!r}\??( "
                                         rf"\(where)? [^)]*{lib}"):
        learn.on(name)
    with pytest.raises(ValueError, match=f"did you mean .*{ev!r}"): learn(name)

@pytest.mark.parametrize('name, ev, lib', FOREIGN)
def test_callback_keyword_of_another_librarys_event_raises(name, ev, lib):
    with pytest.raises(TypeError, match=rf"unknown keyword {name!r}; did you mean .*{ev!r}\??( \(where)? "
                                        rf"[^)]*{lib}"):
        Callback(**{name: lambda self: None})

def test_foreign_event_table():
    assert all(ev in event for names in foreign_events.values() for ev in names.values())
    assert {'Keras', 'Lightning', 'fastNLP', 'pytorch-accelerated', 'Hugging Face'} <= set(foreign_events)
    assert not {n for names in foreign_events.values() for n in names} & set(event)

# ---------------------------------------------------------------- 3. the optimizer follows the model

def test_replaced_model_gets_a_new_optimizer_and_trains():
    learn = counted()
    learn.fit(1)
    old_opt = learn.opt
    learn.model = nn.Linear(2, 2)
    w = weights(learn)
    with pytest.warns(UserWarning,
                      match=r'learn.model \(or some of its parameters\) changed.*reset_opt=True'):
        learn.fit(2)
    assert learn.opt is not old_opt and learn.opt.param_groups[0]['params'][0] is learn.model.weight
    assert not torch.equal(w[0], learn.model.weight)                      # it trained
    assert learn.recorder.values[0][0] != learn.recorder.values[1][0]   # and the loss moves

def test_replaced_layer_gets_a_new_optimizer():
    learn = synth_learner(model=nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2)))
    learn.fit(1)
    learn.model[2] = nn.Linear(4, 2)
    with pytest.warns(UserWarning, match='changed since the optimizer was made'): learn.fit(1)
    assert any(p is learn.model[2].weight for pg in learn.opt.param_groups for p in pg['params'])

def test_unchanged_model_keeps_its_optimizer_and_its_state():
    learn = synth_learner()
    learn.fit(1)
    opt, state = learn.opt, learn.opt.state_dict()['state'][0]['exp_avg'].clone()
    learn.model.load_state_dict(learn.model.state_dict())               # same tensors
    learn.model.to('cpu')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn.fit(1)
    assert not any('changed since the optimizer' in str(o.message) for o in w)
    assert learn.opt is opt and not torch.equal(state, learn.opt.state_dict()['state'][0]['exp_avg'])

def test_reset_opt_after_replacing_the_model_does_not_warn():
    learn = synth_learner()
    learn.fit(1)
    learn.model = nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn.fit(1, reset_opt=True)
    assert not any('changed since the optimizer' in str(o.message) for o in w)
    assert learn.opt.param_groups[0]['params'][0] is learn.model.weight

def test_fit_one_cycle_after_replacing_the_model():
    learn = synth_learner()
    learn.fit(1)
    learn.model = nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn.fit_one_cycle(1)
    assert sum('changed since the optimizer was made' in str(o.message) for o in w) == 1
    assert learn.opt.param_groups[0]['params'][0] is learn.model.weight

def test_optimizer_set_by_hand_on_other_tensors_raises():
    learn = counted()
    learn.opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    w = weights(learn)
    with pytest.raises(ValueError) as info: learn.fit(1)
    msg = message(info)
    assert 'learn.opt (SGD, set by hand) updates tensors that are not parameters of learn.model' in msg
    assert 'reset_opt=True' in msg and learn.train_batches.n == 0
    assert all(torch.equal(a, b) for a, b in zip(w, weights(learn)))

def test_optimizer_set_by_hand_on_the_model_is_used():
    learn = synth_learner()
    opt = torch.optim.SGD(learn.model.parameters(), lr=0.1, momentum=0.9)
    learn.opt = opt
    learn.fit(1)
    assert learn.opt is opt and opt.state

# ---------------------------------------------------------------- 4. one run at a time

def nested(call):
    "A callback that calls `call(learn)` at `after_epoch` and keeps the error it raises"
    class Nested(Callback):
        def __init__(self): self.errors = []
        def after_epoch(self):
            try: call(self.learn)
            except RuntimeError as e: self.errors.append(str(e))
    return Nested()

CALLS = {'fit': (lambda learn: learn.fit(1), 'learn.fit()'),
         'fit_reset_opt': (lambda learn: learn.fit(1, reset_opt=True, lr=5.), 'learn.fit()'),
         'lr_find': (lambda learn: learn.lr_find(show_plot=False), 'learn.lr_find()'),
         'fit_one_cycle': (lambda learn: learn.fit_one_cycle(1, reset_opt=True), 'learn.fit_one_cycle()'),
         'fit_flat_cos': (lambda learn: learn.fit_flat_cos(1, lr=5.), 'learn.fit_flat_cos()')}

@pytest.mark.parametrize('what', CALLS)
def test_fit_from_a_callback_raises_and_the_outer_fit_goes_on(what):
    call, name = CALLS[what]
    plain = synth_learner()
    plain.fit(3)
    cb = nested(call)
    learn = synth_learner(cbs=cb)
    learn.fit(3)
    assert len(cb.errors) == 3
    assert cb.errors[0].startswith(f'{name} was called during learn.fit() of this learner (from a callback?)')
    assert 'learn.validate() or learn.get_preds()' in cb.errors[0]
    assert (learn.epoch, learn.n_epoch, learn.train_iter) == (2, 3, 12)
    assert all(torch.equal(a, b) for a, b in zip(weights(plain), weights(learn)))  # exactly as if not called
    assert learn.recorder.values == plain.recorder.values and learn.recorder.lrs == plain.recorder.lrs

def test_uncaught_nested_fit_ends_the_outer_fit_clearly_and_the_learner_is_usable():
    learn = synth_learner()
    # after the Recorder's
    refit = Callback(after_epoch=lambda self: self.learn.fit(1), name='refit', order=99)
    with pytest.raises(RuntimeError) as info: learn.fit(3, cbs=refit)
    msg = message(info)
    assert ('learn.fit() was called during learn.fit()' in msg and "raised by Callback('refit') in "
                                                                   "'after_epoch'" in msg)
    assert len(learn.recorder.values) == 1 and learn._running is None and not learn.fitting
    learn.fit(1)
    assert len(learn.recorder.values) == 1 and learn.exception is None

def test_fit_from_a_callback_of_validate_raises():
    learn = synth_learner()
    with pytest.raises(RuntimeError,
                       match=r'learn.fit\(\) was called during learn.validate\(\) or learn.get_preds\(\)'):
        learn.validate(cbs=Callback(after_validate=lambda self: self.learn.fit(1)))
    assert learn.opt is None and learn._running is None

def test_validate_and_get_preds_inside_a_fit_still_work():
    seen = []
    def look(self): seen.append((self.learn.validate(), self.learn.get_preds()[0].shape))
    learn = synth_learner()
    learn.fit(2, cbs=Callback(after_epoch=look))
    assert len(seen) == 2 and seen[0][1] == (32, 2)

def fit_in_thread(learn, n_epoch=1):
    """Start `learn.fit` in a thread that waits in `before_fit` until released; returns (thread, release,
    errors)"""
    started, release, errors = threading.Event(), threading.Event(), []
    def wait(self): started.set(); release.wait(30)
    def run():
        try: learn.fit(n_epoch, cbs=Callback(before_fit=wait))
        except BaseException as e: errors.append(e)
    t = threading.Thread(target=run, name='trainer', daemon=True)
    t.start()
    assert started.wait(30)
    return t, release, errors

@pytest.mark.parametrize('what', ['fit', 'fit_one_cycle', 'lr_find', 'validate'])
def test_second_thread_raises_at_once_and_the_first_fit_goes_on(what):
    learn = counted()
    t, release, errors = fit_in_thread(learn, 2)
    try:
        call = {'fit': lambda: learn.fit(1), 'fit_one_cycle': lambda: learn.fit_one_cycle(1),
                'lr_find': lambda: learn.lr_find(show_plot=False), 'validate': lambda: learn.validate()}[what]
        with pytest.raises(RuntimeError) as info: call()
        msg = message(info)
        assert "in thread 'MainThread' while thread 'trainer' runs learn.fit() on this learner" in msg
        assert 'thread.join()' in msg and learn.train_batches.n == 0
    finally:
        release.set(); t.join(30)
    assert not t.is_alive() and errors == []
    assert learn.train_batches.n == 8 and len(learn.recorder.values) == 2 and learn._running is None

def test_fits_in_turn_from_two_threads():
    learn = counted()
    t = threading.Thread(target=learn.fit, args=(1,), daemon=True)
    t.start(); t.join(60)
    assert not t.is_alive()
    learn.fit(1)
    assert learn.train_batches.n == 8
