"""The tricks, checked against their peers' own tests: each test is written from an assertion of
fastai's notebooks, torchvision's, PyTorch's, Lightning's or optuna-integration's tests, named in its
comment."""
import math, warnings
from functools import partial
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from learncb.all import *
from learncb.test_utils import synth_learner, synth_dls

# 1. CutMix

def test_cutmix_defaults_to_alpha_1_and_does_not_fold_lambda():
    # fastai 19_callback.mixup: `CutMix(alpha=1.)` is the default; torchvision's test_cutmix draws
    # lam ~ Beta(alpha, alpha) with alpha=1.0 and uses it unfolded: the box covers half of the image on
    # average
    cut = CutMix()
    assert cut.alpha == 1.0
    torch.manual_seed(0)
    lams = torch.tensor([cut.draw_lambda() for _ in range(5000)])
    assert abs(lams.mean() - 0.5) < 0.02 and (lams < 0.5).float().mean() > 0.45
    # and the share of the image left after the paste is the lambda the loss uses (torchvision: lam = 1 - box
    # area / image area)
    imgs = torch.randn(32, 3, 16, 16)
    learn = synth_learner(dls=DataLoaders(DataLoader(TensorDataset(imgs, torch.randint(0, 2, (32,))),
                                                     batch_size=8), None),
                          model=nn.Sequential(nn.Flatten(), nn.Linear(768, 2)))
    areas = []
    class Box(Callback):
        order = 60
        def before_batch(self):
            if self.training:
                y1, y2, x1, x2 = cut.last_box; areas.append((1 - (y2 - y1) * (x2 - x1) / 256, cut.lam))
    learn.fit(1, cbs=[cut, Box()])
    assert areas and all(abs(a - lam) < 1e-9 for a, lam in areas)

def test_mixup_keeps_folding_lambda():
    # fastai 19_callback.mixup: MixUp takes lam as max(lam, 1-lam) (`lam = torch.stack([lam, 1-lam],
    # 1).max(1)[0]`)
    torch.manual_seed(0)
    mix = MixUp(alpha=1.)
    assert min(mix.draw_lambda() for _ in range(500)) >= 0.5

# 2. ShortEpochCallback on a dataloader without a length

class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(64): yield torch.randn(2, generator=g), torch.randint(0, 2, (), generator=g)

def test_short_epoch_pct_on_an_iterable_is_refused_before_the_first_batch():
    # Lightning's test_dataloaders_with_limit_percent_batches / _check_dataloader_iterable: a fractional
    # limit_train_batches on an IterableDataset without __len__ raises a MisconfigurationException before
    # training
    seen = []
    learn = synth_learner(dls=DataLoaders(DataLoader(Stream(), batch_size=8), None),
                          cbs=Callback(before_batch=lambda self: seen.append(1)))
    with pytest.raises(ValueError, match=r'pct=0.5\) ends an epoch after a share .* training dataloader has '
                                         r'no length.*n_batches='):
        learn.fit(1, cbs=ShortEpochCallback(pct=0.5))
    assert seen == []
    # ...and an integer limit works on it: `limit_train_batches=2` runs 2 batches
    learn.fit(1, cbs=ShortEpochCallback(n_batches=2))
    assert len(seen) == 2

# 3. A monitor that is not finite

def scripted(values):
    "A monitored loss (minimised: its name says loss) that takes `values`, one per epoch"
    def scripted_loss(learn): return values[learn.epoch]
    return scripted_loss

@pytest.mark.parametrize('bad', [float('nan'), float('inf')])
def test_early_stopping_stops_at_a_monitor_that_is_not_finite(bad):
    # Lightning's test_early_stopping_on_non_finite_monitor: losses [4, 3, 2, bad, 0] with check_finite=True
    # stop at the
    # epoch of the non-finite value (index 3), saying it is not finite
    stop = EarlyStoppingCallback(monitor=scripted([4., 3., 2., bad, 0., 0.]), patience=3)
    learn = synth_learner(cbs=stop)
    with warnings.catch_warnings(record=True): learn.fit(6)
    assert stop.stopped_epoch == 3 and learn.epoch == 3
    assert 'not finite' in learn.stop_reason and str(bad) in learn.stop_reason
    # check_finite=False: patience alone decides (Lightning: the run goes on to the patience limit)
    stop = EarlyStoppingCallback(monitor=scripted([4., 3., 2., bad, 5., 5., 5.]), patience=3,
                                 check_finite=False)
    learn = synth_learner(cbs=stop)
    with warnings.catch_warnings(record=True): learn.fit(7)
    assert stop.stopped_epoch == 5

def test_save_model_never_saves_a_best_that_is_not_finite(tmp_path):
    # fastai 17_callback.tracker: SaveModelCallback saves at each new best; a NaN or -inf loss is never a best
    # (Lightning's ModelCheckpoint skips non-finite monitors in check_monitor_top_k)
    save = SaveModelCallback(monitor=scripted([2., float('nan'), float('-inf'), 3.]))
    learn = synth_learner(path=tmp_path, cbs=save)
    with warnings.catch_warnings(record=True): learn.fit(4)
    assert (save.best, save.best_epoch) == (2., 0)

# 4. Options the peers' users reach for

def test_tta_use_max():
    # fastai 18a_callback.training / tta: `use_max=True` returns the element-wise maximum over the passes
    learn = synth_learner(); learn.fit(1)
    plain, _ = learn.get_preds()
    neg = learn.tta(n=1, augment=lambda x: -x)[0] * 2 - plain
    got = learn.tta(n=2, augment=lambda x: -x, use_max=True)[0]
    assert torch.allclose(got, torch.maximum(plain, neg), atol=1e-6)

