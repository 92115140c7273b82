"""predict, test_dl, export and load_learner: state left alone, a file that loads in a process without the
model's code"""
import io, json, os, random, subprocess, sys, textwrap, warnings, zipfile
from pathlib import Path
import numpy as np
import pytest, torch
from torch import nn
from torch.utils.data import TensorDataset
import learncb
from learncb.all import *
from learncb.inference.export import *
from learncb.test_utils import synth_dls, synth_learner

ROOT = Path(learncb.__file__).resolve().parent.parent      # the checkout whose learncb these tests import

class DropNorm(nn.Module):
    """A model whose outputs depend on train/eval mode (dropout, batch norm) and that draws random numbers in
    training"""
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8,
            2))
    def forward(self, x): return self.body(x)

def _rngs():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()

def _same_rngs(a, b): return torch.equal(a[0], b[0]) and a[1] == b[1] and (a[2] == b[2]).all()

def test_predict_is_the_get_preds_row_and_leaves_the_learner_alone():
    learn = synth_learner(model=DropNorm())
    learn.fit(1)
    x,_ = learn.dls.valid.dataset[5]
    learn.model.train()
    rec = learn.recorder
    history = (list(rec.values), list(rec.losses), list(rec.lrs), learn.epoch, learn.iter, learn.train_iter)
    loop = [getattr(learn, k) for k in ('pred', 'xb', 'yb', 'dl', 'batch', 'loss')]
    params = {k: v.clone() for k,v in learn.model.state_dict().items()}      # batch norm statistics included
    before = _rngs()
    dec,probs = learn.predict(x)
    assert _same_rngs(before, _rngs())
    assert learn.model.training
    assert (list(rec.values), list(rec.losses), list(rec.lrs), learn.epoch, learn.iter,
            learn.train_iter) == history
    assert all(getattr(learn, k) is v for k,v in zip(('pred', 'xb', 'yb', 'dl', 'batch', 'loss'), loop))
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k,v in params.items())
    p1,t1,d1 = learn.get_preds(dl=learn.test_dl([x]), with_decoded=True)
    assert t1 is None and torch.equal(probs, p1[0]) and torch.equal(dec, d1[0])
    p,_,d = learn.get_preds(with_decoded=True)                      # eval mode: the row of the validation set
    torch.testing.assert_close(probs, p[5])
    assert torch.equal(dec, d[5])
    probs.mul_(2)  # an ordinary tensor, not an inference tensor

def test_predict_goes_through_the_callbacks():
    "A callback that changes predictions at after_pred changes those of predict as those of get_preds"
    negate = Callback(after_pred=lambda cb: setattr(cb.learn, 'pred', -cb.learn.pred))
    learn = synth_learner(cbs=negate)
    x = torch.randn(2)
    with torch.no_grad(): raw = learn.model(x[None])[0]
    torch.testing.assert_close(learn.predict(x)[1], torch.softmax(-raw, -1))

def test_get_preds_on_inputs_only():
    learn = synth_learner()
    x = torch.randn(37, 2)
    inp,preds,targs,dec,losses = learn.get_preds(dl=learn.test_dl(x), with_input=True, with_decoded=True,
                                                 with_loss=True)
    assert torch.equal(inp, x) and preds.shape == (37, 2) and targs is None and losses is None
    assert torch.equal(dec, preds.argmax(1))

