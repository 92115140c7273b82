"""The behaviours of pytorch-accelerated's and fastNLP's callbacks that learncb gives too, written from their
tests and docs: acting on the optimizer steps that are taken (fastNLP's
`on_before_optimizers_step`/`on_after_optimizers_step` under accumulation), an evaluation triggered by the
main monitor (fastNLP's `MoreEvaluateCallback(watch_monitor=...)`, keeping its best weights), a warm-up given
as a share of the fit's steps (fastNLP's `TorchWarmupCallback(0.1)`), and a table whose names and values agree
after a fit with an extra evaluation."""
import math
import pytest, torch
from torch import nn
from learncb.all import *
from learncb.test_utils import synth_dl, synth_dls, synth_learner

def accumulating_learner(**kw):
    """25 training batches of 4 items; `GradientAccumulation(12)` steps every 3 batches: 9 steps an epoch (the
    last on 1)"""
    dls = DataLoaders(synth_dl(100, bs=4), synth_dl(32, bs=16))
    return synth_learner(dls=dls, cbs=[GradientAccumulation(12), *kw.pop('cbs', [])], **kw)

class FastNLPStyleWarmup(Callback):
    """A fastNLP-style callback: counts optimizer steps at its `on_before_optimizers_step` and
    `on_after_optimizers_step`"""
    order = Order.STEP
    def __init__(self): self.before,self.after,self.norms = 0,0,[]
    def before_step(self):
        self.before += 1
        grads = [p.grad for p in self.learn.model.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g
                                                                in grads])).item())
    def after_step(self):
        if self.learn.stepped: self.after += 1

def test_callbacks_at_order_step_see_only_the_steps_that_are_taken_and_the_clipped_gradient():
    seen, every_batch = FastNLPStyleWarmup(), []
    learn = accumulating_learner(cbs=[seen, GradientClip(max_norm=1e-3),
                                      Callback(before_step=lambda cb: every_batch.append(1))])
    stepped = []
    learn.fit(1, cbs=Callback(after_step=lambda cb: stepped.append(cb.learn.stepped)))
    assert len(every_batch) == 25  # a default-order before_step: every batch, as in fastai
    assert (seen.before, seen.after) == (9, 9)  # fastNLP's counts: the 9 steps taken, not 25 batches
    # after_step fires every batch; stepped says which stepped
    assert stepped.count(True) == 9 and len(stepped) == 25
    # the gradient the optimizer uses: accumulated and clipped
    assert max(seen.norms) <= 1e-3 * (1 + 1e-4), seen.norms

def test_a_warmup_given_as_a_share_of_the_fit_counts_the_steps_that_are_taken():
    warm = WarmupCallback(0.1)
    learn = accumulating_learner(cbs=[warm])
    learn.fit(10)                                            # 10 epochs of 9 steps: 90 steps, 9 of warm-up
    assert warm.n_steps == 9 and warm.n_done == 9 and len(warm.factors) == 9
    assert warm.factors == [warm.factor(k) for k in range(9)] and warm.factors[0] == 0.
    plain = WarmupCallback(0.25)
    synth_learner(cbs=plain).fit(2)                          # no accumulation: a step a batch
    assert plain.n_steps == round(0.25 * 2 * len(synth_learner().dls.train))
    with pytest.raises(ValueError, match='n_steps'): WarmupCallback(1.5)

def _scripted(values):
    "A monitor f(learn) that gives `values[epoch]`"
    def watched(learn): return values[learn.epoch]
    return watched

def test_an_evaluation_triggered_by_the_main_monitor_keeps_its_best_weights(tmp_path):
    ev = EvaluateCallback(synth_dl(32), name='test', watch_monitor=_scripted([3., 2., 2.5, 1., 1.5, 0.5]),
                          watch_greater_is_better=False, keep_best=2)
    learn = synth_learner(path=tmp_path, metrics=accuracy)
    learn.fit(6, cbs=ev)
    assert [e for e,_ in ev.history] == [0, 1, 3, 5]         # only when the watched value improved
    rec = learn.recorder
    col = rec.value_names.index('test_loss')
    assert [r[col] is not None for r in rec.values] == [True, True, False, True, False, True]
    losses = {e: v[0] for e, v in ev.history}
    best = sorted(losses, key=losses.get)[:2]
    assert [e for _, e, _ in ev.kept] == best                # the two best evaluations' weights, best first
    files = sorted(p.name for p in (tmp_path/'models').glob('test_best_epoch_*.pth'))
    assert files == sorted(f'test_best_epoch_{e}.pth' for e in best)

def test_the_watched_monitor_is_a_value_of_the_validation():
    ev = EvaluateCallback(synth_dl(32), name='test', watch_monitor='valid_loss')
    learn = synth_learner()
    learn.fit(4, cbs=ev)
    valid = [r[learn.recorder.value_names.index('valid_loss')] for r in learn.recorder.values]
    improved = [e for e in range(4) if all(valid[e] < v for v in valid[:e])]
    assert [e for e,_ in ev.history] == improved
    with pytest.raises(TypeError, match='watch_monitor'): EvaluateCallback(synth_dl(32), watch_monitor=3)

def test_names_and_values_of_the_table_agree_after_a_fit_with_an_extra_evaluation():
    learn = synth_learner(metrics=accuracy)
    learn.fit(2, cbs=EvaluateCallback(synth_dl(32), name='test'))     # the callback is gone after the fit
    rec = learn.recorder
    assert rec.value_names == ['train_loss', 'valid_loss', 'accuracy', 'test_loss', 'test_accuracy']
    assert all(len(r) == len(rec.value_names) for r in rec.values)
    assert rec.metric_names == ['epoch', *rec.value_names, 'time']
    learn.fit(1)                                             # a fit without it: its own columns
    assert rec.value_names == ['train_loss', 'valid_loss', 'accuracy'] and len(rec.values[0]) == 3
