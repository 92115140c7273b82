"""The distributed rows of issue 62's table: a padded language model's batch cut over ranks (DDP, FSDP), over
ranks and accumulation, over ranks and micro-batches (DDP, FSDP, torchft), over replica groups of one process
or of two ranks (torchft), each within 1e-6 of the whole batch in one process: every rank's mean weighed by
the tokens it counts, over the run's."""
from pathlib import Path
import pytest, torch
from conftest import run_forked

SCRIPT = Path(__file__).parent/'lm_script.py'
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('lm_items')]

def run(out, way):
    res = run_forked(SCRIPT, out, '--way', way, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out/f'{way}.pt', weights_only=True)

@pytest.fixture(scope='module')
def whole(tmp_path_factory): return run(tmp_path_factory.mktemp('one'), 'one')

def rel_dist(a, b): return max(((a[k] - w).abs().max() / w.abs().max()).item() for k,w in b.items())

ways = ['ddp', 'fsdp', 'ddp_accumulation', 'ddp_microbatch', 'fsdp_microbatch', 'torchft', 'torchft_ranks',
        'torchft_microbatch', 'torchft_fsdp_microbatch']

@pytest.mark.parametrize('way', ways)
def test_a_padded_batch_cut_over_processes_trains_as_the_whole_batch(way, whole, tmp_path):
    got = run(tmp_path, way)
    assert got['train_iter'] == (8 if way == 'ddp_accumulation' else 2)
    assert rel_dist(got['weights'], whole['weights']) < 1e-6, way
