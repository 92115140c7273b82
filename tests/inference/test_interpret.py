"""`ClassificationInterpretation` on a small 3-class problem (and the digits), checked against counts made by
hand"""
import io, math
from contextlib import redirect_stdout
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import pytest, torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
from learncb.inference.interpret import *
from learncb.demo import digits_dls, digits_model
from learncb.test_utils import synth_learner

def three_classes(n, seed):
    """`n` points of the plane, labelled by the third of the circle they lie in, with a tenth of the labels
    flipped"""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    y = ((torch.atan2(x[:, 1], x[:, 0]) + math.pi) * 3 / (2 * math.pi)).long().clamp(max=2)
    flip = torch.rand(n, generator=g) < 0.1
    return x, torch.where(flip, (y + 1) % 3, y)

def three_dl(n, seed, shuffle=False, bs=16):
    return DataLoader(TensorDataset(*three_classes(n, seed)), batch_size=bs, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(seed))

@pytest.fixture(scope='module')
def learn():
    learn = synth_learner(dls=DataLoaders(three_dl(192, 0, shuffle=True), three_dl(90, 1)), model=nn.Linear(2,
        3))
    learn.fit(3)
    return learn

@pytest.fixture(scope='module')
def interp(learn): return ClassificationInterpretation.from_learner(learn)

def test_keeps_one_get_preds_pass(learn, interp):
    inps,preds,targs,dec,losses = learn.get_preds(with_input=True, with_loss=True, with_decoded=True)
    for a,b in zip((inps, preds, targs, dec, losses), (interp.inputs, interp.preds, interp.targs,
                                                       interp.decoded, interp.losses)):
        assert torch.equal(a, b)
    assert interp.vocab == ['0', '1', '2'] and interp.n_classes == 3 and len(interp) == 90
    assert interp.learn is learn and interp.dl.dataset is learn.dls.valid.dataset

def test_confusion_matrix_by_hand(learn, interp):
    _,targs,dec = learn.get_preds(with_decoded=True)
    hand = torch.zeros(3, 3, dtype=torch.long)
    for t,d in zip(targs.tolist(), dec.tolist()): hand[t][d] += 1
    cm = interp.confusion_matrix()
    assert torch.equal(cm, hand)
    mistakes = (cm - cm.diag().diag()).sum()
    assert mistakes > 0, 'the model should make some mistakes (a tenth of the labels are flipped)'

def test_most_confused_by_hand(interp):
    counts = {}
    for t,d in zip(interp.targs.tolist(), interp.decoded.tolist()):
        if t != d: counts[(str(t), str(d))] = counts.get((str(t), str(d)), 0) + 1
    mc = interp.most_confused()
    assert sorted(mc) == sorted((a, p, n) for (a,p),n in counts.items())
    assert [n for *_,n in mc] == sorted(counts.values(), reverse=True)
    top = max(counts.values())
    assert interp.most_confused(min_val=top) == [(a, p, n) for (a,p),n in counts.items() if n == top]
    assert interp.most_confused(min_val=top + 1) == []

def test_top_losses_index_the_dataset_of_a_shuffled_dl(learn):
    dl = three_dl(60, 2, shuffle=True, bs=8)
    interp = ClassificationInterpretation.from_learner(learn, dl=dl)
    x,y = dl.dataset.tensors
    assert torch.equal(interp.targs, y)
    losses,idxs = interp.top_losses(10)
    assert (losses[:-1] >= losses[1:]).all()
    with torch.no_grad():
        for l,i in zip(losses, idxs):
            xi,yi = dl.dataset[i]
            assert torch.allclose(l, F.cross_entropy(learn.model(xi[None]), yi[None]), atol=1e-6)
        every = F.cross_entropy(learn.model(x), y, reduction='none')
    assert torch.allclose(losses, every.sort(descending=True).values[:10], atol=1e-6)
    small,_ = interp.top_losses(5, largest=False)
    assert torch.allclose(small, every.sort().values[:5], atol=1e-6)
    all_losses,all_idxs = interp.top_losses()
    assert len(all_losses) == 60 and sorted(all_idxs.tolist()) == list(range(60))

def test_top_losses_k_checks(interp):
    with pytest.raises(ValueError, match='k=91 but there are only 90 items'): interp.top_losses(91)
    with pytest.raises(ValueError, match='k must be'): interp.top_losses(-1)
    with pytest.raises(TypeError, match='k must be'): interp.top_losses(2.5)
    assert len(interp.top_losses(0)[0]) == 0

