"""`SpikeGuard`: a poisoned batch rolled back and skipped, so that the run ends equal to the run on data that
never held it (one process, and two under DDP and FSDP where one rank alone sees the bad batch); a run killed
after a rollback and resumed skips the same batches; the snapshot reuses its memory; no step on a non-finite
loss with a fused optimizer."""
import contextlib, io, re, warnings
from functools import partial
from pathlib import Path
import pytest, torch
from learncb.all import *
from learncb.state import LearnerSnapshot
from guard_script import regression, regression_learner, N, BS, BAD

SCRIPT = Path(__file__).parent/'guard_script.py'

def weights_equal(a, b): return all(torch.equal(a[k], b[k]) for k in a)

def fit(dls, cbs=(), epochs=3, **kwargs):
    """A fit of the regression, with what it printed (the guard tells through the learner's output) in
    `learn.said`"""
    learn, out = regression_learner(dls, **kwargs), io.StringIO()
    with contextlib.redirect_stdout(out): learn.fit(epochs, cbs=list(cbs))
    learn.said = out.getvalue().splitlines()
    return learn

@pytest.fixture(scope='module')
def clean(): return fit(regression(drop=True))

@pytest.mark.parametrize('poison', ['scale', 'inf'])
@pytest.mark.parametrize('guard', [dict(), dict(check_every=4, snapshot_every=4, warmup=4)], ids=['defaults',
    'snapshots-in-epoch'])
