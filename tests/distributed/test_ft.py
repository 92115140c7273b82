"""Fault tolerance per step on torchft (CPU, gloo, a lighthouse on loopback): replicas killed in the middle of
a step, started again or for the first time while the others train; every replica that finishes ends as the
undisturbed run.

Each replica group is a process running `tests/distributed/ft_script.py`: forked from one that imported
learncb (no 2 to 3 s of imports each), or the plain `python ft_script.py` of a user (the new replica that
joins a running one); every wait is bounded by a timeout."""
import gc, os, subprocess, sys, time
from pathlib import Path
import pytest, torch

torchft = pytest.importorskip('torchft')
from learncb.distributed.replicas import Lighthouse, replica_env
from learncb.ranks import free_port
from conftest import run_forked, start_forked, start_torchrun_group

SCRIPT = Path(__file__).parent/'ft_script.py'
WAIT = 240          # seconds any one wait may take, on a loaded 2-core machine

def start(out, lighthouse, replica, n, *args, plain_python=False):
    """Replica group `replica` of `n` (its output in OUT/log{replica}-{k}): a process forked from one that
    imported learncb (`start_forked`), or with `plain_python` the `python ft_script.py` a user runs"""
    log = out/f'log{replica}-{len(list(out.glob(f"log{replica}-*")))}'
    env = {**os.environ, **replica_env(lighthouse, replica, n), 'RUST_LOG': 'warn'}
    if not plain_python: return start_forked(SCRIPT, out, *args, env=env, out=log)
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out), *args], env=env, stdout=open(log, 'w'),
                            stderr=subprocess.STDOUT)

def start_awaited(out, lighthouse, replica, n, *args, plain_python=False):
    """`start` after making OUT/hold: the replicas started with `--wait-for` wait for this one, however late
    it starts"""
    (out/'hold').touch()
    return start(out, lighthouse, replica, n, *args, plain_python=plain_python)

