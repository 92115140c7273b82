"""The "Porting a training loop" page: its three ports, taken from the page, end with the hand-written loops'
weights (`torch.equal`); the nanoGPT port killed with SIGKILL in the middle of a gradient accumulation and
resumed with `resume=True` ends with them too."""
import subprocess, sys
from pathlib import Path
import pytest, torch
from fastcore.nbio import read_nb
from conftest import child_pythonpath

ROOT = Path(__file__).resolve().parents[1]
MARKS = ('# nanoGPT:', '# classifier:', '# language model:')

def page_module(folder):
    """The page's imports and the cells that define its models, loops and learners, as the module
    `porting_page`"""
    cells = [c.source for c in read_nb(ROOT/'nbs'/'35_porting.ipynb').cells if c.cell_type == 'code']
    code = [s for s in cells if s.startswith('import math') or s.startswith(MARKS)]
    (folder/'porting_page.py').write_text('\n\n'.join(code) + '\n')

@pytest.fixture
def page(tmp_path, monkeypatch):
    page_module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib, porting_page
    return importlib.reload(porting_page)

def equal_weights(a, b): return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))

@pytest.mark.slow
def test_the_three_ports_end_with_the_hand_written_loops_weights(page):
    ref, estimates = page.nanogpt_by_hand()
    learn = page.nanogpt_learner()
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert equal_weights(ref, learn.model)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(learn.estimate_loss.estimates, estimates) for k in b)
    ref, _ = page.classifier_by_hand()
    learn = page.classifier_learner()
    with learn.no_bar(), learn.no_logging(): learn.fit(page.epochs)
    assert equal_weights(ref, learn.model)
    ref, _, lr = page.lm_by_hand()
    learn = page.lm_learner()
    with learn.no_bar(), learn.no_logging(): learn.fit(page.lm_epochs)
    assert equal_weights(ref, learn.model) and learn.opt.param_groups[0]['lr'] == lr < page.lm_lr

SCRIPT = '''
import os, signal, sys
from pathlib import Path
import torch
from porting_page import *
out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
class KillAt(Callback):
    "SIGKILL after training batch `k`: no handler runs, nothing is flushed"
    order = 99
    def __init__(self, k): self.k = k
    def after_batch(self):
        if self.training and self.train_iter == self.k: os.kill(os.getpid(), signal.SIGKILL)
if kill_at < 0:                         # the hand-written loop, in a process like the others (same kernels)
    model, estimates = nanogpt_by_hand()
    torch.save({'model': model.state_dict(), 'estimates': estimates}, out/'reference.pt')
    sys.exit()
learn = nanogpt_learner(path=out)
with learn.no_bar(), learn.no_logging():
    if kill_at: learn.fit(1, cbs=[CheckpointCallback(every_n_steps=5), KillAt(kill_at)])
    else: learn.fit(1, resume=True)
torch.save({'model': learn.model.state_dict(), 'estimates': learn.estimate_loss.estimates,
            'iters': learn.train_iter},
           out/'final.pt')
'''

@pytest.mark.slow
def test_the_nanogpt_port_killed_mid_accumulation_resumes_to_the_same_weights(tmp_path):
    page_module(tmp_path)
    (tmp_path/'kill.py').write_text(SCRIPT)
    env = {'PYTHONPATH': child_pythonpath(tmp_path), 'PATH': '/usr/bin:/bin', 'OMP_NUM_THREADS': '1'}
    run = lambda *args: subprocess.run([sys.executable, str(tmp_path/'kill.py'), str(tmp_path), *args],
                                       capture_output=True, text=True, timeout=600, env=env)
    killed = run('37')  # batch 37: the first micro-batch of iteration 18 is done, the second is not
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (tmp_path/'final.pt').exists() and list((tmp_path/'checkpoints').glob('checkpoint_*'))
    resumed = run('0')
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert run('-1').returncode == 0
    got, ref = (torch.load(tmp_path/f, weights_only=True) for f in ('final.pt', 'reference.pt'))
    assert got['iters'] == 80
    for a, b in zip(got['estimates'], ref['estimates']): assert all(torch.equal(a[k], b[k]) for k in b)
    for k, v in ref['model'].items(): assert torch.equal(got['model'][k], v), k
