"""Ray Train: the recipe of the cluster page (taken from its cell) run by `TorchTrainer` on two
CPU workers, on a local Ray the module starts once. Rank 1 fails once in the middle of the run; Ray starts the
workers again (`FailureConfig(max_failures=2)`) with the last checkpoint `RayTrainReportCallback` reported,
and the run ends with the weights of a run where no worker failed, `torch.equal`: the same fit on two ranks
torchrun started (`ray_job.py`). Each worker has a folder of its own: the restart finds its checkpoint
through Ray only."""
import os, shutil, tempfile
from functools import partial
from pathlib import Path
from conftest import child_pythonpath, run_forked, run_script
import pytest, torch
from fastcore.nbio import read_nb
ray = pytest.importorskip('ray', reason='ray is not installed (pip install "learncb[ray]")')
pytestmark = pytest.mark.xdist_group('ray')   # with pytest -n: one local Ray at a time, on one worker

HERE = Path(__file__).parent

def recipe_module(folder):
    "The cell of the cluster page that defines `train_func`, as a module the workers can import"
    cell = next(c.source for c in read_nb(HERE.parents[1]/'nbs'/'23d_cluster.ipynb').cells
                if 'def train_func(config)' in c.source)
    (folder/'ray_recipe.py').write_text('from learncb.all import *\n' + cell)

@pytest.fixture(scope='module')
def ray_cluster(tmp_path_factory):
    """A local Ray for the module's tests, and the folder of the recipe's module, which its workers import
    (on their path)"""
    folder = tmp_path_factory.mktemp('ray_recipe')
    recipe_module(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        mp.setenv('PYTHONPATH', child_pythonpath(folder))
        mp.setenv('OMP_NUM_THREADS', '1')
        mp.setenv('RAY_DEDUP_LOGS', '0')
        # Ray lowers its workers' priority; on a busy machine they starve
        mp.setenv('RAY_worker_niceness', '0')
        # Ray Train's controller looks at its workers every 2 s, and a run goes through several of its states
        mp.setenv('RAY_TRAIN_HEALTH_CHECK_INTERVAL_S', '0.3')
        temp = tempfile.mkdtemp(prefix='ray')               # short: Ray's socket paths must fit in 107 bytes
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
        try: yield folder
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)

@pytest.fixture
def local_ray(ray_cluster, tmp_path):
    "A test's folder, with the module's local Ray started"
    return tmp_path

def run_without_ray(out, fsdp=False):
    "The recipe's fit on two ranks torchrun starts (`ray_job.py`): what rank 0 saved at the end"
    out.mkdir()
    res = run_script(HERE/'ray_job.py', out, *(['--fsdp'] if fsdp else []), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out/'final.pt', weights_only=False)

def run(out, storage, fail_at=None, checkpoint=None, fsdp=False, workers=2):
    "The recipe (`fsdp`: under FSDP) on `workers` Ray workers; its result, and what rank 0 saved at the end"
    from ray.train import ScalingConfig, RunConfig, FailureConfig
    from ray.train.torch import TorchTrainer
    from ray_recipe import train_func
    from ray_job import job_learner, fsdp_train_func
    out.mkdir()
    trainer = TorchTrainer(fsdp_train_func if fsdp else train_func,
                           train_loop_config={'make_learner': partial(job_learner, out, fail_at),
                                              'n_epoch': 3, 'checkpoint': checkpoint},
                           scaling_config=ScalingConfig(num_workers=workers),
                           run_config=RunConfig(storage_path=str(storage), name=out.name,
                                                failure_config=FailureConfig(max_failures=2)))
    result = trainer.fit()
    return result, torch.load(out/'final.pt', weights_only=False)

def restored_copies(): return sorted(Path(tempfile.gettempdir()).glob('learncb-ray-*'))

@pytest.mark.slow
def test_ray_train_restarts_a_failed_worker_the_run_ends_exactly_and_a_new_run_goes_on_from_it(local_ray):
    """The run restarted after rank 1 failed ends as the unfailed run; then, through
    `ray_checkpoint(result.checkpoint)`, a new run goes on from its last checkpoint (the end), trains nothing
    again and leaves no copy of it"""
    tmp = local_ray
    before = restored_copies()
    ref = run_without_ray(tmp/'ref')
    result, got = run(tmp/'failed', tmp/'storage', fail_at=8)
    assert (tmp/'failed'/'failed').exists() and got['train_iter'] == ref['train_iter'] == 18
    for k in ref['model']: assert torch.equal(got['model'][k], ref['model'][k]), k
    assert got['values'] == ref['values']
    assert result.metrics['train_iter'] == 18 and result.checkpoint is not None      # the last one reported
    assert result.metrics['valid_loss'] == ref['values'][-1][1]
    assert restored_copies() == before  # the restarted workers' copies of the checkpoint are gone
    again, got = run(tmp/'again', tmp/'storage', checkpoint=result.checkpoint)
    assert got['train_iter'] == ref['train_iter'] == 18 and got['values'] == ref['values']
    for k in ref['model']: assert torch.equal(got['model'][k], ref['model'][k]), k
    # nothing trained again: resumed at the end
    assert not list((tmp/'again').glob('worker*/checkpoints/checkpoint_*'))
    assert restored_copies() == before

