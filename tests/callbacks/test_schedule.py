"Schedules: annealers, ParamScheduler, fit_one_cycle/fit_flat_cos, LRSchedulerCallback, WarmupCallback"
import math, warnings
from functools import partial
import matplotlib
matplotlib.use('Agg')
import pytest, torch
from torch import nn
from learncb.all import *
from learncb.callbacks.schedule import *
from learncb.callbacks.policies import *
from conftest import synth_learner, synth_dls, CrashAt

N_ITER = 4      # batches per epoch of conftest's synth_dls (64 items, bs 16)

def cos_from_to(a, b, p): return a + (b - a) * (1 - math.cos(math.pi * p)) / 2

def one_cycle_at(p, pct, start, middle, end):
    "The 1cycle value at position p, written out independently of the library"
    return cos_from_to(start, middle, p / pct) if p < pct else cos_from_to(middle, end, (p - pct) / (1 - pct))

class Probe(Callback):
    """Records what the optimizer will step with (after warmup and schedules have acted): lr, momentum or
    betas[0]"""
    order = 20
    def __init__(self): self.lrs,self.moms,self.iters = [],[],[]
    def before_step(self):
        pg = self.learn.opt.param_groups[0]
        self.lrs.append(pg['lr'])
        self.moms.append(pg['momentum'] if 'momentum' in pg else pg['betas'][0] if 'betas' in pg else None)
        self.iters.append(self.learn.train_iter)

def approx(v): return pytest.approx(v, rel=1e-9, abs=1e-15)

# ---------------------------------------------------------------- annealers

@pytest.mark.parametrize('pos', [0., 0.25, 0.5, 1.])
def test_annealers_follow_their_formulas(pos):
    assert SchedLin(2., 10.)(pos) == approx(2. + 8. * pos)
    assert SchedCos(2., 10.)(pos) == approx(2. + 8. * (1 - math.cos(math.pi * pos)) / 2)
    assert SchedNo(2., 10.)(pos) == 2.
    assert SchedExp(1e-4, 1e-1)(pos) == approx(1e-4 * 1000 ** pos)
    assert SchedPoly(2., 10., 3)(pos) == approx(2. + 8. * pos ** 3)

def test_annealer_end_points_and_mid_values():
    assert [SchedLin(1., 0.)(p) for p in (0, 0.5, 1)] == approx([1., 0.5, 0.])
    assert [SchedCos(1., 0.)(p) for p in (0, 0.5, 1)] == approx([1., 0.5, 0.])
    assert SchedCos(1., 0.)(1.) == 0. and SchedCos(0., 3.)(1.) == 3.          # the end is reached exactly
    assert [SchedExp(1., 100.)(p) for p in (0, 0.5, 1)] == approx([1., 10., 100.])
    assert [SchedPoly(0., 1., 0.5)(p) for p in (0, 0.25, 1)] == approx([0., 0.5, 1.])

def test_annealer_validation():
    with pytest.raises(ValueError, match=r"SchedExp\(0.0, 1.0\).*both be > 0"): SchedExp(0., 1.)
    with pytest.raises(ValueError, match="both be > 0"): SchedExp(1., -1.)
    with pytest.raises(TypeError, match="end must be a number, not \\[1, 2\\]"): SchedCos(0., [1, 2])
    with pytest.raises(ValueError, match="power must be > 0"): SchedPoly(0., 1., -1)

def test_combine_scheds_switches_at_the_boundaries():
    f = combine_scheds([0.25, 0.5, 0.25], [SchedLin(0., 1.), SchedNo(7., 7.), SchedLin(10., 20.)])
    assert f(0.) == 0. and f(0.125) == approx(0.5) and f(0.2499) == approx(0.9996)
    assert f(0.25) == 7. and f(0.5) == 7. and f(0.7499) == 7.
    assert f(0.75) == 10. and f(0.875) == approx(15.) and f(1.) == approx(20.)
    # empty shares are skipped
    g = combine_scheds([0., 1., 0.], [SchedNo(-1, -1), SchedLin(0, 1), SchedNo(-2, -2)])
    assert [g(p) for p in (0., 0.5, 1.)] == approx([0., 0.5, 1.])

