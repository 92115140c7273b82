"""Everything around a language model's fit (issue 62): predictions on rows of unequal length, the loss of
each row of a model's own loss, export and prediction of a transformers model in a new process, and the
mistakes an LM fit trains on silently unless told."""
import subprocess, sys
from pathlib import Path
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader
from learncb.all import *
from learncb.test_utils import TinyLM, padded_tokens
from lm_models import gpt2, hf_tokens

def pad_collate(rows):
    """Rows `(x, y)` cut to their own length, padded to the longest of the batch: inputs with 0, targets with
    -100"""
    n = max(int((y != -100).sum()) for _,y in rows)
    return torch.stack([x[:n] for x,_ in rows]), torch.stack([y[:n] for _,y in rows])

def lm_learner(valid_bs=4):
    ds = padded_tokens(16, lengths=(2, 24))
    valid = DataLoader(ds, batch_size=valid_bs, collate_fn=pad_collate)
    dls = DataLoaders(DataLoader(ds, batch_size=8), valid)
    torch.manual_seed(0)
    return Learner(dls, TinyLM(), CrossEntropyLossFlat())

def test_get_preds_on_batches_of_unequal_length_pads_to_the_longest():
    learn = lm_learner()
    lengths = [b[0].shape[1] for b in learn.dls.valid]
    assert len(set(lengths)) > 1                      # the batches differ in length
    preds, targs, losses = learn.get_preds(with_loss=True)
    longest = max(lengths)
    assert preds.shape == (16, longest, 24) and targs.shape == (16, longest)
    start = 0
    for x, y in learn.dls.valid:
        n, k = x.shape
        with torch.no_grad(): p = torch.softmax(learn.model(x), -1)
        assert torch.allclose(preds[start:start + n, :k], p, atol=1e-6)
        assert (targs[start:start + n, k:] == -100).all()            # the padding: targets -100, outputs 0
        assert torch.allclose(preds[start:start + n, k:], torch.tensor(1 / 24))   # softmax of 0, gathered
        rows = nn.functional.cross_entropy(learn.model(x).transpose(1, 2), y, reduction='none').detach()
        expect = (rows * (y != -100)).sum(1) / (y != -100).sum(1)
        assert torch.allclose(losses[start:start + n], expect, atol=1e-6)    # each row's mean over its tokens
        start += n

def test_get_preds_along_the_wrong_dimension_says_which():
    learn = lm_learner()
    with pytest.raises(ValueError, match=r'concat_dim must be the dimension of the items') as e:
        learn.get_preds(concat_dim=1)
    assert 'the dataloader holds 16 items' in str(e.value)

def test_get_preds_with_loss_of_a_model_that_computes_its_own_gives_each_rows_loss():
    rows = hf_tokens(12)
    dls = DataLoaders(DataLoader(rows, batch_size=4), DataLoader(rows, batch_size=4))
    learn = Learner(dls, gpt2(), loss_func=None)
    _, _, losses = learn.get_preds(with_loss=True)
    assert losses.shape == (12,)
    for i, row in enumerate(rows):
        n = int(row['attention_mask'].sum())
        with torch.no_grad():
            out = learn.model(input_ids=row['input_ids'][None, :n], labels=row['labels'][None, :n])
        assert losses[i].item() == pytest.approx(out.loss.item(), rel=1e-5)    # its own loss on the row alone

PREDICT = """
import sys, torch
sys.path.insert(0, {tests!r})
from learncb.all import *
from lm_models import gpt2, hf_collate
learn = load_learner({path!r}, model=gpt2())
item, rows = torch.load({item!r}), torch.load({rows!r})
dec, probs = learn.predict(item)
dec_t, probs_t = learn.predict(item['input_ids'])                     # the model called on a tensor
preds, targs = learn.get_preds(dl=learn.test_dl(rows, bs=3, collate_fn=hf_collate))
torch.save(dict(dec=dec, probs=probs, probs_t=probs_t, preds=preds, targs=targs), {out!r})
"""

