"""Experiment trackers (TensorBoard, MLflow, W&B offline): what they log, read back with each tracker's own
reader; resumed fits continue the same run without writing a step twice; no host sync per batch; missing
packages."""
import subprocess, sys, time
from pathlib import Path
import pytest, torch
from torch import nn
from learncb.all import *
from learncb.integrations.wandb import read_offline_run
from conftest import synth_dls, synth_learner, SyncCounter

N_EPOCH, N_BATCHES = 3, 4                     # synth_dls: 64 training items in batches of 16
STEPS = list(range(1, N_EPOCH * N_BATCHES + 1))
EPOCH_STEPS = [N_BATCHES * (e + 1) for e in range(N_EPOCH)]

class RawLosses(Callback):
    "The raw loss and lr of every training batch, at its step (`train_iter` once it is done)"
    order, run_valid = 99, False
    def __init__(self): self.losses, self.lrs = {}, {}
    def after_batch(self):
        self.losses[self.train_iter] = float(self.loss)
        self.lrs[self.train_iter] = [g['lr'] for g in self.opt.param_groups]

class Boom(Callback):
    "An error at the end of epoch 1, after the trackers (70) and the checkpoints (95) have done their part"
    order = 99
    def after_epoch(self):
        if self.epoch == 1: raise RuntimeError('boom')

def make_learner(path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))
    return synth_learner(dls=synth_dls(shuffle=True), model=model, path=path, lr=1e-2, metrics=accuracy)

def fit(path, tracker, cbs=(), resume=None, **ckpt):
    "`fit_one_cycle` (the lr changes every batch) with checkpoints every 3 batches; returns the learner"
    learn = make_learner(path)
    learn.fit_one_cycle(N_EPOCH, 1e-2, cbs=[CheckpointCallback(every_n_steps=3, **ckpt), tracker, *cbs],
                        resume=resume)
    return learn

# the two ways a run is interrupted at the end of epoch 1 (batches 5 to 8):
# from the epoch end: the error's checkpoint, at the end of epoch 1: nothing written twice; from inside the
# epoch: the last checkpoint is at batch 6: batches 7, 8 and epoch 1's row, already written, are done again
RESUMES = {'from_the_epoch_end': {},
           'from_inside_the_epoch': dict(every_epoch=False, on_exception=False)}

def interrupted_then_resumed(path, make_tracker, how):
    raw = RawLosses()
    with pytest.raises(RuntimeError, match='boom'):
        fit(path, make_tracker(), cbs=[Boom(), raw], **RESUMES[how])
    assert max(raw.losses) == 8
    last = checkpoints_in(path/'checkpoints')[-1].name
    want = ('checkpoint_00000008_epoch_end.pt' if how == 'from_the_epoch_end'
            else 'checkpoint_00000006_batch.pt')
    assert last == want
    tracker = make_tracker()
    learn = fit(path, tracker, resume=True, **RESUMES[how])
    return learn, tracker

def check_logged(history, learn, raw):
    """`history` (`{name: [(step, value)]}`) holds the recorder's table and the raw batch losses and lrs, each
    step once"""
    for name, points in history.items():
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), f'{name}: a step written twice: {steps}'
    rec = learn.recorder
    assert {f'epoch/{n}' for n in rec.value_names} | {'batch/loss', 'batch/lr'} <= set(history)
    for j, n in enumerate(rec.value_names):
        points = sorted(history[f'epoch/{n}'])
        assert [s for s, _ in points] == EPOCH_STEPS
        assert [v for _, v in points] == pytest.approx([row[j] for row in rec.values], rel=1e-6)
    for key, want in (('batch/loss', raw.losses), ('batch/lr', {s: lrs[0] for s, lrs in raw.lrs.items()})):
        points = sorted(history[key])
        assert [s for s, _ in points] == STEPS
        assert [v for _, v in points] == pytest.approx([want[s] for s in STEPS], rel=1e-6)

def same_history(a, b):
    assert a.keys() == b.keys()
    for k in a:
        (steps_a, values_a), (steps_b, values_b) = zip(*sorted(a[k])), zip(*sorted(b[k]))
        assert steps_a == steps_b, k                                    # the same steps, exactly
        assert list(values_a) == pytest.approx(list(values_b), rel=1e-6), k

