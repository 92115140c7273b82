"""Loggers: printed progress lines, the loss graph, log_metrics dicts, the CSV history, the phase timer,
callback order"""
import csv, itertools
import pytest, torch
import learncb.callbacks.loggers
from learncb.all import *
from learncb.callbacks.loggers import *
from conftest import synth_learner, synth_dls

def fit_printing(capsys, learn, *args, **kwargs):
    "Fit and return the printed lines"
    capsys.readouterr()
    learn.fit(*args, **kwargs)
    return capsys.readouterr().out.splitlines()

# PrintProgressCallback

def test_print_progress_start_epoch_and_end_lines(capsys):
    learn = synth_learner(metrics=accuracy, cbs=PrintProgressCallback())
    lines = fit_printing(capsys, learn, 2)
    assert len(lines) == 4
    assert lines[0] == 'fit: 2 epochs of 4 training batches and 2 validation batches'
    for e, (line, row) in enumerate(zip(lines[1:3], learn.recorder.values)):
        fields = line.split('  ')
        assert fields[0] == f'epoch {e} (of 2)'
        assert fields[1:4] == [f'train_loss {row[0]:.6f}', f'valid_loss {row[1]:.6f}',
                               f'accuracy {row[2]:.6f}']
        assert fields[4].startswith('time ') and ':' in fields[4]
    assert lines[3].startswith('fit done in ')

def test_print_progress_shows_missing_values_as_dash(capsys):
    learn = synth_learner(dls=synth_dls(n_valid=0), metrics=accuracy, cbs=PrintProgressCallback())
    lines = fit_printing(capsys, learn, 1)
    assert lines[0] == 'fit: 1 epoch of 4 training batches, no validation set'
    assert 'valid_loss -  accuracy -  time ' in lines[1]

def test_print_progress_says_why_the_fit_stopped(capsys):
    def stop(self):
        if self.epoch == 1: self.learn.stop_fit('valid_loss did not improve')
    learn = synth_learner(cbs=PrintProgressCallback())
    lines = fit_printing(capsys, learn, 5, cbs=Callback(after_epoch=stop))
    assert [l.split()[1] for l in lines[1:3]] == ['0', '1']
    assert lines[-1].startswith('fit cancelled in epoch 1 (of 5): valid_loss did not improve (after ')

def test_print_progress_reports_a_failure(capsys):
    def boom(self):
        if self.epoch == 1: raise RuntimeError('out of memory')
    learn = synth_learner(cbs=PrintProgressCallback())
    with pytest.raises(RuntimeError, match='out of memory'):
        learn.fit(3, cbs=Callback(before_epoch=boom))
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith('fit failed in epoch 1 (of 3): RuntimeError: out of memory (after ')
    assert len(lines) == 3

# ShowGraphCallback

class FakeBar:
    "Stands in for the master bar: records the graphs it is asked to draw"
    def __init__(self): self.calls = []
    def update_graph(self, graphs, x_bounds=None, y_bounds=None):
        self.calls.append((graphs, x_bounds, y_bounds))

class FakeProgress(Callback):
    "Stands in for ProgressCallback, with a master bar that records graphs"
    order = 60
    def before_fit(self): self.mbar = FakeBar()

def test_show_graph_draws_losses_after_each_epoch():
    progress = FakeProgress(name='progress')
    learn = synth_learner(cbs=[progress, ShowGraphCallback()])
    learn.fit(3)
    rec, calls = learn.recorder, progress.mbar.calls
    assert len(calls) == 3
    (train, valid), x_bounds, y_bounds = calls[-1]
    assert train == (list(range(12)), rec.losses)
    assert valid == ([4, 8, 12], [v[1] for v in rec.values])
    assert x_bounds == (0, 12) and calls[0][1] == (0, 12)
    assert y_bounds[0] == 0 and y_bounds[1] > max(rec.losses + [v[1] for v in rec.values])
    first_train, first_valid = calls[0][0]
    assert first_train == (list(range(4)), rec.losses[:4]) and first_valid[0] == [4]

