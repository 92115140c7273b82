"""`rank_memory`'s estimate, made in each process before its process group starts (a fake one, fake
tensors), held against what the run's ranks hold (tests/distributed/memory_script.py): 4 processes, one
launch, FSDP over 4, tensor parallel over 4, 2D (2x2)."""
from pathlib import Path
import pytest, torch
from conftest import run_script

SCRIPT = Path(__file__).parent/'memory_script.py'
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.distributed.is_available(),
                                                   reason='torch.distributed is not available')]
PARTS = ('params', 'grads', 'opt_state', 'activations')

@pytest.fixture(scope='module')
def per_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp('memory')
    res = run_script(SCRIPT, out, nproc=4, timeout=400)
    assert res.returncode == 0, f'exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-5000:]}'
    return [torch.load(out/f'memory{r}.pt') for r in range(4)]

@pytest.mark.parametrize('layout', ['fsdp', 'tp', '2d'])
def test_the_estimate_is_within_20_percent_of_what_each_rank_holds(per_rank, layout):
    for r,both in enumerate(per_rank):
        est,got = both[layout]['estimate'],both[layout]['measured']
        for part in PARTS: assert abs(est[part] - got[part]) <= 0.2 * got[part], (r, layout, part, est, got)
        assert est['total'] == sum(est[p] for p in PARTS)

def test_the_layouts_cut_what_they_should(per_rank):
    "FSDP cuts the weights, not the activations; tensor parallel cuts both; 2D in between"
    from llama_port import Transformer
    whole = sum(p.numel() * 4 for p in Transformer().parameters())
    got = {k: v['measured'] for k,v in per_rank[0].items()}
    assert got['fsdp']['params'] == pytest.approx(whole / 4, rel=0.05)
    assert got['tp']['activations'] < got['2d']['activations'] < got['fsdp']['activations']