def test_combined_cos_shape():
    f = combined_cos(0.3, 1., 5., 0.)
    assert f(0.) == approx(1.) and f(0.15) == approx(3.) and f(0.3) == approx(5.) and f(1.) == approx(0.)
    assert f(0.65) == approx(2.5)
    for p in (0., 0.1, 0.3, 0.31, 0.8, 1.): assert f(p) == approx(one_cycle_at(p, 0.3, 1., 5., 0.))
    assert combined_cos(0., 1., 5., 0.)(0.) == approx(5.)        # no warm-up leg

@pytest.mark.parametrize('pcts, scheds, err, match', [
    ([0.5, 0.4], [SchedNo(0, 0)] * 2, ValueError, r"sum to 1, got \[0.5, 0.4\]"),
    ([0.5, 0.5], [SchedNo(0, 0)] * 3, ValueError, "2 fractions"),
    ([], [], ValueError, "at least one"),
    ([1.5, -0.5], [SchedNo(0, 0)] * 2, ValueError, "numbers >= 0"),
    ([1.], [3.], TypeError, "function of pos, not 3.0"),
])
def test_combine_scheds_validation(pcts, scheds, err, match):
    with pytest.raises(err, match=match): combine_scheds(pcts, scheds)

# ---------------------------------------------------------------- ParamScheduler

def test_param_scheduler_sets_every_group_each_training_batch():
    two_groups = lambda params, **kw: torch.optim.SGD([{'params': [p]} for p in params], **kw)
    learn = synth_learner(opt_func=two_groups)
    probe = Probe()
    sched = ParamScheduler({'lr': SchedLin(0.1, 0.0), 'wd': lambda pos: [0.01, 0.02 * pos],
                            'dampening': SchedNo(0.5, 0.5)})
    seen = []
    learn.fit(2, cbs=[sched, probe, Callback(before_step=lambda self: seen.append([dict(pg) for pg
        in self.opt.param_groups]))])
    n = 2 * N_ITER
    assert probe.lrs == approx([0.1 * (1 - i / n) for i in range(n)])
    assert all(pgs[0]['lr'] == pgs[1]['lr'] for pgs in seen)
    assert [pgs[1]['weight_decay'] for pgs in seen] == approx([0.02 * i / n for i in range(n)])
    assert all(pgs[0]['weight_decay'] == 0.01 and pgs[0]['dampening'] == 0.5 for pgs in seen)
    assert len(sched.hps['lr']) == n and sched.hps['wd'][-1] == approx([0.01, 0.02 * (n - 1) / n])
    assert learn.recorder.lrs == probe.lrs          # the Recorder sees the scheduled lr

def test_param_scheduler_mom_and_sqr_mom_on_adam_and_sgd():
    learn = synth_learner(opt_func=torch.optim.AdamW)
    learn.fit(1, cbs=ParamScheduler({'mom': SchedLin(0.9, 0.8), 'sqr_mom': SchedNo(0.95, 0.95),
                                     'eps': SchedNo(1e-5, 1e-5)}))
    pg = learn.opt.param_groups[0]
    assert pg['betas'] == approx((0.9 - 0.1 * 3 / 4, 0.95)) and pg['eps'] == 1e-5
    learn = synth_learner(opt_func=partial(torch.optim.SGD, momentum=0.5))
    learn.fit(1, cbs=ParamScheduler({'mom': SchedNo(0.7, 0.7)}))
    assert learn.opt.param_groups[0]['momentum'] == 0.7 and 'betas' not in learn.opt.param_groups[0]

def test_param_scheduler_leaves_validation_alone():
    learn = synth_learner()
    sched = ParamScheduler({'lr': SchedLin(0.1, 0.05)})
    lr_in_valid = []
    learn.fit(2, cbs=[sched, Callback(after_loss=lambda self: None if self.training
                                      else lr_in_valid.append(self.opt.param_groups[0]['lr']))])
    assert len(sched.hps['lr']) == 2 * N_ITER
    assert lr_in_valid[:2] == [sched.hps['lr'][3]] * 2  # validation of epoch 0 sees the last training value

