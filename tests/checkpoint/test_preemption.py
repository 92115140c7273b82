"""Preemption: SIGTERM ends a fit with an exact checkpoint and exit code 143, `resume='auto'` goes on from
it; the ranks of a distributed run stop at the same batch; torchrun's restarts resume by themselves; a lost
rank does not leave the others waiting. Every process is bounded by a timeout."""
import os, re, signal, subprocess, sys
from pathlib import Path
import pytest, torch
from learncb.checkpoint.callback import checkpoints_in
from learncb.files import load_torch_file
from test_resume import run_resume, assert_same_run, reference
from test_distributed import free_port, run, result

HERE = Path(__file__).parent

def test_sigterm_writes_one_checkpoint_exits_143_and_auto_resume_is_exact(reference, tmp_path):
    stopped = run_resume(tmp_path, '--every', '0', '--term', '1,4', check=False)   # epoch 1, batch 4 (of 10)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert 'stopped by SIGTERM' in stopped.stderr and 'SIGTERM HANDLER BACK True' in stopped.stdout
    names = [p.name for p in checkpoints_in(tmp_path/'checkpoints')]
    # the end of epoch 0, and the stop
    assert names == ['checkpoint_00000010_epoch_end.pt', 'checkpoint_00000015_batch.pt'], names
    resumed = run_resume(tmp_path, '--every', '0', '--resume', '--out', str(tmp_path/'final.pt'))
    assert ("resume='auto': resuming the run from" in resumed.stdout and 'checkpoint_00000015_batch.pt'
            in resumed.stdout)
    assert_same_run(load_torch_file(tmp_path/'final.pt'), reference)

@pytest.mark.parametrize('sig', ['SIGUSR1', 'SIGUSR2'])        # SLURM's --signal, submitit's
def test_requeue_asks_slurm_once_the_checkpoint_is_written_and_the_job_resumes_exactly(reference, tmp_path,
        sig):
    bin_dir = tmp_path/'bin'; bin_dir.mkdir()
    fake = bin_dir/'scontrol'  # a fake scontrol: writes down what it was asked
    fake.write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n'); fake.chmod(0o755)
    env = {**os.environ, 'PATH': f"{bin_dir}:{os.environ['PATH']}", 'SLURM_JOB_ID': '4242',
           'SCONTROL_LOG': str(tmp_path/'scontrol.log')}
    stopped = run_resume(tmp_path, '--every', '0', '--term', '1,4', '--signal', sig, '--requeue', check=False,
                         env=env)
    assert stopped.returncode == 128 + signal.Signals[sig], stopped.stderr[-3000:]
    assert (tmp_path/'scontrol.log').read_text() == 'requeue 4242\n'
    assert 'learncb: requeued SLURM job 4242' in stopped.stdout
    assert checkpoints_in(tmp_path/'checkpoints')[-1].name == 'checkpoint_00000015_batch.pt'  # written before
    resumed = run_resume(tmp_path, '--every', '0', '--signal', sig, '--requeue', '--resume', '--out',
                         str(tmp_path/'final.pt'), env=env)      # what SLURM runs again
    assert 'checkpoint_00000015_batch.pt' in resumed.stdout
    assert_same_run(load_torch_file(tmp_path/'final.pt'), reference)

def test_requeue_outside_slurm_warns_and_exits_as_usual(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith('SLURM_')}
    stopped = run_resume(tmp_path, '--every', '0', '--term', '1,4', '--requeue', check=False, env=env)
    assert stopped.returncode == 143 and 'this is not a SLURM job (no SLURM_JOB_ID)' in stopped.stderr

def test_resume_auto_starts_a_run_without_checkpoints(tmp_path, reference):
    res = run_resume(tmp_path, '--resume', '--out', str(tmp_path/'final.pt'))
    assert "resume='auto': no checkpoint in" in res.stdout
    assert_same_run(load_torch_file(tmp_path/'final.pt'), reference)

def stops(res):
    "{rank: the training batch it stopped at} from what the ranks printed"
    return {int(r): int(i) for r, i in re.findall(r'STOPPED RANK (\d) AT (\d+)', res.stdout)}

@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_at_the_same_batch(tmp_path):
    common = ('--bs', '8', '--ckpt', '--shuffle', '--dropout', '0.2')
    run(tmp_path/'ref', *common)
    out = tmp_path/'stopped'
    res = run(out, *common, '--term-at', '5', check=False)
    assert res.returncode != 0
    at = stops(res)
    assert set(at) == {0, 1} and at[0] == at[1], res.stdout[-2000:] + res.stderr[-3000:]
    assert checkpoints_in(out/'checkpoints')[-1].name == f'checkpoint_{at[0]:08d}_batch.pt'
    run(out, *common, '--resume')
    got, ref = result(out), result(tmp_path/'ref')
    for k in ref['model']: assert torch.equal(got['model'][k], ref['model'][k]), k
    assert got['losses'] == ref['losses'] and got['values'] == ref['values']