def test_swa_start_epoch_as_a_share_of_the_fit():
    # Lightning's test_swa_callback_1_epoch / swa_epoch_start=0.8: a float starts at int(0.8 * max_epochs)
    epochs = []
    swa = SWACallback(start_epoch=0.8, swa_lr=0.05)
    learn = synth_learner(opt_func=torch.optim.SGD,
                          cbs=Callback(after_epoch=lambda self: epochs.append(swa.n_averaged), order=99))
    learn.fit(10, cbs=swa)
    assert epochs == [0] * 8 + [1, 2]

def test_ema_update_every_and_start_step():
    # Lightning's test_ema (EMAWeightAveraging(update_every_n_steps=..., update_starting_at_step=...)): the
    # average is
    # updated on step i when i >= start and i % every == 0, and its first update copies the weights
    seen = []
    class Weights(Callback):
        order = 90
        def after_step(self): seen.append([p.detach().clone() for p in self.model.parameters()])
    ema = EMACallback(decay=0.5, validate=False, replace_at_end=False, update_every=3, start_step=4)
    synth_learner(cbs=[ema, Weights()]).fit(4)
    taken = [w for i, w in enumerate(seen) if i >= 4 and i % 3 == 0]
    avg = taken[0]
    for w in taken[1:]: avg = [0.5 * a + 0.5 * b for a, b in zip(avg, w)]
    assert ema.n_averaged == len(taken) >= 2
    for a, b in zip(ema.average.module.parameters(), avg): assert torch.allclose(a, b)

def test_activation_stats_include_paramless():
    # fastai 15_callback.hook: HookCallback(include_paramless=True) hooks every leaf module, ReLU included
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
    stats = ActivationStats(include_paramless=True)
    synth_learner(model=model, cbs=stats).fit(1)
    # the ReLU's outputs: never negative
    assert stats.stats.shape[1] == 3 and (stats.layer_stats(1)[0] >= 0).all()
    default = ActivationStats()
    synth_learner(model=model, cbs=default).fit(1)
    assert default.stats.shape[1] == 2  # the Linear layers alone

def test_model_sizes_and_num_features_model():
    # fastai 15_callback.hook: model_sizes(m) == [[1, 16, 64, 64], [1, 32, 32, 32], [1, 32, 32, 32]] and
    # num_features_model(m) == 32 for three ConvLayers; num_features_model(Conv2d(5,4,3), Conv2d(4,3,3)) == 3
    def conv(ni, nf, stride=1):
        return nn.Sequential(nn.Conv2d(ni, nf, 3, stride, 1), nn.BatchNorm2d(nf), nn.ReLU())
    m, m2 = nn.Sequential(conv(3, 16), conv(16, 32, stride=2), conv(32, 32)), nn.Sequential(nn.Conv2d(5, 4,
        3), nn.Conv2d(4, 3, 3))
    state = torch.random.get_rng_state()
    assert [list(s) for s in model_sizes(m)] == [[1, 16, 64, 64], [1, 32, 32, 32], [1, 32, 32, 32]]
    assert num_features_model(m) == 32
    assert num_features_model(m2) == 3
    assert torch.equal(torch.random.get_rng_state(), state) and m.training  # nothing of the user's changed

# 5. Label smoothing with class weights

def test_label_smoothing_is_torchs_and_fastais_without_weights():
    # fastai 01a_losses: LabelSmoothingCrossEntropy == (1-eps)*nll + eps*mean(-log p) (its `weight` weighs the
    # nll only);
    # torch's test_cross_entropy_label_smoothing_with_weight: the smoothing term is weighted by the class
    # weights too
    torch.manual_seed(0)
    pred, targ, w = torch.randn(16, 5), torch.randint(0, 5, (16,)), torch.rand(5) + 0.5
    logp = pred.log_softmax(-1)
    fastai_value = lambda weight: 0.9 * nn.functional.nll_loss(logp, targ,
                                                               weight=weight) + 0.1 * (-logp).mean(-1).mean()
    assert torch.allclose(LabelSmoothingCrossEntropy(0.1)(pred, targ), fastai_value(None))
    weighted = LabelSmoothingCrossEntropy(0.1, weight=w)(pred, targ)
    assert torch.allclose(weighted, nn.CrossEntropyLoss(weight=w, label_smoothing=0.1)(pred, targ))
    assert not torch.allclose(weighted, fastai_value(w), atol=1e-3)  # documented: torch's, not fastai's

# 6. An lr given in a partial opt_func

def test_lr_of_a_partial_opt_func_is_the_optimizers():
    # fastai 13a_learner: with opt_func=partial(SGD, lr=1.) the optimizer's lr is 1 (create_opt takes the
    # partial's lr),
    # unless fit is given one
    learn = synth_learner(opt_func=partial(torch.optim.SGD, lr=1.))
    learn.fit(1)
    assert learn.opt.param_groups[0]['lr'] == 1.
    learn.fit(1, lr=0.5)
    assert learn.opt.param_groups[0]['lr'] == 0.5
    with pytest.warns(UserWarning, match=r"Learner\(lr=0.1\) and the opt_func's lr=1.0: the opt_func's is "
                                         r"used"):
        learn = Learner(synth_dls(), nn.Linear(2, 2), nn.CrossEntropyLoss(), opt_func=partial(torch.optim.SGD,
            lr=1.), lr=0.1)
    assert learn.lr == 1.