@pytest.mark.parametrize('scheds, opt_func, err, match', [
    ({'sqr_mom': SchedNo(0.9, 0.9)}, torch.optim.SGD, ValueError, r"cannot schedule 'sqr_mom' .*betas\[1\].* "
                                                                  r"on SGD.*keys \[.*'momentum'"),
    ({'mom': SchedNo(0.9, 0.9)}, torch.optim.Adagrad, ValueError, r"cannot schedule 'mom' .* on "
                                                                  r"Adagrad.*'lr_decay'"),
    ({'warmth': SchedNo(1., 1.)}, torch.optim.Adam, ValueError, r"cannot schedule 'warmth' on Adam: its "
                                                                r"param groups have the keys \[.*'betas'"),
    ({'lr': lambda pos: [0.1, 0.2, 0.3]}, torch.optim.SGD, ValueError, "returns 3 values, but SGD has 1 "
     "param group"),
    ({'lr': lambda pos: None}, torch.optim.SGD, TypeError, "must return a number .* returned None"),
])
def test_param_scheduler_errors_at_before_fit(scheds, opt_func, err, match):
    learn = synth_learner(opt_func=opt_func)
    w = learn.model.weight.detach().clone()
    with pytest.raises(err, match=match): learn.fit(1, cbs=ParamScheduler(scheds))
    assert torch.equal(learn.model.weight, w) and learn.recorder.lrs == []      # failed before any batch
    learn.fit(1)  # and the learner still works

def test_param_scheduler_construction_errors():
    with pytest.raises(TypeError, match="dict mapping"): ParamScheduler([SchedNo(1, 1)])
    with pytest.raises(TypeError, match="schedule for 'lr' must be a function of pos, not 0.1"):
        ParamScheduler({'lr': 0.1})

def test_plot_sched_draws_one_axis_per_hyper_parameter():
    learn = synth_learner(opt_func=torch.optim.Adam)
    learn.fit_one_cycle(1)
    axs = learn.param_scheduler.plot_sched()
    assert [ax.get_title() for ax in axs] == ['lr', 'mom']
    assert len(axs[0].lines[0].get_ydata()) == N_ITER

# ---------------------------------------------------------------- fit_one_cycle / fit_flat_cos

@pytest.mark.parametrize('opt_func', [torch.optim.Adam, partial(torch.optim.SGD, momentum=0.9)])
def test_one_cycle_lr_and_momentum_follow_the_formula(opt_func):
    learn = synth_learner(opt_func=opt_func)
    probe = Probe()
    n_epoch = 3
    lr_max = 0.02
    div = 10.
    div_final = 1e4
    pct = 0.25
    learn.fit_one_cycle(n_epoch, lr_max=lr_max, div=div, div_final=div_final, pct_start=pct, cbs=probe)
    total = n_epoch * N_ITER
    assert probe.iters == list(range(total))
    for i in (0, 3, 6, total - 1):                 # first, end of warm-up (pos = 0.25), middle, last
        pos = i / total
        assert probe.lrs[i] == approx(one_cycle_at(pos, pct, lr_max / div, lr_max, lr_max / div_final)), i
        assert probe.moms[i] == approx(one_cycle_at(pos, pct, 0.95, 0.85, 0.95)), i
        assert learn.recorder.lrs[i] == probe.lrs[i]
    assert (probe.lrs[0] == approx(lr_max / div) and probe.lrs[3] == approx(lr_max)
            and probe.moms[3] == approx(0.85))
    assert max(probe.lrs) == probe.lrs[3] and min(probe.moms) == probe.moms[3]
    assert learn.param_scheduler.hps['mom'] == probe.moms

def test_one_cycle_defaults_lr_none_and_reset_opt():
    learn = synth_learner(opt_func=torch.optim.Adam, lr=0.05)
    assert learn.opt is None
    learn.fit_one_cycle(1)
    assert learn.recorder.lrs[0] == approx(0.05 / 25) and learn.recorder.lrs[1] == approx(0.05)
    opt = learn.opt
    learn.fit_one_cycle(1, reset_opt=True, wd=0.1)
    assert learn.opt is not opt and learn.opt.param_groups[0]['weight_decay'] == 0.1
    learn.fit_one_cycle(1)
    assert learn.opt.param_groups[0]['weight_decay'] == 0.1        # wd=None keeps what the optimizer has

def test_one_cycle_per_group_lr_max():
    two_groups = lambda params, **kw: torch.optim.Adam([{'params': [p]} for p in params], **kw)
    learn = synth_learner(opt_func=two_groups)
    seen = []
    learn.fit_one_cycle(1, lr_max=[0.01, 0.1], cbs=Callback(before_step=lambda self: seen.append([pg['lr']
        for pg in self.opt.param_groups])))
    assert seen[0] == approx([0.01 / 25, 0.1 / 25]) and seen[1] == approx([0.01, 0.1])

