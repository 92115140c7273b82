"""Files and resume: nothing the user had is lost, and a resumed run is the same run.

Loads that do not fit change nothing; files from wrapped models load; damaged files are refused by their
checksum and `resume=True` goes back to an intact one; the user's dataloader is never replaced; Ctrl-C's
handler comes back after every fit; a resume checks the data and says when the run is over; save names and
write errors name the right file."""
import copy, errno, os, re, signal, warnings
from pathlib import Path
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset
from learncb.all import *
from conftest import synth_dls, synth_learner, CrashAt

# ---------------------------------------------------------------- helpers

class CountBatches(Callback):
    "Counts the training batches that ran"
    order = -50
    def __init__(self): self.n = 0
    def before_batch(self):
        if self.training: self.n += 1

def snapshot(learn):
    "What a failed load must leave as it was: weights, optimizer state, history, loop position, learn.state"
    return {'model': {k: v.clone() for k, v in learn.model.state_dict().items()},
            'opt': None if learn.opt is None else copy.deepcopy(learn.opt.state_dict()),
            'values': copy.deepcopy(learn.recorder.values), 'losses': list(learn.recorder.losses),
            'loop': (learn.epoch, learn.iter, learn.train_iter), 'state': dict(learn.state)}

def same_tensors(a, b):
    if isinstance(a, dict): return a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor): return torch.equal(a, b)
    return a == b

def assert_untouched(learn, before):
    after = snapshot(learn)
    for k in before: assert same_tensors(before[k], after[k]), f'{k} changed'

def messages(info): return str(info.value) + '\n'.join(getattr(info.value, '__notes__', []))

def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(),
                                                 b.model.state_dict().values()))

def flip_a_weight_byte(path, tensor):
    "Change one byte of `tensor`'s data inside the file `path` (torch.load alone does not notice)"
    data = bytearray(path.read_bytes())
    at = data.find(tensor.detach().numpy().tobytes())
    assert at >= 0
    data[at + 1] ^= 0x40
    path.write_bytes(bytes(data))

def net_learner(path, dls=None, **kw):
    "A network with dropout (so that the random state matters) on shuffled data: 4 training batches per epoch"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    return synth_learner(dls=dls if dls is not None else synth_dls(shuffle=True), model=model, path=path,
                         **kw)

def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return fn(*args, **kw)

# ---------------------------------------------------------------- 3. loads validate the whole file first

@pytest.mark.parametrize('saved_with, loaded_with, lacking', [(torch.optim.SGD, torch.optim.Adam, 'betas'),
                                                              (torch.optim.Adam, torch.optim.SGD,
                                                               'momentum')])
def test_load_with_another_optimizers_state_raises_and_changes_nothing(tmp_path, saved_with, loaded_with,
        lacking):
    other = synth_learner(path=tmp_path, opt_func=saved_with)
    other.fit(1)
    other.save('theirs')
    learn = synth_learner(path=tmp_path, opt_func=loaded_with)
    learn.fit(1)
    learn.state.note = 'mine'
    before = snapshot(learn)
    with pytest.raises(ValueError) as info: learn.load('theirs')
    msg = messages(info)
    assert 'theirs.pth' in msg and f"'{lacking}'" in msg and loaded_with.__name__ in msg
    assert 'with_opt=False' in msg and 'same opt_func' in msg
    assert_untouched(learn, before)
    learn.fit(1)                                                   # the optimizer still works
    learn.load('theirs', with_opt=False)                           # and the weights alone load
    assert same_weights(learn, other)

