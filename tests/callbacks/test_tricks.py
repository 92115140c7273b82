"""Training tricks across a checkpoint: a run with MixUp, CutMix, EMA or SWA stopped in the middle of an epoch
and resumed equals one never stopped"""
import re
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
from learncb.test_utils import synth_learner
from conftest import CrashAt

def image_learner(path):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 2, 6, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True),
                      DataLoader(TensorDataset(x[:32], y[:32]), batch_size=16))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    return synth_learner(dls=dls, model=model, path=path, lr=1e-2)

def weights_and_extra(learn, trick):
    out = {k: v.clone() for k, v in learn.model.state_dict().items()}
    if isinstance(trick, EMACallback):
        out.update({f'ema.{k}': v.clone() for k, v in trick.average.state_dict().items()})
    if isinstance(trick, SWACallback):
        out.update({f'swa.{k}': v.clone() for k, v in trick.average.state_dict().items()})
    return out

@pytest.mark.parametrize('make', [lambda: MixUp(0.4), lambda: CutMix(1.), lambda: EMACallback(0.9),
                                  lambda: SWACallback(start_epoch=1, swa_lr=0.005)], ids=['mixup', 'cutmix',
    'ema', 'swa'])
def test_a_resumed_run_with_a_trick_equals_an_uninterrupted_one(tmp_path, make):
    whole = image_learner(tmp_path/'whole')
    trick = make()
    whole.fit(3, cbs=[trick, CheckpointCallback(every_n_steps=2)])
    reference = weights_and_extra(whole, trick)

    cut = image_learner(tmp_path/'cut')
    with pytest.raises(RuntimeError, match='boom'):
        # in the middle of epoch 2
        cut.fit(3, cbs=[make(), CheckpointCallback(every_n_steps=2), CrashAt(9, 'boom')])
    resumed = image_learner(tmp_path/'cut')
    trick = make()
    resumed.fit(3, cbs=[trick, CheckpointCallback(every_n_steps=2)], resume=True)
    got = weights_and_extra(resumed, trick)
    assert got.keys() == reference.keys()
    for k in reference: assert torch.equal(got[k], reference[k]), k
    assert resumed.recorder.values == whole.recorder.values

def test_the_ema_is_in_the_checkpoint(tmp_path):
    learn = image_learner(tmp_path)
    ema = EMACallback(0.9, replace_at_end=False)
    learn.fit(1, cbs=[ema, CheckpointCallback()])
    state = load_torch_file(checkpoints_in(tmp_path/'checkpoints')[-1])
    saved = state['cbs']['ema']['ema']
    assert int(saved['n_averaged']) == ema.n_averaged == 6
    for k, v in ema.average.state_dict().items(): assert torch.equal(saved[k], v), k

@pytest.mark.slow
def test_ema_under_ddp_equals_one_process(tmp_path):
    from test_distributed import run, result
    run(tmp_path/'one', '--bs', '16', '--ema', nproc=1)
    run(tmp_path/'two', '--bs', '8', '--ema')
    one, two = result(tmp_path/'one'), result(tmp_path/'two')
    for k in one['model']: torch.testing.assert_close(two['model'][k], one['model'][k], atol=1e-6, rtol=1e-5)
    # and the model holds the average, not the last weights: a run without EMA ends elsewhere
    run(tmp_path/'plain', '--bs', '16', nproc=1)
    plain = result(tmp_path/'plain')
    assert any(not torch.allclose(plain['model'][k], one['model'][k]) for k in one['model'])

@pytest.mark.slow
def test_optuna_pruning_stops_every_rank_at_the_same_epoch(tmp_path):
    pytest.importorskip('optuna')
    from test_distributed import run
    res = run(tmp_path, '--bs', '8', '--prune-at', '1', '--epochs', '4')
    said = re.findall(r'PRUNED RANK (\d) AT EPOCH (\d+)', res.stdout)     # the ranks' lines may run together
    assert sorted(said) == [('0', '1'), ('1', '1')], res.stdout[-2000:]
