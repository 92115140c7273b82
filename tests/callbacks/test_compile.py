"torch.compile, with the default backend (inductor) on the CPU"
import warnings
import pytest, torch
from torch import nn
from learncb.all import *
from conftest import synth_dls, synth_learner

def learner(path='.', compiled=False, **kw):
    torch.manual_seed(0)
    learn = synth_learner(model=nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2)), path=path, **kw)
    if compiled: learn.compile()
    return learn

@pytest.mark.slow
def test_compiled_fit_equals_eager_and_files_have_plain_keys(tmp_path):
    eager, compiled = learner(), learner(tmp_path, compiled=True)
    eager.fit(2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        compiled.fit(2, cbs=CheckpointCallback(every_n_steps=3))
    assert not [m for m in w if 'torch.compile failed' in str(m.message)]  # no fallback: it really compiled
    assert compiled.compiler.compiled.failed is None and type(compiled.model) is nn.Sequential
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for a, b in zip(eager.recorder.values, compiled.recorder.values):
        assert all(abs(x - y) < 1e-5 for x, y in zip(a, b))
    ckpt = checkpoints_in(tmp_path/'checkpoints')[-1]
    assert list(load_torch_file(ckpt)['model']) == ['0.weight', '0.bias', '2.weight', '2.bias']
    fresh = learner()  # never compiled: takes the checkpoint and the weights file
    fresh.load_checkpoint(ckpt)
    fresh.load(compiled.save('w'))
    for a, b in zip(fresh.model.parameters(), compiled.model.parameters()): assert torch.equal(a, b)
    fname = compiled.export('exported.pt')
    from learncb.inference.export import load_learner
    x = compiled.dls.valid.dataset.tensors[0]
    # the exported program picks its own kernels: equal to float rounding
    torch.testing.assert_close(load_learner(fname).get_preds(dl=compiled.test_dl(x))[0],
                               compiled.get_preds(dl=compiled.test_dl(x))[0], rtol=1e-5, atol=1e-6)

def test_a_compiler_failure_falls_back_with_the_reason():
    def broken(gm, inputs): raise RuntimeError('no kernels today')
    learn = learner()
    learn.compile(backend=broken)
    with pytest.warns(UserWarning, match='torch.compile failed .*no kernels today.* not compiled'):
        learn.fit(1)
    assert learn.recorder.values[0][1] is not None and learn.compiler.compiled.failed

def test_bad_compile_arguments_fall_back():
    learn = learner()
    learn.compile(mode='no-such-mode')
    with pytest.warns(UserWarning, match='torch.compile failed'): learn.fit(1)

def test_an_error_of_the_model_itself_is_not_hidden():
    class Bad(nn.Linear):
        def forward(self, x): return super().forward(x[:, :1])           # wrong shape for the weights
    torch.manual_seed(0)
    learn = synth_learner(model=Bad(2, 2))
    learn.compile(backend='aot_eager')
    with pytest.raises(RuntimeError, match='mat1 and mat2'): learn.fit(1)

def test_a_compiled_step_keeps_an_ema_of_the_weights():
    """EMACallback's after_step is deferred: it averages after each compiled step, and ends as the eager fit's
    average"""
    def fit(step):
        learn = learner(cbs=[EMACallback(0.9)], opt_func=torch.optim.Adam)
        if step: learn.compile(step=True, fallback=False)
        learn.fit_one_cycle(3, 1e-2)
        return learn
    eager, compiled = fit(False), fit(True)
    assert compiled.compiler.fell_back is None and compiled.ema._n == eager.ema._n > 0
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):  # the averages (replace_at_end)
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()

@pytest.mark.slow
@pytest.mark.parametrize('opt_func', [torch.optim.Adam, fast_adam], ids=['Adam', 'default'])
def test_twelve_compiled_learners_in_one_process_each_compile_their_whole_step(opt_func, caplog):
    """A notebook re-running a cell: torch's recompile limit (8 entries per code object) is never reached,
    nothing runs eagerly"""
    eager = learner(opt_func=opt_func)
    eager.fit(1)
    with caplog.at_level('WARNING', logger='torch._dynamo'), warnings.catch_warnings():
        warnings.simplefilter('error', UserWarning)  # a fallback to the eager step warns: here it is an error
        for i in range(12):
            learn = learner(opt_func=opt_func)
            learn.compile(step=True)
            learn.fit(1)
            assert learn.compiler.fell_back is None, (i, learn.compiler.fell_back)
            for a, b in zip(eager.model.parameters(), learn.model.parameters()):
                assert (a - b).abs().max() < 1e-5, i
    assert not [r for r in caplog.records if 'recompile_limit' in r.getMessage()]

def test_the_recompile_limit_makes_the_fit_fall_back_saying_so():
    """Where torch would run a part of the step eagerly without a word, the fit falls back to the eager step
    with a warning"""
    eager, learn = learner(dls=synth_dls(n_train=68)), learner(dls=synth_dls(n_train=68))
    eager.fit(2)
    learn.compile(step=True)          # the last batch, of 4 items, is a second graph: one more than the limit
    with torch._dynamo.config.patch(recompile_limit=1):
        with pytest.warns(UserWarning, match=r'recompile limit .*recompile_limit = 1.*runs the eager step'):
            learn.fit(2)
    assert ('recompile limit' in learn.compiler.fell_back
            and torch._dynamo.config.fail_on_recompile_limit_hit is False)
    for a, b in zip(eager.model.parameters(), learn.model.parameters()): assert (a - b).abs().max() < 1e-5
