"The learning-rate finder: lr_find leaves the learner as it was, its ramp and stop, the suggestion functions"
import copy, math
import matplotlib
matplotlib.use('Agg')
import pytest, torch
from learncb.all import *
from learncb.callbacks.lr_find import *
from conftest import synth_learner, synth_dls

def approx(v): return pytest.approx(v, rel=1e-9, abs=1e-15)

def snapshot(learn):
    return (copy.deepcopy(learn.model.state_dict()), None if learn.opt is None
            else copy.deepcopy(learn.opt.state_dict()),
            (list(learn.recorder.losses), list(learn.recorder.lrs), list(learn.recorder.iters),
             [list(v) for v in learn.recorder.values]),
            {k: getattr(learn, k) for k in ('epoch', 'n_epoch', 'iter', 'n_iter', 'train_iter', 'pct_train',
                                            'training')})

def assert_unchanged(learn, snap):
    model, opt, history, counters = snap
    now = learn.model.state_dict()
    assert now.keys() == model.keys() and all(torch.equal(now[k], v) for k, v in model.items())
    if opt is None: assert learn.opt is None
    else:
        state = learn.opt.state_dict()
        assert state['param_groups'] == opt['param_groups']
        assert state['state'].keys() == opt['state'].keys()
        for i, s in opt['state'].items():
            assert s.keys() == state['state'][i].keys()
            for k, v in s.items():
                assert torch.equal(state['state'][i][k], v), (i, k)
                assert state['state'][i][k].dtype == v.dtype
    assert (list(learn.recorder.losses), list(learn.recorder.lrs), list(learn.recorder.iters),
            [list(v) for v in learn.recorder.values]) == history
    assert {k: getattr(learn, k) for k in counters} == counters

def test_lr_find_leaves_adam_state_weights_and_history_bit_for_bit():
    learn = synth_learner(opt_func=torch.optim.Adam, wd=0.01)
    learn.fit(2, lr=0.01)
    assert 'exp_avg' in learn.opt.state_dict()['state'][0]
    snap = snapshot(learn)
    res = learn.lr_find(num_it=10, show_plot=False)
    assert_unchanged(learn, snap)
    assert len(learn.lr_finder.lrs) == 10 and 1e-7 <= res.valley <= 10
    learn.fit(1)                                                # and training goes on as normal
    assert len(learn.recorder.values) == 1

def test_lr_find_without_optimizer_leaves_none():
    learn = synth_learner()
    snap = snapshot(learn)
    learn.lr_find(num_it=6, show_plot=False)
    assert_unchanged(learn, snap)
    assert learn.opt is None

def test_training_after_lr_find_is_the_same_as_without():
    def run(with_lr_find):
        learn = synth_learner(dls=synth_dls(shuffle=True), opt_func=torch.optim.Adam)
        learn.fit(1)
        if with_lr_find: learn.lr_find(num_it=9, show_plot=False)
        learn.fit(2)
        return learn.model.state_dict(), learn.recorder.losses
    (w1, l1), (w2, l2) = run(False), run(True)
    assert all(torch.equal(w1[k], w2[k]) for k in w1) and l1 == l2

def test_lr_find_ramp_epochs_and_no_validation():
    valid_batches = []
    learn = synth_learner(cbs=Callback(after_loss=lambda self: None if self.training
                                       else valid_batches.append(1)))
    epochs = []
    learn.lr_find(start_lr=1e-5, end_lr=1e-1, num_it=10, stop_div=False, show_plot=False,
                  suggest_funcs=(valley, minimum, steep))
    f = learn.lr_finder
    assert f.lrs == approx([1e-5 * 1e4 ** (i / 9) for i in range(10)]) and f.lrs[-1] == approx(1e-1)
    assert len(f.losses) == 10 and valid_batches == []  # 3 epochs of 4 batches, cut at 10; no validation
    assert f.suggestions._fields == ('valley', 'minimum', 'steep')
    assert all(1e-5 <= lr <= 1e-1 for lr in f.suggestions)

def test_lr_find_stops_when_the_loss_diverges():
    learn = synth_learner()
    res = learn.lr_find(start_lr=1e-3, end_lr=1e6, num_it=100, show_plot=False, suggest_funcs=(valley,
        minimum, steep))
    f = learn.lr_finder
    assert len(f.lrs) < 100
    assert f.losses[-1] > 4 * min(f.losses[:-1]) or not math.isfinite(f.losses[-1])
    assert all(1e-3 <= lr <= 1e6 for lr in res)
    learn2 = synth_learner()
    learn2.lr_find(start_lr=1e-3, end_lr=1e6, num_it=100, stop_div=False, show_plot=False)
    assert len(learn2.lr_finder.lrs) == 100