# ---------------------------------------------------------------- TensorBoard

def tb_history(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir), size_guidance={'scalars': 0}, purge_orphaned_data=False)
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()['scalars']}, acc

def tb_hparams(acc):
    from tensorboard.plugins.hparams import plugin_data_pb2
    start = acc.PluginTagToContent('hparams')['_hparams_/session_start_info']
    info = plugin_data_pb2.HParamsPluginData.FromString(start)
    return {k: getattr(v, v.WhichOneof('kind')) for k, v in info.session_start_info.hparams.items()}

def test_tensorboard_logs_the_table_the_raw_batch_losses_and_the_hparams(tmp_path):
    raw, tb = RawLosses(), TensorBoardCallback(log_every=3)  # 3: flushes inside epochs and at their ends
    learn = fit(tmp_path, tb, cbs=[raw])
    assert tb.run_dir.parent == tmp_path/'runs'
    history, acc = tb_history(tb.run_dir)
    check_logged(history, learn, raw)
    # the one-cycle schedule, batch by batch
    assert len(set(history['batch/lr'][i][1] for i in range(12))) > 6
    hps = tb_hparams(acc)
    assert (hps['n_epoch'], hps['lr'], hps['bs'], hps['opt'], hps['model']) == (3, 1e-2, 16, 'Adam',
        'Sequential')
    assert hps['n_params'] == sum(p.numel() for p in learn.model.parameters()) == 42
    assert hps['loss_func'] == 'CrossEntropyLoss' and 'TensorBoardCallback' in hps['callbacks']

def test_tensorboard_each_fit_is_a_run_of_its_own(tmp_path):
    learn = synth_learner(path=tmp_path)
    tbs = [TensorBoardCallback(run_name='exp'), TensorBoardCallback(run_name='exp')]
    for tb in tbs: learn.fit(1, cbs=tb)
    assert [tb.run_dir.name for tb in tbs] == ['exp', 'exp-2']
    assert [tb_history(tb.run_dir)[0]['batch/loss'][-1][0] for tb in tbs] == [4, 4]

@pytest.mark.slow
@pytest.mark.parametrize('how', RESUMES)
def test_tensorboard_resumed_run_equals_an_uninterrupted_one(tmp_path, how):
    ref_tb = TensorBoardCallback(log_every=2)
    fit(tmp_path/'ref', ref_tb)
    learn, tb = interrupted_then_resumed(tmp_path/'run', lambda: TensorBoardCallback(log_every=2), how)
    assert [p.name for p in (tmp_path/'run'/'runs').iterdir()] == [tb.run_dir.name]    # the same run folder
    assert len(list(tb.run_dir.glob('events.out.tfevents.*'))) == 2                   # written by both fits
    history, _ = tb_history(tb.run_dir)
    for name, points in history.items():
        assert len(points) == len({s for s, _ in points}), f'{name}: a step written twice'
    same_history(history, tb_history(ref_tb.run_dir)[0])

def test_tensorboard_with_several_param_groups(tmp_path):
    model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))
    groups = lambda m: [list(m[0].parameters()), list(m[1].parameters())]
    learn = synth_learner(model=model, path=tmp_path, splitter=groups)
    tb = TensorBoardCallback()
    learn.fit(1, lr=slice(1e-3, 1e-2), cbs=tb)
    history, acc = tb_history(tb.run_dir)
    assert [v for _, v in history['batch/lr_0']] == pytest.approx([1e-3] * 4)
    assert [v for _, v in history['batch/lr_1']] == pytest.approx([1e-2] * 4)
    hps = tb_hparams(acc)
    assert (hps['lr_0'], hps['lr_1']) == pytest.approx((1e-3, 1e-2)) and 'lr' not in hps

# ---------------------------------------------------------------- MLflow

@pytest.fixture(scope='module')
def mlflow_dir(tmp_path_factory):
    """The folder of the one database of these tests (MLflow takes seconds to make one): `learn.path` of the
    first"""
    return tmp_path_factory.mktemp('mlflow')