def test_test_dl_and_predict_with_two_inputs():
    class Two(nn.Module):
        def __init__(self): super().__init__(); self.a,self.b = nn.Linear(2, 2),nn.Linear(3, 2)
        def forward(self, x1, x2): return self.a(x1) + self.b(x2)
    x1,x2,y = torch.randn(20, 2),torch.randn(20, 3),torch.randint(0, 2, (20,))
    ds = TensorDataset(x1, x2, y)
    dls = DataLoaders(torch.utils.data.DataLoader(ds, batch_size=8), torch.utils.data.DataLoader(ds,
        batch_size=8))
    learn = synth_learner(dls=dls, model=Two(), n_inp=2)
    b = next(iter(learn.test_dl(ds)))
    assert len(b) == 2 and torch.equal(b[0], x1[:8]) and torch.equal(b[1], x2[:8])  # the targets are dropped
    assert torch.equal(learn.get_preds(dl=learn.test_dl(ds))[0], learn.get_preds()[0])
    dec,probs = learn.predict((x1[3], x2[3]))
    assert torch.equal(probs, learn.get_preds(dl=learn.test_dl([(x1[3], x2[3])]))[0][0])
    with pytest.raises(ValueError, match='n_inp=2'): learn.predict(x1[3])
    with pytest.raises(ValueError, match='predict takes one item'): learn.predict((x1[:4], x2[:4]))
    with pytest.raises(ValueError, match='n_inp=2'): learn.test_dl(x1)
    with pytest.raises(ValueError, match='item 1'): learn.test_dl([(x1[0], x2[0]), x1[1]])

MODELS = '''
import torch
from torch import nn
class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
    def forward(self, x): return self.body(x)
'''

LOADER = '''
import sys, torch
try:
    import mymodels
    sys.exit('mymodels should not be importable here')
except ImportError: pass
from learncb.inference.export import load_learner
learn = load_learner(sys.argv[1])
x = torch.load(sys.argv[2], weights_only=True)
preds,targs = learn.get_preds(dl=learn.test_dl(x))
assert targs is None
dec,probs = learn.predict(x[0])
torch.save({'preds': preds, 'dec': dec, 'probs': probs, 'vocab': learn.vocab,
            'model': type(learn.model).__name__},
           sys.argv[3])
'''

@pytest.mark.slow
def test_export_then_load_where_the_model_class_cannot_be_imported(tmp_path, monkeypatch):
    (tmp_path/'mymodels.py').write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import mymodels
    learn = synth_learner(model=mymodels.TinyNet(), path=tmp_path)
    learn.fit(2)
    learn.vocab = ['neg', 'pos']
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        fname = learn.export('tiny.pt')
    x = torch.randn(50, 2)
    torch.save(x, tmp_path/'x.pt')
    elsewhere = tmp_path/'elsewhere'
    elsewhere.mkdir()
    env = {**os.environ, 'PYTHONPATH': str(ROOT)}
    res = subprocess.run([sys.executable, '-c', LOADER, str(fname), str(tmp_path/'x.pt'),
                          str(tmp_path/'out.pt')],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = torch.load(tmp_path/'out.pt', weights_only=True)
    dec,probs = learn.predict(x[0])
    # the exported program and the eager model compute the same function with kernels each picks for itself
    # (another
    # process, another graph): equal to float rounding, not bit for bit
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    close(out['preds'], learn.get_preds(dl=learn.test_dl(x))[0])
    close(out['probs'], probs)
    assert torch.equal(out['dec'], dec)  # the class: the same unless two probabilities tie within rounding
    assert out['vocab'] == ['neg', 'pos'] and out['model'] == 'ExportedModel'

class Branchy(nn.Module):
    "Control flow on a tensor's value: torch.export cannot capture it"
    def __init__(self): super().__init__(); self.lin = nn.Linear(2, 2)
    def forward(self, x): return self.lin(x) if x.sum() > 0 else -self.lin(x)

def test_a_model_torch_export_cannot_capture_round_trips_with_model(tmp_path):
    learn = synth_learner(model=Branchy(), path=tmp_path)
    learn.fit(1)
    with pytest.warns(UserWarning, match='holds its weights only'): fname = learn.export()
    assert 'GuardOnDataDependent' in torch.load(fname, weights_only=True)['program_error']
    with pytest.raises(ValueError, match=r'model=MyModel\(\.\.\.\)') as e: load_learner(fname)
    assert 'GuardOnDataDependent' in str(e.value)
    inf = load_learner(fname, model=Branchy())
    x = torch.randn(40, 2)
    assert torch.equal(inf.get_preds(dl=inf.test_dl(x, bs=16))[0], learn.get_preds(dl=learn.test_dl(x,
        bs=16))[0])
    for a,b in zip(inf.predict(x[0]), learn.predict(x[0])): assert torch.equal(a, b)

class BySize(nn.Module):
    "Code that depends on the batch size: torch fixes the branch of the sample batch without a word"
    def __init__(self): super().__init__(); self.lin = nn.Linear(2, 2)
    def forward(self, x): return self.lin(x) if x.shape[0] > 1 else 2 * self.lin(x)

def test_a_model_that_depends_on_the_batch_size_is_captured_for_one_item(tmp_path):
    learn = synth_learner(model=BySize(), path=tmp_path)
    learn.fit(1)
    with pytest.warns(UserWarning, match='batches of one item'): fname = learn.export()
    inf = load_learner(fname)
    x = torch.randn(10, 2)
    assert inf.test_dl(x).batch_size == 1
    assert torch.equal(inf.get_preds(dl=inf.test_dl(x))[0], learn.get_preds(dl=learn.test_dl(x, bs=1))[0])
    for a,b in zip(inf.predict(x[0]), learn.predict(x[0])): assert torch.equal(a, b)
    with pytest.raises(ValueError, match='batches of 1'): inf.test_dl(x, bs=8)

def test_export_leaves_the_learner_alone(tmp_path):
    learn = synth_learner(model=DropNorm(), path=tmp_path)
    learn.fit(1)
    learn.model.train()
    params = {k: v.clone() for k,v in learn.model.state_dict().items()}
    before = _rngs()
    learn.export()
    assert _same_rngs(before, _rngs()) and learn.model.training
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k,v in params.items())
    learn.model.eval()
    inf = load_learner(tmp_path/'export.pt')
    x = torch.randn(9, 2)
    assert torch.equal(inf.get_preds(dl=inf.test_dl(x))[0], learn.get_preds(dl=learn.test_dl(x))[0])