def test_lr_find_restores_everything_after_an_error():
    learn = synth_learner(opt_func=torch.optim.Adam)
    learn.fit(1)
    w_grad = torch.ones_like(learn.model.weight)
    learn.model.weight.grad = w_grad.clone()
    learn.model.eval()
    snap = snapshot(learn)
    state = {'armed': True}
    def boom(self):
        if state['armed'] and self.train_iter == 3: raise KeyboardInterrupt()
    learn.add_cb(Callback(after_step=boom, name='boom'))
    with pytest.raises(KeyboardInterrupt): learn.lr_find(num_it=20, show_plot=False)
    state['armed'] = False
    assert_unchanged(learn, snap)
    assert torch.equal(learn.model.weight.grad, w_grad) and learn.model.bias.grad is None
    assert not learn.model.training
    assert isinstance(learn.recorder, Recorder) and learn.recorder in learn.cbs
    assert len(learn.lr_finder.lrs) == 4                       # what was recorded before the interruption

def test_lr_find_plot_and_custom_suggestions():
    def tenth_of_last(lrs, losses): return lrs[-1] / 10
    learn = synth_learner()
    res = learn.lr_find(num_it=12, suggest_funcs=[minimum, tenth_of_last])
    assert res._fields == ('minimum',
                           'tenth_of_last') and res.tenth_of_last == approx(learn.lr_finder.lrs[-1] / 10)
    ax = learn.lr_finder.plot(skip_end=0)
    assert ax.get_xscale() == 'log' and len(ax.lines) == 3  # the curve and one marker per suggestion

@pytest.mark.parametrize('kw, match', [(dict(start_lr=0), 'start_lr must be a number > 0'),
                                       (dict(start_lr=1., end_lr=0.1), r'end_lr \(0.1\) must be larger'),
                                       (dict(num_it=1), 'num_it must be an int >= 2'),
                                       (dict(suggest_funcs=[lambda l, x: 1.]), 'defined with a name'),
                                       (dict(suggest_funcs=[valley, valley]), 'repeated names')])
def test_lr_find_argument_errors(kw, match):
    learn = synth_learner()
    with pytest.raises(ValueError, match=match): learn.lr_find(show_plot=False, **kw)
    assert learn.opt is None

def test_suggestion_functions_on_known_curves():
    lrs = [10 ** (i / 2 - 6) for i in range(11)]
    falling_then_rising = [5., 4., 3.5, 3.4, 2., 1.5, 1.4, 3., 6., 9., 12.]
    assert valley(lrs, falling_then_rising) == lrs[3]          # longest descent: 0..6, halfway at 3
    assert minimum(lrs, falling_then_rising) == approx(lrs[6] / 10)
    assert steep(lrs, falling_then_rising) == lrs[3]           # 3.4 -> 2.0
    assert minimum(lrs, sorted(falling_then_rising)) == lrs[0]     # never below the first lr tried
    assert valley(lrs[:1], [1.]) == lrs[0] and steep(lrs[:1], [1.]) == lrs[0]
    assert valley(lrs[:3], [1., 2., 3.]) == lrs[0]              # no descent at all: the first lr

def test_lr_find_leaves_out_callbacks_that_ask_and_explains_errors():
    calls = []
    class Watcher(Callback):
        remove_on_lr_find = True
        def after_batch(self): calls.append(self.train_iter)
    learn = synth_learner(cbs=Watcher())
    learn.lr_find(num_it=6, show_plot=False)
    assert calls == [] and sits_out_lr_find(learn.watcher) and not sits_out_lr_find(learn.train_eval)
    assert sits_out_lr_find(learn.recorder) and learn.watcher in learn.cbs
    class NeedsRecorder(Callback):
        def after_epoch(self): self.learn.recorder.values
    learn = synth_learner(cbs=NeedsRecorder())
    with pytest.raises(AttributeError) as e: learn.lr_find(num_it=10, show_plot=False)
    assert any('remove_on_lr_find = True' in n for n in e.value.__notes__)
    assert isinstance(learn.recorder, Recorder) and learn.opt is None
