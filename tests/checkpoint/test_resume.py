"""Checkpoints survive a crash and resume bit-exactly (issue: checkpoints). Runs
tests/checkpoint/resume_script.py in
subprocesses that SIGKILL themselves at chosen points, then resume them and compare with an uninterrupted
run."""
import os, pickle, random, signal, subprocess, sys, time, warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import pytest, torch
from torch import nn
from learncb.all import *
from conftest import FailAfterEpoch, CrashAt, run_script

HERE = Path(__file__).parent
SCRIPT = HERE/'resume_script.py'
N_EPOCH, N_TRAIN, N_VALID = 3, 10, 4           # as in resume_script.py

def run_resume(path, *args, check=True, env=None):
    "resume_script.py's run in `path` (forked: `run_script`); fails on an exit other than 0 if `check`"
    res = run_script(SCRIPT, path, *args, timeout=300, env=env)
    if check and res.returncode != 0:
        raise AssertionError(f'{args}: exit {res.returncode}\n{res.stdout}\n{res.stderr}')
    return res

@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp('ref')
    run_resume(path, '--out', str(path/'final.pt'))
    return load_torch_file(path/'final.pt')

def assert_same_run(a, b):
    for k in a['model']: assert torch.equal(a['model'][k], b['model'][k]), f'model {k} differs'
    sa, sb = a['opt']['state'], b['opt']['state']
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]),
                               torch.as_tensor(sb[i][k])), f'optimizer {i}.{k} differs'
    assert a['opt']['param_groups'] == b['opt']['param_groups']
    assert a['losses'] == b['losses'] and a['values'] == b['values'] and a['lrs'] == b['lrs']

def kill_points(n=20, seed=2024):
    """`n` kill points across epochs: always the first and last training batch of an epoch and a validation
    batch"""
    train = [(e, ep, i, 'train') for e in ('before_batch', 'after_pred', 'after_loss', 'after_backward',
                                           'after_step', 'after_batch')
             for ep in range(N_EPOCH) for i in range(N_TRAIN)]
    valid = [(e, ep, i, 'valid') for e in ('before_batch', 'after_loss', 'after_batch') for ep
             in range(N_EPOCH) for i in range(N_VALID)]
    stage = [(e, ep, 0, '-') for e in ('before_epoch', 'after_train', 'before_validate', 'after_validate',
                                       'after_epoch')
             for ep in range(N_EPOCH)]
    must = [('before_batch', 1, 0, 'train'), ('after_batch', 0, N_TRAIN - 1, 'train'), ('after_loss', 2, 2,
        'valid'),
            ('after_step', 2, N_TRAIN - 1, 'train')]
    rng = random.Random(seed)
    rest = rng.sample([p for p in train + valid + stage if p not in must], n - len(must))
    return must + rest

def kill_and_resume(point, path):
    spec = ','.join(map(str, point))
    killed = run_resume(path, '--kill', spec, check=False)
    assert killed.returncode == -signal.SIGKILL, (f'{spec}: expected SIGKILL, got {killed.returncode}\n'
                                                  f'{killed.stderr}')
    run_resume(path, '--resume', '--out', str(path/'final.pt'))
    return load_torch_file(path/'final.pt')

@pytest.mark.slow
def test_resume_after_sigkill_at_20_points(reference, tmp_path):
    points = kill_points()
    assert len(set(points)) == 20
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda ip: kill_and_resume(ip[1], tmp_path/f'run{ip[0]}'), enumerate(points)))
    for point, result in zip(points, results):
        try: assert_same_run(reference, result)
        except AssertionError as e: raise AssertionError(f'kill at {point}: {e}') from None

def test_kill_while_writing_a_checkpoint_keeps_the_previous_one(reference, tmp_path):
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), '--stall-save', '13'],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == 'STALLED'
        folder = tmp_path/'checkpoints'
        tmp_files = list(folder.glob('.checkpoint_*.tmp'))
        assert len(tmp_files) == 1 and tmp_files[0].stat().st_size > 0        # a half-done save is on disk
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    done = checkpoints_in(folder)
    assert done, 'no complete checkpoint left'
    state = load_torch_file(done[-1])          # the previous checkpoint is intact and loadable
    assert state['format'] == 'learncb-checkpoint'
    run_resume(tmp_path, '--resume', '--out', str(tmp_path/'final.pt'))
    assert not list(folder.glob('.checkpoint_*.tmp'))         # the stale temporary file was cleaned up
    assert_same_run(reference, load_torch_file(tmp_path/'final.pt'))

