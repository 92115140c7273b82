"""Ports under several processes (ports_script.py): the dcgan example's two optimizers in turn under DDP, bit
for bit its hand-written DDP loop, and under FSDP; time_sequence_prediction's LBFGS under DDP, as in one
process."""
from pathlib import Path
import pytest, torch
from conftest import run_forked

SCRIPT = Path(__file__).parent/'ports_script.py'

def fit(out, way):
    res = run_forked(SCRIPT, out, '--way', way, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out/f'{way}.pt', weights_only=False)

def max_rel(a, b):
    return max(((a[k] - w).abs().max() / w.abs().max()).item() for k,w in b.items() if w.is_floating_point())

@pytest.mark.slow
def test_the_dcgan_port_under_ddp_is_its_hand_written_ddp_loop_bit_for_bit_and_under_fsdp_close(tmp_path):
    """Each turn's gradients reduced over the ranks: D's after D's backward, G's after G's (the port calls
    gan.D, gan.G)"""
    hand = fit(tmp_path, 'gan_hand_ddp')
    ddp,fsdp = fit(tmp_path, 'gan_ddp'),fit(tmp_path, 'gan_fsdp')
    for net in 'GD':
        assert all(torch.equal(hand[net][k], v) for k,v in ddp[net].items()), net
        assert max_rel(fsdp[net], hand[net]) <= 1e-6, net

@pytest.mark.slow
def test_lbfgs_under_ddp_takes_the_steps_of_one_process(tmp_path):
    "The closure's loss is the run's batch's and its gradients are reduced: every rank's LBFGS iterates alike"
    assert max_rel(fit(tmp_path, 'lbfgs_ddp'), fit(tmp_path, 'lbfgs_one')) <= 1e-6
