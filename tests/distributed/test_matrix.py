"""The capability x strategy matrix: every built-in callback that acts on the step, in one process and under
DDP, FSDP, a strategy registered with no override ('plain') and torchft (two processes or replica groups,
gloo; 'torchft_fsdp': two replica groups of two ranks, FSDP within each), and `ModelParallel` on 4 processes
('tp': a mesh of tp 4; 'fsdp_tp': dp 2 x tp 2), and one DiLoCo group syncing after each inner step
with an outer SGD of lr 1 ('diloco': DiLoCo's definition, which is then the plain loop), each
fit held against the same fit in one process, or
refused by name before its first batch. One launch per strategy runs every capability in
turn (matrix_script.py)."""
from pathlib import Path
import pytest, torch
from conftest import run_forked

SCRIPT = Path(__file__).parent/'matrix_script.py'
WAIT = 900
pytestmark = pytest.mark.xdist_group('matrix')  # the one-process fits, made once, are read by every strategy

# The cells a strategy refuses today, and who is named: a cell refused or run that is not in this table fails
# the test. None is refused
refused = {'ddp': {}, 'plain': {}, 'torchft': {}, 'fsdp': {}, 'torchft_fsdp': {}, 'tp': {}, 'fsdp_tp': {},
           'diloco': {}}
named = {'torchft_fsdp': 'torchft', 'tp': 'model_parallel',   # the name a refusal gives the strategy
         'fsdp_tp': 'model_parallel', 'diloco': 'torchft'}
tolerance = {'precision': 1e-2}       # bf16: equal to its rounding; every other cell to float32's (1e-5)

def matrix(out, strategy):
    "Every capability's fit under `strategy`, as rank (or replica) 0 saw it"
    res = run_forked(SCRIPT, out, '--strategy', strategy, timeout=WAIT)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out/f'{strategy}0.pt', weights_only=False)

@pytest.fixture(scope='module')
def one(tmp_path_factory):
    "The fits in one process, in the order `distrib_ctx(global_batch=64)` gives"
    return matrix(tmp_path_factory.mktemp('one'), 'one')

@pytest.mark.slow
def test_in_one_process_every_capability_runs_and_accumulation_steps_every_128_items(one):
    assert all(r['refused'] is None and r['train_iter'] == 16 for c,r in one.items() if c != 'spike_guard')
    guarded = one['spike_guard']             # both scripted spikes rolled back, and their batches skipped
    assert guarded['skipped'] == ((0, 3), (1, 2)) and guarded['train_iter'] == 14
    found = one['spike_rows']                # the poisoned rows found and left out: no batch skipped
    assert found['skipped_items'] == [37, 301] and found['skipped'] == () and found['train_iter'] == 16
    # 2 epochs of 512 items, 64 a batch
    assert one['none']['steps'] == 16 and one['accumulation']['steps'] == 8
    assert one['turns']['steps'] == 32 and one['closure']['steps'] == 16        # turns: 2 steps a batch

def max_rel(a, b):
    return max(((a[k] - w).abs().max() / w.abs().max()).item() for k,w in b.items())

@pytest.mark.slow
@pytest.mark.parametrize('strategy', ['ddp', 'fsdp', 'plain', 'torchft', 'torchft_fsdp', 'tp', 'fsdp_tp',
                                      'diloco'])
def test_every_capability_means_the_same_under_every_strategy(strategy, one, tmp_path):
    """Each cell: the one-process fit's optimizer steps and weights, or a refusal before the first batch
    naming who and why"""
    got = matrix(tmp_path, strategy)
    assert set(got) == set(one)
    for cap,r in got.items():
        if cap in refused[strategy]:
            assert r['refused'] is not None and r['train_iter'] == 0, cap
            who = f"{refused[strategy][cap]}: strategy='{named.get(strategy, strategy)}'"
            assert r['refused'].startswith(who), r['refused']
            continue
        assert r['refused'] is None, (cap, r['refused'])
        counts = lambda r: (r['steps'], r['train_iter'], r['skipped'], r['skipped_items'])
        assert counts(r) == counts(one[cap]), cap
        assert max_rel(r['weights'], one[cap]['weights']) <= tolerance.get(cap, 1e-5), cap
    if 'compiled_step' not in refused[strategy]: assert got['compiled_step']['graphs'] > 0    # it compiled