@pytest.fixture(scope='module')
def mlflow_uri(mlflow_dir): return f"sqlite:///{(mlflow_dir/'mlflow.db').resolve()}"

def ml_history(client, run_id):
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)]
            for k in client.get_run(run_id).data.metrics}

def test_mlflow_logs_params_metrics_and_the_model(tmp_path, mlflow_dir, mlflow_uri, monkeypatch):
    from mlflow import MlflowClient
    monkeypatch.delenv('MLFLOW_TRACKING_URI', raising=False)
    raw, cb = RawLosses(), MLflowCallback(log_every=5, log_model=True, hparams={'dropout': 0.2})
    learn = fit(mlflow_dir, cb, cbs=[raw])
    assert cb.uri == mlflow_uri                            # the default: a database in learn.path
    client = MlflowClient(cb.uri)
    run = client.get_run(cb.run_id)
    assert run.info.status == 'FINISHED'
    params = run.data.params
    assert (params['n_epoch'], params['lr'], params['bs'], params['dropout']) == ('3', '0.01', '16', '0.2')
    check_logged(ml_history(client, cb.run_id), learn, raw)
    assert [a.path for a in client.list_artifacts(cb.run_id, 'model')] == [f'model/model_{cb.run_id}.pth']
    local = Path(client.download_artifacts(cb.run_id, f'model/model_{cb.run_id}.pth', str(tmp_path/'dl')))
    state = torch.load(local, weights_only=True)['model']
    assert all(torch.equal(state[k], v) for k, v in learn.model.state_dict().items())
    assert (mlflow_dir/'mlartifacts').is_dir()                # artifacts beside the database, not in the cwd

@pytest.mark.parametrize('how', RESUMES)
def test_mlflow_resumed_fit_writes_into_the_same_run(tmp_path, mlflow_uri, how):
    from mlflow import MlflowClient
    client = MlflowClient(mlflow_uri)
    ref = MLflowCallback(mlflow_uri, experiment_name=f'ref-{how}', log_every=2)
    fit(tmp_path/'ref', ref)
    made = []
    def tracker():
        made.append(MLflowCallback(mlflow_uri, experiment_name=f'resumed-{how}', log_every=2))
        return made[-1]
    interrupted_then_resumed(tmp_path/'run', tracker, how)
    first, resumed = made
    assert first.run_id == resumed.run_id
    exp = client.get_experiment_by_name(f'resumed-{how}')
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [first.run_id]     # one run
    assert client.get_run(first.run_id).info.status == 'FINISHED'
    history = ml_history(client, first.run_id)
    for name, points in history.items():
        assert len(points) == len({s for s, _ in points}), f'{name}: a step written twice'
    same_history(history, ml_history(client, ref.run_id))

@pytest.mark.slow
def test_mlflow_failed_fit_and_second_fit(tmp_path, mlflow_uri):
    from mlflow import MlflowClient
    client, learn = MlflowClient(mlflow_uri), synth_learner(path=tmp_path)
    cb = MLflowCallback(mlflow_uri, experiment_name='twice')
    with pytest.raises(RuntimeError, match='boom'): learn.fit(2, cbs=[cb, Boom()])
    failed = cb.run_id
    learn.fit(2, cbs=cb)
    assert cb.run_id != failed
    assert [client.get_run(r).info.status for r in (failed, cb.run_id)] == ['FAILED', 'FINISHED']

# ---------------------------------------------------------------- Weights & Biases (offline only)

@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')
    for v in ('WANDB_CONFIG_DIR', 'WANDB_CACHE_DIR', 'WANDB_DATA_DIR', 'WANDB_ARTIFACT_DIR'):
        monkeypatch.setenv(v, str(tmp_path/'wandb-home'/v))

def read_finished(run_dir, wait=120):
    "The offline run in `run_dir` once W&B's own process has written all of it (its exit record), or as it is"
    deadline = time.time() + wait
    while not (run := read_offline_run(run_dir))['finished'] and time.time() < deadline: time.sleep(0.1)
    return run

def wb_history(*run_dirs):
    history = {}
    for d in run_dirs:
        for row in read_finished(d)['history']:
            for k, v in row.items():
                if not k.startswith('_'): history.setdefault(k, []).append((row['_step'], v))
    return history

