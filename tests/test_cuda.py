"""The CUDA paths: no host sync per batch, pinned gathering, fp16 with GradScaler, bf16, CUDA RNG
in checkpoints, and two DDP ranks on one GPU. Every test skips without a GPU."""
import pytest, torch
from functools import partial
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from fastcore.basics import noop
from learncb.all import *
from conftest import FailAfterEpoch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')

def cuda_learner(path='.', dropout=0., pin=True, **kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g); y = (x[:, 0] * x[:, 1] > 0).long()
    train = DataLoader(TensorDataset(x[:384], y[:384]), batch_size=32, shuffle=True, pin_memory=pin,
                       generator=torch.Generator().manual_seed(0))
    valid = DataLoader(TensorDataset(x[384:], y[384:]), batch_size=64, pin_memory=pin)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 2))
    learn = Learner(DataLoaders(train, valid), model, nn.CrossEntropyLoss(), device='cuda', path=path, **kw)
    learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, ProgressCallback)])
    learn.logger = noop
    return learn

def test_no_host_sync_in_any_batch():
    "torch.cuda.set_sync_debug_mode('error') from before_batch to after_batch: any sync in a batch raises"
    # torch's Adam syncs in its own step
    learn = cuda_learner(opt_func=torch.optim.SGD, lr=0.1, metrics=accuracy)
    on = Callback(before_batch=lambda self: torch.cuda.set_sync_debug_mode('error'), order=-1000)
    off = Callback(after_batch=lambda self: torch.cuda.set_sync_debug_mode('default'), order=1000)
    try: learn.fit(2, cbs=[on, off])
    finally: torch.cuda.set_sync_debug_mode('default')
    assert learn.train_iter == 24 and learn.recorder.values[-1][2] > 0.5

def test_get_preds_gathers_into_pinned_memory():
    """The outputs land in one preallocated pinned buffer (returned as is with an identity activation), then
    activated"""
    learn = cuda_learner()
    learn.fit(1)
    raw, targs = learn.get_preds(act=lambda x: x)
    assert raw.device.type == 'cpu' and raw.is_pinned() and raw.shape == (128, 2) and targs.is_pinned()
    preds, _ = learn.get_preds()
    with torch.no_grad(): want = learn.model(learn.dls.valid.dataset.tensors[0].cuda())
    torch.testing.assert_close(raw, want.cpu())
    torch.testing.assert_close(preds, want.softmax(-1).cpu())

@pytest.mark.parametrize('dtype', ['fp16', 'bf16'])
def test_mixed_precision(dtype):
    learn = cuda_learner(cbs=MixedPrecision(dtype), lr=1e-2)
    learn.fit(3)
    mp = learn.mixed_precision
    assert (mp.scaler is not None) == (dtype == 'fp16')            # a GradScaler for float16 only
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())
    vals = learn.recorder.values
    assert vals[-1][1] < vals[0][1]

def test_checkpoint_keeps_the_cuda_rng_and_resumes_exactly(tmp_path):
    def run(path, cbs=(), resume=None):
        learn = cuda_learner(path, dropout=0.3, opt_func=torch.optim.SGD, lr=0.1)
        learn.fit(3, cbs=[CheckpointCallback(every_n_steps=5), *cbs], resume=resume)
        return learn
    ref = run(tmp_path/'ref')
    with pytest.raises(RuntimeError): run(tmp_path/'run', cbs=[FailAfterEpoch()])
    state = load_torch_file(checkpoints_in(tmp_path/'run'/'checkpoints')[-1])
    assert 'cuda' in state['rng']
    resumed = run(tmp_path/'run', resume=True)
    for a, b in zip(ref.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)
    assert ref.recorder.losses == resumed.recorder.losses

def test_two_ranks_on_one_gpu(tmp_path):
    """DDP with CUDA tensors: 2 ranks share the GPU (gloo, since NCCL needs a GPU per rank) and train as one
    process"""
    from test_distributed import run, result
    run(tmp_path/'one', '--bs', '16', '--device', 'cuda', nproc=1)
    run(tmp_path/'two', '--bs', '8', '--device', 'cuda')
    one, two = result(tmp_path/'one'), result(tmp_path/'two')
    for k in one['model']:
        torch.testing.assert_close(two['model'][k].cpu(), one['model'][k].cpu(), atol=1e-5, rtol=1e-4)
    for a, b in zip(one['values'], two['values']): assert all(abs(x - y) < 1e-5 for x, y in zip(a, b)), (a, b)

@pytest.mark.parametrize('opt_func', [torch.optim.Adam, fast_adam, partial(torch.optim.SGD, momentum=0.9)],
                         ids=['Adam', 'fused Adam', 'SGD with momentum'])
def test_compiled_step_as_cuda_graphs(opt_func):
    """`learn.compile(step=True, mode='reduce-overhead')`: the step replayed as CUDA graphs (Adam's
    hyper-parameters as device tensors), with SpikeGuard: no fallback, the eager fit's weights, the Recorder's
    losses its own copies"""
    def fit(**compile):
        learn = cuda_learner(opt_func=opt_func, lr=1e-2, cbs=SpikeGuard())
        if compile: learn.compile(step=True, fallback=False, **compile)
        learn.fit(3)
        return learn
    eager, graphs = fit(), fit(mode='reduce-overhead')
    assert graphs.compiler.fell_back is None and graphs.compiler.compiled_step.cuda_graphs
    for a, b in zip(eager.model.state_dict().values(), graphs.model.state_dict().values()):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max(), (a - b).abs().max()
    losses = graphs.recorder.losses
    # each batch's own loss, not the last replay's
    assert len(losses) == 36 and len(set(map(float, losses))) > 30
    for a, b in zip(eager.recorder.values, graphs.recorder.values): assert abs(a[0] - b[0]) < 1e-3, (a, b)

@pytest.mark.parametrize('name', ['compile()', 'compile(step=True)', 'AutoMicrobatch', 'SpikeGuard',
                                  'MixedPrecision', 'CheckpointCallback'])
def test_nothing_callable_is_set_on_the_learner_or_the_model_on_a_gpu(name, tmp_path):
    """As tests/test_step.py checks on the CPU: at the third batch the learner's and the model's instances
    hold no function"""
    import warnings
    from test_step import capabilities, AtThirdBatch
    learn = cuda_learner(path=tmp_path)
    capabilities[name](learn)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(1, cbs=(spy := AtThirdBatch()))
    assert spy.seen[:2] == ([], []), spy.seen