def test_show_graph_without_validation_draws_only_training_loss():
    progress = FakeProgress(name='progress')
    learn = synth_learner(dls=synth_dls(n_valid=0), cbs=[progress, ShowGraphCallback()])
    learn.fit(1)
    (train, valid), _, _ = progress.mbar.calls[-1]
    assert len(train[1]) == 4 and valid == ([], [])

def test_show_graph_is_quiet_without_bars(capsys):
    learn = synth_learner(cbs=ShowGraphCallback())
    learn.fit(1)                                   # no ProgressCallback at all
    learn.add_cb(ProgressCallback())               # stdout is not a terminal here: mbar is None
    learn.fit(1)
    assert learn.progress.mbar is None and 'Traceback' not in capsys.readouterr().err

# LogMetricsCallback

class Collect(LogMetricsCallback):
    def __init__(self, log_every=None): super().__init__(log_every); self.logged = []
    def log_metrics(self, metrics): self.logged.append(metrics)

class Extra(Callback):
    "Adds a column to the table, filled with the epoch times ten"
    recorder_columns = ['tenfold']
    def after_epoch(self): self.learn.recorder.record('tenfold', self.learn.epoch * 10)

def test_log_metrics_gets_each_epoch_row_by_name():
    collect = Collect()
    learn = synth_learner(metrics=accuracy, cbs=[collect, Extra()])
    learn.fit(3)
    names = ['train_loss', 'valid_loss', 'accuracy', 'tenfold']
    assert collect.logged == [{'epoch': e, **dict(zip(names, row))} for e,
                              row in enumerate(learn.recorder.values)]
    assert [d['tenfold'] for d in collect.logged] == [0, 10, 20]

def test_log_metrics_every_k_batches():
    collect = Collect(log_every=3)
    learn = synth_learner(cbs=collect)
    learn.fit(2)
    batch_logs = [d for d in collect.logged if 'train_iter' in d]
    assert [d['train_iter'] for d in batch_logs] == [3, 6]
    assert [d['train_loss'] for d in batch_logs] == [learn.recorder.losses[2], learn.recorder.losses[5]]
    assert all(d['lr'] == 0.1 and set(d) == {'train_iter', 'train_loss', 'lr'} for d in batch_logs)
    kinds = ['iter' if 'train_iter' in d else 'epoch' for d in collect.logged]
    assert kinds == ['iter', 'epoch', 'iter', 'epoch']             # in the order they happen

def test_log_metrics_without_log_every_takes_no_batch_events():
    collect = Collect()
    learn = synth_learner(cbs=collect)
    assert collect not in [h.__self__ for h in learn._tables[True]['after_batch']]
    learn.fit(1)
    assert [list(d) for d in collect.logged] == [['epoch', 'train_loss', 'valid_loss']]

def test_log_metrics_default_prints_and_bad_log_every(capsys):
    learn = synth_learner(cbs=LogMetricsCallback())
    lines = fit_printing(capsys, learn, 1)
    assert lines == [str({'epoch': 0, 'train_loss': learn.recorder.values[0][0],
                          'valid_loss': learn.recorder.values[0][1]})]
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match='log_every must be'): LogMetricsCallback(log_every=bad)

# CSVLogger

def read_csv(path):
    with open(path, newline='') as f: return list(csv.reader(f))

def test_csv_has_the_recorder_table(tmp_path):
    learn = synth_learner(metrics=[accuracy, error_rate], path=tmp_path, cbs=[CSVLogger('logs/h.csv'),
        Extra()])
    learn.fit(3)
    rows = read_csv(tmp_path/'logs'/'h.csv')
    assert rows[0] == learn.recorder.metric_names == ['epoch', 'train_loss', 'valid_loss', 'accuracy',
                                                      'error_rate', 'tenfold', 'time']
    assert len(rows) == 4
    for e, (row, values) in enumerate(zip(rows[1:], learn.recorder.values)):
        assert int(row[0]) == e
        assert [float(v) for v in row[1:-1]] == values                  # exactly: floats are written in full
        assert ':' in row[-1]
    log = learn.csv_logger.read_log()
    assert [list(r.values())[:-1] for r in log] == [[e, *v] for e, v in enumerate(learn.recorder.values)]