def test_one_cycle_without_momentum_warns_and_still_schedules_lr():
    learn = synth_learner(opt_func=torch.optim.Adagrad)
    with pytest.warns(UserWarning, match="Adagrad has no momentum.*moms=None"):
        learn.fit_one_cycle(1, lr_max=0.1)
    assert list(learn.param_scheduler.hps) == ['lr'] and learn.recorder.lrs[1] == approx(0.1)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        learn.fit_one_cycle(1, moms=None)

@pytest.mark.parametrize('kw, match', [(dict(lr_max=-1.), 'lr_max must be a number >= 0'), (dict(div=0),
    'div must be'),
                                       (dict(moms=(0.9, 0.8)), r'moms must be \(start, middle, end\)'),
                                       (dict(pct_start=2.), 'fit_one_cycle: pct_start must be a fraction')])
def test_one_cycle_argument_errors(kw, match):
    with pytest.raises(ValueError, match=match): synth_learner().fit_one_cycle(1, **kw)

def test_fit_flat_cos():
    learn = synth_learner()
    probe = Probe()
    learn.fit_flat_cos(2, lr=0.04, cbs=probe)  # pct_start=0.75: 6 flat batches, then a cosine over 2
    total = 2 * N_ITER
    assert probe.lrs[:6] == [0.04] * 6
    for i in (6, 7): assert probe.lrs[i] == approx(cos_from_to(0.04, 0.04 / 1e5, (i / total - 0.75) / 0.25))
    learn.fit_flat_cos(1, pct_start=0.)
    assert learn.recorder.lrs == approx([cos_from_to(0.1, 0.1 / 1e5, i / N_ITER) for i in range(N_ITER)])
    with pytest.raises(ValueError, match="pct_start must be a fraction"):
        learn.fit_flat_cos(1, pct_start=-0.1)

# ---------------------------------------------------------------- LRSchedulerCallback

def hand_lrs(make, n_batches, stepped):
    "The lr of each batch when `make(opt)` is stepped after the batches in `stepped`"
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    s = make(opt)
    lrs = []
    for i in range(n_batches):
        lrs.append(opt.param_groups[0]['lr'])
        opt.step()
        if i in stepped: s.step()
    return lrs

step_lr = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
lambda_lr = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (k + 1))

@pytest.mark.parametrize('make', [step_lr, lambda_lr])
def test_lr_scheduler_per_batch_and_per_epoch_match_hand_stepping(make):
    learn = synth_learner()
    n = 3 * N_ITER
    cb = LRSchedulerCallback(make)
    learn.fit(3, cbs=cb)
    assert learn.recorder.lrs == approx(hand_lrs(make, n, range(n)))
    assert cb.scheduler.last_epoch == n
    learn.fit(3, cbs=LRSchedulerCallback(make, step_on='epoch'))
    assert learn.recorder.lrs == approx(hand_lrs(make, n, {3, 7, 11}))
    assert learn.recorder.lrs[:4] == [0.1] * 4 and learn.recorder.lrs[8] < 0.1     # constant within an epoch

def test_cancelled_steps_do_not_advance_the_scheduler():
    def cancel(self):
        if self.train_iter in (1, 2, 5): raise CancelStepException()
    learn = synth_learner()
    cb = LRSchedulerCallback(step_lr)
    learn.fit(2, cbs=[cb, Callback(before_step=cancel)])
    assert learn.recorder.lrs == approx(hand_lrs(step_lr, 8, {0, 3, 4, 6, 7}))
    assert cb.scheduler.last_epoch == 5
    # the cancel raised by a callback that runs after it in before_step is seen too
    learn.fit(2, cbs=[cb, Callback(before_step=cancel, order=-20)])
    assert cb.scheduler.last_epoch == 5

def test_scheduler_instance_built_on_learn_opt_keeps_its_position():
    learn = synth_learner()
    learn.create_opt()
    s = torch.optim.lr_scheduler.LambdaLR(learn.opt, lambda k: 0.5 ** k)
    cb = LRSchedulerCallback(s)
    learn.fit(1, cbs=cb)
    learn.fit(1, lr=0.3, cbs=cb)          # the scheduler owns the lr: it goes on from where it was
    assert learn.recorder.lrs == approx([0.1 * 0.5 ** k for k in range(4, 8)])

