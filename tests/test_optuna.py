"Optuna: two processes share one study through its SQLite file and together finish all of its trials"
import subprocess, sys
from pathlib import Path
import pytest
optuna = pytest.importorskip('optuna')

def test_two_processes_share_a_sqlite_study(tmp_path):
    db = tmp_path/'search.db'
    study = optuna.create_study(study_name='search', storage=f'sqlite:///{db}',
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0))
    for lr in (0.05, 0.1, 0.2): study.enqueue_trial({'lr': lr})
    script = Path(__file__).parent/'optuna_script.py'
    first = subprocess.run([sys.executable, str(script), str(db), '3'], capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]                 # the good ones first: the pruner's baseline
    for lr in (20., 50., 100., 0.15, 30., 0.08): study.enqueue_trial({'lr': lr})
    procs = [subprocess.Popen([sys.executable, str(script), str(db), '3'], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    try: outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs: p.kill()
    for p, (out, err) in zip(procs, outs): assert p.returncode == 0, err[-3000:]
    trials = optuna.load_study(study_name='search', storage=f'sqlite:///{db}').trials
    states = [t.state for t in trials]
    assert len(trials) == 9 and all(s in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for s in states)
    diverging = [t for t in trials if t.params['lr'] >= 20]
    pruned = [t for t in diverging if t.state == optuna.trial.TrialState.PRUNED]
    assert len(pruned) >= 2 and all(max(t.intermediate_values) < 3 for t in pruned), [(t.params, t.state) for t in trials]
    assert {t.params['lr'] for t in trials} == {0.05, 0.1, 0.2, 20., 50., 100., 0.15, 30., 0.08}   # each trial once