def test_csv_missing_values_are_empty_cells(tmp_path):
    learn = synth_learner(dls=synth_dls(n_valid=0), path=tmp_path, cbs=CSVLogger())
    learn.fit(1)
    assert read_csv(tmp_path/'history.csv')[1][2] == ''
    assert learn.csv_logger.read_log()[0]['valid_loss'] is None

def test_csv_rows_are_on_disk_as_soon_as_written(tmp_path):
    seen = []
    def check_then_crash(self):
        seen.append(len(read_csv(tmp_path/'history.csv')))       # read while the file is still open
        if self.epoch == 1: raise RuntimeError('crash')
    learn = synth_learner(path=tmp_path, cbs=CSVLogger())
    with pytest.raises(RuntimeError, match='crash'):
        learn.fit(5, cbs=Callback(after_epoch=check_then_crash, order=80))
    assert seen == [2, 3]                                          # header + each finished epoch
    # closed after the crash
    assert len(read_csv(tmp_path/'history.csv')) == 3 and learn.csv_logger._file is None

def test_csv_append_and_overwrite(tmp_path):
    learn = synth_learner(metrics=accuracy, path=tmp_path)
    learn.fit(2, cbs=CSVLogger())
    first = [r[:-1] for r in read_csv(tmp_path/'history.csv')]
    learn.fit(1, cbs=CSVLogger(append=True))
    rows = read_csv(tmp_path/'history.csv')
    assert [r[:-1] for r in rows[:3]] == first and len(rows) == 4
    assert rows[3][:-1] == ['0', *map(repr, learn.recorder.values[0])]
    assert sum(r[0] == 'epoch' for r in rows) == 1
    learn.fit(1, cbs=CSVLogger())                                  # append=False starts the file again
    assert len(read_csv(tmp_path/'history.csv')) == 2

def test_csv_append_to_new_or_empty_file_writes_the_header(tmp_path):
    (tmp_path/'empty.csv').touch()
    learn = synth_learner(path=tmp_path)
    for name in ('new.csv', 'empty.csv'):
        learn.fit(1, cbs=CSVLogger(name, append=True))
        assert read_csv(tmp_path/name)[0] == learn.recorder.metric_names

def test_csv_append_with_other_columns_is_refused_and_file_kept(tmp_path):
    learn = synth_learner(metrics=accuracy, path=tmp_path)
    learn.fit(1, cbs=CSVLogger())
    before = (tmp_path/'history.csv').read_bytes()
    learn.metrics = [error_rate]
    w = learn.model.weight.clone()
    with pytest.raises(ValueError, match=r"history.csv has the columns \[.*'accuracy'.*\], but this fit's "
                                         r"table has \[.*'error_rate'"):
        learn.fit(1, cbs=CSVLogger(append=True))
    assert (tmp_path/'history.csv').read_bytes() == before
    assert learn.train_iter == 0 and torch.equal(learn.model.weight, w)           # refused before training

def test_csv_needs_a_recorder(tmp_path):
    learn = synth_learner(path=tmp_path)
    learn.remove_cb(Recorder)
    with pytest.raises(ValueError, match='no Recorder'): learn.fit(1, cbs=CSVLogger())

# TimerCallback

PHASES = ['fetch', 'forward', 'loss', 'backward', 'step', 'train', 'validate']

def test_timer_measures_every_phase_each_epoch(capsys):
    learn = synth_learner(cbs=TimerCallback())
    lines = fit_printing(capsys, learn, 3)
    times = learn.timer.times
    assert len(times) == 3 and all(list(t) == PHASES for t in times)
    assert all(v > 0 for t in times for v in t.values())
    assert all(t['train'] >= t['fetch'] + t['forward'] + t['loss'] + t['backward'] + t['step'] for t in times)
    assert [l.split(':')[0] for l in lines] == ['epoch 0 times', 'epoch 1 times', 'epoch 2 times']
    assert all(f' {p} ' in l + ' ' for l in lines for p in PHASES)

def test_timer_counts_batch_phases_in_training_only():
    "Fetches, forwards and losses of validation batches are in `validate`, not in the batch phases"
    calls = {'forward': 0}
    class CountingTimer(TimerCallback):
        def after_pred(self):
            calls['forward'] += 1
            super().after_pred()
    learn = synth_learner(cbs=CountingTimer(verbose=False))
    learn.fit(2)
    assert calls['forward'] == 8

