"""A step cut into pieces trains as the whole step when the loss counts tokens (issue 62): each piece weighed
by the items its loss is a mean of. In one process: accumulation, a transformers model's own loss, a
segmentation mask with an ignored label, micro-batches; the Recorder's means by items, and `Perplexity`.
The distributed rows of the table are in tests/distributed/test_lm_items.py."""
import math
from functools import partial
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
from learncb.test_utils import TinyLM, padded_tokens
from lm_models import TooBig, gpt2, hf_tokens

def rel_dist(a, b):
    """The largest distance between two models' weights, relative to the largest weight of `b`, over the
    tensors"""
    sa, sb = a.state_dict(), b.state_dict()
    return max(((sa[k].float() - w.float()).abs().max() / w.float().abs().max()).item() for k,w in sb.items())

def fit_lm(bs, cbs=(), loss_func=None, lengths=(2, 24), n=32, lr=1.0, model=TinyLM, epochs=1):
    "The tiny LM on `n` padded rows, in order, batches of `bs`, SGD: the fitted learner"
    dls = DataLoaders(DataLoader(padded_tokens(n, lengths=lengths), batch_size=bs),
                      DataLoader(padded_tokens(16, lengths=lengths, seed=1), batch_size=8))
    torch.manual_seed(0)
    learn = Learner(dls, model(), loss_func or CrossEntropyLossFlat(), opt_func=torch.optim.SGD, lr=lr)
    with learn.no_bar(), learn.no_logging(): learn.fit(epochs, cbs=list(cbs))
    return learn

def rows_loss(pred, y):
    "The same token mean, from a plain function: learncb cannot tell its items, and weighs it by rows"
    return nn.functional.cross_entropy(pred.flatten(0, 1), y.flatten())

def test_accumulated_padded_batches_train_as_the_whole_batch():
    whole = fit_lm(16)
    acc = fit_lm(4, [GradientAccumulation(16)])
    assert whole.train_iter == 2 and acc.train_iter == 8
    assert rel_dist(acc.model, whole.model) < 1e-6
    by_rows = fit_lm(4, [GradientAccumulation(16)], loss_func=rows_loss)    # what main computed: another fit
    assert rel_dist(by_rows.model, whole.model) > 1e-4
    assert rel_dist(fit_lm(16, loss_func=rows_loss).model, whole.model) < 1e-6   # the same loss, uncut

def test_a_loss_that_says_its_items_is_weighed_by_them():
    class TokenMean(nn.Module):
        def forward(self, pred, y): return rows_loss(pred, y)
        def count_items(self, y): return (y != -100).sum()
    whole = fit_lm(16, loss_func=TokenMean())
    assert rel_dist(fit_lm(4, [GradientAccumulation(16)], loss_func=TokenMean()).model, whole.model) < 1e-6

def test_the_control_rows_of_equal_length_are_equal_by_rows_or_by_tokens():
    whole = fit_lm(16, lengths=None)
    assert rel_dist(fit_lm(4, [GradientAccumulation(16)], lengths=None).model, whole.model) < 1e-6
    assert rel_dist(fit_lm(4, [GradientAccumulation(16)], lengths=None, loss_func=rows_loss).model,
                    whole.model) < 1e-6

def test_micro_batches_of_a_padded_batch_train_as_the_whole_batch():
    whole = fit_lm(16)
    with pytest.warns(UserWarning, match='ran out of memory'):
        micro = fit_lm(16, [auto := AutoMicrobatch()], model=TooBig)
    assert auto.history and rel_dist(micro.model.lm, whole.model) < 1e-6

def test_the_recorder_means_are_over_tokens_and_perplexity_is_their_exp():
    learn = fit_lm(4, epochs=1, lr=0.1, cbs=[])
    learn.metrics = [Perplexity()]
    learn.validate()
    valid_loss, ppl = learn.recorder.last_valid
    model, lf = learn.model.eval(), nn.CrossEntropyLoss(reduction='sum')
    with torch.no_grad():
        total = sum(lf(model(x).transpose(1, 2), y).item() for x,y in learn.dls.valid)
        tokens = sum((y != -100).sum().item() for _,y in learn.dls.valid)
    assert valid_loss == pytest.approx(total / tokens, rel=1e-6)
    assert ppl == pytest.approx(math.exp(valid_loss), rel=1e-6)
    by_rows = sum(lf(model(x).transpose(1, 2), y).item() / (y != -100).sum().item() * len(y)
                  for x,y in learn.dls.valid) / len(learn.dls.valid.dataset)
    assert abs(by_rows - valid_loss) > 1e-4               # the mean of the batches by rows is another number

def test_the_training_loss_of_an_epoch_is_its_token_mean():
    class Seen(Callback):
        def before_fit(self): self.total, self.tokens = 0., 0
        def after_loss(self):
            if not self.training: return
            n = (self.learn.y != -100).sum().item()
            self.total += self.learn.loss.item() * n; self.tokens += n
    learn = fit_lm(4, [seen := Seen()])
    assert learn.recorder.values[-1][0] == pytest.approx(seen.total / seen.tokens, rel=1e-6)

def segmentation(bs, cbs=()):
    """A per-pixel classifier on 4x4 masks with label 255 where a pixel is unlabelled (a different part in
    each mask)"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 4, 4, generator=g)
    y = (x.sum(1) > 0).long()
    y[torch.rand(32, 4, 4, generator=g) < torch.linspace(0, 0.9, 32)[:, None, None]] = 255
    torch.manual_seed(0)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=bs), None)
    learn = Learner(dls, nn.Conv2d(3, 2, 3, padding=1), nn.CrossEntropyLoss(ignore_index=255),
                    opt_func=torch.optim.SGD, lr=1.0)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=list(cbs))
    return learn

def test_accumulated_segmentation_masks_with_an_ignored_label_train_as_the_whole_batch():
    assert rel_dist(segmentation(4, [GradientAccumulation(16)]).model, segmentation(16).model) < 1e-6

def fit_gpt2(bs, cbs=()):
    dls = DataLoaders(DataLoader(hf_tokens(32), batch_size=bs), None)
    learn = Learner(dls, gpt2(), loss_func=None, opt_func=torch.optim.SGD, lr=1.0)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=list(cbs))
    return learn

def test_a_transformers_causal_lm_own_loss_accumulated_trains_as_the_whole_batch():
    whole = fit_gpt2(16)
    assert shifts_labels(whole.model)
    assert rel_dist(fit_gpt2(4, [GradientAccumulation(16)]).model, whole.model) < 1e-6

def test_items_counted_ahead_of_a_cancelled_batch_are_not_the_next_validation_batchs():
    "A data-parallel step counts a batch's items before its forward: a batch cancelled then leaves no count"
    class Cut(Callback):
        "A step cut over processes (as under DDP), in one process; the last training batch cut short"
        def before_train(self): self.learn.step.cut = True
        def after_pred(self):
            if self.training and self.iter == self.n_iter - 1: raise CancelBatchException()
    learn = fit_lm(4, [Cut()], lr=0.1)
    valid_loss = learn.recorder.values[-1][1]
    lf, model = nn.CrossEntropyLoss(reduction='sum'), learn.model.eval()
    with torch.no_grad():
        total = sum(lf(model(x).transpose(1, 2), y).item() for x,y in learn.dls.valid)
    tokens = sum((y != -100).sum().item() for _,y in learn.dls.valid)
    assert valid_loss == pytest.approx(total / tokens, rel=1e-6)