def test_a_gpt2_exported_loads_and_predicts_in_a_new_process(tmp_path):
    from lm_models import hf_collate
    rows = hf_tokens(12)
    dls = DataLoaders(DataLoader(rows, batch_size=4, collate_fn=hf_collate),
                      DataLoader(rows, batch_size=3, collate_fn=hf_collate))
    learn = Learner(dls, gpt2(), loss_func=None, lr=1e-2)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    with pytest.warns(UserWarning, match=r'dict batches \(model\(\*\*batch\)\)'):
        path = learn.export(tmp_path/'lm.pt')
    n = int(rows[0]['attention_mask'].sum())
    item = {k: rows[0][k][:n] for k in ('input_ids', 'attention_mask')}
    dec, probs = learn.predict({**item, 'labels': rows[0]['labels'][:n]})        # labels are left out
    torch.save(item, tmp_path/'item.pt'); torch.save(rows, tmp_path/'rows.pt')
    code = PREDICT.format(tests=str(Path(__file__).parent), path=str(path), item=str(tmp_path/'item.pt'),
                          rows=str(tmp_path/'rows.pt'), out=str(tmp_path/'out.pt'))
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.load(tmp_path/'out.pt')
    assert probs.shape == (n, 24) and torch.allclose(probs.sum(-1), torch.ones(n))    # a causal LM: softmax
    assert torch.allclose(got['probs'], probs, atol=1e-6) and torch.equal(got['dec'], dec)
    assert torch.allclose(got['probs_t'], probs, atol=1e-6)
    preds, targs = learn.get_preds(dl=dls.valid)
    assert torch.allclose(got['preds'], preds, atol=1e-6) and got['targs'] is None    # test_dl: inputs only

def test_the_summary_tells_a_models_own_loss():
    learn = Learner(DataLoaders(DataLoader(hf_tokens(4), batch_size=4), None), gpt2(), loss_func=None)
    line = next(l for l in learn.summary().splitlines() if l.startswith('Loss function'))
    assert "the model's own" in line and "batch['labels']" in line and 'causal LM' in line

def fit_rows(rows, **kwargs):
    learn = Learner(DataLoaders(DataLoader(rows, batch_size=4), None), gpt2(), loss_func=None, **kwargs)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    return learn

def test_labels_that_count_the_padding_are_told_once_a_fit():
    rows = hf_tokens(8)
    for r in rows: r['labels'] = r['input_ids'].clone()            # the padding's token, not -100
    told = r'labels of this batch count positions its attention_mask marks as padding'
    with pytest.warns(UserWarning, match=told) as w:
        fit_rows(rows)
    assert sum('attention_mask marks as padding' in str(m.message) for m in w) == 1     # once, not per batch
    assert "labels.masked_fill(attention_mask == 0, -100)" in str(w[0].message)

def test_labels_shifted_by_hand_for_a_model_that_shifts_them_are_told():
    rows = hf_tokens(8)
    for r in rows: r['labels'] = torch.cat([r['labels'][1:], torch.tensor([-100])])   # shifted by hand
    with pytest.warns(UserWarning, match='the model shifts its labels itself'): fit_rows(rows)

def test_right_labels_are_not_warned_of(recwarn):
    fit_rows(hf_tokens(8))
    assert not [w for w in recwarn if 'labels' in str(w.message)]

def test_a_batch_without_the_label_key_lists_its_keys_and_names_label_key():
    rows = hf_tokens(8)
    for r in rows: r['label'] = r.pop('labels')
    with pytest.raises(ValueError) as e: fit_rows(rows)
    msg = str(e.value)
    assert "no 'labels' entry (learn.label_key)" in msg and "'input_ids', 'attention_mask', 'label'" in msg
    assert "batch['labels'] = batch.pop('label')" in msg and 'nn.CrossEntropyLoss' not in msg
    loss_given = Learner(DataLoaders(DataLoader(rows, batch_size=4), None), gpt2(),
                         loss_func=CrossEntropyLossFlat())
    with pytest.raises(ValueError, match=r"targets are: Learner\(\.\.\., label_key='label'\)"):
        loss_given.fit(1)