@pytest.mark.slow
def test_an_fsdp_run_restarts_a_failed_worker_and_ends_exactly_and_its_checkpoint_goes_on_on_one_worker(
        local_ray):
    """Under FSDP the sharded checkpoint is read in `before_train`: the copy Ray restored must still be there.
    The run restarts on its two workers and ends as the unfailed run; its checkpoint of the middle of an epoch
    (before the failure), its shards written by two ranks, continues on one worker to the end (that a resume
    on another number of ranks is exact, test_transparent.py shows)"""
    from ray.train import Checkpoint
    tmp = local_ray
    before = restored_copies()
    ref = run_without_ray(tmp/'ref', fsdp=True)
    result, got = run(tmp/'failed', tmp/'storage', fail_at=8, fsdp=True)
    assert (tmp/'failed'/'failed').exists() and got['train_iter'] == ref['train_iter'] == 18
    for k in ref['model']: assert torch.equal(got['model'][k], ref['model'][k]), k
    assert got['values'] == ref['values'] and restored_copies() == before
    # mid-epoch: step 5, reported before rank 1 failed
    last = next((tmp/'storage'/'failed').glob('checkpoint_*/checkpoint_00000005_batch')).parent
    _, one = run(tmp/'one', tmp/'storage', checkpoint=Checkpoint.from_directory(str(last)), fsdp=True,
                 workers=1)
    assert one['train_iter'] == 18 and len(one['values']) == 3 and restored_copies() == before
    # from step 5 on: the first 5 losses are the two ranks' own, from the checkpoint
    assert len(one['losses']) == 18
    assert torch.equal(torch.tensor(one['losses'][:5]), torch.tensor(ref['losses'][:5]))

v1_script = """
import os, sys, tempfile
from functools import partial
from pathlib import Path
import ray, torch
from ray.train import ScalingConfig, RunConfig
from ray.train.torch import TorchTrainer
from ray_recipe import train_func
from ray_job import job_learner
out = Path(sys.argv[1])
temp = tempfile.mkdtemp(prefix='ray')
# the older API: a CPU for its trainer
ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
trainer = TorchTrainer(train_func,
                       train_loop_config={'make_learner': partial(job_learner, out), 'n_epoch': 2},
                       scaling_config=ScalingConfig(num_workers=2),
                       run_config=RunConfig(storage_path=str(out/'storage')))
result = trainer.fit()
print('REPORTED', result.metrics['train_iter'], result.checkpoint is not None)
"""

@pytest.mark.slow
def test_the_older_ray_train_api_reports_the_checkpoints_without_a_preemption_notice(tmp_path, monkeypatch):
    """`RAY_TRAIN_V2_ENABLED=0`: no `get_preemption_info`; the callback says so before the first batch, and
    reports"""
    import subprocess, sys
    recipe_module(tmp_path)
    (tmp_path/'v1.py').write_text(v1_script)
    env = dict(os.environ, RAY_TRAIN_V2_ENABLED='0', PYTHONPATH=child_pythonpath(tmp_path),
               OMP_NUM_THREADS='1', RAY_worker_niceness='0',
               RAY_TRAIN_HEALTH_CHECK_INTERVAL_S='0.3')
    res = subprocess.run([sys.executable, str(tmp_path/'v1.py'), str(tmp_path/'out')], capture_output=True,
                         text=True, timeout=420, env=env)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    assert 'REPORTED 12 True' in res.stdout, res.stdout[-2000:]

@pytest.mark.slow
def test_torchft_replica_groups_on_ray_a_killed_worker_heals_and_the_run_is_exact(local_ray):
    """Ray Train's `TorchftConfig`: 2 replica groups of one worker each run tests/distributed/ft_script.py;
    the worker of group 1 SIGKILLs itself in the middle of a step; Ray starts that group again, it heals from
    group 0, which went on without a restart; both end bitwise equal, and within 1e-6 of the same fit in one
    process"""
    from ray.train import ScalingConfig, RunConfig, FailureConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig
    from ray_job import torchft_train_func
    script,out = HERE.parents[0]/'distributed'/'ft_script.py',local_ray/'out'
    plain = run_forked(script, local_ray/'plain', '--plain', timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    args = ['--wait-for', '2', '--slow-alone', '0.3', '--kill-at', '18', '--kill-in', 'backward',
            '--kill-group', '1', '--hold-when-killed']
    lighthouse = {'min_replicas': 1, 'join_timeout_ms': 10000, 'heartbeat_timeout_ms': 2000}
    trainer = TorchTrainer(torchft_train_func, train_loop_config={'script': str(script), 'out': str(out),
                                                                  'args': args},
                           scaling_config=ScalingConfig(num_workers=2),
                           torch_config=TorchftConfig(lighthouse_kwargs=lighthouse, backend='gloo'),
                           run_config=RunConfig(storage_path=str(local_ray/'storage'), name='torchft',
                                                failure_config=FailureConfig(max_failures=2)))
    trainer.fit()
    a,b = [torch.load(out/f'result{g}.pt', weights_only=False) for g in range(2)]
    ref = torch.load(local_ray/'plain'/'resultplain.pt', weights_only=False)
    # group 1 killed, then healed
    assert (out/'killed1').exists() and b['healed_at'] >= 18 and a['healed_at'] < 18
    assert a['tries'] >= 1                       # group 0 computed the step again, without group 1
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model']) and a['values'] == b['values']
    for k,w in ref['model'].items(): assert (a['model'][k] - w).abs().max() <= 1e-6 * w.abs().max(), k
    assert a['counters'] == ref['counters']