class Evil:
    def __reduce__(self): return (os.system, (f'touch {os.environ["LEARNCB_PWNED"]}',))

def small_learner(path, make_model=lambda: nn.Linear(2, 2)):
    from conftest import synth_dls, synth_learner
    torch.manual_seed(0)                 # before the model is made: same initial weights in every run
    return synth_learner(dls=synth_dls(shuffle=True), model=make_model(), path=path, lr=1e-3)

@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, monkeypatch):
    flag = tmp_path/'pwned'
    monkeypatch.setenv('LEARNCB_PWNED', str(flag))
    learn = small_learner(tmp_path)
    learn.fit(1, cbs=CheckpointCallback())
    good = checkpoints_in(tmp_path/'checkpoints')[-1]
    state = load_torch_file(good)
    state['state'] = {'note': Evil()}
    evil = tmp_path/'checkpoints'/'checkpoint_99999999_epoch_end.pt'
    torch.save(state, evil)
    with pytest.raises(ValueError, match=r'refused to load .*checkpoint_99999999_epoch_end.pt: it contains '
                                         r'objects that would run code'):
        learn.load_checkpoint(evil)
    # the newest is the evil one
    with pytest.raises(ValueError, match='refused to load'): learn.fit(1, resume=True)
    with pytest.raises(ValueError, match='refused to load'): learn.fit(1, resume=evil)
    assert not flag.exists()
    with open(tmp_path/'plain.pkl', 'wb') as f: pickle.dump(Evil(), f)
    with pytest.raises(ValueError): learn.load_checkpoint(tmp_path/'plain.pkl')
    assert not flag.exists()

def test_a_checkpoint_written_before_snapshots_still_loads(tmp_path):
    learn = small_learner(tmp_path)
    learn.fit(1, cbs=CheckpointCallback())
    good = checkpoints_in(tmp_path/'checkpoints')[-1]
    assert is_snapshot(torch.load(good, weights_only=True))
    state = load_torch_file(good)
    atomic_save(with_checksum(state), tmp_path/'old.pt')  # the format before snapshots: the state itself
    other = small_learner(tmp_path/'o')
    other.load_checkpoint(tmp_path/'old.pt')
    for a,b in zip(other.model.parameters(), learn.model.parameters()): assert torch.equal(a, b)
    state['model']['weight'] += 1                                  # changed after the checksum was taken
    torch.save(state, tmp_path/'changed.pt')
    with pytest.raises(CorruptFileError, match='changed.pt is damaged'):
        other.load_checkpoint(tmp_path/'changed.pt')

def test_bad_checkpoint_files_give_clear_errors(tmp_path):
    learn = small_learner(tmp_path)
    learn.fit(2, cbs=CheckpointCallback())
    good = checkpoints_in(tmp_path/'checkpoints')[-1]
    data = good.read_bytes()
    (tmp_path/'truncated.pt').write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r'truncated.pt: it is truncated, corrupt or not a torch file'):
        learn.load_checkpoint(tmp_path/'truncated.pt')
    (tmp_path/'noise.pt').write_bytes(os.urandom(5000))
    with pytest.raises(ValueError, match=r'noise.pt: it is truncated, corrupt or not a torch file'):
        learn.fit(2, resume=tmp_path/'noise.pt')
    torch.save({'weights': torch.ones(3)}, tmp_path/'foreign.pt')
    with pytest.raises(ValueError, match=r'foreign.pt is not a learncb checkpoint'):
        learn.load_checkpoint(tmp_path/'foreign.pt')
    with pytest.raises(FileNotFoundError, match=r'no such file: .*missing.pt'):
        learn.load_checkpoint(tmp_path/'missing.pt')
    other = small_learner(tmp_path, lambda: nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match=r"saved from a different model: missing keys \['0.weight', "
                                         r"'0.bias', '1.weight', '1.bias'\], unexpected keys \['weight', "
                                         r"'bias'\]"):
        other.load_checkpoint(good)
    wide = small_learner(tmp_path, lambda: nn.Linear(2, 3))
    with pytest.raises(ValueError, match=r"shape mismatches \[weight: file \(2, 2\) vs model \(3, 2\)"):
        wide.fit(2, resume=good)
    with pytest.raises(ValueError, match=r'taken in a fit of 2 epochs, but this fit has 5: resume the same '
                                         r'run with learn.fit\(2'):
        learn.fit(5, resume=good)
    with pytest.raises(FileNotFoundError, match='no checkpoint in'):
        small_learner(tmp_path/'empty').fit(1, resume=True)