def finish(procs):
    "Wait for every process; kill them all if one takes longer than WAIT; the exit codes"
    try: return [p.wait(timeout=WAIT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None: p.kill()

def logs(out): return '\n'.join(f'--- {f.name}\n{f.read_text()[-3000:]}' for f in sorted(out.glob('log*')))

def result(out, replica): return torch.load(out/f'result{replica}.pt', weights_only=False)

@pytest.fixture(scope='module')
def plain(tmp_path_factory):
    "The same fit on one process under distrib_ctx(global_batch=64)"
    out = tmp_path_factory.mktemp('plain')
    res = run_forked(SCRIPT, out, '--plain', timeout=WAIT)
    assert res.returncode == 0, res.stderr[-3000:]
    return result(out, 'plain')

def same(a, b):
    "Whether `a` and `b` hold the same values, tensors bitwise (in dicts, lists and tuples)"
    if isinstance(a, torch.Tensor): return torch.equal(a, b)
    if isinstance(a, dict): return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return len(a) == len(b) and all(map(same, a, b))
    return a == b

def assert_same(a, b):
    "Bitwise the same weights, optimizer state (several optimizers' too), counters and Recorder values"
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    assert same(a['opt'], b['opt'])
    assert a['counters'] == b['counters'] and a['values'] == b['values']

def assert_each_step_once(*results):
    """`after_batch` fired once per committed step: each step from where the process joined (the start, or its
    heal)"""
    for r in results: assert r['after_batch'] == r['counters'][2] - r['healed_at']

def assert_close_to(a, plain, tol=1e-6):
    "Within `tol` (relative to each tensor's largest value) of the plain fit; the Recorder's values too"
    for k,w in plain['model'].items():
        assert (a['model'][k] - w).abs().max() <= tol * w.abs().max(), k
    for row,ref in zip(a['values'], plain['values'], strict=True):
        assert row == pytest.approx(ref, rel=tol, abs=tol)
    assert a['counters'][0] == plain['counters'][0] and a['counters'][2] == plain['counters'][2]

def kill_and_restart(out, lighthouse, n, kills, restart, slow_alone=0.4, args=()):
    """Start `n` replicas (with `args`); replica r of `kills` ({r: (step, stage)}) SIGKILLs itself once; those
    in `restart` start again"""
    common = ['--wait-for', str(n), '--slow-alone', str(slow_alone), *args]
    procs = {r: start(out, lighthouse, r, n, *common, *([] if r not in kills else
                                                        ['--kill-at', str(kills[r][0]), '--kill-in',
                                                         kills[r][1]]))
             for r in range(n)}
    deadline = time.monotonic() + WAIT
    for r in kills:
        while procs[r].poll() is None and time.monotonic() < deadline: time.sleep(0.1)
        assert procs[r].returncode == -9, logs(out)           # it died of its SIGKILL, in the stage asked
        # the others cannot finish first
        if r in restart: procs[r] = start_awaited(out, lighthouse, r, n, *common)
    codes = finish([p for r,p in procs.items() if r not in kills or r in restart])
    assert codes == [0] * len(codes), logs(out)

@pytest.fixture
def lighthouse():
    with Lighthouse(join_timeout=10, heartbeat_timeout=2) as lh: yield lh

@pytest.mark.parametrize('stage', ['forward'])
def test_killed_replica_heals_and_both_end_as_one_process(tmp_path, lighthouse, plain, stage):
    """Two replicas, one SIGKILLed in the middle of a step of epoch 1 and started again: both end as the
    undisturbed fit"""
    kill_and_restart(tmp_path, lighthouse, 2, {1: (18, stage)}, restart={1})
    a,b = result(tmp_path, 0),result(tmp_path, 1)
    assert b['healed_at'] >= 18  # started again, it healed from its peer: it did not train from the start
    assert a['tries'] >= 1  # the step its peer died in was not committed: the survivor computed it again
    assert_each_step_once(a, b)
    assert_same(a, b)
    assert_close_to(a, plain)

@pytest.mark.slow
@pytest.mark.parametrize('stage', ['backward', 'allreduce', 'step'])
def test_a_kill_in_any_stage_neither_repeats_nor_loses_a_step(tmp_path, lighthouse, plain, stage):
    """Killed during its backward, during the gradients' all-reduce, or during the optimizer step: no step
    twice, none lost"""
    kill_and_restart(tmp_path, lighthouse, 2, {1: (15, stage)}, restart={1})
    a,b = result(tmp_path, 0),result(tmp_path, 1)
    assert b['healed_at'] >= 15
    # killed before its all-reduce: the step is tried again (killed in the all-reduce, its data may have gone
    # out: the survivor may then commit the step, which the healed one gets)
    if stage == 'backward': assert a['tries'] >= 1
    assert_each_step_once(a, b)
    assert_same(a, b)
    assert a['counters'][2] == plain['counters'][2]  # as many committed steps as the plain fit's batches
    assert_close_to(a, plain)

@pytest.mark.slow
@pytest.mark.parametrize('step,stage', [('turns', 'turn2'), ('closure', 'closure')])
def test_a_kill_in_a_later_turn_or_a_closure_call_loses_nothing(tmp_path, lighthouse, step, stage):
    """Several optimizers in turn, killed in the second turn's backward (the first committed); LBFGS, killed
    in a call of its closure: the survivor computes that turn or call again alone, the restarted one joins at
    a later batch's start and heals; both end as the plain fit"""
    res = run_forked(SCRIPT, tmp_path/'plain', '--plain', '--step', step, timeout=WAIT)
    assert res.returncode == 0, res.stderr[-3000:]
    plain = result(tmp_path/'plain', 'plain')
    kill_and_restart(tmp_path, lighthouse, 2, {1: (15, stage)}, restart={1}, args=['--step', step])
    a,b = result(tmp_path, 0),result(tmp_path, 1)
    assert b['healed_at'] >= 15 and a['tries'] >= 1
    assert_each_step_once(a, b)
    assert_same(a, b)
    assert_close_to(a, plain)

@pytest.mark.slow
def test_a_spike_rolls_back_every_replica_one_that_healed_after_the_snapshot_too(tmp_path, lighthouse):
    """SpikeGuard under torchft: replica 1, killed early in epoch 1 and started again, heals after the guard's
    snapshot (the epoch's start) and before the scripted spike (its last batch); both roll back to that
    snapshot together, skip the batch, and end bitwise equal to each other and as the same guarded fit in one
    process"""
    spike = ['--spike-at', '1,11']
    res = run_forked(SCRIPT, tmp_path/'plain', '--plain', *spike, timeout=WAIT)
    assert res.returncode == 0, res.stderr[-3000:]
    plain = result(tmp_path/'plain', 'plain')
    assert plain['skipped'] == ((1, 11),) and plain['counters'][2] == 35        # rolled back in one process
    kill_and_restart(tmp_path, lighthouse, 2, {1: (13, 'forward')}, restart={1}, slow_alone=1.0, args=spike)
    a,b = result(tmp_path, 0),result(tmp_path, 1)
    assert 13 <= b['healed_at'] <= 23  # it joined after the snapshot (batch 12), by the spike (batch 23)
    assert a['skipped'] == b['skipped'] == plain['skipped']
    # said once, by one replica
    assert logs(tmp_path).count('SpikeGuard: rolled back over epoch 1 batch 11') == 1
    assert_same(a, b)
    assert_close_to(a, plain)

@pytest.mark.slow
def test_three_replicas_two_killed_one_restarted(tmp_path, lighthouse, plain):
    "Three replicas, two killed at different steps, one of them started again: the two that finish, the same"
    kill_and_restart(tmp_path, lighthouse, 3, {1: (10, 'forward'), 2: (20, 'backward')}, restart={2})
    assert not (tmp_path/'result1.pt').exists()     # the one not started again finished nothing
    a,c = result(tmp_path, 0),result(tmp_path, 2)
    assert c['healed_at'] >= 20
    assert_same(a, c)
    assert_close_to(a, plain)

def running_past(out, lighthouse, step):
    "Replica 0 of 2, slowed while alone, once it has committed `step` steps (the next one: `start_awaited`)"
    first = start(out, lighthouse, 0, 2, '--wait-for', '2', '--slow-alone', '0.3')
    deadline = time.monotonic() + WAIT
    while not (out/'step0').exists() or int((out/'step0').read_text() or 0) < step:
        assert first.poll() is None and time.monotonic() < deadline, logs(out)
        time.sleep(0.1)
    return first

@pytest.mark.slow
def test_a_new_replica_joins_a_running_one(tmp_path, lighthouse, plain):
    "Scale up: a replica started for the first time while another trains heals from it and takes its share"
    first = running_past(tmp_path, lighthouse, 8)
    # as a user starts one: no other variables
    late = start_awaited(tmp_path, lighthouse, 1, 2, plain_python=True)
    assert finish([first, late]) == [0, 0], logs(tmp_path)
    a,b = result(tmp_path, 0),result(tmp_path, 1)
    assert_same(a, b)
    assert_close_to(a, plain)
    assert b['healed_at'] >= 8          # it joined a run that was under way, and healed from it

@pytest.mark.slow
def test_every_replica_restarted_resumes_from_its_checkpoint(tmp_path, lighthouse, plain):
    """CheckpointCallback still works: both replicas killed, both started again, each resumes from its own
    checkpoint"""
    first = start(tmp_path, lighthouse, 0, 2, '--ckpt', '--kill-at', '18', '--wait-for', '2')
    procs = [first, start_awaited(tmp_path, lighthouse, 1, 2, '--ckpt', '--kill-at', '18')]
    assert finish(procs) == [-9, -9], logs(tmp_path)
    assert all(list((tmp_path/f'ckpt{r}').iterdir()) for r in range(2))
    assert finish([start(tmp_path, lighthouse, r, 2, '--ckpt') for r in range(2)]) == [0, 0], logs(tmp_path)
    a,b = result(tmp_path, 0),result(tmp_path, 1)
    assert 'resuming the run from' in logs(tmp_path) and min(a['healed_at'], b['healed_at']) >= 16
    assert_same(a, b)
    assert_close_to(a, plain)

@pytest.mark.slow
def test_a_replica_of_other_data_is_refused_and_the_run_goes_on(tmp_path, lighthouse, plain):
    """A replica whose training data differs from the run's stops before its first batch; the run goes on,
    exact"""
    first = running_past(tmp_path, lighthouse, 5)
    odd = start(tmp_path, lighthouse, 1, 2, '--n-items', str(64 * 10))
    assert finish([odd]) == [1]
    assert 'resume with the data the run was trained on' in (tmp_path/'log1-0').read_text()
    assert finish([first]) == [0], logs(tmp_path)
    assert_close_to(result(tmp_path, 0), plain)

def start_group(out, lighthouse, group, n, *args):
    """Replica group `group` of `n` as torchrun starts one: 2 ranks (gloo) on its own `--standalone`
    rendezvous, each rank saving OUT/result{group}-{rank}.pt; the same command starts it again"""
    log = out/f'log{group}-{len(list(out.glob(f"log{group}-*")))}'
    env = {**os.environ, **replica_env(lighthouse, group, n), 'RUST_LOG': 'warn'}
    return start_torchrun_group(SCRIPT, env, log, out, *args)

@pytest.mark.slow
@pytest.mark.parametrize('within,stage', [('ddp', 'backward'), ('fsdp', 'allreduce')])
def test_groups_of_two_ranks_one_killed_its_group_restarted_heals(tmp_path, lighthouse, plain, within, stage):
    """2 replica groups of 2 ranks (torchrun, DDP or FSDP within): rank 1 of group 1 SIGKILLed in the middle
    of a step; torchrun ends its group; group 0 goes on without a restart; group 1 started again with the same
    command heals rank by rank (FSDP: each its shards); all four ranks end bitwise equal, and within 1e-6 of
    the one-process fit"""
    common = ['--within', within, '--wait-for', '2', '--slow-alone', '0.4']
    (tmp_path/'hold').touch()                   # group 0 waits for group 1's manager before it trains alone
    first = start_group(tmp_path, lighthouse, 0, 2, *common)
    kill = ['--kill-at', '18', '--kill-in', stage, '--kill-rank', '1']
    killed = start_group(tmp_path, lighthouse, 1, 2, *common, *kill)
    assert finish([killed]) == [1], logs(tmp_path)             # torchrun's exit: a rank failed
    assert (tmp_path/'killed1').exists()
    (tmp_path/'hold').touch()
    again = start_group(tmp_path, lighthouse, 1, 2, *common)
    assert finish([first, again]) == [0, 0], logs(tmp_path)
    (a,b),(c,d) = [[result(tmp_path, f'{g}-{r}') for r in range(2)] for g in range(2)]
    assert c['healed_at'] == d['healed_at'] >= 18 > a['healed_at']      # group 1 healed, after its kill
    if stage == 'backward': assert a['tries'] >= 1         # the step its peer died in was computed again
    assert_each_step_once(a, b, c, d)
    for other in (b, c, d): assert_same(a, other)
    assert_close_to(a, plain)

def test_replicas_with_different_weights_stop_at_the_first_step(tmp_path):
    """Replicas that start together with models made differently (not seeded alike) say so before the first
    step is taken"""
    # the first quorum holds both
    with Lighthouse(min_replicas=2, join_timeout=10, heartbeat_timeout=2) as both:
        assert finish([start(tmp_path, both, r, 2, '--seed', str(r)) for r in range(2)]) == [1, 1]
    assert logs(tmp_path).count('start with different weights') == 2

# In this process: what is wrong is said before the first batch, and nothing of the learner's is lost

from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import Learner, DataLoaders, TorchFT

def tiny_learner():
    ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    return Learner(DataLoaders(DataLoader(ds, batch_size=16), None), nn.Linear(4, 1), loss_func=nn.MSELoss())

def fit_torchft(monkeypatch, env, strategy=None):
    for k in ('TORCHFT_LIGHTHOUSE', 'REPLICA_GROUP_ID', 'NUM_REPLICA_GROUPS', 'WORLD_SIZE'):
        monkeypatch.delenv(k, raising=False)
    for k,v in env.items(): monkeypatch.setenv(k, v)
    learn = tiny_learner()
    model,weights = learn.model,{k: v.clone() for k,v in learn.model.state_dict().items()}
    try:
        with learn.distrib_ctx(strategy=strategy or TorchFT(connect_timeout=2)): learn.fit(1)
    finally:
        assert learn.model is model and type(learn.strategy).__name__ == 'SingleProcess'
        # no step was taken
        assert all(torch.equal(v, learn.model.state_dict()[k]) for k,v in weights.items())

def test_no_lighthouse_is_an_error_before_the_first_batch(monkeypatch):
    env = replica_env(f'http://127.0.0.1:{free_port()}', 0, 1)
    with pytest.raises(ConnectionError, match='no lighthouse answers at '
                                              'TORCHFT_LIGHTHOUSE.*torchft_lighthouse'):
        fit_torchft(monkeypatch, env)

def test_missing_settings_are_named(monkeypatch):
    with pytest.raises(ValueError, match='TORCHFT_LIGHTHOUSE is not set'): fit_torchft(monkeypatch, {})
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID=None"):
        fit_torchft(monkeypatch, {'TORCHFT_LIGHTHOUSE': 'http://127.0.0.1:1'})
    with pytest.raises(ValueError, match="within='fsdp'"): TorchFT(shard=nn.Linear)
    with pytest.raises(ValueError, match="within must be 'ddp' or 'fsdp', not 'hsdp'"): TorchFT(within='hsdp')

def test_an_untested_or_missing_torchft_is_named(monkeypatch):
    import importlib.metadata
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, 'version', lambda n: '0.1.0' if n == 'torchft' else real(n))
    with pytest.raises(ImportError, match=r'torchft 0\.1\.0 is '
                                          r'installed.*torchft==0\.2\.0.*allow_untested=True'):
        fit_torchft(monkeypatch, replica_env('http://127.0.0.1:1', 0, 1))
    def missing(n): raise importlib.metadata.PackageNotFoundError(n)
    monkeypatch.setattr(importlib.metadata, 'version', missing)
    with pytest.raises(ImportError, match=r"pip install 'learncb\[ft\]'"):
        fit_torchft(monkeypatch, replica_env('http://127.0.0.1:1', 0, 1))

@pytest.mark.slow
def test_a_quorum_that_does_not_form_says_which_timeout_expired(monkeypatch):
    with Lighthouse(min_replicas=2) as lh, pytest.raises(TimeoutError, match=r'quorum_timeout=2 '
            r's.*--min_replicas'):
        fit_torchft(monkeypatch, replica_env(lh, 0, 2), TorchFT(quorum_timeout=2))

def test_a_compiled_step_compiles_the_model_inside_the_fault_tolerant_step(monkeypatch):
    "learn.compile(step=True) under torchft: the model compiled inside the fault-tolerant step"
    from test_step import AtThirdBatch
    with Lighthouse() as lh:
        learn = tiny_learner()
        learn.compile(step=True, fallback=False)
        monkeypatch.setenv('RUST_LOG', 'warn')
        for k,v in replica_env(lh, 0, 1).items(): monkeypatch.setenv(k, v)
        graphs,seen = torch._dynamo.utils.counters['stats']['unique_graphs'],AtThirdBatch()
        with learn.distrib_ctx(strategy='torchft'): learn.fit(1, cbs=seen)
    assert isinstance(learn.model, nn.Linear) and learn.train_iter == 4
    assert learn.compiler.compiled_step is None
    assert seen.seen[2] == 'FaultTolerantStep'
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] > graphs

