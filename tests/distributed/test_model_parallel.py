"""`ModelParallel` on a 2x2 mesh (4 processes, torchrun, gloo): PyTorch's fsdp_tp example ported, held against
the example's own loop; a language-model fit of its model killed and resumed by itself; its checkpoint resumed
on a 1x2 mesh (tests/distributed/model_parallel_script.py); `rank_memory`'s estimate, made in each process
before its process group starts (a fake one, fake tensors), held against what the run's ranks hold for FSDP
over 4, tensor parallel over 4 and 2D (memory_script.py). One launch of each layout."""
from pathlib import Path
import pytest, torch
from conftest import run_forked, run_script, torchrun

SCRIPT = Path(__file__).parent/'model_parallel_script.py'
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.distributed.is_available(),
                                                   reason='torch.distributed is not available'),
              pytest.mark.xdist_group('model_parallel')]     # pytest -n: one worker makes the runs, once

def check(res, what):
    assert res.returncode == 0, f'{what}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}'
    return res

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "One launch on 2x2 (4 processes, one restart allowed: the killed fit's), then one on 1x2 (2 processes)"
    out = tmp_path_factory.mktemp('mp')
    res = check(run_forked(*torchrun(4, '--max-restarts=1'), SCRIPT, out, '--way', 'all', timeout=600), '2x2')
    ckpt = out/'whole'/'checkpoints'/'checkpoint_00000004_epoch_end'       # the end of epoch 1 (of 2)
    down = check(run_script(SCRIPT, out, '--way', 'down', '--ckpt', ckpt, nproc=2, timeout=300), '1x2')
    return out, res, down

def weights(out, name, ranks=range(4)): return [torch.load(out/f'{name}{r}.pt') for r in ranks]

def test_the_fsdp_tp_example_ported_trains_as_its_own_loop_on_every_rank(runs):
    "The example's plan on tp, FSDP2 on dp, each dp rank its own stream: its loop's weights, bit for bit"
    out,_,_ = runs
    mine,theirs = weights(out, 'learncb'),weights(out, 'example')
    for r in range(4):
        assert set(mine[r]) == set(theirs[r])
        for k,v in theirs[r].items(): assert torch.equal(mine[r][k], v), (r, k)
    from llama_port import Transformer
    torch.manual_seed(0)
    start = Transformer().state_dict()
    assert any(not torch.equal(mine[0][k], start[k]) for k in start)          # it trained

def test_killed_on_2x2_and_resumed_equals_the_uninterrupted_fit(runs):
    out,res,_ = runs
    assert (out/'killed.flag').exists() and "resume='auto': resuming the run from" in res.stdout
    for r,(got,ref) in enumerate(zip(weights(out, 'killed'), weights(out, 'whole'))):
        for k,v in ref.items(): assert torch.equal(got[k], v), (r, k)

def test_a_2x2_checkpoint_resumed_on_1x2_goes_on_as_on_2x2(runs):
    "Epoch 1's checkpoint of the 2x2 fit, resumed on 1x2 (one data-parallel rank of batches twice as big)"
    out,_,_ = runs
    ref = weights(out, 'whole', [0])[0]
    for got in weights(out, 'down', range(2)):
        for k,v in ref.items(): torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0)

def test_another_global_batch_on_another_mesh_is_refused(runs):
    "The global batch counts the data-parallel ranks (2 on 2x2, 1 on 1x2), not the processes (4, 2)"
    said = (runs[0]/'refused.txt').read_text()
    assert 'global batch of 8 (4 per data-parallel rank x 2 data-parallel ranks)' in said
    assert "this run's is 4 (4 x 1 data-parallel rank)" in said and 'a batch size of 8 per' in said

@pytest.mark.parametrize('way', ['hsdp', 'hsdp_tp'])
def test_hsdp_trains_as_the_2x2_mesh(runs, way):
    """dp_replicate 2 x dp 2 (batches of 2), or dp_replicate 2 x tp 2 (of 4): the global batch of the 2x2 fit,
    within float32's rounding (the gradients are summed in another order)"""
    out,_,_ = runs
    ref = weights(out, 'whole', [0])[0]
    for got in weights(out, way):
        for k,v in ref.items(): torch.testing.assert_close(got[k], v, atol=1e-5, rtol=1e-5)

# What each rank holds: estimated before launch, measured in the run
PARTS = ('params', 'grads', 'opt_state', 'activations')

def memory(runs): return [torch.load(runs[0]/f'memory{r}.pt') for r in range(4)]

@pytest.mark.parametrize('layout', ['fsdp', 'tp', '2d'])
def test_the_estimate_is_within_20_percent_of_what_each_rank_holds(runs, layout):
    per_rank = memory(runs)
    for r,both in enumerate(per_rank):
        est,got = both[layout]['estimate'],both[layout]['measured']
        for part in PARTS: assert abs(est[part] - got[part]) <= 0.2 * got[part], (r, layout, part, est, got)
        assert est['total'] == sum(est[p] for p in PARTS)

def test_the_layouts_cut_what_they_should(runs):
    "FSDP cuts the weights, not the activations; tensor parallel cuts both; 2D in between"
    per_rank = memory(runs)
    from llama_port import Transformer
    whole = sum(p.numel() * 4 for p in Transformer().parameters())
    got = {k: v['measured'] for k,v in per_rank[0].items()}
    assert got['fsdp']['params'] == pytest.approx(whole / 4, rel=0.05)
    assert got['tp']['activations'] < got['2d']['activations'] < got['fsdp']['activations']