def test_keep_last_and_names(tmp_path):
    learn = small_learner(tmp_path)
    # batches 3, 6 and the epoch ends at 4, 8
    learn.fit(2, cbs=CheckpointCallback(every_n_steps=3, keep_last=3))
    names = [p.name for p in checkpoints_in(tmp_path/'checkpoints')]
    assert names == ['checkpoint_00000004_epoch_end.pt', 'checkpoint_00000006_batch.pt',
                     'checkpoint_00000008_epoch_end.pt']
    assert sorted(p.name for p in (tmp_path/'checkpoints').iterdir()) == names  # nothing else left behind
    with pytest.raises(ValueError, match='every_n_steps'): CheckpointCallback(every_n_steps=0)
    with pytest.raises(ValueError, match='keep_last'): CheckpointCallback(keep_last=0)

def in_process_run(path, cbs=(), resume=None, n_epoch=3):
    learn = small_learner(path, lambda: nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Dropout(0.3),
                                                      nn.Linear(16, 2)))
    learn.fit_one_cycle(n_epoch, 1e-2, cbs=[CheckpointCallback(every_n_steps=2), *cbs], resume=resume)
    return learn

def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(),
                                                 b.model.state_dict().values()))

def test_ctrl_c_waits_for_the_end_of_the_batch_and_resumes_exactly(tmp_path):
    handler_before = signal.getsignal(signal.SIGINT)      # the default, or SIG_IGN in a background job
    ref = in_process_run(tmp_path/'ref')
    class CtrlC(Callback):
        def after_pred(self):
            if self.training and self.train_iter == 5: os.kill(os.getpid(), signal.SIGINT)
    log = []
    with pytest.raises(KeyboardInterrupt, match='resume=True'):
        in_process_run(tmp_path/'run', cbs=[CtrlC(),
                                            Callback(after_batch=lambda self: log.append(self.train_iter),
                                                     order=99)])
    assert log[-1] == 5  # the interrupted batch was finished (train_iter 5 -> 6)...
    # ...and saved
    assert checkpoints_in(tmp_path/'run'/'checkpoints')[-1].name == 'checkpoint_00000006_batch.pt'
    assert signal.getsignal(signal.SIGINT) is handler_before        # the handler found before the fit is back
    resumed = in_process_run(tmp_path/'run', resume=True)
    assert same_weights(ref, resumed) and ref.recorder.losses == resumed.recorder.losses

def test_error_between_batches_saves_an_exact_checkpoint(tmp_path):
    ref = in_process_run(tmp_path/'ref')
    with pytest.raises(RuntimeError) as info: in_process_run(tmp_path/'run', cbs=[FailAfterEpoch()])
    assert 'the run is saved in' in info.value.__notes__[-1] and 'not exact' not in info.value.__notes__[-1]
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        resumed = in_process_run(tmp_path/'run', resume=True)
    assert same_weights(ref, resumed)

def test_error_inside_a_batch_saves_an_inexact_checkpoint_that_warns(tmp_path):
    class Boom(Callback):
        def after_loss(self):
            if self.training and self.train_iter == 5: raise RuntimeError('boom')
    with pytest.raises(RuntimeError) as info: in_process_run(tmp_path, cbs=[Boom()])
    assert 'resuming from it is not exact' in info.value.__notes__[-1]
    last = checkpoints_in(tmp_path/'checkpoints')[-1]
    state = load_torch_file(last)
    # the last complete batch: batch 0 of epoch 1
    assert state['exact'] is False and state['loop']['iter'] == 0
    with pytest.warns(UserWarning, match='written after an error in the middle of a batch'):
        in_process_run(tmp_path, resume=True)