def test_report_by_hand(interp):
    rep,t,d = interp.classification_report(),interp.targs,interp.decoded
    ps = []
    rs = []
    fs = []
    ns = []
    for c in range(3):
        tp,pred_c,true_c = ((d == c) & (t == c)).sum().item(),(d == c).sum().item(),(t == c).sum().item()
        p,r = (tp / pred_c if pred_c else 0.),(tp / true_c if true_c else 0.)
        f = 2 * p * r / (p + r) if p + r else 0.
        assert rep[str(c)]['precision'] == pytest.approx(p) and rep[str(c)]['recall'] == pytest.approx(r)
        assert rep[str(c)]['f1-score'] == pytest.approx(f) and rep[str(c)]['support'] == true_c
        ps.append(p); rs.append(r); fs.append(f); ns.append(true_c)
    assert rep['accuracy'] == pytest.approx((t == d).float().mean().item())
    assert rep['macro avg'] == pytest.approx({'precision': sum(ps) / 3, 'recall': sum(rs) / 3,
                                              'f1-score': sum(fs) / 3, 'support': 90})
    w = [n / 90 for n in ns]
    assert rep['weighted avg'] == pytest.approx({'precision': sum(a * b for a,b in zip(ps, w)),
                                                 'recall': sum(a * b for a,b in zip(rs, w)),
                                                 'f1-score': sum(a * b for a,b in zip(fs, w)), 'support': 90})

def test_report_zero_division():
    "Class 2 is never predicted and class 3 has no item: their ratios are 0, not nan"
    targs,dec = torch.tensor([0, 0, 1, 1, 2]),torch.tensor([0, 1, 1, 1, 3])
    preds = F.one_hot(dec, 4).float()
    interp = ClassificationInterpretation(None, None, preds, targs, dec, torch.ones(5), vocab='abcd')
    rep = interp.classification_report()
    assert rep['c'] == {'precision': 0., 'recall': 0., 'f1-score': 0., 'support': 1}
    assert rep['d'] == {'precision': 0., 'recall': 0., 'f1-score': 0., 'support': 0}
    assert rep['a'] == pytest.approx({'precision': 1., 'recall': .5, 'f1-score': 2 / 3, 'support': 2})
    assert rep['b'] == pytest.approx({'precision': 2 / 3, 'recall': 1., 'f1-score': .8, 'support': 2})
    assert rep['accuracy'] == pytest.approx(3 / 5)
    assert rep['macro avg']['precision'] == pytest.approx((1 + 2 / 3) / 4)
    assert interp.most_confused() == [('a', 'b', 1), ('c', 'd', 1)]
    cm = interp.confusion_matrix()
    assert cm.tolist() == [[1, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]]

def test_print_report_layout(interp):
    rep = interp.classification_report()
    with redirect_stdout(io.StringIO()) as out: interp.print_classification_report()
    lines = out.getvalue().splitlines()
    assert lines[0] == ' ' * 13 + '{:>10}{:>10}{:>10}{:>10}'.format('precision', 'recall', 'f1-score',
                                                                    'support')
    assert lines[0].index('support') + len('support') == len(lines[2])
    for c,line in zip('012', lines[2:5]):
        assert line.split() == [c, *(f"{rep[c][k]:.2f}" for k in ('precision', 'recall', 'f1-score')),
                                str(rep[c]['support'])]
    assert lines[6].split() == ['accuracy', f"{rep['accuracy']:.2f}", '90']
    assert lines[7].split() == ['macro', 'avg', *(f"{rep['macro avg'][k]:.2f}" for k in
                                                  ('precision', 'recall', 'f1-score')), '90']
    assert lines[8].startswith('weighted avg') and len(lines) == 9

def test_plots_saved(interp, tmp_path):
    for i,kw in enumerate([{}, dict(normalize=True, norm_dec=3, cmap='Greens', figsize=(4, 4)),
                           dict(plot_txt=False)]):
        ax = interp.plot_confusion_matrix(**kw)
        assert ax.get_xlabel() == 'Predicted' and ax.get_ylabel() == 'Actual'
        assert len(ax.texts) == (0 if kw.get('plot_txt') is False else 9)
        ax.figure.savefig(tmp_path/f'cm{i}.png')
        assert (tmp_path/f'cm{i}.png').stat().st_size > 0
        plt.close(ax.figure)
    fig,axs = plt.subplots(1, 2)
    assert interp.plot_confusion_matrix(ax=axs[1]) is axs[1]
    plt.close(fig)

