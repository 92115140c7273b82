"Optuna: two processes share one study through its SQLite file and together finish all of its trials"
import subprocess, sys
from pathlib import Path
import pytest
optuna = pytest.importorskip('optuna')
SCRIPT = Path(__file__).parent/'optuna_script.py'

def worker(db, lrs):
    return subprocess.Popen([sys.executable, str(SCRIPT), str(db), ','.join(map(str, lrs))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

def finish(procs, timeout=180):
    try: outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs: p.kill()
    for p, (out, err) in zip(procs, outs): assert p.returncode == 0, err[-3000:]

@pytest.mark.slow
def test_two_processes_share_a_sqlite_study(tmp_path):
    db = tmp_path/'search.db'
    optuna.create_study(study_name='search', storage=f'sqlite:///{db}')   # each worker brings its pruner
    finish([worker(db, (0.05, 0.1, 0.2))])  # the good ones first: the pruner's baseline
    finish([worker(db, (20., 0.15, 50.)), worker(db, (100., 30., 0.08))])  # then two processes at once
    trials = optuna.load_study(study_name='search', storage=f'sqlite:///{db}').trials
    assert len(trials) == 9
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in trials)
    assert sorted(t.user_attrs['lr'] for t in trials) == [0.05, 0.08, 0.1, 0.15, 0.2, 20., 30., 50., 100.]
    pruned = [t for t in trials if t.user_attrs['lr'] >= 20 and t.state == optuna.trial.TrialState.PRUNED]
    assert len(pruned) == 4 and all(max(t.intermediate_values) < 3 for t in pruned), \
        [(t.user_attrs, t.state, t.intermediate_values) for t in trials]