def test_a_list_of_batches_resumes_exactly_without_a_warning(tmp_path):
    "A list cannot skip: a resume reads it again up to the checkpoint's batch, from the epoch's random state"
    def learner(path):
        learn = small_learner(path)
        torch.manual_seed(1)
        learn.dls.train = list(learn.dls.train)         # shuffled once, here: each epoch the same batches
        return learn
    ref = learner(tmp_path/'ref')
    ref.fit(2)
    learn = learner(tmp_path/'run')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with pytest.raises(RuntimeError, match='went away'):
            learn.fit(2, cbs=[CheckpointCallback(every_n_steps=1), CrashAt(5)])
        again = learner(tmp_path/'run')
        again.fit(2, resume=True)
    assert same_weights(ref, again) and again.recorder.values == ref.recorder.values

def test_learner_state_dict_roundtrip(tmp_path):
    learn = in_process_run(tmp_path, n_epoch=1)
    learn.state.best = 0.5
    path = learn.save_checkpoint(tmp_path/'x.pt')
    other = in_process_run(tmp_path/'other', n_epoch=2)
    other.load_checkpoint(path)
    assert same_weights(learn,
                        other) and other.state.best == 0.5 and other.recorder.losses == learn.recorder.losses
    assert (other.epoch, other.train_iter) == (learn.epoch, learn.train_iter)

JUPYTER_SETUP = '''
import signal, time, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
def make_learner(path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g); y = (x.sum(1) > 0).long()
    dls = DataLoaders(DataLoader(TensorDataset(x[:192], y[:192]), batch_size=8, shuffle=True),
                      DataLoader(TensorDataset(x[192:], y[192:]), batch_size=32))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    return Learner(dls, model, nn.CrossEntropyLoss(), path=path, device='cpu')
class HoldForCtrlC(Callback):
    "Holds training batch 10 until Ctrl-C has been caught (at most 300 s): the fit stops mid-run anywhere"
    def before_train(self):     # CheckpointCallback's handler, set in before_fit, holds Ctrl-C till it comes
        if self.epoch == 0: self.holding = signal.getsignal(signal.SIGINT)
    def after_batch(self):      # (read here, it would miss a Ctrl-C caught earlier in this batch, wait 300 s)
        if self.train_iter != 10: return
        deadline = time.monotonic() + 300
        while signal.getsignal(signal.SIGINT) is self.holding and time.monotonic() < deadline:
            time.sleep(0.01)
'''

@pytest.mark.slow
def test_ctrl_c_in_a_jupyter_kernel(tmp_path):
    """Interrupt a fit in a real kernel: it survives, a checkpoint exists, and resume=True finishes the run
    exactly"""
    manager = pytest.importorskip('jupyter_client.manager')
    km, kc = manager.start_new_kernel(kernel_name='python3')
    def run(code, timeout=600):              # generous: a loaded machine runs the kernel's fits slowly
        reply = kc.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
        return reply['content']
    try:
        assert run(JUPYTER_SETUP)['status'] == 'ok'
        fit = (f"learn = make_learner({str(tmp_path/'run')!r}); learn.fit_one_cycle(4, 1e-2, "
               f"cbs=[CheckpointCallback(every_n_steps=5), HoldForCtrlC()])")
        msg_id = kc.execute(fit)
        folder = tmp_path/'run'/'checkpoints'
        deadline = time.monotonic() + 300
        while not any(p.name.endswith('_batch.pt') for p
                      in folder.glob('*.pt')) and time.monotonic() < deadline: time.sleep(0.05)
        km.interrupt_kernel()  # the fit is in its first 10 batches, or held at the 10th until this comes
        reply = kc.get_shell_msg(timeout=600)
        while reply['parent_header'].get('msg_id') != msg_id: reply = kc.get_shell_msg(timeout=600)
        assert reply['content']['status'] == 'error' and reply['content']['ename'] == 'KeyboardInterrupt'
        status = run('1 + 1')['status']
        # sent while the kernel still flushed its queue
        if status == 'aborted': status = run('1 + 1')['status']
        assert km.is_alive() and status == 'ok'
        assert checkpoints_in(folder), 'no checkpoint after Ctrl-C'
        # it stopped mid-run
        assert run('assert 0 < learn.train_iter < 96, learn.train_iter')['status'] == 'ok'
        assert run("learn.fit_one_cycle(4, 1e-2, resume=True)")['status'] == 'ok'
        check = (f"ref = make_learner({str(tmp_path/'ref')!r}); ref.fit_one_cycle(4, 1e-2, "
                 f"cbs=CheckpointCallback(every_n_steps=5))\nassert all(torch.equal(a, b) for a, b in "
                 f"zip(ref.model.state_dict().values(), learn.model.state_dict().values()))\nassert "
                 f"ref.recorder.losses == learn.recorder.losses and learn.train_iter == 96")
        result = run(check)
        assert result['status'] == 'ok', result
    finally:
        kc.stop_channels(); km.shutdown_kernel(now=True)

