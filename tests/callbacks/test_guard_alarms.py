"""`SpikeGuard` can be left on: no false alarm on clean fits (fresh and second fits, constant and one-cycle
schedules, three problems, two seeds), a spike after the warm-up of a second fit still caught; every rollback
and stop told, each time, in a fresh process with Python's default warning filters; a NaN stop says where and
why."""
import os, subprocess, sys, textwrap
import pytest, torch
from learncb.all import *
from learncb.test_utils import clean_fit, clean_fit_cases, synth_learner, synth_dl

class TenTimes(Callback):
    "Makes the loss (and the gradients) of training batch `batch` of epoch `epoch` ten times larger"
    def __init__(self, epoch, batch): self.at = (epoch, batch)
    def after_loss(self):
        if self.training and (self.epoch, self.iter) == self.at:
            self.learn.loss_grad = self.loss_grad * 10
            self.learn.loss = self.learn.loss_grad.detach()

@pytest.mark.slow
@pytest.mark.parametrize('case', clean_fit_cases, ids=['-'.join(map(str, c)) for c in clean_fit_cases])
def test_clean_fits_skip_no_batch(case):
    guard = SpikeGuard()
    learn = clean_fit(*case, cbs=[guard])
    assert learn.skipped_batches == () and guard.rollbacks == 0 and 'rolled back' not in learn.printed

@pytest.mark.parametrize('problem', ['digits', 'regression', 'language model'])
def test_a_spike_just_after_the_warmup_of_a_second_fit_is_caught(problem):
    guard = SpikeGuard()
    learn = clean_fit(problem, second=True, cbs=[guard, TenTimes(0, guard.warmup)])
    assert learn.skipped_batches == ((0, guard.warmup),) and guard.rollbacks == 1
    assert f'rolled back over epoch 0 batch {guard.warmup} (loss ' in learn.printed
    if problem == 'language model':            # a plain function for a loss: the rows cannot be told apart
        assert 'its rows cannot be told apart (loss_func takes no reduction argument' in learn.printed
        assert len(learn.skipped_items) == 16
    else:
        assert 'stands out, so the batch is skipped' in learn.printed
        assert learn.skipped_items == []

def run_fresh(code, timeout=300):
    "`code` in a new Python process with Python's own warning filters (no -W, no PYTHONWARNINGS): its output"
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONWARNINGS'}
    res = subprocess.run([sys.executable, '-c', textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=os.path.dirname(__file__))
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout, res.stderr

@pytest.mark.slow
def test_every_rollback_is_told_in_a_fresh_process_printed_or_warned():
    out, err = run_fresh('''
        from learncb.all import *
        from guard_script import regression, regression_learner
        for quiet in (False, True):
            for _ in range(2):          # two learners, one rollback each, from the same line
                learn = regression_learner(regression())
                if quiet:
                    with learn.no_logging(): learn.fit(1, cbs=SpikeGuard())
                else: learn.fit(1, cbs=SpikeGuard())
    ''')
    assert out.count('SpikeGuard: rolled back over epoch 0 batch 5 (loss ') == 2, out
    assert out.count('no row of it (40-47) stands out, so the batch is skipped') == 2, out
    assert err.count('RuntimeWarning: SpikeGuard: rolled back over epoch 0 batch 5') == 2, err
    assert 'learncb' not in err.replace('learn.', ''), err  # the line shown is the user's, not learncb's

@pytest.mark.slow
def test_a_compiled_learner_that_runs_eagerly_says_so_at_each_fit():
    out, err = run_fresh('''
        from learncb.all import *
        from learncb.test_utils import synth_learner
        for _ in range(2):
            learn = synth_learner()
            learn.compile(step=True)
            for _ in range(2): learn.fit(1, cbs=Callback(after_backward=lambda cb: None))
    ''')
    assert err.count('UserWarning: learn.compile(step=True):') == 4, err
    assert err.count('the fit runs the eager step') == 4 and 'learncb/' not in err, err

def nan_fit(*cbs, **kwargs):
    class NaNAt(Callback):
        def after_loss(self):
            if self.training and self.train_iter == 6:
                self.learn.loss_grad = self.loss_grad * float('nan')
                self.learn.loss = self.learn.loss_grad.detach()
    learn = synth_learner([TerminateOnNaNCallback(), NaNAt(), *cbs], dls=DataLoaders(synth_dl(64),
        synth_dl(64)), **kwargs)
    learn.fit(3)
    return learn

reason = ('training loss is NaN or infinite at epoch 1, batch 2: the fit stopped before it, so the weights '
          'are those from before batch 2')

def test_a_nan_stop_leaves_its_reason_and_the_table_logger_prints_it(capsys):
    learn = nan_fit(logger=print)
    assert learn.stop_reason == reason and learn.exception is None and (learn.epoch, learn.train_iter) == (1,
        6)
    assert capsys.readouterr().out.splitlines()[-1] == f'fit stopped: {reason}'

def test_print_progress_prints_the_stop_reason_counting_epochs_as_the_reason_does(capsys):
    nan_fit(PrintProgressCallback())
    assert capsys.readouterr().out.splitlines()[-1].startswith(f'fit cancelled in epoch 1 (of 3): {reason} '
                                                               f'(after ')

def test_the_bars_print_the_stop_reason(capsys, monkeypatch):
    import learncb.progress
    # a terminal: fastprogress's console bars
    monkeypatch.setattr(learncb.progress, 'can_draw_bars', lambda: True)
    nan_fit(progress=True)
    assert f'fit stopped: {reason}' in capsys.readouterr().out

def test_an_out_of_memory_error_without_automicrobatch_gets_a_note_naming_it():
    class OutOfMemory(torch.nn.Linear):
        def forward(self, x):
            if torch.is_grad_enabled(): raise torch.OutOfMemoryError('out of memory (injected)')
            return super().forward(x)
    learn = synth_learner(model=OutOfMemory(2, 2))
    with pytest.raises(torch.OutOfMemoryError) as e: learn.fit(1)
    assert any('training batch 0 ran out of memory' in n and 'cbs=AutoMicrobatch()' in n for n
               in e.value.__notes__)
    with pytest.raises(RuntimeError) as e: synth_learner(model=OutOfMemory(2, 2)).fit(1, cbs=AutoMicrobatch())
    assert not any('cbs=AutoMicrobatch()' in n for n in getattr(e.value, '__notes__', []))

@pytest.mark.slow
def test_the_compiled_step_prints_nothing_the_user_did_not_cause():
    """A torch scheduler wraps `opt.step` on the instance: torch's wrapper (its profiler annotation) runs
    outside the graph"""
    out, err = run_fresh('''
        import torch
        from learncb.all import *
        from learncb.test_utils import synth_learner
        learn = synth_learner(opt_func=torch.optim.SGD)
        learn.compile(step=True)
        learn.create_opt()
        sched = torch.optim.lr_scheduler.StepLR(learn.opt, 1)
        learn.fit(2, cbs=Callback(after_epoch=lambda cb: sched.step()))
        assert learn.compiler.fell_back is None and sched.last_epoch == 2
    ''')
    assert err == '', err