@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_the_run_resumes_by_itself(tmp_path):
    common = ('--bs', '8', '--ckpt', '--shuffle', '--dropout', '0.2', '--auto')
    run(tmp_path/'ref', *common)
    out = tmp_path/'restarted'
    out.mkdir()
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2', '--max-restarts=2',
           f'--master-port={free_port()}', str(HERE.parent/'distributed'/'ddp_script.py'), str(out), *common,
           '--kill-once', str(out/'killed')]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    # killed once, restarted
    assert (out/'killed').exists() and "resume='auto': resuming the run from" in res.stdout
    got, ref = result(out), result(tmp_path/'ref')
    for k in ref['model']: assert torch.equal(got['model'][k], ref['model'][k]), k
    assert got['losses'] == ref['losses'] and got['values'] == ref['values']

def test_a_rank_killed_under_launch_ends_the_others(tmp_path):
    res = subprocess.run([sys.executable, str(HERE/'launch_kill_script.py')], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0
    assert 'process 1 terminated with signal SIGKILL' in res.stderr, res.stderr[-3000:]

def test_a_full_disk_in_the_writer_is_raised_in_the_training_thread(tmp_path, monkeypatch):
    import errno, os, stat
    from learncb.all import CheckpointCallback
    from learncb.test_utils import synth_learner
    real, files = os.fsync, [0]
    def fsync(fd):                              # the second checkpoint file finds the disk full
        if stat.S_ISREG(os.fstat(fd).st_mode):
            files[0] += 1
            if files[0] >= 2: raise OSError(errno.ENOSPC, 'No space left on device')
        real(fd)
    learn = synth_learner(path=tmp_path)
    monkeypatch.setattr(os, 'fsync', fsync)
    with pytest.raises(OSError) as e: learn.fit(2, cbs=CheckpointCallback(every_n_steps=1))
    notes = ' '.join(getattr(e.value, '__notes__', []))
    assert 'checkpoint_00000002_batch.pt' in str(e.value) and 'the disk is full; it needs' in notes, (e.value,
        notes)
    # kept
    assert [p.name for p in checkpoints_in(tmp_path/'checkpoints')] == ['checkpoint_00000001_batch.pt']

def test_checkpoints_copy_into_the_memory_of_the_one_before_and_each_file_holds_its_own_state(tmp_path):
    from torch import nn
    from learncb.all import Callback, CheckpointCallback
    from learncb.test_utils import synth_learner
    ckpt = CheckpointCallback(every_n_steps=1, keep_last=1000, every_epoch=False)
    seen = []
    class Watch(Callback):                   # after each save: where its bytes went, and the weights it holds
        order = ckpt.order + 1
        def after_batch(self):
            if self.learn.training:
                seen.append((ckpt._store._buffer, ckpt.last, self.learn.model[1].weight.detach().clone()))
    learn = synth_learner(path=tmp_path, model=nn.Sequential(nn.Linear(2, 512), nn.Linear(512, 512),
                                                             nn.Linear(512, 2)))
    learn.fit(2, cbs=[ckpt, Watch()])  # 1 MB of weights: a state large enough to keep its memory
    buffers = {id(b) for b,_,_ in seen}        # held here: a buffer made anew cannot take an earlier one's id
    # mostly copied into again
    assert len(seen) > 4 and None not in [b for b,_,
                                          _ in seen] and len(buffers) < len(seen) / 2, (len(buffers),
                                              len(seen))
    for _,path,weight in seen: assert torch.equal(load_torch_file(path)['model']['1.weight'], weight), path
    assert ckpt._store is None                   # let go with the fit, and the memory with it

def test_signal_guard_holds_a_signal_to_the_end_of_a_batch_and_gives_the_handler_back():
    """A held SIGUSR1 only notes itself; the check at the end of the batch stops; a second one runs the
    handler from before"""
    from learncb.checkpoint.preemption import SignalGuard
    got, fitting = [], [True]
    def mine(s, f): got.append(s)
    before = signal.signal(signal.SIGUSR1, mine)
    try:
        guard = SignalGuard(signals=('SIGUSR1',), hold_ctrl_c=False)
        guard.start(lambda: fitting[0])
        assert not guard.watching and not guard.stop_asked()
        signal.raise_signal(signal.SIGUSR1)                  # in the middle of a batch: held, nothing runs
        assert got == [] and guard.watching and guard.stop_asked() and guard.signal == signal.SIGUSR1
        signal.raise_signal(signal.SIGUSR1)                  # a second one: the handler from before, at once
        assert got == [signal.SIGUSR1]
        guard.pass_on(signal.SIGUSR1)                        # what a stop does once its checkpoint is written
        assert got == [signal.SIGUSR1] * 2
        assert guard.take() == signal.SIGUSR1 and guard.take() is None
        guard.start(lambda: fitting[0])                      # a new fit holds it again
        fitting[0] = False  # the fit is over: a signal is passed on as it comes
        signal.raise_signal(signal.SIGUSR1)
        assert got == [signal.SIGUSR1] * 3 and guard.caught is None
        guard.restore()
        assert signal.getsignal(signal.SIGUSR1) is mine                # the handler it found, given back
    finally:
        signal.signal(signal.SIGUSR1, before)
