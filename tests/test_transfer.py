"Transfer learning: splitter, freeze/unfreeze, lr slices, fine_tune and fit_sgdr against fastai's formulas"
import math, warnings
import pytest, torch
from torch import nn
from learncb.all import *
from conftest import synth_dls, synth_learner, FailAfterEpoch

class BodyHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16),
                                  nn.ReLU())
        self.head = nn.Linear(16, 2)
    def forward(self, x): return self.head(self.body(x))

def three_groups(m):
    return [list(m.body[:2].parameters()), list(m.body[3].parameters()), list(m.head.parameters())]

def learner(path='.', **kw):
    torch.manual_seed(0)
    kw.setdefault('splitter', three_groups)
    return synth_learner(dls=synth_dls(shuffle=True), model=BodyHead(), path=path, **kw)

# fastai's formulas, written out: cosine annealing, 1cycle, and the lrs of a slice
def cos_anneal(start, end, pos): return end + (start - end) / 2 * (1 + math.cos(math.pi * pos))
def one_cycle_lr(lr, pos, pct_start, div=25., div_final=1e5):
    if pos < pct_start: return cos_anneal(lr / div, lr, pos / pct_start)
    return cos_anneal(lr, lr / div_final, (pos - pct_start) / (1 - pct_start))
def slice_lrs(lo, hi, n):
    if lo is None: return [hi / 10] * (n - 1) + [hi]
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]

class LogGroups(Callback):
    "The lr of each param group at each optimizer step, and the position of the fit"
    order = 99
    def __init__(self): self.lrs,self.pos = [],[]
    def before_step(self):
        self.lrs.append([pg['lr'] for pg in self.opt.param_groups]); self.pos.append(self.pct_train)

def test_splitter_makes_param_groups_and_slice_spreads_lrs():
    learn = learner(opt_func=torch.optim.SGD)
    learn.fit(1, lr=slice(1e-4, 1e-2))
    assert [len(pg['params']) for pg in learn.opt.param_groups] == [4, 2, 2]
    assert all(math.isclose(a, b) for a,b in zip([pg['lr'] for pg in learn.opt.param_groups], [1e-4, 1e-3,
        1e-2]))
    learn.fit(1, lr=slice(1e-2))
    assert [pg['lr'] for pg in learn.opt.param_groups] == [1e-3, 1e-3, 1e-2]
    assert learn.lr_range(slice(1e-2)) == [1e-3, 1e-3, 1e-2]

def test_splitter_errors_are_clear():
    with pytest.raises(TypeError, match='splitter must be a function'): learner(splitter=3)
    learn = learner(splitter=lambda m: [list(m.parameters()), list(m.head.parameters())])
    with pytest.raises(ValueError, match='more than one group'): learn.fit(1)
    learn = learner(splitter=lambda m: [m.body, m.head])
    with pytest.raises(TypeError, match='list of parameter lists'): learn.fit(1)
    with pytest.raises(ValueError, match=r'slice\(0.01, 0.1\)'): learner().fit(1, lr=slice(0.1, 0.01))

def test_freeze_semantics():
    learn = learner()
    learn.freeze()
    assert learn.frozen_idx == 2
    bn = {id(p) for p in learn.model.body[1].parameters()}
    trains = {id(p): p.requires_grad for p in learn.model.parameters()}
    assert all(trains[i] for i in bn)                                     # train_bn=True: BatchNorm trains
    assert not any(p.requires_grad for p in learn.model.body[0].parameters())
    assert not any(p.requires_grad for p in learn.model.body[3].parameters())
    assert all(p.requires_grad for p in learn.model.head.parameters())
    learn.freeze_to(1, train_bn=False)
    assert not any(p.requires_grad for p in learn.model.body[1].parameters())
    assert all(p.requires_grad for p in learn.model.body[3].parameters())
    learn.unfreeze()
    assert learn.frozen_idx == 0 and all(p.requires_grad for p in learn.model.parameters())
    with pytest.warns(UserWarning, match='all of it is frozen'): learn.freeze_to(5)

def test_frozen_parameters_do_not_change_nor_grow_optimizer_state():
    learn = learner(opt_func=torch.optim.AdamW, wd=0.1)  # decoupled weight decay would move them if stepped
    learn.freeze()
    frozen = [p for g in learn.param_groups()[:2] for p in g if not p.requires_grad]
    before = [p.detach().clone() for p in frozen]
    learn.fit(2)
    assert all(torch.equal(a, b) for a,b in zip(before, frozen))
    assert all(len(learn.opt.state[p]) == 0 for p in frozen)
    assert all(len(learn.opt.state[p]) > 0 for p in learn.model.head.parameters())