@pytest.mark.parametrize('first, then', [(torch.optim.Adam, fast_adam), (fast_adam, torch.optim.Adam)],
                         ids=['plain-then-fused', 'fused-then-plain'])
def test_a_checkpoint_of_one_adam_resumes_with_the_other(tmp_path, first, then):
    "The optimizer state moves between torch's implementations of Adam; each goes on as itself"
    def run(path, opt_func, cbs=(), resume=None):
        learn = small_learner(path, lambda: nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2)))
        learn.opt_func = opt_func
        learn.fit_one_cycle(3, 1e-2, cbs=[CheckpointCallback(every_n_steps=2), *cbs], resume=resume)
        return learn
    ref = run(tmp_path/'ref', first)
    with pytest.raises(RuntimeError, match='boom'): run(tmp_path/'run', first, cbs=[FailAfterEpoch()])
    resumed = run(tmp_path/'run', then, resume=True)
    assert bool(resumed.opt.param_groups[0]['fused']) == (then is fast_adam)
    flat = lambda learn: torch.cat([p.detach().flatten() for p in learn.model.parameters()])
    assert ((flat(resumed) - flat(ref)).norm() / flat(ref).norm()) < 1e-6
    assert resumed.train_iter == ref.train_iter

def assert_close_run(a, b, rtol=1e-6):
    """`assert_same_run` within `rtol` of each tensor's largest value: a compiled run's kernels may round in
    another order"""
    close = lambda x, y: (x - y).abs().max() <= rtol * max(x.abs().max(), 1e-12)
    for k in a['model']: assert close(a['model'][k], b['model'][k]), f'model {k} differs'
    sa, sb = a['opt']['state'], b['opt']['state']
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert close(torch.as_tensor(sa[i][k]).double(),
                         torch.as_tensor(sb[i][k]).double()), f'optimizer {i}.{k} differs'
    for x, y in [(a['losses'], b['losses']), (a['values'], b['values']), (a['lrs'], b['lrs'])]:
        assert torch.allclose(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64),
                              rtol=rtol, atol=0)

@pytest.mark.slow
def test_a_compiled_fit_killed_and_resumed_equals_the_uninterrupted_one(tmp_path):
    """learn.compile(step=True), dropout, one-cycle and GradientAccumulation: SIGKILL, then resume='auto',
    compiled again. Within 1e-6, not bitwise: the resumed process compiles its graphs in another order, which
    may round differently"""
    ref = tmp_path/'ref'
    run_resume(ref, '--compile-step', '--out', str(ref/'final.pt'))
    reference = load_torch_file(ref/'final.pt')
    for i, point in enumerate([('after_batch', 1, 3, 'train'), ('before_batch', 2, 1, 'valid')]):
        path, spec = tmp_path/f'run{i}', ','.join(map(str, point))
        killed = run_resume(path, '--compile-step', '--kill', spec, check=False)
        assert killed.returncode == -signal.SIGKILL, (f'{spec}: expected SIGKILL, got {killed.returncode}\n'
                                                      f'{killed.stderr}')
        run_resume(path, '--compile-step', '--resume', '--out', str(path/'final.pt'))
        try: assert_close_run(reference, load_torch_file(path/'final.pt'))
        except AssertionError as e: raise AssertionError(f'kill at {point}: {e}') from None