def test_custom_activation_warns_and_comes_back_with_act(tmp_path):
    class Tempered(nn.CrossEntropyLoss):
        def activation(self, x): return torch.softmax(x / 3, dim=-1)
    learn = synth_learner(path=tmp_path)
    learn.loss_func = Tempered()
    learn.fit(1)
    with pytest.warns(UserWarning, match='load_learner.path, act=') as w: fname = learn.export()
    assert len([o for o in w if 'export:' in str(o.message)]) == 1   # the decoding is argmax: it has a name
    x = torch.randn(5, 2)
    want = learn.get_preds(dl=learn.test_dl(x))[0]
    assert not torch.allclose(load_learner(fname).get_preds(dl=learn.test_dl(x))[0], want)
    assert torch.equal(load_learner(fname, act=learn.loss_func.activation).get_preds(dl=learn.test_dl(x))[0],
                       want)

class Payload:
    "Unpickling it would create the folder `path`"
    def __init__(self, path): self.path = path
    def __reduce__(self): return (os.mkdir, (self.path,))

def test_a_file_with_pickled_objects_is_refused_and_its_payload_does_not_run(tmp_path):
    marker = tmp_path/'payload_ran'
    torch.save({'learncb_export': 1, 'model': {}, 'payload': Payload(str(marker))}, tmp_path/'crafted.pt')
    with pytest.raises(ValueError, match='refused to load'): load_learner(tmp_path/'crafted.pt')
    assert not marker.exists()

def _rewrite(blob, name, edit):
    "`blob`, a zip archive, with the file ending in `name` replaced by `edit(bytes)`"
    z = zipfile.ZipFile(io.BytesIO(blob))
    out = io.BytesIO()
    with zipfile.ZipFile(out, 'w') as w:
        for n in z.namelist(): w.writestr(n, edit(z.read(n)) if n.endswith(name) else z.read(n))
    return out.getvalue()