def test_lr_scheduler_errors():
    learn = synth_learner()
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"StepLR was built on another optimizer.*learn.create_opt\(\)"):
        learn.fit(1, cbs=LRSchedulerCallback(torch.optim.lr_scheduler.StepLR(other, step_size=1)))
    with pytest.raises(ValueError, match="must return a scheduler built on the optimizer it is given"):
        learn.fit(1, cbs=LRSchedulerCallback(lambda opt: torch.optim.lr_scheduler.StepLR(other, step_size=1)))
    with pytest.raises(ValueError, match="step_on must be 'batch'.*not 'step'"):
        LRSchedulerCallback(step_lr, step_on='step')
    with pytest.raises(TypeError, match="function opt -> scheduler"): LRSchedulerCallback(0.1)
    learn.create_opt()
    # reset_opt=True makes a new optimizer that an existing scheduler does not drive: said at before_fit
    s = torch.optim.lr_scheduler.StepLR(learn.opt, step_size=1)
    with pytest.raises(ValueError, match="built on another optimizer"):
        learn.fit(1, cbs=LRSchedulerCallback(s), reset_opt=True)

def test_reduce_lr_on_plateau_steps_on_the_validation_loss():
    class Spy(torch.optim.lr_scheduler.ReduceLROnPlateau):
        def step(self, metrics, *args, **kw):
            seen.append(metrics)
            return super().step(metrics, *args, **kw)
    seen = []
    learn = synth_learner(metrics=accuracy)
    learn.fit(3, cbs=LRSchedulerCallback(lambda opt: Spy(opt, patience=0), step_on='epoch'))
    assert seen == approx([v[1] for v in learn.recorder.values])
    seen.clear()
    learn.fit(2, cbs=LRSchedulerCallback(lambda opt: Spy(opt), step_on='epoch', monitor='accuracy'))
    assert seen == approx([v[2] for v in learn.recorder.values])
    with pytest.raises(ValueError, match="pass step_on='epoch'"):
        learn.fit(1, cbs=LRSchedulerCallback(lambda opt: Spy(opt)))
    with pytest.raises(ValueError,
                       match=r"monitors 'f1', which is not one of .*\['valid_loss', 'accuracy'\]"):
        learn.fit(1, cbs=LRSchedulerCallback(lambda opt: Spy(opt), step_on='epoch', monitor='f1'))

# ---------------------------------------------------------------- WarmupCallback

def test_warmup_factors_and_restoration():
    learn = synth_learner()
    probe, warmup = Probe(), WarmupCallback(5, start_factor=0.1)
    learn.fit(2, cbs=[warmup, probe])
    expected = [0.1 * (0.1 + 0.9 * k / 5) for k in range(5)] + [0.1] * 3
    assert probe.lrs == approx(expected)
    assert warmup.factors == approx([0.1, 0.28, 0.46, 0.64, 0.82]) and warmup.n_done == 5
    assert learn.recorder.lrs == [0.1] * 8 and learn.opt.param_groups[0]['lr'] == 0.1
    learn.fit(1, cbs=[warmup, probe])                 # each fit warms up again
    assert probe.lrs[-4:] == approx([0.1 * (0.1 + 0.9 * k / 5) for k in range(4)])
    assert [warmup.factor(k) for k in (0, 5, 9)] == approx([0.1, 1., 1.])

def test_warmup_counts_only_real_steps():
    def cancel(self):
        if self.train_iter in (0, 2, 3): raise CancelStepException()
    learn = synth_learner()
    probe, warmup = Probe(), WarmupCallback(3)
    learn.fit(2, cbs=[warmup, probe, Callback(before_step=cancel, order=30)])
    # the probe runs before the cancelling callback, so it sees every attempted step and its factor
    factors = [lr / 0.1 for lr in probe.lrs]
    assert factors == approx([0., 0., 1 / 3, 1 / 3, 1 / 3, 2 / 3, 1., 1.])
    assert warmup.factors == approx([0., 1 / 3, 2 / 3])
    assert learn.opt.param_groups[0]['lr'] == 0.1