def test_a_replica_alone_trains_and_nothing_callable_is_set_on_the_learner(monkeypatch):
    """One replica under a lighthouse trains at once, through FaultTolerantStep, setting no function on an
    instance"""
    from test_step import AtThirdBatch
    with Lighthouse() as lh:
        for k,v in {**replica_env(lh, 0, 2), 'RUST_LOG': 'warn'}.items(): monkeypatch.setenv(k, v)
        learn,seen = tiny_learner(),AtThirdBatch()
        opt_func = learn.opt_func
        with learn.distrib_ctx(strategy='torchft'): learn.fit(1, cbs=seen)
    assert seen.seen == ([], [], 'FaultTolerantStep') and learn.train_iter == 4
    assert isinstance(learn.model, nn.Linear) and learn.opt_func is opt_func
    assert type(learn.strategy).__name__ == 'SingleProcess'


class CollectingData(torch.utils.data.Dataset):
    "Rows whose first read collects the garbage (in a DataLoader worker: what the forked copy inherited)"
    def __len__(self): return 8
    def __getitem__(self, i):
        if i == 0: gc.collect()
        return torch.full((2,), float(i))

@pytest.mark.parametrize('sync', ['step', 'diloco'])
def test_a_dataloader_worker_forked_after_a_fit_frees_nothing_of_it(monkeypatch, sync):
    """After a fit under torchft, the manager and gloo's process group are freed in this process: a forked
    DataLoader worker that collects the garbage neither hangs (on gloo's or the manager's threads, which it
    has no copy of) nor aborts"""
    with Lighthouse() as lh:
        for k,v in {**replica_env(lh, 0, 1), 'RUST_LOG': 'warn'}.items(): monkeypatch.setenv(k, v)
        learn = tiny_learner()
        ft = TorchFT(sync=sync, sync_every=None if sync == 'step' else 2)
        with learn.distrib_ctx(strategy=ft): learn.fit(1)
    assert learn.train_iter == 4
    del learn, ft
    dl = torch.utils.data.DataLoader(CollectingData(), batch_size=4, num_workers=1, timeout=120,
                                     multiprocessing_context='fork')
    assert [b[:, 0].tolist() for b in dl] == [[0., 1., 2., 3.], [4., 5., 6., 7.]]
