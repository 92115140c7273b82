"""No host-device sync per batch in the default callbacks: the number of sync calls must not grow with the
batches"""
from collections import Counter
import pytest, torch
from learncb.all import *
from conftest import synth_learner, synth_dls, SyncCounter, SYNCS

def syncs_for_one_epoch(n_batches, metrics=None):
    # SGD: torch's CPU Adam itself calls .item() on each parameter's step count every step, which is not ours
    # to count
    learn = synth_learner(dls=synth_dls(n_train=16 * n_batches, n_valid=16 * 4), metrics=metrics,
                          opt_func=torch.optim.SGD)
    with SyncCounter() as counter: learn.fit(1)
    assert learn.train_iter == n_batches
    return counter.counts

def test_the_counter_sees_syncs():
    with SyncCounter() as c:
        t = torch.ones(3)
        t.sum().item(); float(t[0]); bool(t[1]); t.tolist(); t.cpu()
    assert c.counts == Counter({n: 1 for n in SYNCS})

@pytest.mark.slow
@pytest.mark.parametrize('metrics', [None, [accuracy, error_rate]])
def test_syncs_do_not_grow_with_batches(metrics):
    few, many = syncs_for_one_epoch(100, metrics), syncs_for_one_epoch(300, metrics)
    assert few == many, f'100 batches: {dict(few)}, 300 batches: {dict(many)}'
    assert sum(many.values()) <= 4, dict(many)      # a handful per epoch: training losses, validation means

@pytest.mark.slow
def test_adam_syncs_are_torchs_own():
    """The default Adam (fused) syncs no more than SGD; `torch.optim.Adam` as it comes adds what a bare
    `opt.step()` does"""
    m = torch.nn.Linear(2, 2); opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 2)).sum().backward()
    with SyncCounter() as c: opt.step()
    per_step = c.counts['item']
    assert per_step > 0                                 # torch's plain CPU Adam reads its step counts
    plain = synth_learner(dls=synth_dls(n_train=16 * 100, n_valid=16 * 4), opt_func=torch.optim.Adam)
    with SyncCounter() as c: plain.fit(1)
    assert c.counts['item'] - 100 * per_step == syncs_for_one_epoch(100)['item']
    default = synth_learner(dls=synth_dls(n_train=16 * 100, n_valid=16 * 4))
    with SyncCounter() as c: default.fit(1)
    assert default.opt.defaults['fused'] and c.counts == syncs_for_one_epoch(100)

def test_reading_the_history_syncs_once():
    learn = synth_learner(dls=synth_dls(n_train=16 * 50))
    learn.fit(1)
    with SyncCounter() as c:
        learn.recorder.losses; learn.recorder.smooth_loss; learn.recorder.values
    assert sum(c.counts.values()) == 0                  # already floats after the epoch

@pytest.mark.slow
@pytest.mark.parametrize('make,did_its_work', [(ThroughputCallback, lambda cb, n: len(cb.history) == 1),
                                               (lambda: EMACallback(0.9), lambda cb, n: cb.n_averaged == n),
                                               (AutoMicrobatch, lambda cb, n: cb.since_change == n
                                                and not cb.history)],
                         ids=['throughput', 'ema', 'microbatch'])
def test_callbacks_that_do_not_sync_per_batch(make, did_its_work):
    def syncs(n_batches):
        learn = synth_learner(dls=synth_dls(n_train=16 * n_batches, n_valid=16 * 4), opt_func=torch.optim.SGD)
        cb = make()
        with SyncCounter() as c: learn.fit(1, cbs=cb)
        assert did_its_work(cb, n_batches)              # the count below is of a callback that ran
        return c.counts
    few, many = syncs(100), syncs(300)
    assert few == many, f'100 batches: {dict(few)}, 300 batches: {dict(many)}'

@pytest.mark.slow
def test_activation_stats_keep_their_values_on_the_device():
    def syncs(n_batches):
        learn = synth_learner(dls=synth_dls(n_train=16 * n_batches, n_valid=16 * 4), opt_func=torch.optim.SGD,
                              model=torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(),
                                                        torch.nn.Linear(8, 2)))
        stats = ActivationStats(with_hist=True)
        with SyncCounter() as c: learn.fit(1, cbs=stats)
        assert len(stats._stats) == n_batches
        return c.counts
    few, many = syncs(100), syncs(300)
    assert few == many, f'100 batches: {dict(few)}, 300 batches: {dict(many)}'

@pytest.mark.slow
@pytest.mark.parametrize('snapshot_every, extra', [(1000, 2), (100, 4)])
def test_spike_guard_syncs_once_per_check_not_per_batch(snapshot_every, extra):
    "One `tolist` per check (every 100 batches), and one per snapshot (the Recorder's state reads its losses)"
    def syncs(n_batches):
        learn = synth_learner(dls=synth_dls(n_train=16 * n_batches, n_valid=16 * 4), opt_func=torch.optim.SGD)
        with SyncCounter() as c: learn.fit(1, cbs=SpikeGuard(check_every=100, snapshot_every=snapshot_every))
        assert learn.train_iter == n_batches
        return c.counts
    few, many = syncs(100), syncs(300)  # 200 more batches: 2 more checks (and 2 more snapshots)
    assert many - few == Counter(tolist=extra), f'100 batches: {dict(few)}, 300 batches: {dict(many)}'

@pytest.mark.slow
def test_a_compiled_step_does_not_sync_per_batch():
    "learn.compile(step=True), with GradientClip traced into the step and the Recorder after it"
    def syncs(n_batches):
        learn = synth_learner(dls=synth_dls(n_train=16 * n_batches, n_valid=16 * 4), opt_func=torch.optim.SGD,
                              cbs=GradientClip(1.))
        learn.compile(step=True, fallback=False)
        learn.fit(1)  # compiles: torch's own reads while it traces are not counted
        with SyncCounter() as c: learn.fit(1)
        assert learn.compiler.fell_back is None and learn.train_iter == n_batches
        return c.counts
    few, many = syncs(100), syncs(300)
    assert few == many, f'100 batches: {dict(few)}, 300 batches: {dict(many)}'
