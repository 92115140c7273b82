"""Checkpointing changes nothing a run computes. The same seeded run (dropout, shuffle=True) trained with
`CheckpointCallback(every_n_steps=5)` and without, killed by SIGKILL and resumed with resume='auto', fitted
twice in a row, on one process and on two (DDP, gloo), and resumed on another number of processes: every run
ends with the weights, the recorded losses and table, and the next `torch.rand(3)` of the run that never
checkpointed. Runs tests/checkpoint/transparent_script.py (in this process, or in processes bounded by
timeouts: conftest.run_script)."""
import shutil, warnings
from pathlib import Path
import pytest, torch
from torch.utils.data import DataLoader, Sampler, TensorDataset
from learncb.all import *
from conftest import run_script
from transparent_script import make_learner, run_fits

SCRIPT = Path(__file__).parent/'transparent_script.py'
# pytest -n: the tests that share a module fixture's runs go to one worker, which makes them once
shares_ddp, shares_killed_on_two = (pytest.mark.xdist_group('transparent_ddp'),
                                    pytest.mark.xdist_group('transparent_killed_on_two'))

def run(out, *args, nproc=1, check=True):
    "The script in `nproc` processes (torchrun) or one (plain python), never longer than 240 s"
    res = run_script(SCRIPT, out, *args, nproc=nproc, timeout=240)
    if check and res.returncode != 0:
        raise AssertionError(f'{args}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}')
    return res

def result(out): return torch.load(Path(out)/'result.pt', weights_only=False)

def assert_same_run(got, ref):
    "Weights, every fit's recorded losses and table, and every rank's next `torch.rand(3)`: all equal"
    for k in ref['model']: assert torch.equal(got['model'][k], ref['model'][k]), k
    assert got['fits'] == ref['fits']
    assert len(got['rands']) == len(ref['rands']) and all(map(torch.equal, got['rands'], ref['rands']))

def in_process(path, ckpt, workers=0, n_fits=1, **kw):
    learn = make_learner(path, workers=workers, **kw)
    fits = run_fits(learn, n_fits, ckpt)
    return {'model': learn.model.state_dict(), 'fits': fits, 'rands': [torch.rand(3)]}

# One process

@pytest.mark.parametrize('workers', [0, 1])
def test_checkpoints_change_nothing_of_a_fit(tmp_path, workers):
    plain = in_process(tmp_path/'plain', ckpt=False, workers=workers)
    saved = in_process(tmp_path/'saved', ckpt=True, workers=workers)
    assert_same_run(saved, plain)
    assert len(list((tmp_path/'saved'/'checkpoints').iterdir())) == 2       # it did checkpoint (keep_last=2)

def test_two_fits_in_a_row_the_first_checkpointed(tmp_path):
    plain = in_process(tmp_path/'plain', ckpt=False, n_fits=2)
    saved = in_process(tmp_path/'saved', ckpt=True, n_fits=2)
    assert_same_run(saved, plain)

def test_the_user_gets_the_dataloader_back_after_the_fit(tmp_path):
    learn = make_learner(tmp_path)
    train = learn.dls.train
    learn.fit(1, cbs=CheckpointCallback(every_n_steps=5))
    assert learn.dls.train is train and type(train.sampler) is torch.utils.data.RandomSampler

def test_a_dataloader_with_its_own_generator_is_ordered_by_it(tmp_path):
    """RandomSampler with a generator draws its order from that generator: so does the checkpointed run, and
    leaves it as torch does"""
    def fit(ckpt):
        learn = make_learner(tmp_path/str(ckpt))
        g = torch.Generator().manual_seed(5)
        learn.dls.train = DataLoader(learn.dls.train.dataset, batch_size=8, shuffle=True, generator=g)
        fits = run_fits(learn, 1, ckpt)
        return fits, learn.model.state_dict(), g.get_state()
    (f1, m1, g1), (f2, m2, g2) = fit(False), fit(True)
    assert f1 == f2 and torch.equal(g1, g2) and all(torch.equal(m1[k], m2[k]) for k in m1)

@pytest.mark.parametrize('workers', ['0', '1'])
def test_sigkill_then_resume_equals_the_run_that_never_checkpointed(tmp_path, workers):
    run(tmp_path/'plain', '--workers', workers)
    killed = run(tmp_path/'killed', '--workers', workers, '--ckpt', '--kill-at', '13', check=False)
    assert killed.returncode == -9
    resumed = run(tmp_path/'killed', '--workers', workers, '--ckpt')
    assert 'resuming the run from' in resumed.stdout                        # a fresh start would end the same
    assert_same_run(result(tmp_path/'killed'), result(tmp_path/'plain'))

class EveryOther(Sampler):
    "A custom sampler: every other item, then the rest"
    def __init__(self, n): self.n = n
    def __len__(self): return self.n
    def __iter__(self): return iter([*range(0, self.n, 2), *range(1, self.n, 2)])

