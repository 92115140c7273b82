"""`ModelParallel` on a 2x2 mesh (4 processes, torchrun, gloo): PyTorch's fsdp_tp example ported, held against
the example's own loop (tests/distributed/model_parallel_script.py)."""
from pathlib import Path
import pytest, torch
from conftest import run_script

SCRIPT = Path(__file__).parent/'model_parallel_script.py'
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.distributed.is_available(),
                                                   reason='torch.distributed is not available')]

def weights(out, way):
    res = run_script(SCRIPT, out, '--way', way, nproc=4, timeout=400)
    assert res.returncode == 0, f'{way}: exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-5000:]}'
    return [torch.load(out/f'{way}{r}.pt') for r in range(4)]

def test_the_fsdp_tp_example_ported_trains_as_its_own_loop_on_every_rank(tmp_path):
    "The example's plan on tp, FSDP2 on dp, each dp rank its own stream: its loop's weights, bit for bit"
    mine,theirs = weights(tmp_path, 'learncb'),weights(tmp_path, 'example')
    for r in range(4):
        assert set(mine[r]) == set(theirs[r])
        for k,v in theirs[r].items(): assert torch.equal(mine[r][k], v), (r, k)
    from llama_port import Transformer
    torch.manual_seed(0)
    start = Transformer().state_dict()
    assert any(not torch.equal(mine[0][k], start[k]) for k in start)          # it trained
