"""FSDP2 and sharded checkpoints on the CPU with gloo: tests/distributed/ddp_script.py launched by torchrun,
each run bounded by a timeout. An MLP of 3 blocks, each block an FSDP unit; AdamW, so the optimizer has state
to shard."""
import shutil, subprocess, sys
from pathlib import Path
import pytest, torch
from conftest import run_forked, torchrun
from test_distributed import run, result, ranks_said

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason='torch.distributed is not '
                                'available')
# pytest -n: the tests sharing a module fixture's runs go to one worker, which makes them once
shared_runs = pytest.mark.xdist_group('fsdp_runs')

# checkpoints every batch, shuffled data (--dist-order: a run of one process reads DistributedSampler's
# order, as the ranks of a distributed run do together)
COMMON = ('--blocks', '--adam', '--ckpt', '--shuffle', '--dist-order')
FSDP = ('--strategy', 'fsdp')

def assert_weights_close(got, ref, atol=1e-5):
    for k in ref['model']: torch.testing.assert_close(got['model'][k], ref['model'][k], atol=atol, rtol=1e-5)

def assert_weights_equal(got, ref):
    for k in ref['model']: assert torch.equal(got['model'][k], ref['model'][k]), k
    for i, st in ref['opt']['state'].items():
        for key, v in st.items(): assert torch.equal(got['opt']['state'][i][key], v), (i, key)

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "Uninterrupted runs on the same global batch of 16: one process (batches of 16), two under FSDP (8 each)"
    one, two = tmp_path_factory.mktemp('one'), tmp_path_factory.mktemp('fsdp')
    run(one, *COMMON, '--bs', '16', nproc=1)
    res = run(two, *COMMON, *FSDP, '--bs', '8', '--export')
    return result(one), result(two), res, two

@pytest.fixture(scope='module')
def killed(tmp_path_factory):
    "Folders of runs killed at training batch 5 (of 12): two processes under FSDP and DDP, and one process"
    out = {}
    for name, args, nproc in (('fsdp', (*FSDP, '--bs', '8'), 2), ('ddp', ('--bs', '8'), 2), ('one', ('--bs',
            '16'), 1)):
        out[name] = tmp_path_factory.mktemp(f'killed_{name}')
        assert run(out[name], *COMMON, *args, '--kill-at', '5', nproc=nproc, check=False).returncode != 0
    return out

def copy_of(folder, tmp_path, name):
    shutil.copytree(folder, tmp_path/name)
    return tmp_path/name

@pytest.mark.slow
@shared_runs
def test_fsdp_trains_like_one_process(runs):
    one, two, res, _ = runs
    assert two['world'] == 2 and two['is_plain']                    # learn.model is the plain model again
    assert_weights_close(two, one)
    for a, b in zip(one['values'], two['values']): assert all(abs(x - y) < 1e-5 for x, y in zip(a, b)), (a, b)
    assert torch.equal(two['preds'], two['alone'])  # get_preds under FSDP: gathered in dataset order
    assert ranks_said(res) == {0: (2, 3, 0), 1: (2, 3, 0)}
    # the group ended with distrib_ctx, its threads too (DTensor's caches kept FSDP2's device mesh, and with
    # it the group, until the interpreter's teardown)
    assert res.stdout.count('GLOO THREADS LEFT 0') == 2, res.stdout[-2000:]

@shared_runs
def test_fsdp_shards_parameters_and_optimizer_state(runs):
    one, two, _, _ = runs
    alone, ranks = one['sizes'][0], two['sizes']
    for part in ('params', 'opt'):
        assert sum(r[part] for r in ranks) == alone[part] > 0, part     # every element once, on one rank
    block = max(alone['units'])
    for r in ranks:
        assert r['params'] <= alone['params'] / 2 + block and r['opt'] <= alone['opt'] / 2 + 2 * block

@pytest.mark.slow
@shared_runs
def test_export_after_fsdp_loads_in_a_fresh_process(runs, tmp_path):
    _, two, _, folder = runs
    torch.save(two['x_valid'], tmp_path/'x.pt')
    code = ("import sys, torch; from learncb.all import *; il = load_learner(sys.argv[1]); "
            "torch.save(il.get_preds(dl=il.test_dl(torch.load(sys.argv[2])))[0], sys.argv[3])")
    subprocess.run([sys.executable, '-c', code, str(folder/'export.pkl'), str(tmp_path/'x.pt'),
                    str(tmp_path/'p.pt')],
                   check=True, timeout=120)
    torch.testing.assert_close(torch.load(tmp_path/'p.pt'), two['alone'], atol=1e-6, rtol=1e-6)

@pytest.mark.slow
def test_gradient_accumulation_skips_the_reduce_scatter(tmp_path):
    run(tmp_path/'one', '--blocks', '--bs', '8', '--acc', '16', nproc=1)
    # 8 items a batch in all: the run's n_acc
    run(tmp_path/'two', '--blocks', *FSDP, '--bs', '4', '--acc', '16')
    one, two = result(tmp_path/'one'), result(tmp_path/'two')
    assert two['syncs'][:6] == [False, True] * 3  # a reduce-scatter in the backward of a step only
    assert_weights_close(two, one, atol=1e-6)