def test_timer_without_validation_and_outside_a_fit(capsys):
    learn = synth_learner(dls=synth_dls(n_valid=0), cbs=TimerCallback(sync_cuda=True, verbose=False))
    learn.fit(1)
    assert learn.timer.times[0]['validate'] is None and learn.timer.times[0]['step'] > 0
    learn = synth_learner(cbs=TimerCallback(verbose=False))
    learn.validate()                                          # not in a fit: nothing to record, no error
    learn.fit(1)
    assert len(learn.timer.times) == 1 and capsys.readouterr().out == ''

@pytest.fixture
def ticking_clock():
    "learncb's clock, made to tick: each reading is one second after the previous one"
    ticks = itertools.count()
    with clock.replaced(lambda: float(next(ticks))): yield

def test_timer_phases_are_measured_between_the_right_events(ticking_clock):
    "With a clock that ticks once per reading, each phase's time counts the readings between its two events"
    learn = synth_learner(cbs=TimerCallback(verbose=False))
    learn.fit(2)
    # per batch the timer reads the clock 9 times: fetch 2, forward/loss 3 (shared boundary), backward 2, step
    # 2
    expected = {'fetch': 4., 'forward': 4., 'loss': 4., 'backward': 4., 'step': 4., 'train': 4 * 9 + 2.,
                'validate': 1.}
    assert learn.timer.times == [expected, expected]

def test_timer_counts_a_validation_inside_a_validation_once(ticking_clock):
    nested = []
    def validate_again(self):
        if not nested: nested.append(1); self.learn.validate(dl=synth_dls().valid)
    timer = TimerCallback(verbose=False)
    learn = synth_learner(cbs=[timer, Callback(after_validate=validate_again, order=0)])
    learn.fit(1)
    # clock readings: outer start 0, inner start 1, (the inner end is not timed on its own), outer end 2
    assert timer.times[0]['validate'] == 2.
    assert timer._valid_starts == []

def test_timer_sync_cuda_synchronizes_at_every_boundary(monkeypatch):
    """On CUDA (faked here after the batch mover is set up), sync_cuda=True synchronizes at every phase
    boundary"""
    syncs = []
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda *a: syncs.append(1))
    import learncb.callbacks.loggers
    real = learncb.callbacks.loggers.model_device
    def fake_cuda(self): learncb.callbacks.loggers.model_device = lambda *a: torch.device('cuda')
    def undo(self): learncb.callbacks.loggers.model_device = real
    fake = [Callback(before_fit=fake_cuda, order=69), Callback(before_fit=undo, order=71)]
    for sync_cuda, n in ((False, 0), (True, 4 * 9 + 3 + 2)):
        syncs.clear()
        synth_learner(cbs=[TimerCallback(sync_cuda=sync_cuda, verbose=False), *fake]).fit(1)
        assert len(syncs) == n

# Order

def test_loggers_run_after_recorder_and_trackers(tmp_path):
    seen = []
    class Tracker(Callback):
        order = 60
        def after_epoch(self): seen.append(('tracker', len(self.learn.recorder.values)))
    class MyLogger(LogMetricsCallback):
        def log_metrics(self, metrics): seen.append(('logger', metrics['epoch']))
    learn = synth_learner(path=tmp_path, cbs=[MyLogger(), PrintProgressCallback(), CSVLogger(),
                                              TimerCallback(verbose=False), Tracker()])
    assert [type(cb).__name__ for cb in learn.ordered_cbs('after_epoch')] == \
        ['Recorder', 'Tracker', 'MyLogger', 'PrintProgressCallback', 'CSVLogger', 'TimerCallback']
    assert all(cb.order == 70 for cb in learn.cbs if isinstance(cb, (LogMetricsCallback,
                                                                     PrintProgressCallback, CSVLogger,
                                                                     TimerCallback)))
    assert ShowGraphCallback.order > ProgressCallback.order > Recorder.order
    learn.fit(2)
    assert seen == [('tracker', 1), ('logger', 0), ('tracker', 2), ('logger', 1)]