def test_wandb_offline_logs_config_history_and_the_model(tmp_path, wandb_offline):
    raw, cb = RawLosses(), WandbCallback(log_every=5, log_model=True, run_name='r')
    learn = fit(tmp_path, cb, cbs=[raw])
    assert cb.run_dir.parent == tmp_path/'wandb' and cb.run_dir.name.startswith('offline-run-')
    run = read_finished(cb.run_dir)
    assert (run['config']['n_epoch'], run['config']['lr'], run['config']['model']) == (3, 1e-2, 'Sequential')
    check_logged(wb_history(cb.run_dir), learn, raw)
    assert run['artifacts'] == [f'model-{cb.run_id}']

def test_wandb_offline_resumed_run_keeps_its_id_and_steps(tmp_path, wandb_offline):
    ref = WandbCallback(log_every=2)
    fit(tmp_path/'ref', ref)
    made = []
    def tracker():
        made.append(WandbCallback(log_every=2))
        return made[-1]
    interrupted_then_resumed(tmp_path/'run', tracker, 'from_inside_the_epoch')
    first, resumed = made
    assert first.run_id == resumed.run_id and first.run_dir != resumed.run_dir  # offline: a folder per fit
    history = wb_history(first.run_dir, resumed.run_dir)
    for name, points in history.items():
        assert len(points) == len({s for s, _ in points}), f'{name}: a step written twice'
    same_history(history, wb_history(ref.run_dir))

# ---------------------------------------------------------------- all of them

def trackers(tmp_path, uri, log_every):
    return {'tensorboard': lambda: TensorBoardCallback(log_every=log_every),
            'mlflow': lambda: MLflowCallback(uri, experiment_name='syncs', log_every=log_every),
            'wandb': lambda: WandbCallback(log_every=log_every)}

@pytest.mark.parametrize('kind', ['tensorboard', 'mlflow', 'wandb'])
def test_no_host_sync_per_batch(tmp_path, mlflow_uri, wandb_offline, kind):
    n = 50
    def syncs(n_batches):
        learn = synth_learner(dls=synth_dls(n_train=16 * n_batches, n_valid=16 * 4), opt_func=torch.optim.SGD,
                              path=tmp_path, cbs=trackers(tmp_path, mlflow_uri, n)[kind]())
        with SyncCounter() as counter: learn.fit(1)
        return sum(counter.counts.values())
    few, many = syncs(100), syncs(300)
    assert many - few <= (300 - 100) // n, (few, many)

def test_only_rank_0_logs_and_lr_find_does_not(tmp_path, monkeypatch):
    import learncb.dispatch
    assert all(c.rank0_only and c.remove_on_lr_find for c in (TensorBoardCallback, MLflowCallback,
                                                              WandbCallback))
    learn = synth_learner(path=tmp_path, cbs=TensorBoardCallback())
    learn.lr_find(num_it=8, show_plot=False)
    assert not (tmp_path/'runs').exists()
    # the dispatch tables leave rank0_only out
    monkeypatch.setattr(learncb.dispatch, 'is_rank0', lambda: False)
    learn.fit(1)
    assert not (tmp_path/'runs').exists()

@pytest.mark.parametrize('cls, package', [(TensorBoardCallback, 'tensorboard'), (MLflowCallback, 'mlflow'),
                                          (WandbCallback, 'wandb')])
def test_a_missing_package_names_the_install_command(monkeypatch, cls, package):
    monkeypatch.setitem(sys.modules, package, None)        # as if it were not installed
    pattern = rf'{cls.__name__} needs the {package} package.*pip install "learncb\[{package}\]"'
    with pytest.raises(ImportError, match=pattern):
        cls()

def test_a_package_that_fails_to_import_says_why():
    with pytest.raises(ImportError, match=r'importing it failed.*pip install "learncb\[x\]"'):
        import_optional('json.no_such_module', 'json', 'x', 'Me')

@pytest.mark.slow
def test_learncb_all_imports_no_tracker_package():
    code = ("import sys, learncb.all; print([m for m in ('tensorboard', 'torch.utils.tensorboard', 'mlflow', "
            "'wandb') if m in sys.modules])")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == '[]'
