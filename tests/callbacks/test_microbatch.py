"""AutoMicrobatch against real out-of-memory errors: a capped address space, and one rank of two (DDP) running
out"""
import os, subprocess, sys
from pathlib import Path
import pytest, torch
from conftest import run_script

SCRIPT = Path(__file__).parent/'microbatch_script.py'
# every large allocation its own mapping, freed at once, and one malloc arena: what the process maps follows
# what it holds. Read when Python starts: a forked process has its parent's heap, whose free room a cap misses
MALLOC_ENV = {**os.environ, 'MALLOC_MMAP_THRESHOLD_': '65536', 'MALLOC_ARENA_MAX': '1'}

def run(out, *args, nproc=1, timeout=300):
    """The script in `nproc` processes (torchrun, gloo) or in one, never longer than `timeout`; its exit
    status and stderr. A capped run in new Pythons with `MALLOC_ENV` (the real torchrun), the others forked"""
    if '--cap' not in args: res = run_script(SCRIPT, out, *args, nproc=nproc, timeout=timeout)
    else:
        from learncb.ranks import free_port
        launcher = ([sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={nproc}',
                     f'--master-port={free_port()}'] if nproc > 1 else [sys.executable])
        res = subprocess.run([*launcher, str(SCRIPT), str(out), *args], capture_output=True, text=True,
                             timeout=timeout, env=MALLOC_ENV)
    return res.returncode, res.stderr

def result(out, rank=0): return torch.load(Path(out)/f'rank{rank}.pt', weights_only=False)

def max_diff(a, b): return max((a[k] - b[k]).abs().max().item() for k in a)

@pytest.mark.slow
def test_a_capped_address_space_fails_without_it_and_trains_to_the_same_weights_with_it(tmp_path):
    rc, err = run(tmp_path/'ref')
    assert rc == 0, err[-3000:]
    rc, _ = run(tmp_path/'plain', '--cap')
    # the allocator failed
    assert rc == 3 and "can't allocate memory" in (tmp_path/'plain'/'error0.txt').read_text()
    rc, err = run(tmp_path/'auto', '--cap', '--auto')
    assert rc == 0, err[-3000:]
    ref, auto = result(tmp_path/'ref'), result(tmp_path/'auto')
    assert max_diff(ref['model'], auto['model']) < 1e-5 and auto['train_iter'] == ref['train_iter']
    # it split, validation too
    assert auto['history'] and auto['history'][0][2] < 512 and auto['valid_halvings']
    one, whole, cap = auto['rooms']  # MiB, measured: the cap lets a quarter of a batch through
    assert one < cap < whole
    flat = lambda rows: [v for row in rows for v in row]
    assert flat(auto['values']) == pytest.approx(flat(ref['values']), rel=1e-5)   # the whole batches' losses

@pytest.mark.slow
@pytest.mark.parametrize('out_of_memory', [('--inject', '100'), ('--cap',)], ids=['injected', 'capped'])
def test_two_processes_agree_on_the_split_when_one_rank_runs_out(tmp_path, out_of_memory):
    "Rank 1 alone runs out (an injected error, or its address space capped); rank 0 has the memory"
    rc, err = run(tmp_path/'ref', nproc=2)
    assert rc == 0, err[-3000:]
    if out_of_memory[0] == '--cap':  # without AutoMicrobatch the capped rank's allocator fails
        rc, _ = run(tmp_path/'plain', *out_of_memory, '--cap-rank', '1', nproc=2)
        assert rc != 0 and "can't allocate memory" in (tmp_path/'plain'/'error1.txt').read_text()
    rc, err = run(tmp_path/'auto', '--auto', *out_of_memory, '--inject-rank', '1', '--cap-rank', '1', nproc=2)
    assert rc == 0, err[-3000:]
    for rank in (0, 1):
        ref, auto = result(tmp_path/'ref', rank), result(tmp_path/'auto', rank)
        assert max_diff(ref['model'], auto['model']) < 1e-5 and auto['train_iter'] == ref['train_iter']
    r0, r1 = result(tmp_path/'auto', 0), result(tmp_path/'auto', 1)
    # rank 0 split as rank 1 needed
    assert r0['halvings'] == r1['halvings'] > 0 and r0['history'] == r1['history']

def max_rel(a, b): return max(((a[k] - b[k]).abs().max() / a[k].abs().max()).item() for k in a)

@pytest.mark.slow
def test_under_fsdp_a_rank_whose_memory_is_capped_splits_alone_and_takes_the_same_step(tmp_path):
    """FSDP (2 processes): rank 1's address space capped between one item and its batch. With the parameters
    whole for the step, a rank's split needs no collective: rank 1 splits, rank 0 does not, and the gradients
    are averaged after the last micro-batch"""
    fsdp = ('--strategy', 'fsdp')
    rc, err = run(tmp_path/'ref', *fsdp, nproc=2)
    assert rc == 0, err[-3000:]
    rc, _ = run(tmp_path/'plain', *fsdp, '--cap', '--cap-rank', '1', nproc=2)      # without it: rank 1 fails
    assert rc != 0 and "can't allocate memory" in (tmp_path/'plain'/'error1.txt').read_text()
    rc, err = run(tmp_path/'auto', *fsdp, '--auto', '--cap', '--cap-rank', '1', nproc=2)
    assert rc == 0, err[-3000:]
    for rank in (0, 1):
        ref, auto = result(tmp_path/'ref', rank), result(tmp_path/'auto', rank)
        assert max_rel(ref['model'], auto['model']) <= 1e-6 and auto['train_iter'] == ref['train_iter']
    r0, r1 = result(tmp_path/'auto', 0), result(tmp_path/'auto', 1)
    # rank 1 split, rank 0 ran whole batches
    assert r1['halvings'] > 0 and r1['history'] and not r0['history']
    one, whole, cap = r1['rooms']
    assert one < cap < whole

@pytest.mark.slow
@pytest.mark.parametrize('strategy', ['one', 'ddp', 'fsdp'])
def test_with_turns_each_turn_splits_alike_and_steps_its_own_optimizer(tmp_path, strategy):
    """Two optimizers in turn (the body's, the head's), rank 1's batches over 100 items out of memory
    (injected): each turn's forward and backward split, its own optimizer's gradients alone, the fit's weights
    those of the fit that did not split"""
    nproc, how = (1, ()) if strategy == 'one' else (2, ('--strategy', strategy))
    rc, err = run(tmp_path/'ref', '--turns', *how, nproc=nproc)
    assert rc == 0, err[-3000:]
    inject = ('--inject', '100', '--inject-rank', str(nproc - 1))
    rc, err = run(tmp_path/'auto', '--turns', '--auto', *inject, *how, nproc=nproc)
    assert rc == 0, err[-3000:]
    for rank in range(nproc):
        ref, auto = result(tmp_path/'ref', rank), result(tmp_path/'auto', rank)
        assert max_diff(ref['model'], auto['model']) < 1e-5 and auto['train_iter'] == ref['train_iter']
    assert result(tmp_path/'auto', nproc - 1)['history'][0][2] == 64         # the injected rank split
