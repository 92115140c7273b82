"""submitit: the recipe of the cluster page (taken from its cell, so the docs and the test cannot
drift apart) run by `submitit.LocalExecutor` with a time limit that falls in the middle of the fit: the job
(of one task, and of two forming a distributed run) is
stopped with SIGUSR2, requeued by submitit and resumed by `resume='auto'`, more than once, and ends with the
weights of the job that was never stopped. The job's first two starts hold a batch until the signal has come,
so that the number of stops does not depend on the machine's speed. Bounded by submitit's time limits and the
test's timeouts."""
import os
from functools import partial
from pathlib import Path
from conftest import child_pythonpath
import pytest, torch
from fastcore.nbio import read_nb
submitit = pytest.importorskip('submitit', reason='submitit is not installed (pip install submitit)')

HERE = Path(__file__).parent

def recipe_module(folder):
    "The cell of the cluster page that defines `Train`, as a module the job's processes can import"
    cell = next(c.source for c in read_nb(HERE.parents[1]/'nbs'/'23d_cluster.ipynb').cells
                if 'class Train(submitit.helpers.Checkpointable)' in c.source)
    (folder/'cluster_recipe.py').write_text(cell)

def run_job(folder, out, timeout_min, n_held=0, tasks=1):
    from cluster_recipe import Train
    from submitit_job import job_learner
    executor = submitit.LocalExecutor(folder=folder, max_num_timeout=10)
    # signal_delay_s: the time a task has, after the signal, to checkpoint and exit before submitit gives up
    # on the job
    # (10 s: the two tasks of a loaded 2-core machine need more than 4)
    executor.update_parameters(timeout_min=timeout_min, signal_delay_s=10, tasks_per_node=tasks)
    out.mkdir(parents=True)
    job = executor.submit(Train(partial(job_learner, out, n_held), n_epoch=3))
    job.results()                                   # one per task
    return (out/'starts.txt').read_text().count('start'), torch.load(out/'final.pt', weights_only=False)

@pytest.mark.slow
@pytest.mark.parametrize('tasks', [1, 2])
def test_submitit_requeues_at_the_time_limit_and_the_job_resumes_exactly(tmp_path, monkeypatch, tasks):
    recipe_module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv('PYTHONPATH', child_pythonpath(tmp_path))
    monkeypatch.setenv('OMP_NUM_THREADS', '1')
    starts, ref = run_job(tmp_path/'ref', tmp_path/'ref_out', timeout_min=5, tasks=tasks)
    assert starts == 1 and ref['train_iter'] == 36 // tasks
    # SIGUSR2 at 26 s: submitit sets its handler only once the job is unpickled (torch and learncb imported);
    # with the
    # signal at 14 s a loaded machine's start could take longer, and the signal's default action ended the job
    starts, got = run_job(tmp_path/'job', tmp_path/'job_out', timeout_min=0.6, n_held=2, tasks=tasks)
    assert starts >= 3 and got['train_iter'] == 36 // tasks, starts  # requeued at least twice
    for k in ref['model']: assert torch.equal(got['model'][k], ref['model'][k]), k
    assert got['losses'] == ref['losses'] and got['values'] == ref['values']