def test_load_with_other_parameter_groups_raises_and_changes_nothing(tmp_path):
    two = synth_learner(path=tmp_path, model=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    two.opt_func = lambda params, **kw: torch.optim.Adam([{'params': two.model[0].parameters()},
                                                           {'params': two.model[1].parameters()}], **kw)
    two.fit(1)
    two.save('grouped')
    learn = synth_learner(path=tmp_path, model=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    learn.fit(1)
    before = snapshot(learn)
    with pytest.raises(ValueError, match=r'grouped.pth: its optimizer state does not fit') as info:
        learn.load('grouped')
    assert 'parameter groups' in messages(info)
    assert_untouched(learn, before)

def test_load_into_a_learner_without_optimizer_leaves_it_without(tmp_path):
    sgd = synth_learner(path=tmp_path, opt_func=torch.optim.SGD)
    sgd.fit(1)
    sgd.save('sgd')
    fresh = synth_learner(path=tmp_path)
    assert fresh.opt is None
    w = fresh.model.weight.detach().clone()
    with pytest.raises(ValueError, match='sgd.pth: its optimizer state does not fit'): fresh.load('sgd')
    assert fresh.opt is None and torch.equal(fresh.model.weight, w)

def test_load_checkpoint_with_another_optimizers_state_raises_and_changes_nothing(tmp_path):
    sgd = synth_learner(path=tmp_path, opt_func=torch.optim.SGD)
    sgd.fit(1)
    path = sgd.save_checkpoint(tmp_path/'sgd.pt')
    learn = synth_learner(path=tmp_path)
    learn.fit(2)
    learn.state.best = 0.5
    before = snapshot(learn)
    with pytest.raises(ValueError) as info: learn.load_checkpoint(path)
    assert 'sgd.pt: its optimizer state does not fit' in messages(info) and "'betas'" in messages(info)
    assert_untouched(learn, before)
    counter = CountBatches()
    learn.fit(1, cbs=counter)                                      # the next fit trains as before
    assert counter.n == 4

def test_resume_with_another_optimizers_state_raises_before_any_batch(tmp_path):
    sgd = synth_learner(path=tmp_path, opt_func=torch.optim.SGD)
    with pytest.raises(RuntimeError): sgd.fit(2, cbs=[CheckpointCallback(every_n_steps=2), CrashAt(2)])
    learn = synth_learner(path=tmp_path)
    learn.fit(1)
    before, counter = snapshot(learn), CountBatches()
    with pytest.raises(ValueError, match=r'checkpoint_00000002_batch.pt: its optimizer state does not fit '
                                         r'.*Adam'):
        learn.fit(2, cbs=counter, resume=True)
    assert counter.n == 0
    assert_untouched(learn, before)

def test_a_callbacks_state_that_fails_to_load_changes_nothing(tmp_path):
    class Fussy(Callback):
        "Counts batches; refuses a saved count over 1"
        _state_attrs = ('seen',)
        def __init__(self): self.seen = 0
        def after_batch(self): self.seen += 1
        def load_state_dict(self, state):
            if state['seen'] > 1: raise KeyError('seen')
            super().load_state_dict(state)
    learn = synth_learner(path=tmp_path, cbs=Fussy())
    learn.fit(1)
    path = learn.save_checkpoint(tmp_path/'c.pt')
    other = synth_learner(path=tmp_path, cbs=Fussy())
    other.fit(2)  # the optimizer state loads before it, then is undone
    before = snapshot(other)
    with pytest.raises(KeyError) as info: other.load_checkpoint(path)
    assert "c.pt: the state saved for callback 'fussy' does not load" in messages(info)
    assert_untouched(other, before)

# ---------------------------------------------------------------- 3. wrapped models, strict=False

class Wrap(nn.Module):
    "A model inside a wrapper, as DistributedDataParallel (`module`) or torch.compile (`_orig_mod`) hold it"
    def __init__(self, inner, attr='module'):
        super().__init__()
        setattr(self, attr, inner); self.attr = attr
    def forward(self, x): return getattr(self, self.attr)(x)

@pytest.mark.parametrize('wrappers', [['module'], ['_orig_mod'], ['_orig_mod', 'module']])
def test_weights_of_a_wrapped_model_load_into_the_plain_model(tmp_path, wrappers):
    torch.manual_seed(1)
    model = nn.Linear(2, 2)
    for attr in reversed(wrappers): model = Wrap(model, attr)
    wrapped = synth_learner(path=tmp_path, model=model)
    wrapped.fit(1)
    wrapped.save('wrapped')
    assert all(k.startswith('.'.join(wrappers) + '.') for k in wrapped.model.state_dict())
    plain = synth_learner(path=tmp_path)
    plain.load('wrapped')
    inner = wrapped.model
    for attr in wrappers: inner = getattr(inner, attr)
    assert torch.equal(plain.model.weight, inner.weight) and torch.equal(plain.model.bias, inner.bias)
    assert same_tensors(plain.opt.state_dict()['state'], wrapped.opt.state_dict()['state'])

def test_weights_of_a_plain_model_load_into_a_wrapped_one(tmp_path):
    plain = synth_learner(path=tmp_path)
    plain.fit(1)
    plain.save('plain')
    wrapped = synth_learner(path=tmp_path, model=Wrap(nn.Linear(2, 2)))
    wrapped.load('plain')
    assert torch.equal(wrapped.model.module.weight, plain.model.weight)

def test_a_checkpoint_of_a_wrapped_model_resumes_in_the_plain_model(tmp_path):
    torch.manual_seed(0)
    wrapped = synth_learner(path=tmp_path, model=Wrap(nn.Linear(2, 2)))
    with pytest.raises(RuntimeError): wrapped.fit(2, cbs=[CheckpointCallback(every_n_steps=1), CrashAt(3)])
    plain = synth_learner(path=tmp_path)
    plain.fit(2, resume=tmp_path/'checkpoints'/'checkpoint_00000003_batch.pt')
    assert plain.train_iter == 8 and len(plain.recorder.values) == 2

def test_strict_false_with_no_key_in_common_raises_and_changes_nothing(tmp_path):
    learn = synth_learner(path=tmp_path)
    atomic_save({'model': {'encoder.weight': torch.ones(2, 2), 'encoder.bias': torch.ones(2)}},
                tmp_path/'models'/'encoder.pth')
    before = snapshot(learn)
    with pytest.raises(ValueError) as info: learn.load('encoder', strict=False)
    msg = messages(info)
    assert ('encoder.pth has no key in common with the model' in msg and "'encoder.weight'" in msg
            and "'weight'" in msg)
    assert_untouched(learn, before)

def test_strict_false_with_some_keys_in_common_warns_with_the_keys(tmp_path):
    first = nn.Linear(2, 2)
    atomic_save({'model': {'0.weight': first.weight.detach() + 1, '0.bias': first.bias.detach(),
                           'head.weight': torch.ones(2, 2)}}, tmp_path/'models'/'part.pth')
    learn = synth_learner(path=tmp_path, model=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    kept = learn.model[1].weight.detach().clone()
    with pytest.warns(UserWarning, match=r"part.pth: strict=False loaded 2 of the model's 4 entries; left as "
                                         r"they "
                                         r"were \(not in the file\): \['1.weight', '1.bias'\]; ignored \(not "
                                         r"in the "
                                         r"model\): \['head.weight'\]"):
        learn.load('part', strict=False)
    assert torch.equal(learn.model[0].weight, first.weight + 1) and torch.equal(learn.model[1].weight, kept)

# ---------------------------------------------------------------- 3. checksums and damaged checkpoints

def test_a_checkpoint_whose_bytes_changed_is_refused_naming_it(tmp_path):
    learn = synth_learner(path=tmp_path)
    learn.fit(1)
    path = learn.save_checkpoint(tmp_path/'c.pt')
    assert torch.load(path, weights_only=True)['checksum'].startswith('sha256:')
    flip_a_weight_byte(path, learn.model.weight)
    learn.fit(1)
    before = snapshot(learn)
    with pytest.raises(CorruptFileError,
                       match=r'c.pt is damaged: its content does not match the checksum') as info:
        learn.load_checkpoint(path)
    assert 'another copy' in messages(info)
    assert_untouched(learn, before)
    counter = CountBatches()
    with pytest.raises(CorruptFileError, match='c.pt is damaged'): learn.fit(1, cbs=counter, resume=path)
    assert counter.n == 0

def test_a_weights_file_whose_bytes_changed_is_refused_naming_it(tmp_path):
    learn = synth_learner(path=tmp_path)
    learn.fit(1)
    path = learn.save('m')
    flip_a_weight_byte(path, learn.model.weight)
    before = snapshot(learn)
    with pytest.raises(CorruptFileError, match=r'm.pth is damaged'): learn.load('m')
    assert_untouched(learn, before)

@pytest.mark.parametrize('damage,resume', [('truncate', True), ('flip', True), ('truncate', 'auto')])
def test_resume_true_goes_back_to_the_newest_intact_checkpoint(tmp_path, damage, resume):
    "The warning names the `resume` given: `resume='auto'` is not told `resume=True`"
    ref = net_learner(tmp_path/'ref')
    ref.fit(3, cbs=CheckpointCallback(every_n_steps=1))
    crashed = net_learner(tmp_path/'run')
    with pytest.raises(RuntimeError): crashed.fit(3, cbs=[CheckpointCallback(every_n_steps=1), CrashAt(6)])
    folder = tmp_path/'run'/'checkpoints'
    newest = checkpoints_in(folder)[-1]
    assert newest.name == 'checkpoint_00000006_batch.pt'
    if damage == 'truncate': newest.write_bytes(newest.read_bytes()[:3000])
    else: flip_a_weight_byte(newest, crashed.model[0].weight)
    resumed = net_learner(tmp_path/'run')
    told = (re.escape(f"resume={resume!r}: the newest checkpoints") + r".*damaged "
            r".*\['checkpoint_00000006_batch.pt'\]; resuming from checkpoint_00000005_batch.pt, the newest "
            r"intact one")
    with pytest.warns(UserWarning, match=told):
        resumed.fit(3, cbs=CheckpointCallback(every_n_steps=1), resume=resume)
    assert same_weights(ref, resumed) and ref.recorder.losses == resumed.recorder.losses
    assert all(p.exists() for p in checkpoints_in(folder))

def test_resume_true_with_every_checkpoint_damaged_raises(tmp_path):
    learn = synth_learner(path=tmp_path)
    learn.fit(1, cbs=CheckpointCallback(every_n_steps=2))
    for p in checkpoints_in(tmp_path/'checkpoints'): p.write_bytes(p.read_bytes()[:200])
    counter = CountBatches()
    with pytest.raises(CorruptFileError, match=r'every checkpoint in .*checkpoints is damaged'):
        learn.fit(1, cbs=counter, resume=True)
    assert counter.n == 0

def test_keep_last_never_removes_the_checkpoint_a_message_points_to(tmp_path):
    folder = tmp_path/'checkpoints'
    old = synth_learner(path=tmp_path)
    old.fit(3, cbs=CheckpointCallback(keep_last=1))  # an earlier run: checkpoint_00000012_epoch_end.pt
    learn = synth_learner(path=tmp_path)
    with pytest.warns(UserWarning,
                      match=r'already holds 1 checkpoint of an earlier run .*checkpoint_00000012'):
        with pytest.raises(RuntimeError) as info:
            learn.fit(3, cbs=[CheckpointCallback(every_n_steps=1, keep_last=1), CrashAt(6)])
    saved = Path(info.value.__notes__[-1].split('the run is saved in ')[1])
    assert saved.name == 'checkpoint_00000006_batch.pt' and saved.exists()
    assert [p.name for p in checkpoints_in(folder)] == ['checkpoint_00000006_batch.pt',
                                                        'checkpoint_00000012_epoch_end.pt']

def test_resuming_an_older_checkpoint_warns_of_the_newer_ones(tmp_path):
    learn = synth_learner(path=tmp_path)
    learn.fit(2, cbs=CheckpointCallback(every_n_steps=2, keep_last=4))
    folder = tmp_path/'checkpoints'
    with pytest.warns(UserWarning, match=r"resuming from checkpoint_00000006_batch.pt, but .* holds newer "
                                         r"checkpoints"):
        synth_learner(path=tmp_path).fit(2, resume=folder/'checkpoint_00000006_batch.pt')

# ---------------------------------------------------------------- 3. the data pipeline is the user's

class Doubling(DataLoader):
    "A DataLoader subclass with its own __iter__: a transform of every batch"
    iters = 0
    def __iter__(self):
        Doubling.iters += 1
        return ((x * 2, y) for x, y in super().__iter__())

def doubling_dls(seed=0):
    base = synth_dls(shuffle=True, seed=seed)
    return DataLoaders(Doubling(base.train.dataset, batch_size=16, shuffle=True), base.valid)

def test_a_dataloader_subclass_is_kept_and_resumes_exactly(tmp_path):
    ref_dls = doubling_dls()
    ref = net_learner(tmp_path/'ref', dls=ref_dls)
    ref.fit(3, cbs=CheckpointCallback(every_n_steps=1))
    assert ref.dls.train is ref_dls.train and isinstance(ref.dls.train, Doubling)
    run = net_learner(tmp_path/'run', dls=doubling_dls())
    with pytest.raises(RuntimeError): run.fit(3, cbs=[CheckpointCallback(every_n_steps=1), CrashAt(6)])
    dls = doubling_dls()
    resumed = net_learner(tmp_path/'run', dls=dls)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        resumed.fit(3, resume=True,
                    cbs=Callback(before_batch=lambda self: seen.append(self.x.abs().max().item())))
    assert resumed.dls.train is dls.train                           # not replaced...
    assert same_weights(ref, resumed) and ref.recorder.losses == resumed.recorder.losses     # ...and exact
    plain = synth_dls(shuffle=True).train.dataset.tensors[0].abs().max().item()
    assert max(seen) > 1.5 * plain                                  # its own __iter__ made the batches

def test_a_subclass_that_does_not_read_its_sampler_replays_the_epoch(tmp_path):
    class OwnOrder(DataLoader):
        "Makes its batches without its batch sampler (a fixed order)"
        def __iter__(self):
            x, y = self.dataset.tensors
            return ((x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16))
    make = lambda: DataLoaders(OwnOrder(synth_dls().train.dataset, batch_size=16, shuffle=True),
                               synth_dls().valid)
    ref = net_learner(tmp_path/'ref', dls=make())
    ref.fit(2, cbs=CheckpointCallback(every_n_steps=1))
    with pytest.raises(RuntimeError):
        net_learner(tmp_path/'run', dls=make()).fit(2, cbs=[CheckpointCallback(every_n_steps=1), CrashAt(6)])
    resumed = net_learner(tmp_path/'run', dls=make())
    counter = CountBatches()
    with pytest.warns(UserWarning, match='OwnOrder does not take its order from its batch sampler: the first '
                                         '2 '):
        resumed.fit(2, resume=True, cbs=counter)
    assert counter.n == 2 and resumed.train_iter == 8  # the rest of epoch 1, not a whole epoch again
    assert same_weights(ref, resumed)

def test_a_dataloader_with_a_custom_sampler_is_kept_without_a_warning(tmp_path):
    class EveryOther(Sampler):
        def __init__(self, n): self.n = n
        def __len__(self): return self.n
        def __iter__(self): return iter(list(range(0, self.n, 2)) + list(range(1, self.n, 2)))
    ds = synth_dls().train.dataset
    dl = DataLoader(ds, batch_size=16, sampler=EveryOther(len(ds)))
    learn = synth_learner(path=tmp_path, dls=DataLoaders(dl, synth_dls().valid))
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # it resumes by replaying its epoch, exactly: nothing to say
        learn.fit(1, cbs=CheckpointCallback())
    assert learn.dls.train is dl

def stateful_dls_(num_workers=0):
    sdl = pytest.importorskip('torchdata.stateful_dataloader')
    base = synth_dls(shuffle=True)
    torch.manual_seed(0)                          # its sampler seeds its own generator from torch's, once
    return DataLoaders(sdl.StatefulDataLoader(base.train.dataset, batch_size=16, shuffle=True,
                                              num_workers=num_workers),
                       base.valid)

@pytest.mark.filterwarnings('ignore:.*set_vital')
@pytest.mark.parametrize('crash_at, workers', [(6, 0), (8, 0), (6, 2)])     # in epoch 1, at its last batch
def test_a_stateful_dataloader_resumes_by_its_own_state(tmp_path, crash_at, workers):
    stateful_dls = lambda: stateful_dls_(workers)
    ref_dls = stateful_dls()
    ref = net_learner(tmp_path/'ref', dls=ref_dls)
    ref.fit(3, cbs=CheckpointCallback(every_n_steps=1))
    assert ref.dls.train is ref_dls.train
    with pytest.raises(RuntimeError):
        crashing = [CheckpointCallback(every_n_steps=1), CrashAt(crash_at)]
        net_learner(tmp_path/'run', dls=stateful_dls()).fit(3, cbs=crashing)
    dls = stateful_dls()
    resumed = net_learner(tmp_path/'run', dls=dls)
    counter = CountBatches()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        warnings.filterwarnings('ignore', '.*set_vital')
        resumed.fit(3, resume=True, cbs=counter)
    assert resumed.dls.train is dls.train and counter.n == 12 - crash_at
    assert same_weights(ref, resumed) and ref.recorder.losses == resumed.recorder.losses

@pytest.mark.filterwarnings('ignore:.*set_vital')
def test_a_stateful_dataloader_resumes_at_the_end_of_an_epoch(tmp_path):
    stateful_dls = stateful_dls_
    ref = net_learner(tmp_path/'ref', dls=stateful_dls())
    ref.fit(3, cbs=CheckpointCallback())
    class CrashAfterEpoch(Callback):
        order = 99
        def after_epoch(self):
            if self.epoch == 0: raise RuntimeError('after the first epoch')
    with pytest.raises(RuntimeError):
        net_learner(tmp_path/'run', dls=stateful_dls()).fit(3, cbs=[CheckpointCallback(), CrashAfterEpoch()])
    resumed = net_learner(tmp_path/'run', dls=stateful_dls())
    resumed.fit(3, resume=True)
    assert same_weights(ref, resumed) and ref.recorder.losses == resumed.recorder.losses

# ---------------------------------------------------------------- 3. Ctrl-C's handler comes back

@pytest.fixture
def sigint_handler():
    "A handler of our own in force before the fit (restored after the test)"
    calls = []
    def handler(signum, frame): calls.append(signum)
    old = signal.signal(signal.SIGINT, handler)
    try: yield handler, calls
    finally: signal.signal(signal.SIGINT, old)

def test_sigint_handler_is_back_after_a_callback_raises_in_after_fit(tmp_path, sigint_handler):
    handler, calls = sigint_handler
    def broken(self): raise RuntimeError('cleanup broke')
    learn = synth_learner(path=tmp_path)
    with pytest.raises(RuntimeError, match='cleanup broke'):
        # order 0: before CheckpointCallback's
        learn.fit(1, cbs=[CheckpointCallback(), Callback(after_fit=broken)])
    assert signal.getsignal(signal.SIGINT) is handler
    os.kill(os.getpid(), signal.SIGINT)
    assert calls == [signal.SIGINT]

@pytest.mark.parametrize('found', ['ignored', 'default'])
def test_sigint_handler_is_back_whatever_it_was(tmp_path, found):
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN if found == 'ignored' else signal.default_int_handler)
    try:
        found_handler = signal.getsignal(signal.SIGINT)
        learn = synth_learner(path=tmp_path)
        learn.fit(1, cbs=CheckpointCallback('first'))
        assert signal.getsignal(signal.SIGINT) is found_handler
        late = Callback(before_fit=lambda self: 1 / 0, order=99)  # after CheckpointCallback's before_fit
        with pytest.raises(ZeroDivisionError): learn.fit(1, cbs=[CheckpointCallback(), late])
        assert signal.getsignal(signal.SIGINT) is found_handler
    finally: signal.signal(signal.SIGINT, before)

def test_ctrl_c_after_a_fit_that_could_not_give_the_handler_back_reaches_it(tmp_path, sigint_handler):
    handler, calls = sigint_handler
    def broken(self): raise RuntimeError('broke')
    learn = synth_learner(path=tmp_path)
    bad = [Callback(after_exception=broken), Callback(after_fit=broken)]  # both before CheckpointCallback's
    with pytest.raises(RuntimeError): learn.fit(1, cbs=[CheckpointCallback(), *bad, CrashAt(2)])
    os.kill(os.getpid(), signal.SIGINT)  # the fit is over: not held
    assert calls == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is handler

# ---------------------------------------------------------------- 4. a resumed run is the same run

def crashed_run(path, dls=None, n_epoch=3):
    learn = synth_learner(path=path, dls=dls)
    with pytest.raises(RuntimeError):
        learn.fit(n_epoch, cbs=[CheckpointCallback(every_n_steps=1), CrashAt(5)])
    return learn

@pytest.mark.parametrize('dls, now', [
    (lambda: synth_dls(n_train=80), '5 batches per epoch, batch size 16, 80 items'),
    (lambda: synth_dls(bs=8), '8 batches per epoch, batch size 8, 64 items'),
    (lambda: DataLoaders(DataLoader(synth_dls(n_train=72).train.dataset, batch_size=16, drop_last=True),
                         None),
     '4 batches per epoch, batch size 16, 72 items')])
def test_resume_on_training_data_of_another_shape_raises_naming_both(tmp_path, dls, now):
    crashed_run(tmp_path)
    learn = synth_learner(path=tmp_path, dls=dls())
    learn.fit(1)
    before, counter = snapshot(learn), CountBatches()
    with pytest.raises(ValueError) as info: learn.fit(3, cbs=counter, resume=True)
    msg = messages(info)
    assert ('checkpoint_00000005_batch.pt was taken with training data of 4 batches per epoch, batch size '
            '16, 64 items') in msg
    assert f'the training data now has {now}' in msg and 'resume with the data the run was trained on' in msg
    assert counter.n == 0
    assert_untouched(learn, before)

def test_resuming_a_finished_run_says_so_and_trains_nothing(tmp_path):
    done = synth_learner(path=tmp_path)
    done.fit(2, cbs=CheckpointCallback())
    learn, counter = synth_learner(path=tmp_path), CountBatches()
    with pytest.warns(UserWarning, match=r'checkpoint_00000008_epoch_end.pt is the end of a run that is over '
                                         r'\(all its 2 epochs are done\): there is nothing left to train'):
        learn.fit(2, cbs=counter, resume=True)
    assert counter.n == 0 and same_weights(learn, done) and learn.recorder.values == done.recorder.values

def test_resuming_a_stopped_run_says_so_and_trains_nothing(tmp_path):
    def stop(self):
        if self.epoch == 1: self.learn.stop_fit('enough')
    stopped = synth_learner(path=tmp_path)
    stopped.fit(5, cbs=[CheckpointCallback(), Callback(after_epoch=stop)])
    assert len(stopped.recorder.values) == 2
    learn, counter = synth_learner(path=tmp_path), CountBatches()
    with pytest.warns(UserWarning, match=r'is the end of a run that is over \(it was stopped after epoch 1: '
                                         r'enough\)'):
        learn.fit(5, cbs=counter, resume=True)
    assert counter.n == 0 and same_weights(learn, stopped)

def test_a_run_stopped_in_an_epoch_stops_there_again_when_resumed(tmp_path):
    def stop(self):
        if self.training and self.train_iter == 6: self.learn.stop_fit('enough')
    ref = synth_learner(path=tmp_path/'ref')
    ref.fit(4, cbs=[CheckpointCallback(every_n_steps=1), Callback(after_batch=stop)])
    assert ref.train_iter == 8  # the epoch of the stop is finished, no more
    run = synth_learner(path=tmp_path/'run')
    with pytest.raises(RuntimeError):
        run.fit(4, cbs=[CheckpointCallback(every_n_steps=1), Callback(after_batch=stop), CrashAt(7)])
    resumed = synth_learner(path=tmp_path/'run')
    resumed.fit(4, resume=True)
    assert resumed.train_iter == 8 and same_weights(ref, resumed)

# ---------------------------------------------------------------- 4. save names and write errors

@pytest.mark.parametrize('name, where', [('model.v2', 'models/model.v2.pth'), ('best.pth', 'models/best.pth'),
                                         ('v1.0', 'models/v1.0.pth'), ('runs/best.pth', 'runs/best.pth')])
def test_save_names_and_paths(tmp_path, monkeypatch, name, where):
    monkeypatch.chdir(tmp_path)                                      # a path with a folder is the caller's
    learn = synth_learner(path=tmp_path/'project' if name.startswith('runs') else tmp_path)
    path = learn.save(name)
    assert path.resolve() == (tmp_path/where).resolve() and path.exists()
    w = learn.model.weight.detach().clone()
    learn.fit(1)
    learn.load(name)
    assert torch.equal(learn.model.weight, w)

def test_save_to_an_absolute_path(tmp_path):
    learn = synth_learner(path=tmp_path/'project')
    assert learn.save(tmp_path/'elsewhere'/'weights') == tmp_path/'elsewhere'/'weights'
    learn.load(tmp_path/'elsewhere'/'weights')

def test_a_write_error_names_the_target_not_the_temporary_file(tmp_path):
    learn = synth_learner(path=tmp_path)
    (tmp_path/'models'/'m.pth').mkdir(parents=True)                  # a folder where the file should go
    with pytest.raises(IsADirectoryError) as info: learn.save('m')
    assert info.value.filename == str(tmp_path/'models'/'m.pth') and '.tmp' not in messages(info)
    assert 'was not written' in messages(info)
    assert [p.name for p in (tmp_path/'models').iterdir()] == ['m.pth']

def test_a_full_disk_names_the_target_and_keeps_the_old_file(tmp_path, monkeypatch):
    learn = synth_learner(path=tmp_path)
    path = learn.save('m')
    old = path.read_bytes()
    learn.fit(1)
    def full(fd): raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(os, 'fsync', full)
    with pytest.raises(OSError) as info: learn.save('m')
    assert (info.value.errno == errno.ENOSPC and info.value.filename == str(path) and '.tmp' not
            in messages(info))
    assert 'the disk is full; it needs' in messages(info) and 'are free there' in messages(info)
    assert path.read_bytes() == old and [p.name for p in path.parent.iterdir()] == ['m.pth']

def test_a_checkpoint_write_error_names_the_checkpoint(tmp_path, monkeypatch):
    learn = synth_learner(path=tmp_path)
    real,calls = os.fsync,[]
    def full(fd):  # the first fsync is that of the first checkpoint (on the writer's thread)
        calls.append(fd)
        if len(calls) == 1: raise OSError(errno.ENOSPC, 'No space left on device')
        real(fd)
    monkeypatch.setattr(os, 'fsync', full)
    with pytest.raises(OSError) as info:
        learn.fit(1, cbs=CheckpointCallback(every_n_steps=2, on_exception=False))
    assert info.value.filename == str(tmp_path/'checkpoints'/'checkpoint_00000002_batch.pt')
    assert '.tmp' not in messages(info) and not list((tmp_path/'checkpoints').glob('.*'))