def test_warmup_composes_with_schedules():
    learn = synth_learner()
    probe = Probe()
    learn.fit_one_cycle(2, lr_max=0.1, cbs=[WarmupCallback(4, start_factor=0.5), probe])
    assert probe.lrs == approx([lr * f for lr, f in zip(learn.recorder.lrs, [0.5, 0.625, 0.75, 0.875, 1, 1, 1,
        1])])
    learn = synth_learner()
    probe = Probe()
    learn.fit(2, cbs=[LRSchedulerCallback(step_lr), WarmupCallback(3, start_factor=0.5), probe])
    assert learn.recorder.lrs == approx(hand_lrs(step_lr, 8, range(8)))  # the torch schedule is not disturbed
    assert probe.lrs == approx([lr * f for lr, f in zip(learn.recorder.lrs, [0.5, 2 / 3, 5 / 6] + [1] * 5)])

def test_warmup_puts_the_lr_back_after_an_error_or_a_cancelled_batch():
    def boom(self):
        if self.train_iter == 1: raise RuntimeError('boom in the step')
    learn = synth_learner()
    with pytest.raises(RuntimeError, match='boom'):
        learn.fit(1, cbs=[WarmupCallback(4), Callback(before_step=boom, order=10)])
    assert learn.opt.param_groups[0]['lr'] == 0.1
    def cancel_batch(self):
        if self.train_iter == 0: raise CancelBatchException()
    warmup = WarmupCallback(2)
    probe = Probe()
    learn.fit(1, cbs=[warmup, probe, Callback(before_step=cancel_batch, order=30)])
    assert warmup.factors == approx([0., 0.5]) and probe.lrs == approx([0., 0., 0.05, 0.1])
    assert learn.opt.param_groups[0]['lr'] == 0.1

def test_warmup_validation_and_zero_steps():
    with pytest.raises(ValueError, match="n_steps must be an int >= 0"): WarmupCallback(2.5)
    with pytest.raises(ValueError, match=r"start_factor must be in \[0, 1\]"):
        WarmupCallback(3, start_factor=-0.1)
    learn = synth_learner()
    probe = Probe()
    learn.fit(1, cbs=[WarmupCallback(0), probe])
    assert probe.lrs == [0.1] * 4

# ---------------------------------------------------------------- state for checkpoints

def test_lr_scheduler_state_loaded_outside_a_fit_goes_to_the_next_scheduler():
    learn = synth_learner()
    first = LRSchedulerCallback(step_lr)
    learn.fit(1, cbs=first)                                   # 4 steps: lr 0.1 * 0.5 ** 2
    second = LRSchedulerCallback(step_lr)
    second.load_state_dict(first.state_dict())
    learn.fit(1, cbs=second)
    assert learn.recorder.lrs == approx(hand_lrs(step_lr, 8, range(8))[4:])
    assert LRSchedulerCallback(step_lr).state_dict() == {}

@pytest.mark.parametrize('kind', ['one_cycle', 'torch_scheduler'])
def test_interrupted_scheduled_run_resumes_exactly(kind, tmp_path):
    from learncb.checkpoint.callback import CheckpointCallback
    def run(folder, stop_at=None, resume=None):
        learn = synth_learner(path=folder, opt_func=torch.optim.Adam)
        warmup = WarmupCallback(3, start_factor=0.1)
        cbs = [warmup, CheckpointCallback(every_n_steps=1)] + ([CrashAt(stop_at, 'killed')]
                                                               if stop_at is not None else [])
        if kind == 'one_cycle':
            learn.fit_one_cycle(3, lr_max=0.05, cbs=cbs, resume=resume)
            sched_state = learn.param_scheduler.hps
        else:
            sched = LRSchedulerCallback(lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2,
                gamma=0.7))
            learn.fit(3, cbs=cbs + [sched], resume=resume)
            sched_state = sched.scheduler.state_dict()
        return learn.model.state_dict(), sched_state, warmup.factors, learn.opt.param_groups[0]['lr']
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        full = run(tmp_path/'full')
        # in the middle of the warmup
        with pytest.raises(RuntimeError, match='killed'): run(tmp_path/'cut', stop_at=2)
        resumed = run(tmp_path/'cut', resume=True)
    assert all(torch.equal(full[0][k], resumed[0][k]) for k in full[0])
    assert full[1:] == resumed[1:]