def test_gradient_clip_and_bf16_under_fsdp(tmp_path):
    res = run(tmp_path, '--blocks', *FSDP, '--bs', '8', '--clip-bf16')
    vals = result(tmp_path)['values']
    assert len(vals) == 3 and all(v == v for row in vals for v in row) and ranks_said(res)[1][1] == 3

@pytest.mark.slow
@shared_runs
def test_sigkill_then_resume_on_two_processes_is_exact(runs, killed, tmp_path):
    _, ref, _, _ = runs
    out = copy_of(killed['fsdp'], tmp_path, 'again')
    folders = out/'checkpoints'
    assert (folders/'checkpoint_00000004_epoch_end'/'complete.pt').exists()              # folders, not files
    # in flight at the kill: not counted
    assert not (folders/'checkpoint_00000005_batch'/'complete.pt').exists()
    run(out, *COMMON, *FSDP, '--bs', '8', '--resume')
    got = result(out)
    assert_weights_equal(got, ref)
    assert got['losses'] == ref['losses'] and got['values'] == ref['values']

@pytest.mark.slow
@shared_runs
@pytest.mark.parametrize('strategy', ['fsdp', 'ddp'])
def test_resume_on_another_number_of_processes(runs, killed, tmp_path, strategy):
    one, _, _, _ = runs  # the uninterrupted run (two processes give the same, within 1e-5)
    down = copy_of(killed[strategy], tmp_path, 'down')
    run(down, *COMMON, '--bs', '16', '--resume', nproc=1)                                  # 2 processes -> 1
    up = copy_of(killed['one'], tmp_path, 'up')
    run(up, *COMMON, '--strategy', strategy, '--bs', '8', '--resume')                     # 1 process -> 2
    for out in (down, up):
        got = result(out)
        assert_weights_close(got, one)
        assert len(got['values']) == 3

@pytest.mark.slow
@shared_runs
def test_another_global_batch_is_refused(killed, tmp_path):
    out = copy_of(killed['fsdp'], tmp_path, 'other_batch')
    res = run(out, *COMMON, '--bs', '8', '--resume', nproc=1, check=False)
    assert res.returncode != 0
    assert ('global batch of 16 (8 per process x 2 processes), but this run\'s is 8 (8 x 1 process)'
            in res.stderr)
    assert 'Resume with a batch size of 16 per process' in res.stderr

@pytest.mark.slow
@shared_runs
@pytest.mark.parametrize('remove', ['__1_0.distcp', 'complete.pt'])
def test_an_incomplete_checkpoint_folder_is_skipped(runs, killed, tmp_path, remove):
    _, ref, _, _ = runs
    out = copy_of(killed['fsdp'], tmp_path, 'broken')
    newest = out/'checkpoints'/'checkpoint_00000004_epoch_end'  # the newest complete one (5 was in flight)
    (newest/remove).unlink()
    res = run(out, *COMMON, *FSDP, '--bs', '8', '--resume')
    assert "damaged or incomplete" in res.stderr
    assert "['checkpoint_00000005_batch', 'checkpoint_00000004_epoch_end']" in res.stderr
    assert 'resuming from checkpoint_00000004_batch' in res.stderr
    assert_weights_equal(result(out), ref)  # from the one before: still the uninterrupted run's weights

@pytest.mark.slow
def test_lr_find_fine_tune_and_batchnorm_agree_on_every_rank(tmp_path):
    script = Path(__file__).parent/'fsdp_extras_script.py'
    res = run_forked(*torchrun(2), script, tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-5000:]
    r0, r1 = (torch.load(tmp_path/f'rank{r}.pt', weights_only=False) for r in (0, 1))
    # one curve: the loss of both ranks
    assert r0['lr'] == r1['lr'] and r0['finder_losses'] == r1['finder_losses']
    assert r0['values'] == r1['values'] and len(r0['values']) == 1 and r0['plain'] and r0['frozen_idx'] == 0
    # BatchNorm statistics: rank 0's
    for k, v in r0['model'].items(): assert torch.equal(v, r1['model'][k]), k

@pytest.mark.slow
def test_gradient_clip_clips_the_global_norm(tmp_path):
    run(tmp_path/'one', '--blocks', '--bs', '16', '--clip', nproc=1)
    run(tmp_path/'two', '--blocks', *FSDP, '--bs', '8', '--clip')
    assert_weights_close(result(tmp_path/'two'), result(tmp_path/'one'), atol=1e-6)

@pytest.mark.slow
@shared_runs
def test_save_in_an_fsdp_fit_writes_a_whole_file(runs, tmp_path):
    "SaveModelCallback saves each epoch, while the model is sharded: a file of whole tensors, for one process"
    _, two, _, _ = runs
    run(tmp_path, *COMMON, *FSDP, '--bs', '8', '--save-best')
    state = torch.load(tmp_path/'models'/'epoch_2.pth', weights_only=True)
    for k, v in two['model'].items(): assert torch.equal(state['model'][k], v), k  # the final weights, whole
    for i, st in two['opt']['state'].items():
        for key, v in st.items(): assert torch.equal(state['opt']['state'][i][key], v), (i, key)
