"""Distributed training on the CPU with gloo: 2 processes launched by torchrun, each run bounded by a timeout.
Runs tests/distributed/ddp_script.py; rank 0 saves its results, which are compared with a 1-process run."""
import re
from pathlib import Path
import pytest, torch
# free_port: the other test modules import it from here
from learncb.ranks import num_distrib, rank_distrib, free_port
from conftest import run_script

SCRIPT = Path(__file__).parent/'ddp_script.py'
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason='torch.distributed is not '
                                'available')
# pytest -n: the tests sharing a module fixture's runs go to one worker, which makes them once
shared_runs = pytest.mark.xdist_group('ddp_one_and_two')

def run(out, *args, nproc=2, check=True, timeout=180):
    """Run the script in `nproc` processes (torchrun) or in one (`nproc=1`, plain python), forked; never
    longer than `timeout`"""
    res = run_script(SCRIPT, out, *args, nproc=nproc, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f'{args}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}')
    return res

def result(out): return torch.load(Path(out)/'result.pt', weights_only=False)

def ranks_said(res):
    "What each rank printed at the end: {rank: (world, epochs, files written)}"
    return {int(r): tuple(map(int, rest)) for r,*rest in re.findall(r'RANK (\d) OF (\d) EPOCHS (\d+) WRITES '
                                                                    r'(\d+)', res.stdout)}

@pytest.fixture(scope='module')
def one_and_two(tmp_path_factory):
    "The same training, in 1 process with batches of 16 and in 2 processes with batches of 8 each"
    one, two = tmp_path_factory.mktemp('one'), tmp_path_factory.mktemp('two')
    run(one, '--bs', '16', nproc=1)
    res = run(two, '--bs', '8')
    return result(one), result(two), res

@pytest.mark.slow
@shared_runs
def test_two_processes_train_like_one(one_and_two):
    one, two, res = one_and_two
    assert two['world'] == 2 and one['world'] == 1 and two['is_plain']  # the model is unwrapped after the fit
    for k in one['model']: torch.testing.assert_close(two['model'][k], one['model'][k], atol=1e-6, rtol=1e-5)
    for a, b in zip(one['values'], two['values']):  # the table: global values, as 1 process
        assert all(abs(x - y) < 1e-6 for x, y in zip(a, b)), (a, b)
    assert ranks_said(res) == {0: (2, 3, 0), 1: (2, 3, 0)}
    # the group and its threads freed when distrib_ctx ends it: left to the interpreter's teardown, a gloo
    # thread can abort the process at exit (seen)
    assert res.stdout.count('GLOO THREADS LEFT 0') == 2, res.stdout[-2000:]

@shared_runs
def test_get_preds_gathers_in_order_without_duplicates(one_and_two):
    one, two, _ = one_and_two
    assert two['preds'].shape == (33, 3)  # 33 items: 17 on rank 0, 16 on rank 1
    assert torch.equal(two['targs'], one['targs'])                           # in dataset order
    # what one process gets with those weights (every item in a batch of the same size in both: 4, or 1 for
    # item 32)
    assert torch.equal(two['preds'], two['alone'])

@pytest.mark.slow
def test_only_rank0_writes_and_the_table_prints_once(tmp_path):
    res = run(tmp_path, '--bs', '8', '--ckpt', '--count-writes')
    said = ranks_said(res)
    assert said[1][2] == 0 and said[0][2] > 0, said
    assert res.stdout.count('train_loss') == 1                               # the header, from rank 0 alone
    assert (tmp_path/'models'/'best.pth').exists() and (tmp_path/'history.csv').exists()

@pytest.mark.slow
def test_early_stopping_stops_both_ranks_at_the_same_epoch(tmp_path):
    res = run(tmp_path, '--bs', '8', '--early', '--epochs', '6')
    said = ranks_said(res)
    assert said[0][1] == said[1][1] < 6, said

@pytest.mark.slow
def test_an_error_on_rank_1_ends_both_processes(tmp_path):
    "Rank 1 fails; rank 0 does not wait for it forever: both end (run's timeout fails the test if they hang)"
    res = run(tmp_path, '--bs', '8', '--fail-rank', '1', '--timeout', '20', check=False, timeout=300)
    assert res.returncode != 0
    assert 'boom on rank 1' in res.stdout + res.stderr
    assert not (tmp_path/'result.pt').exists()