def test_normalized_rows(interp):
    ax = interp.plot_confusion_matrix(normalize=True, norm_dec=3)
    cm = interp.confusion_matrix()
    assert [t.get_text() for t in ax.texts[:3]] == [f'{v:.3f}' for v in (cm[0] / cm[0].sum()).tolist()]
    plt.close(ax.figure)

def test_top_losses_table_for_vectors(interp):
    with redirect_stdout(io.StringIO()) as out: res = interp.plot_top_losses(4)
    assert res is None
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ['index', 'predicted', 'actual', 'loss', 'probability', 'input']
    losses,idxs = interp.top_losses(4)
    for line,l,i in zip(lines[1:], losses, idxs):
        cells = line.split()
        assert cells[:5] == [str(i.item()), str(interp.decoded[i].item()), str(interp.targs[i].item()),
                             f'{l:.2f}', f'{interp.preds[i].max():.2f}']
    assert len(lines) == 5

@pytest.mark.parametrize('shape', [(8, 8), (1, 8, 8), (3, 8, 8), (8, 8, 3), (8, 8, 1)])
def test_top_losses_images(shape, tmp_path):
    n,g = 12,torch.Generator().manual_seed(0)
    preds = torch.rand(n, 3, generator=g).softmax(1)
    targs,losses = torch.randint(0, 3, (n,), generator=g),torch.rand(n, generator=g)
    interp = ClassificationInterpretation(None, torch.randn(n, *shape, generator=g), preds, targs,
                                          preds.argmax(1), losses, vocab=['cat', 'dog', 'bird'])
    fig = interp.plot_top_losses(5, nrows=2)
    assert len(fig.axes) == 6 and not fig.axes[5].images
    i = losses.argmax()
    names = interp.vocab
    assert fig.axes[0].get_title() == (f'{names[preds[i].argmax()]}/{names[targs[i]]} / {losses[i]:.2f} / '
                                       f'{preds[i].max():.2f}')
    fig.savefig(tmp_path/'top.png')
    assert (tmp_path/'top.png').stat().st_size > 0
    plt.close(fig)

def test_plot_top_losses_args(interp):
    images = ClassificationInterpretation(None, torch.rand(90, 4, 4), interp.preds, interp.targs,
                                          interp.decoded, interp.losses)
    with pytest.raises(ValueError, match='2 rows of 2 cannot hold 5 items'):
        images.plot_top_losses(5, nrows=2, ncols=2)
    with pytest.raises(ValueError, match='k must be a positive int'): images.plot_top_losses(0)
    fig = images.plot_top_losses(3, largest=False, ncols=3, figsize=(6, 2))
    assert fig.axes[0].get_title().split(' / ')[1] == f'{interp.losses.min():.2f}'
    plt.close(fig)
    no_inputs = ClassificationInterpretation(None, None, interp.preds, interp.targs, interp.decoded,
                                             interp.losses)
    with pytest.raises(ValueError, match='shows the inputs'): no_inputs.plot_top_losses(3)

def test_digits_images(tmp_path):
    "The digits seen as 8x8 images by a model that flattens them: a grid of the worst ones"
    torch.manual_seed(0)
    dls = digits_dls()
    learn = synth_learner(dls=dls, model=nn.Sequential(nn.Flatten(), digits_model()), lr=3e-3)
    learn.fit(1)
    xv,yv = dls.valid.dataset.tensors
    interp = ClassificationInterpretation.from_learner(learn, dl=DataLoader(TensorDataset(xv.view(-1, 1, 8,
        8), yv),
                                                                            batch_size=100))
    assert interp.inputs.shape == (len(yv), 1, 8, 8) and interp.vocab == [str(i) for i in range(10)]
    fig = interp.plot_top_losses(9)
    fig.savefig(tmp_path/'digits.png')
    assert (tmp_path/'digits.png').stat().st_size > 0 and len(fig.axes) == 9
    assert fig._suptitle.get_text() == 'Prediction/Actual/Loss/Probability'
    plt.close(fig)
    flat = ClassificationInterpretation.from_learner(learn)
    assert torch.allclose(flat.losses, interp.losses)

