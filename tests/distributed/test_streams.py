"""Each rank's own stream (an `IterableDataset`) under DDP, killed and resumed exactly; a loss of the
prediction alone under DDP. Runs tests/distributed/streams_script.py in 2 processes (torchrun, gloo) and in
one."""
from pathlib import Path
import pytest, torch
from conftest import run_script

SCRIPT = Path(__file__).parent/'streams_script.py'
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.distributed.is_available(),
                                                   reason='torch.distributed is not available')]

def run(out, *args, nproc=2, check=True):
    res = run_script(SCRIPT, out, *args, nproc=nproc, timeout=240)
    if check and res.returncode != 0:
        raise AssertionError(f'{args}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}')
    return res

def result(out): return torch.load(Path(out)/'result.pt', weights_only=False)

def assert_same_fit(a, b, exact=False):
    for k in a['model']:
        if exact: assert torch.equal(a['model'][k], b['model'][k]), k
        else: torch.testing.assert_close(a['model'][k], b['model'][k], atol=1e-6, rtol=1e-5)
    for va, vb in zip(a['values'], b['values']):
        assert all(abs(p - q) < 1e-6 for p, q in zip(va, vb)), (va, vb)

@pytest.fixture(scope='module')
def streams(tmp_path_factory):
    "The stream fit in one process (whole global batches) and in two (each rank its half)"
    one, two = tmp_path_factory.mktemp('one'), tmp_path_factory.mktemp('two')
    run(one, nproc=1)
    run(two)
    return result(one), result(two), two

def test_each_rank_reading_its_own_stream_trains_as_one_process(streams):
    one, two, _ = streams
    assert (one['world'], two['world']) == (1, 2)
    assert_same_fit(one, two)
    # get_preds over the ranks' streams: every rank's items, rank 0's first
    assert two['preds'].shape == one['preds'].shape == (32, 3)
    assert sorted(two['targs'].tolist()) == sorted(one['targs'].tolist())

@pytest.mark.parametrize('kill_at', [4, 6])
def test_a_stream_fit_killed_then_resumed_equals_the_fit_not_killed(streams, tmp_path, kill_at):
    """Killed after training batch 4 (the last of epoch 0) and 6 (mid-epoch 1): each rank resumes its own
    stream from its own state"""
    _, _, two = streams
    killed = run(tmp_path, '--kill-at', str(kill_at), check=False)
    assert killed.returncode != 0
    run(tmp_path, '--resume')
    assert_same_fit(result(two), result(tmp_path), exact=True)

def test_every_rank_reading_the_same_stream_is_refused(tmp_path):
    res = run(tmp_path, '--mode', 'same', check=False)
    assert res.returncode != 0
    assert 'every rank read the same first batch from the training IterableDataset' in res.stderr, \
        res.stderr[-3000:]

def test_a_loss_of_the_prediction_alone_trains_under_ddp_as_in_one_process(tmp_path):
    run(tmp_path/'one', '--mode', 'pred-loss', nproc=1)
    run(tmp_path/'two', '--mode', 'pred-loss')
    one, two = result(tmp_path/'one'), result(tmp_path/'two')
    assert_same_fit(one, two)
    assert len(one['losses']) == 12 and one['targs'] is None and two['preds'].shape == (32, 3)

def test_fsdp_on_a_model_parallelized_already_says_what_to_do(tmp_path):
    "torch's own `Invariant encountered` error, then a failed cleanup, were all a user saw"
    res = run(tmp_path, '--mode', 'tp-then-fsdp', check=False)
    assert res.returncode != 0
    said = ("FSDP() shards a plain model over every rank (a 1-D mesh), but the model's parameter 0.weight is "
            "a DTensor already")
    assert said in res.stderr and "strategy=ModelParallel(mesh=" in res.stderr, res.stderr[-3000:]
    assert 'after_fit raised' not in res.stderr, res.stderr[-3000:]