def test_fine_tune_frozen_epochs_keep_the_body_and_lrs_follow_fastai():
    learn = learner()
    body = {n: p.detach().clone() for n,p in learn.model.body.named_parameters()}
    log,kept = LogGroups(),[]
    def after_fit(self):
        if self.frozen_idx:
            kept.append(all(torch.equal(body[n], p) for n,p in self.model.body.named_parameters()
                            if n not in ('1.weight', '1.bias')))          # BatchNorm trains (train_bn)
    base_lr, n = 1e-2, 4                                                  # 4 batches per epoch
    learn.fine_tune(2, base_lr=base_lr, freeze_epochs=2, cbs=[log, Callback(after_fit=after_fit)])
    assert kept == [True] and learn.frozen_idx == 0
    assert len(log.lrs) == 2 * n + 2 * n
    frozen_lrs = slice_lrs(None, base_lr, 3)
    for i in (0, 3, 7):                                                    # first fit: pct_start 0.99, div 25
        assert all(math.isclose(a, one_cycle_lr(lr, i / (2 * n), 0.99), rel_tol=1e-9)
                   for a,lr in zip(log.lrs[i], frozen_lrs))
    unfrozen_lrs = slice_lrs(base_lr / 2 / 100, base_lr / 2, 3)
    for i in (0, 2, 5, 7):                                                 # second fit: pct_start 0.3, div 5
        expected = [one_cycle_lr(lr, i / (2 * n), 0.3, div=5.) for lr in unfrozen_lrs]
        assert all(math.isclose(a, b, rel_tol=1e-9) for a,b in zip(log.lrs[2 * n + i], expected)), (i,
            log.lrs[2 * n + i])

def test_fine_tune_refuses_resume():
    with pytest.raises(TypeError, match='two fits'): learner().fine_tune(1, resume=True)

def test_fit_sgdr_follows_fastai():
    learn = learner()
    log = LogGroups()
    learn.fit_sgdr(2, 1, lr_max=slice(1e-3, 1e-1), cycle_mult=2, cbs=log)    # cycles of 1 and 2 epochs
    assert learn.n_epoch == 3 and len(log.lrs) == 12
    lrs = slice_lrs(1e-3, 1e-1, 3)
    for i in (0, 1, 3, 4, 6, 11):
        pos = log.pos[i]
        expected = [cos_anneal(lr, 0, pos * 3) if pos < 1 / 3 else cos_anneal(lr, 0, (pos - 1 / 3) * 3 / 2)
                    for lr in lrs]
        assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a,b in zip(log.lrs[i], expected)), i

def test_freeze_survives_a_checkpoint_and_a_resume(tmp_path):
    def run(path, cbs=(), resume=None):
        learn = learner(path, opt_func=torch.optim.Adam)
        if resume is None: learn.freeze()  # the resumed learner is made unfrozen: the checkpoint says
        learn.fit_one_cycle(3, 1e-2, cbs=[CheckpointCallback(every_n_steps=3), *cbs], resume=resume)
        return learn
    ref = run(tmp_path/'ref')
    with pytest.raises(RuntimeError, match='boom'): run(tmp_path/'run', cbs=[FailAfterEpoch()])
    resumed = run(tmp_path/'run', resume=True)
    assert resumed.frozen_idx == ref.frozen_idx == 2
    assert [p.requires_grad for p in resumed.model.parameters()] == [p.requires_grad for p
                                                                     in ref.model.parameters()]
    for (k,a),b in zip(ref.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
    assert ref.recorder.losses == resumed.recorder.losses

def test_unfreeze_survives_save_checkpoint_load_checkpoint(tmp_path):
    learn = learner()
    learn.freeze_to(1)
    learn.fit(1)
    learn.save_checkpoint(tmp_path/'ck.pt')
    other = learner()
    other.load_checkpoint(tmp_path/'ck.pt')
    assert other.frozen_idx == 1
    assert [p.requires_grad for p in other.model.parameters()] == [p.requires_grad for p
                                                                   in learn.model.parameters()]

def test_plot_sched_shows_lr_and_momentum_per_iteration(tmp_path):
    import matplotlib; matplotlib.use('Agg')
    learn = learner(splitter=None)
    learn.fit_one_cycle(2, 1e-2)
    axs = learn.recorder.plot_sched()
    assert [ax.get_title() for ax in axs] == ['lr', 'mom']
    lr_line,mom_line = axs[0].lines[0].get_ydata(),axs[1].lines[0].get_ydata()
    assert len(lr_line) == len(mom_line) == 8 and list(lr_line) == learn.recorder.lrs
    assert all(math.isclose(m, cos_anneal(0.95, 0.85, i / 8 / 0.25) if i / 8 < 0.25 else
                            cos_anneal(0.85, 0.95, (i / 8 - 0.25) / 0.75), rel_tol=1e-9) for i,
               m in enumerate(mom_line))
    axs[0].figure.savefig(tmp_path/'sched.png')
    assert (tmp_path/'sched.png').stat().st_size > 0
    with pytest.raises(ValueError, match="'sqr_mom'.* not scheduled"): learn.recorder.plot_sched('sqr_mom')