def test_a_poisoned_batch_is_skipped_and_the_run_equals_the_one_without_it(clean, poison, guard):
    guarded, ruined = fit(regression(poison=poison), [SpikeGuard(**guard)]), fit(regression(poison=poison))
    assert weights_equal(guarded.model.state_dict(), clean.model.state_dict())
    assert not weights_equal(ruined.model.state_dict(), clean.model.state_dict())
    ruined_loss = ruined.recorder.losses[-1]
    assert not (ruined_loss < 100 * clean.recorder.losses[-1])           # far off, or not even finite
    assert [tuple(b) for b in guarded.skipped_batches] == [(0, BAD), (1, BAD), (2, BAD)]
    assert guarded.train_iter == clean.train_iter == 3 * (N // BS - 1)
    rows = list(range(BAD * BS, (BAD + 1) * BS))  # the poisoned items, by dataset index
    rollbacks = [l for l in guarded.said if 'rolled back' in l]
    assert len(rollbacks) == 1 and f'epoch 0 batch {BAD} (loss ' in rollbacks[0], guarded.said
    if poison == 'inf':                           # losses that are not finite name their rows: they leave
        assert guarded.skipped_items == rows
        assert f'all its rows ({rows[0]}-{rows[-1]}) made it spike and left the data' in rollbacks[0]
    else:                                         # every row high, none far from the others: skip the batch
        assert guarded.skipped_items == []
        assert f'no row of it ({rows[0]}-{rows[-1]}) stands out, so the batch is skipped' in rollbacks[0]
    summary = f'the fit skipped 3 batches: epoch 0 batch {BAD}, epoch 1 batch {BAD}, epoch 2 batch {BAD}'
    told = f'; rows {rows[0]}-{rows[-1]} left out (learn.skipped_items: drop them from the data)'
    assert guarded.said[-1] == summary + (told if poison == 'inf' else '')

def test_a_batch_that_comes_back_each_epoch_is_skipped_there_with_one_rollback(clean):
    """Without shuffling the epochs repeat their batches: the batch found in epoch 0 is skipped in the others,
    no rollback"""
    guard = SpikeGuard()
    guarded, clean4 = fit(regression(), [guard], epochs=4), fit(regression(drop=True), epochs=4)
    assert guard.rollbacks == 1 and [tuple(b) for b in guarded.skipped_batches] == [(e, BAD) for e
        in range(4)]
    assert weights_equal(guarded.model.state_dict(), clean4.model.state_dict())

def test_shuffled_poisoned_rows_are_found_named_and_kept_out_of_later_fits():
    """Shuffled, the bad rows land in other batches each epoch: each is found once, named, and stays out of
    later fits"""
    dl = torch.utils.data.DataLoader(regression().train.dataset, batch_size=BS, shuffle=True,
                                     generator=torch.Generator().manual_seed(1))
    guard = SpikeGuard(max_rollbacks=50)
    guarded = fit(DataLoaders(dl), [guard])
    bad = list(range(BAD * BS, (BAD + 1) * BS))
    assert guarded.skipped_items == bad and guarded.skipped_batches == () and 0 < guard.rollbacks <= len(bad)
    told = set()                                                                   # the rows each line names
    for line in guarded.said:
        if 'made it spike' in line:
            for a, b in re.findall(r'(\d+)(?:-(\d+))?', re.search(r'rows? ([\d, -]+) of it', line).group(1)):
                told |= set(range(int(a), int(b or a) + 1))
    assert told == set(bad), guarded.said
    assert sum('rolled back' in l for l in guarded.said) == guard.rollbacks
    guarded.said = []
    with contextlib.redirect_stdout(io.StringIO()) as out: guarded.fit(1, cbs=[guard])
    assert guarded.skipped_items == bad and guard.rollbacks == 0 and 'rolled back' not in out.getvalue()
    seen = []                                                                      # and without a guard
    def note(cb):
        if cb.training: seen.extend(cb.y.flatten().tolist())
    guarded.fit(1, cbs=Callback(before_batch=note))
    assert len(seen) == N - len(bad) and max(map(abs, seen)) < 100                # no poisoned target
    guarded.dls = regression(drop=True)                                            # other data: none kept
    guarded.fit(1)
    assert guarded.skipped_items == []

def test_after_max_rollbacks_the_fit_stops_naming_the_batches_with_the_weights_before_the_spike(clean,
        tmp_path):
    """Batch 5 spikes in epoch 0 (and is skipped again in epoch 1, with no rollback); batch 10 of epoch 1 is
    one too many"""
    from learncb.checkpoint.callback import checkpoints_in
    from learncb.state import read_checkpoint
    class SpikeAt(Callback):
        def after_loss(self):
            if self.training and (self.epoch, self.iter) == (1, 10):
                self.learn.loss = self.learn.loss_grad = self.loss_grad * 1e4
    learn = regression_learner(regression(), path=tmp_path)
    with pytest.raises(RuntimeError, match=r'epoch 1 batch 10, rows 80-87 .*max_rollbacks=1.*\(0, 5\), \(1, '
                                           r'5\), \(1, 10\)\]; '
                                           r'their rows in the dataset: 80-87') as e:
        with contextlib.redirect_stdout(io.StringIO()):
            learn.fit(3, cbs=[SpikeGuard(max_rollbacks=1), CheckpointCallback(every_epoch=False), SpikeAt()])
    # the clean run's first epoch: where the second spike was
    one_epoch = fit(regression(drop=True), epochs=1)
    assert weights_equal(learn.model.state_dict(), one_epoch.model.state_dict())
    assert [tuple(b) for b in learn.skipped_batches] == [(0, BAD), (1, BAD)]
    notes = '\n'.join(e.value.__notes__)  # the checkpoint written on the error is of that state, exact
    assert 'the run is saved in' in notes and 'not exact' not in notes, notes
    folder = tmp_path/'checkpoints'
    saved = read_checkpoint(FileStore(folder), checkpoints_in(folder)[-1])
    assert saved['loop']['train_iter'] == learn.train_iter == one_epoch.train_iter
    assert weights_equal(saved['model'], learn.model.state_dict())
    assert learn.fit(1) is None                            # the learner is usable after the error

def test_the_snapshot_reuses_its_buffers():
    learn = regression_learner(regression(drop=True))
    learn.fit(1)
    snap = LearnerSnapshot(learn)
    ptrs = [t.data_ptr() for t in snap.state['model'].values()]
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    learn.fit(1)
    snap.take()
    assert [t.data_ptr() for t in snap.state['model'].values()] == ptrs  # the same memory, new values
    assert weights_equal(snap.state['model'], learn.model.state_dict())
    assert not weights_equal(snap.state['model'], before)

def test_a_fit_with_the_guard_rebuilds_no_dispatch_table(monkeypatch):
    """A learner that keeps SpikeGuard fits again without rebuilding its dispatch tables (a skip_on_device
    guard too)"""
    from learncb.dispatch import CallbackHost
    rebuilt = []
    for guard in (SpikeGuard(), SpikeGuard(skip_on_device=True)):
        learn = regression_learner(regression(drop=True))
        learn.add_cb(guard)
        learn.fit(1)
        monkeypatch.setattr(CallbackHost, 'cbs_changed', lambda self: rebuilt.append(self))
        learn.fit(1)
        monkeypatch.undo()
    assert rebuilt == []

def test_no_step_is_taken_on_a_non_finite_loss_with_a_fused_optimizer():
    """The fused kernel skips the step on the device: the weights and the step count stay; no check until the
    epoch's end"""
    seen = {}
    class Watch(Callback):
        order = Order.LAST + 100
        def before_step(self):
            if self.iter == BAD: seen['before'] = [p.detach().clone() for p in self.model.parameters()]
        def after_step(self):
            if self.iter == BAD:
                seen['after'] = [p.detach().clone() for p in self.model.parameters()]
                seen['steps'] = {int(s['step']) for s in self.opt.state.values()}
    learn = regression_learner(regression(poison='inf'), opt_func=partial(torch.optim.Adam, fused=True))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(1, cbs=[SpikeGuard(check_every=1000, skip_on_device=True), Watch()])
    assert all(torch.equal(a, b) for a, b in zip(seen['before'], seen['after']))
    assert seen['steps'] == {BAD}                          # steps 0..BAD-1 taken, the bad one not counted
    assert [tuple(b) for b in learn.skipped_batches] == [(0, BAD)]
    assert not hasattr(learn.opt, 'found_inf')             # the flag leaves the optimizer with the fit

class StopAfter(Callback):
    def __init__(self, n): self.n = n
    def after_batch(self):
        if self.training and self.train_iter == self.n: raise CancelFitException()

def test_terminate_on_nan_stops_at_the_bad_batch_with_the_weights_before_it(capsys):
    learn = regression_learner(regression(poison='inf'))
    learn.fit(3, cbs=TerminateOnNaNCallback())
    reason = (f'training loss is NaN or infinite at epoch 0, batch {BAD}: the fit stopped before it, so the '
              f'weights are those from before batch {BAD}')
    assert (learn.stop_reason == reason and capsys.readouterr().out.splitlines()[-1] == f'fit stopped: '
            f'{reason}')
    assert (learn.epoch, learn.train_iter) == (0, BAD)          # no step on it: batches 0..BAD-1 counted
    before = regression_learner(regression(poison='inf'))
    before.fit(3, cbs=StopAfter(BAD))
    assert weights_equal(learn.model.state_dict(), before.model.state_dict())
    assert not weights_equal(learn.model.state_dict(),
                             regression_learner(regression(poison='inf')).model.state_dict())

def test_terminate_on_nan_with_a_dataloader_that_cannot_replay_stops_at_its_check():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            return iter([(torch.randn(4, generator=g), torch.tensor([float('inf') if i == 9 else 0.])) for i
                         in range(64)])
    learn = regression_learner(DataLoaders(torch.utils.data.DataLoader(Stream(), batch_size=4)))
    learn.fit(1, cbs=TerminateOnNaNCallback(check_every=8))
    assert re.search('batch 2: the fit stopped at batch 7, .*IterableDataset',
                     learn.stop_reason), learn.stop_reason

def test_a_dataloader_that_cannot_replay_is_refused_before_the_first_batch():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self): return iter([(torch.randn(4), torch.randn(1)) for _ in range(16)])
    learn = regression_learner(DataLoaders(torch.utils.data.DataLoader(Stream(), batch_size=4)))
    with pytest.raises(ValueError, match='SpikeGuard replays the batches.*IterableDataset'):
        learn.fit(1, cbs=SpikeGuard())
    assert learn.train_iter == 0

