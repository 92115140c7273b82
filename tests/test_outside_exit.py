"""A fit ended from outside: `SystemExit` raised by another library's handler in the middle of a
batch. The checkpoint written on the way out records a position consistent with the loop's counters, so that
`resume='auto'` neither repeats nor skips a batch: the resumed run takes the uninterrupted run's number of
steps, and ends with its weights where the checkpoint is exact. An exit after the optimizer stepped
(`after_step`) counts the batch: the weights have seen it, so the resumed run goes on with the next one."""
import pytest, torch
from learncb.all import *
from learncb.state import read_checkpoint
from learncb.checkpoint.callback import checkpoints_in
from transparent_script import make_learner

class ExitAt(Callback):
    """Raises SystemExit (as submitit's or another library's signal handler does) at `event` of epoch 1, batch
    3"""
    def __init__(self, event): setattr(self, event, self.maybe_exit)
    def maybe_exit(self):
        if self.training and (self.epoch, self.iter) == (1, 3): raise SystemExit(143)

class Steps(Callback):
    "Counts the optimizer steps of a fit"
    def before_fit(self): self.n = 0
    def after_step(self): self.n += 1

def fit(path, *cbs, resume=None):
    learn, steps = make_learner(path), Steps()
    learn.fit(3, cbs=[CheckpointCallback(every_n_steps=5), steps, *cbs], resume=resume)
    return learn, steps.n

@pytest.mark.parametrize('event, exact', [('after_batch', True), ('before_batch', False), ('after_step',
    True)])
def test_systemexit_mid_batch_then_resume_takes_the_same_steps(tmp_path, event, exact):
    ref, ref_steps = fit(tmp_path/'ref')
    with pytest.raises(SystemExit) as e: fit(tmp_path/'run', ExitAt(event))
    note = '\n'.join(getattr(e.value, '__notes__', []))
    assert 'the run is saved in' in note and (('not exact' in note) != exact), note
    folder = tmp_path/'run'/'checkpoints'
    # the newest: written on the way out
    loop = read_checkpoint(FileStore(folder), checkpoints_in(folder)[-1])['loop']
    assert loop['train_iter'] == loop['epoch'] * 12 + loop['iter'] + 1  # the position and the counters agree
    resumed, steps = fit(tmp_path/'run', resume='auto')
    assert loop['train_iter'] + steps == ref_steps == resumed.train_iter == 36  # no batch repeated or skipped
    assert len(resumed.recorder.losses) == len(ref.recorder.losses)
    same = all(torch.equal(a, b) for a, b in zip(resumed.model.state_dict().values(),
                                                 ref.model.state_dict().values()))
    if exact: assert same and resumed.recorder.values == ref.recorder.values

def test_a_fit_off_the_main_thread_says_signals_cannot_be_caught(tmp_path):
    # Ray Train runs the training function off the main thread, where Python cannot install signal handlers
    import threading, warnings
    caught, done = [], []
    def train(signals):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            learn = make_learner(tmp_path/str(len(done)))
            learn.fit(1, cbs=CheckpointCallback(signals=signals))
        caught.append([str(x.message) for x in w if 'off the main thread'
                       in str(x.message)]); done.append(learn.train_iter)
    for signals in (('SIGTERM',), ()):
        t = threading.Thread(target=train, args=(signals,), name='ray-train'); t.start(); t.join(60)
    assert done == [12, 12]                                          # the fits ran, with their checkpoints
    assert len(caught[0]) == 1 and 'SIGTERM will not stop it' in caught[0][0] and 'ray-train' in caught[0][0]
    assert caught[1] == []  # signals=(): nothing asked, nothing to say