class NamedLearner(Learner):
    vocab = ('west', 'south', 'east')

def test_vocab_of_the_learner(learn):
    named = NamedLearner(learn.dls, learn.model, nn.CrossEntropyLoss(), device='cpu', cbs=None)
    named.remove_cbs([cb for cb in named.cbs if type(cb).__name__ == 'ProgressCallback'])
    interp = ClassificationInterpretation.from_learner(named)
    assert interp.vocab == ['west', 'south', 'east']
    assert all(a in named.vocab and p in named.vocab for a,p,_ in interp.most_confused())
    assert set(interp.classification_report()) == {'west', 'south', 'east', 'accuracy', 'macro avg',
                                                   'weighted avg'}
    with pytest.raises(ValueError, match='2 names'):
        ClassificationInterpretation(None, *interp[:], vocab=['a', 'b'])

def test_getitem(interp):
    x,p,y,d,l = interp[[4, 1]]
    assert torch.equal(y, interp.targs[[4, 1]]) and torch.equal(x, interp.inputs[[4, 1]])
    two = Interpretation(None, (interp.inputs, interp.inputs * 2), interp.preds, interp.targs, None,
                         interp.losses)
    (a,b),*_,d,l = two[torch.tensor([0, 3])]
    assert torch.equal(b, 2 * a) and d is None and torch.equal(l, interp.losses[[0, 3]])

def test_loss_without_reduction(learn):
    other = synth_learner(dls=learn.dls, model=learn.model)
    other.loss_func = lambda pred, targ: F.cross_entropy(pred, targ)
    with pytest.raises(TypeError) as e: ClassificationInterpretation.from_learner(other)
    notes = '\n'.join(e.value.__notes__)
    assert 'ClassificationInterpretation.from_learner' in notes and "reduction='none'" in notes

class MeanLoss(nn.Module):
    "Has a `reduction` attribute, but always averages"
    reduction = 'mean'
    def forward(self, pred, targ): return F.cross_entropy(pred, targ)

def test_loss_ignoring_reduction(learn):
    other = synth_learner(dls=learn.dls, model=learn.model)
    other.loss_func = MeanLoss()
    with pytest.raises(Exception) as e: ClassificationInterpretation.from_learner(other)
    notes = '\n'.join(getattr(e.value, '__notes__', []))
    assert 'one loss per item' in notes and 'ClassificationInterpretation.from_learner' in notes

def test_preds_not_one_per_class():
    x,y = three_classes(64, 0)
    dls = DataLoaders(DataLoader(TensorDataset(x, (y > 0).float()), batch_size=16),
                      DataLoader(TensorDataset(x, (y > 0).float()), batch_size=16))
    learn = synth_learner(dls=dls, model=nn.Sequential(nn.Linear(2, 1), nn.Flatten(0)))
    learn.loss_func = nn.BCEWithLogitsLoss()
    with pytest.raises(ValueError, match=r'shape \(n_items, n_classes\).*shape \(64,\)'):
        ClassificationInterpretation.from_learner(learn)
    interp = Interpretation.from_learner(learn)             # the top losses need no classes
    assert len(interp.top_losses(3)[0]) == 3

def test_targets_checked(interp):
    p = interp.preds
    y = interp.targs
    d = interp.decoded
    l = interp.losses
    with pytest.raises(ValueError, match='class indices'):
        ClassificationInterpretation(None, None, p, y.float(), d, l)
    with pytest.raises(ValueError, match='class indices'):
        ClassificationInterpretation(None, None, p, F.one_hot(y, 3), d, l)
    with pytest.raises(ValueError, match='target -1 is not a class index in \\[0, 3\\)'):
        ClassificationInterpretation(None, None, p, y - 1, d, l)
    with pytest.raises(ValueError, match='89 losses for 90'):
        ClassificationInterpretation(None, None, p, y, d, l[1:])

def test_functional_cross_entropy(learn):
    "A plain `F.cross_entropy` loss: probabilities by softmax and argmax decoding all the same"
    other = synth_learner(dls=learn.dls, model=learn.model)
    other.loss_func = F.cross_entropy
    a,b = ClassificationInterpretation.from_learner(other),ClassificationInterpretation.from_learner(learn)
    assert torch.allclose(a.preds, b.preds) and torch.equal(a.decoded, b.decoded)
    assert torch.allclose(a.losses, b.losses)