def run(out, *args, nproc=1, timeout=300, check=True):
    "The guard script in `nproc` processes (torchrun, gloo) or in one, never longer than `timeout`"
    from conftest import run_script
    res = run_script(SCRIPT, out, *args, nproc=nproc, timeout=timeout)
    if check: assert res.returncode == 0, res.stderr[-4000:]
    return res

def result(out): return torch.load(Path(out)/'result.pt', weights_only=False)

@pytest.mark.slow
@pytest.mark.parametrize('strategy', ['ddp', 'fsdp'])
def test_two_processes_agree_on_the_rollback_when_one_rank_sees_the_spike(tmp_path, strategy):
    run(tmp_path/'guarded', '--guard', '--poison-rank', '0', '--strategy', strategy, nproc=2)
    run(tmp_path/'clean', '--drop', '--strategy', strategy, nproc=2)
    guarded, clean = result(tmp_path/'guarded'), result(tmp_path/'clean')
    assert weights_equal(guarded['model'], clean['model'])
    assert guarded['skipped'] == [(0, BAD), (1, BAD),
                                  (2, BAD)] and guarded['train_iter'] == clean['train_iter']
    if strategy == 'ddp':                                  # and without the guard, the spike ruins the run
        run(tmp_path/'ruined', '--poison-rank', '0', nproc=2)
        assert not weights_equal(result(tmp_path/'ruined')['model'], clean['model'])

