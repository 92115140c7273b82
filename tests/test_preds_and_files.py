"get_preds into preallocated memory, validate, FetchPredsCallback, save/load safety, the demo, the public API"
import copy, os, subprocess, sys
from pathlib import Path
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import learncb.all
from learncb.all import *
from conftest import synth_learner, synth_dls

def test_get_preds_writes_into_preallocated_memory(monkeypatch):
    learn = synth_learner(dls=synth_dls(n_valid=100, bs=16))   # 7 batches, the last one short
    learn.fit(1)
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, 'cat', lambda *a, **k: cats.append(1) or real_cat(*a, **k))
    inp, preds, targs, losses = learn.get_preds(with_input=True, with_loss=True)
    assert cats == [] and preds.shape == (100, 2) and inp.shape == (100, 2) and losses.shape == (100,)
    x, y = learn.dls.valid.dataset.tensors
    assert torch.equal(targs, y) and torch.equal(inp, x)
    with torch.no_grad(): expected = learn.model(x)
    assert torch.allclose(preds, torch.softmax(expected, 1), atol=1e-6)
    assert torch.allclose(losses, nn.functional.cross_entropy(expected, y, reduction='none'), atol=1e-6)

def test_get_preds_unknown_length_falls_back_to_concatenation():
    learn = synth_learner()
    batches = list(learn.dls.valid)                                # a plain list: no sampler, length unknown
    preds, targs = learn.get_preds(dl=batches, act=lambda x: x)
    assert preds.shape == (32, 2) and torch.equal(targs, torch.cat([b[1] for b in batches]))

def test_get_preds_reorders_shuffled_and_keeps_history():
    learn = synth_learner(metrics=accuracy)
    learn.fit(2)
    values, losses = [list(v) for v in learn.recorder.values], list(learn.recorder.losses)
    shuffled = DataLoader(learn.dls.train.dataset, batch_size=16, shuffle=True, drop_last=True)
    _, targs, dec = learn.get_preds(dl=shuffled, with_decoded=True)
    assert torch.equal(targs, learn.dls.train.dataset.tensors[1]) and dec.shape == (64,)
    _, targs = learn.get_preds(dl=shuffled, reorder=False)
    assert targs.shape == (64,) and not torch.equal(targs, learn.dls.train.dataset.tensors[1])
    assert learn.recorder.values == values and learn.recorder.losses == losses
    assert learn.loss_func.reduction == 'mean' and not any(isinstance(c, GatherPredsCallback) for c
                                                           in learn.cbs)

def test_get_preds_saves_batches(tmp_path):
    learn = synth_learner()
    learn.get_preds(save_preds=tmp_path/'p', save_targs=tmp_path/'t')
    assert sorted(os.listdir(tmp_path/'p')) == ['0.pth', '1.pth']
    assert torch.load(tmp_path/'t'/'1.pth', weights_only=True)[0].shape == (16,)

def test_validate_and_fetch_preds_inside_a_fit():
    fetch = FetchPredsCallback(ds_idx=0, with_input=True)
    learn = synth_learner(metrics=accuracy, cbs=fetch)
    learn.fit(2)
    loss, acc = learn.validate()
    assert (loss == pytest.approx(learn.recorder.values[-1][1])
            and acc == pytest.approx(learn.recorder.values[-1][2]))
    inp, preds, targs = fetch.preds
    assert torch.equal(inp, learn.dls.train.dataset.tensors[0]) and learn.train_iter == 8
    assert learn.recorder.iters == [4, 8] and not learn.model.training

def test_validate_from_a_callback_mid_epoch_restores_the_loop():
    seen = []
    def check(self):
        if self.training and self.iter == 1:
            before = (self.iter, self.n_iter, self.dl, self.model.training)
            seen.append(self.learn.validate())
            assert (self.iter, self.n_iter, self.dl, self.model.training) == before and self.training
    learn = synth_learner()
    learn.fit(1, cbs=Callback(after_batch=check))
    assert len(seen) == 1 and learn.train_iter == 4 and len(learn.recorder.losses) == 4

def test_save_load_roundtrip_and_errors(tmp_path):
    learn = synth_learner(path=tmp_path)
    learn.fit(1)
    path = learn.save('model')
    state = {k: v.clone() for k, v in learn.model.state_dict().items()}
    opt_state = copy.deepcopy(learn.opt.state_dict())
    learn.fit(1)
    learn.load('model')
    assert all(torch.equal(state[k], v) for k, v in learn.model.state_dict().items())
    assert torch.equal(learn.opt.state_dict()['state'][0]['exp_avg'], opt_state['state'][0]['exp_avg'])
    with pytest.raises(FileNotFoundError, match='other.pth'): learn.load('other')
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match='model.pth: it is truncated, corrupt or not a torch file'):
        learn.load('model')
    other = Learner(synth_dls(), nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)), nn.CrossEntropyLoss(),
                    path=tmp_path, device='cpu')
    learn.save('model')
    with pytest.raises(ValueError, match=r"saved from a different model: missing keys \['0.weight'"):
        other.load('model')

def test_an_lbfgs_and_a_several_optimizers_state_load_back(tmp_path):
    "LBFGS's groups hold fewer keys than its defaults after a step; several optimizers' groups, each its own"
    from functools import partial
    lbfgs = synth_learner(path=tmp_path, opt_func=partial(torch.optim.LBFGS, max_iter=2), lr=0.1)
    two = synth_learner(path=tmp_path, splitter=lambda m: {'a': [m.weight], 'b': [m.bias]},
                        opt_func={'a': torch.optim.Adam, 'b': partial(torch.optim.SGD, momentum=0.9)})
    for learn in (lbfgs, two):
        learn.fit(1)
        opt_state = copy.deepcopy(learn.opt.state_dict())
        learn.save('model')
        learn.fit(1)
        learn.load('model')
        assert str(learn.opt.state_dict()) == str(opt_state)

class Evil:
    def __reduce__(self): return (os.system, (f'touch {Path(os.environ["LEARNCB_PWNED"])}',))

def test_loading_a_malicious_file_refuses_and_runs_nothing(tmp_path, monkeypatch):
    flag = tmp_path/'pwned'
    monkeypatch.setenv('LEARNCB_PWNED', str(flag))
    (tmp_path/'models').mkdir()
    torch.save({'model': Evil()}, tmp_path/'models'/'evil.pth')
    learn = synth_learner(path=tmp_path)
    refused = 'refused to load .*evil.pth: it contains objects that would run code'
    with pytest.raises(ValueError, match=refused):
        learn.load('evil')
    assert not flag.exists()

@pytest.mark.slow
def test_demo_runs_and_reaches_target(tmp_path):
    res = subprocess.run([sys.executable, '-m', 'learncb.demo', '--plot', str(tmp_path/'loss.png')],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    acc = float(res.stdout.split('validation accuracy ')[1].split('%')[0])
    assert acc >= 95
    assert (tmp_path/'loss.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'

def test_public_api():
    names = set(learncb.all.__dict__)
    expected = '''Learner DataLoaders Callback event CancelBatchException CancelStepException
        CancelBackwardException CancelTrainException CancelValidException CancelEpochException
        CancelFitException CancelBatch CancelStep CancelBackward CancelTrain CancelValid CancelEpoch CancelFit
        TrainEvalCallback Recorder ProgressCallback GatherPredsCallback FetchPredsCallback accuracy error_rate
        defaults to_device find_bs atomic_save'''.split()
    assert set(expected) <= names, set(expected) - names
    for name in expected:
        obj = getattr(learncb.all, name)
        if callable(obj) and not isinstance(obj, str): assert obj.__doc__, f'{name} has no docstring'
