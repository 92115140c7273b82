"""The two seams of the docs, run as users would: the `SQLiteStore` of the store page and the `AveragedGrads`
strategy of the distributed page (chosen by the name it registers), taken from the notebooks' own cells, each
in a run killed by SIGKILL and resumed with `resume='auto'` in a new process, equal to the run that was never
interrupted."""
import json
from pathlib import Path
import pytest, torch
from conftest import run_script

ROOT = Path(__file__).resolve().parents[2]

def docs_cell(notebook, start):
    "The code cell of `nbs/notebook` that starts with `start`: the class as the docs show it"
    cells = json.loads((ROOT/'nbs'/notebook).read_text())['cells']
    found = [''.join(c['source']) for c in cells if c['cell_type'] == 'code' and start
             in ''.join(c['source'])]
    assert len(found) == 1, (notebook, start, len(found))
    return found[0]

script_template = '''
import os, signal, sys, torch
import torch.distributed as dist
from pathlib import Path
from torch import nn
from learncb.all import *
from learncb.test_utils import synth_dls
out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
resume, use_store = sys.argv[3] == 'resume', sys.argv[4] == 'store'
torch.set_num_threads(1); out.mkdir(parents=True, exist_ok=True)
{docs}

class Kill(Callback):
    order = Order.CHECKPOINT + 1                    # after the checkpoint of this batch, if one was taken
    def after_batch(self):
        if self.training and self.train_iter == kill_at: os.kill(os.getpid(), signal.SIGKILL)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
bs = 8 if use_store else 4                          # two processes of 4: a global batch of 8
learn = Learner(synth_dls(n_train=64, n_valid=32, bs=bs, shuffle=True), model, nn.CrossEntropyLoss(), lr=1e-2,
                path=out, default_cbs=True)
learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, ProgressCallback)])
store = SQLiteStore(out/'run.db') if use_store else None
ckpt = CheckpointCallback(every_n_steps=3, store=store)
with learn.distrib_ctx(strategy='ddp' if use_store else 'averaged-grads', timeout=60):
    learn.fit(3, cbs=[ckpt, Kill()], resume='auto' if resume else None)
    if is_rank0():
        torch.save({{'weights': learn.model.state_dict(), 'values': learn.recorder.values}}, out/'result.pt')
'''

def script(tmp_path, docs):
    path = tmp_path/'run.py'
    path.write_text(script_template.format(docs=docs))
    return path

def launch(path, out, kill_at, resume, seam, nproc):
    return run_script(path, out, kill_at, 'resume' if resume else 'fresh', seam, nproc=nproc, timeout=240)

def killed_then_resumed_equals_whole(tmp_path, docs, seam, nproc):
    path = script(tmp_path, docs)
    whole, broken = tmp_path/'whole', tmp_path/'broken'
    res = launch(path, whole, -1, False, seam, nproc)
    assert res.returncode == 0, res.stderr[-4000:]
    res = launch(path, broken, 13, False, seam, nproc)                     # killed at training batch 13 of 24
    assert res.returncode != 0 and not (broken/'result.pt').exists(), res.stdout[-2000:]
    res = launch(path, broken, -1, True, seam, nproc)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resume='auto': resuming the run from" in res.stdout, res.stdout[-2000:]
    a, b = (torch.load(p/'result.pt', weights_only=False) for p in (whole, broken))
    for k, v in a['weights'].items(): assert torch.equal(v, b['weights'][k]), k
    assert a['values'] == b['values']
    return a, b

def test_the_store_of_the_docs_resumes_a_killed_run_exactly(tmp_path):
    docs = docs_cell('16d_store.ipynb', 'class SQLiteStore(CheckpointStore)')
    killed_then_resumed_equals_whole(tmp_path, docs, 'store', nproc=1)
    assert not list(
        (tmp_path/'broken').glob('checkpoints/*')), 'the checkpoints went to the store, not to files'

@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason='torch.distributed is not available')
def test_the_strategy_of_the_docs_resumes_a_killed_two_process_run_exactly(tmp_path):
    docs = 'import torch.distributed as dist\n' + docs_cell('23c_distributed.ipynb',
                                                            'class AveragedGrads(Strategy)')
    a, _ = killed_then_resumed_equals_whole(tmp_path, docs, 'strategy', nproc=2)
    assert len(a['values']) == 3