def test_a_custom_sampler_is_left_alone_without_a_warning(tmp_path):
    def fit(ckpt):
        learn = make_learner(tmp_path/str(ckpt))
        ds = learn.dls.train.dataset
        learn.dls.train = DataLoader(ds, batch_size=8, sampler=EveryOther(len(ds)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            fits = run_fits(learn, 1, ckpt)
        said = [str(w.message) for w in caught if 'resume' in str(w.message)]
        return {'model': learn.model.state_dict(), 'fits': fits, 'rands': [torch.rand(3)]}, said
    (plain, none), (saved, said) = fit(False), fit(True)
    assert_same_run(saved, plain)
    assert none == [] and said == []  # replayed from the epoch's start on a resume: exact, nothing to warn of

# Two processes (DDP): the order is DistributedSampler's, with checkpoints or without

@pytest.fixture(scope='module')
def ddp(tmp_path_factory):
    "2-process runs, batches of 4 per rank, dropout: never checkpointed, once and twice fitted"
    out = tmp_path_factory.mktemp('ddp')
    run(out/'plain', '--bs', '4', nproc=2)
    run(out/'plain2', '--bs', '4', '--fits', '2', nproc=2)
    return out

@pytest.mark.slow
@shares_ddp
def test_ddp_with_and_without_checkpoints(ddp, tmp_path):
    run(tmp_path/'saved', '--bs', '4', '--ckpt', nproc=2)
    assert_same_run(result(tmp_path/'saved'), result(ddp/'plain'))
    assert result(ddp/'plain')['world'] == 2

@pytest.mark.slow
@shares_ddp
def test_ddp_two_fits_in_a_row(ddp, tmp_path):
    run(tmp_path/'saved', '--bs', '4', '--fits', '2', '--ckpt', nproc=2)
    assert_same_run(result(tmp_path/'saved'), result(ddp/'plain2'))

@pytest.mark.slow
@shares_ddp
def test_ddp_sigkill_then_resume(ddp, tmp_path):
    assert run(tmp_path/'k', '--bs', '4', '--ckpt', '--kill-at', '17', nproc=2, check=False).returncode != 0
    assert 'resuming the run from' in run(tmp_path/'k', '--bs', '4', '--ckpt', nproc=2).stdout
    assert_same_run(result(tmp_path/'k'), result(ddp/'plain'))

def test_ddp_order_is_distributed_samplers(tmp_path):
    """Rank r of a run reads what DistributedSampler(seed=0) gives rank r, epoch by epoch (a hand-written DDP
    loop's order)"""
    learn = make_learner(tmp_path)
    from learncb.strategy import shard_train_dl
    ds = learn.dls.train.dataset
    for rank in (0, 1):
        share = shard_train_dl(learn.dls.train, rank, 2)
        for epoch in (0, 2):
            share.sampler.set_epoch(epoch)
            theirs = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank)
            theirs.set_epoch(epoch)
            assert list(share.sampler) == list(theirs)

# Another number of processes, the same global batch (12): the table and the weights of the uninterrupted run

def assert_close_run(got, ref, tol=1e-6):
    for k in ref['model']: torch.testing.assert_close(got['model'][k], ref['model'][k], atol=tol, rtol=0)
    rows, ref_rows = got['fits'][0]['values'], ref['fits'][0]['values']
    assert len(rows) == len(ref_rows) == 3
    for a, b in zip(rows, ref_rows): assert all(abs(x - y) < tol for x, y in zip(a, b)), (a, b)

@pytest.fixture(scope='module', params=['ddp', 'fsdp'])
def killed_on_two(request, tmp_path_factory):
    """A 2-process run (6 items per rank, no dropout: masks are drawn per rank) uninterrupted, and one killed
    at step 13"""
    out, common = tmp_path_factory.mktemp(request.param), ('--dropout', '0', '--strategy', request.param,
                                                           '--bs', '6')
    run(out/'plain', *common, nproc=2)
    assert run(out/'killed', *common, '--ckpt', '--kill-at', '13', nproc=2, check=False).returncode != 0
    return out, request.param

@pytest.mark.slow
@shares_killed_on_two
@pytest.mark.parametrize('nproc, bs', [(1, '12'), (3, '4')])
def test_resume_on_another_number_of_processes_keeps_the_table(killed_on_two, tmp_path, nproc, bs):
    out, strategy = killed_on_two
    shutil.copytree(out/'killed', tmp_path/'again')
    res = run(tmp_path/'again', '--dropout', '0', '--strategy', strategy, '--bs', bs, '--ckpt', nproc=nproc)
    assert 'resuming the run from' in res.stdout
    # epoch 1's train_loss too: partial sums kept
    assert_close_run(result(tmp_path/'again'), result(out/'plain'))

# The global batch said once (distrib_ctx(global_batch=12)): the same command on any number of processes

@pytest.mark.slow
def test_global_batch_sets_the_batch_of_each_process_and_a_resume_needs_no_change(tmp_path):
    common = ('--dropout', '0', '--global-batch', '12', '--bs', '5')  # the dataloader's own 5 is replaced
    run(tmp_path/'two', *common, nproc=2)
    run(tmp_path/'one', *common)
    assert_close_run(result(tmp_path/'one'), result(tmp_path/'two'))  # batches of 6 on 2 ranks, of 12 on one
    assert run(tmp_path/'killed', *common, '--ckpt', '--kill-at', '13', nproc=2, check=False).returncode != 0
    res = run(tmp_path/'killed', *common, '--ckpt')  # shrunk to one process, the same command
    assert 'resuming the run from' in res.stdout
    assert_close_run(result(tmp_path/'killed'), result(tmp_path/'two'))
    refused = run(tmp_path/'odd', '--global-batch', '13', nproc=2, check=False)
    assert refused.returncode != 0 and 'distrib_ctx(global_batch=13) over 2 processes' in refused.stderr
    assert not (tmp_path/'odd'/'result.pt').exists()