def test_a_run_killed_after_a_rollback_resumes_skipping_the_same_batches(tmp_path):
    res = run(tmp_path/'run', '--guard', '--ckpt', '--kill-at', '12', check=False)
    assert res.returncode == -9, res.stderr[-3000:]  # killed after the first rollback
    run(tmp_path/'run', '--guard', '--ckpt')                                       # resume='auto'
    run(tmp_path/'clean', '--drop')
    resumed, clean = result(tmp_path/'run'), result(tmp_path/'clean')
    assert resumed['skipped'] == [(0, BAD), (1, BAD), (2, BAD)]
    assert weights_equal(resumed['model'], clean['model']) and resumed['train_iter'] == clean['train_iter']

def test_a_shuffled_run_with_many_rollbacks_ended_by_an_exit_resumes_to_the_uninterrupted_run(tmp_path):
    """The bad items scattered by shuffling: a rollback in most epochs' first batches; an exit mid-run;
    resume='auto'"""
    def shuffled():
        return DataLoaders(torch.utils.data.DataLoader(regression().train.dataset, batch_size=BS,
                                                       shuffle=True,
                                                       generator=torch.Generator().manual_seed(1)))
    class ExitAfterRollback(Callback):
        order = Order.LAST + 100
        def after_batch(self):
            if self.learn.skipped_items and self.train_iter == 30: raise SystemExit(1)
    def run(path, *extra, resume=None):
        learn = regression_learner(shuffled(), path=path)
        guard = SpikeGuard(check_every=4, snapshot_every=4, warmup=4, max_rollbacks=50)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            learn.fit(3, cbs=[guard, CheckpointCallback(every_n_steps=5), *extra], resume=resume)
        return learn
    whole = run(tmp_path/'whole')
    with pytest.raises(SystemExit): run(tmp_path/'run', ExitAfterRollback())
    resumed = run(tmp_path/'run', resume='auto')
    bad = list(range(BAD * BS, (BAD + 1) * BS))              # the poisoned rows, found one by one
    assert whole.skipped_items == resumed.skipped_items == bad
    assert whole.skipped_batches == resumed.skipped_batches
    assert weights_equal(resumed.model.state_dict(),
                         whole.model.state_dict()) and resumed.train_iter == whole.train_iter

def test_a_run_resumed_at_an_epoch_end_keeps_the_guards_history(tmp_path):
    """What the guard judges by (the recent losses) comes back with the checkpoint, so a resumed run judges as
    the whole run"""
    class Seen(Callback):
        order = Order.GUARD + 1
        def before_train(self): self.at = list(self.learn.spike_guard.history['loss'])
    class ExitAtEpoch1(Callback):
        def before_batch(self):
            if self.epoch == 1: raise SystemExit(1)
    def run(path, *extra, resume=None):
        learn, seen = regression_learner(regression(drop=True), path=path), Seen()
        learn.fit(2, cbs=[SpikeGuard(), CheckpointCallback(), seen, *extra], resume=resume)
        return seen.at
    whole = run(tmp_path/'whole')
    with pytest.raises(SystemExit): run(tmp_path/'run', ExitAtEpoch1())
    assert run(tmp_path/'run', resume='auto') == whole and len(whole) == 39

def test_the_quick_verdict_agrees_with_the_judgement_of_each_batch():
    """A check whose values are all low (one sort) must be one in which judging each against its predecessors
    finds no spike"""
    import random
    from learncb.callbacks import spikes as guards
    rng, quick = random.Random(0), 0
    for _ in range(3000):
        history = [rng.lognormvariate(0, rng.choice([0.1, 0.5, 1.5])) for _ in range(rng.randrange(0,
            60))][-50:]
        values = [rng.lognormvariate(0, rng.choice([0.1, 0.5, 1.5])) * rng.choice([1, 1, 1, 3, 20]) for _
                  in range(rng.randrange(1, 26))]
        if guards._all_low(values, history, 5., 50):
            quick += 1
            guards._all_low, saved = (lambda *a: False), guards._all_low
            try: assert not any(guards.judge_losses(values, history, 5., 50)[0]), (values, history)
            finally: guards._all_low = saved
    assert quick > 300                                     # the quick verdict is the common case