@pytest.mark.slow
def test_sigkill_at_3_batches_then_resume_is_exact(tmp_path):
    """Rank 1 SIGKILLed in the forward of training batch k (from 0; 3 epochs of 4 batches per rank): the
    first of the second epoch, one in its middle, the last of the run; each run resumed equals the run never
    killed"""
    common = ('--bs', '8', '--ckpt', '--shuffle', '--dropout', '0.2')
    run(tmp_path/'ref', *common)
    ref = result(tmp_path/'ref')
    for k in (4, 6, 11):
        out = tmp_path/f'kill{k}'
        killed = run(out, *common, '--kill-at', str(k), check=False)
        assert killed.returncode != 0, k
        run(out, *common, '--resume')
        got = result(out)
        for name in ref['model']: assert torch.equal(got['model'][name], ref['model'][name]), (k, name)
        for i, st in ref['opt']['state'].items():
            for key, v in st.items(): assert torch.equal(got['opt']['state'][i][key], v), (k, i, key)
        assert got['losses'] == ref['losses'] and got['values'] == ref['values'], k

def _train_in_each_process(out):
    "What a notebook would pass to `launch`: build a learner, fit under distrib_ctx; rank 0 saves the table"
    from learncb.test_utils import synth_learner
    torch.set_num_threads(1)
    learn = synth_learner()
    with learn.distrib_ctx(timeout=30):
        learn.fit(2)
        if rank_distrib() == 0:
            torch.save({'world': num_distrib(), 'values': learn.recorder.values}, Path(out)/'r.pt')

@pytest.mark.slow
def test_launch_from_a_notebook_forks_a_run(tmp_path):
    from learncb.distributed.context import launch
    import multiprocessing as mp
    p = mp.get_context('spawn').Process(target=launch, args=(_train_in_each_process, tmp_path),
                                        kwargs={'nprocs': 2})
    p.start(); p.join(120)                 # in a fresh process, as a kernel is: fork from there
    if p.is_alive(): p.kill(); pytest.fail('launch did not finish in 120 s')
    assert p.exitcode == 0
    r = torch.load(tmp_path/'r.pt', weights_only=False)
    assert r['world'] == 2 and len(r['values']) == 2

@pytest.mark.slow
def test_gradient_accumulation_skips_the_averaging_of_batches_that_do_not_step(tmp_path):
    run(tmp_path/'one', '--bs', '8', '--acc', '16', nproc=1)
    # 4 items a batch per rank, 8 in all: the run's n_acc, as in one
    run(tmp_path/'two', '--bs', '4', '--acc', '16')
    one, two = result(tmp_path/'one'), result(tmp_path/'two')
    assert two['syncs'][:6] == [False, True] * 3  # no_sync in the backward of the first of each pair
    for k in one['model']: torch.testing.assert_close(two['model'][k], one['model'][k], atol=1e-6, rtol=1e-5)

def test_gradient_clip_and_bf16_under_ddp(tmp_path):
    res = run(tmp_path, '--bs', '8', '--clip-bf16')
    vals = result(tmp_path)['values']
    assert len(vals) == 3 and all(v == v for row in vals for v in row)                # finite: no NaN
    assert ranks_said(res)[1][1] == 3

@pytest.mark.slow
def test_stop_fit_on_one_rank_stops_every_rank(tmp_path):
    said = ranks_said(run(tmp_path, '--bs', '8', '--stop-rank', '1'))
    assert said[0][1] == said[1][1] == 1, said

@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank(tmp_path):
    said = ranks_said(run(tmp_path, '--bs', '8', '--nan-rank', '1'))
    assert said[0][1] == said[1][1] == 2, said                         # found at batch 6 of 12: in epoch 1

@pytest.mark.slow
def test_torchmetrics_sync_themselves(tmp_path):
    pytest.importorskip('torchmetrics')
    run(tmp_path/'one', '--bs', '16', '--torchmetrics', nproc=1)
    run(tmp_path/'two', '--bs', '8', '--torchmetrics')
    one, two = result(tmp_path/'one'), result(tmp_path/'two')
    assert abs(one['values'][-1][3] - two['values'][-1][3]) < 1e-6 and one['values'][-1][3] > 0

@pytest.mark.slow
def test_a_compiled_step_under_ddp_trains_like_the_eager_one(tmp_path):
    """learn.compile(step=True) under DDP (2 processes): within 1e-5 of the eager DDP fit, GradientClip in the
    compiled step"""
    common = ('--bs', '8', '--adam', '--clip', '--epochs', '2', '--n-valid', '30')
    run(tmp_path/'eager', *common, timeout=300)
    run(tmp_path/'compiled', *common, '--compile-step', timeout=600)
    eager, compiled = result(tmp_path/'eager'), result(tmp_path/'compiled')
    assert compiled['graphs'] > 0 and eager['graphs'] == 0 and compiled['is_plain']
    for k, w in eager['model'].items():                # relative to the tensor's largest weight
        assert (compiled['model'][k] - w).abs().max() <= 1e-5 * w.abs().max(), k
    for a, b in zip(eager['values'], compiled['values']):
        assert all(abs(x - y) <= 1e-5 * max(1, abs(x)) for x, y in zip(a, b))