def _pickled_weight(blob, marker):
    cfg = lambda b: b.replace(b'"use_pickle": false', b'"use_pickle": true', 1)
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    return _rewrite(_rewrite(blob, 'model_weights_config.json', cfg), 'weights/weight_0',
                    lambda b: buf.getvalue())

def _shape_expression(blob, marker):
    code = f"__import__('os').mkdir('{marker}') + Symbol('s".encode()
    return _rewrite(blob, 'models/model.json', lambda b: b.replace(b"Symbol('s", code, 1))

def _guard_code(blob, marker):
    def edit(b):
        d = json.loads(b)
        d['guards_code'] = [f"__import__('os').mkdir('{marker}') is None"]
        return json.dumps(d).encode()
    return _rewrite(blob, 'models/model.json', edit)

@pytest.mark.parametrize('craft,message', [(_pickled_weight, 'stored as a pickle'),
                                           (_shape_expression, 'shape expression'), (_guard_code,
    'guard code')])
def test_a_crafted_program_is_refused_and_its_payload_does_not_run(tmp_path, craft, message):
    "Three ways torch.export.load (2.13) runs code from a file; the checks refuse each before torch reads it"
    learn = synth_learner(path=tmp_path)
    fname = learn.export()
    state = torch.load(fname, weights_only=True)
    marker = tmp_path/'payload_ran'
    blob = craft(state['program'].numpy().tobytes(), str(marker))
    state['program'] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    atomic_save(with_checksum(state), fname)  # a crafted file has a checksum that matches
    with pytest.raises(ValueError, match=message): load_learner(fname)
    assert not marker.exists()
    assert torch.equal(load_learner(fname, model=nn.Linear(2, 2)).predict(torch.ones(2))[1],
                       learn.predict(torch.ones(2))[1])  # the weights alone still load into a model

def test_load_learner_errors(tmp_path):
    learn = synth_learner(path=tmp_path)
    fname = learn.export()
    with pytest.raises(FileNotFoundError): load_learner(tmp_path/'nope.pt')
    with pytest.raises(ValueError, match='learn.load'): load_learner(learn.save('w'))
    state = torch.load(fname, weights_only=True)
    state['n_inp'] = 0
    torch.save(state, tmp_path/'damaged.pt')
    with pytest.raises(CorruptFileError, match='damaged'): load_learner(tmp_path/'damaged.pt')
    atomic_save(with_checksum(state), tmp_path/'bad.pt')
    with pytest.raises(CorruptFileError, match=r"\['n_inp'\]"): load_learner(tmp_path/'bad.pt')
    with pytest.raises(ValueError, match='shape mismatches'): load_learner(fname, model=nn.Linear(2, 3))
    with pytest.raises(TypeError, match='not the class'): load_learner(fname, model=nn.Linear)
    learn.vocab = [object()]
    with pytest.raises(TypeError, match=r'vocab\[0\]'): learn.export('v.pt')

@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cuda_predict_export_and_load(tmp_path):
    """On a GPU: predict runs on the model's device, export captures from a CPU copy,
    load_learner(device='cuda') predicts"""
    torch.manual_seed(0)
    learn = Learner(synth_dls(), nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2)),
                    nn.CrossEntropyLoss(), device='cuda', path=tmp_path)
    learn.fit(1)
    x = learn.dls.valid.dataset.tensors[0]
    dec,probs = learn.predict(x[0])
    assert probs.device.type == 'cpu' and next(learn.model.parameters()).is_cuda     # gathered to the CPU
    fname = learn.export()
    assert next(learn.model.parameters()).is_cuda  # the learner's model stays
    inf = load_learner(fname, device='cuda')
    got = inf.get_preds(dl=inf.test_dl(x))[0]
    torch.testing.assert_close(got, learn.get_preds(dl=learn.test_dl(x))[0])
    assert torch.equal(inf.predict(x[0])[0], dec)
