"""In a real Jupyter kernel, with the progress bars on: a GPT-2 fit whose batch spikes on a few poisoned rows
skips only those rows, and SpikeGuard's line stays in the notebook's saved output (the bars' table does not
write over it)."""
from pathlib import Path
import pytest

nbformat = pytest.importorskip('nbformat')
nbclient = pytest.importorskip('nbclient')

FIT = """
import sys, random, torch
sys.path.insert(0, {tests!r})
from torch.utils.data import DataLoader
from learncb.all import *
from learncb.test_utils import padded_tokens
from lm_models import gpt2, hf_rows
x, y = padded_tokens(96, vocab=23, lengths=(2, 24)).tensors
bad = sorted(random.Random(7).sample(range(96), 2))
x[bad, 1] = 23                            # a token whose embedding is NaN: those rows' losses are NaN
model = gpt2(tie=False)
with torch.no_grad(): model.transformer.wte.weight[23] = torch.nan
dl = DataLoader(hf_rows(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(7))
learn = Learner(DataLoaders(dl, None), model, loss_func=None, lr=1e-2, opt_func=torch.optim.Adam)
learn.fit(2, cbs=SpikeGuard(max_rollbacks=10))
assert learn.skipped_items == bad, (learn.skipped_items, bad)
"""

@pytest.mark.slow
def test_a_spiking_gpt2_batch_skips_its_poisoned_rows_and_the_line_stays_in_the_saved_notebook(tmp_path):
    cell = nbformat.v4.new_code_cell(FIT.format(tests=str(Path(__file__).parent)))
    nb = nbformat.v4.new_notebook(cells=[cell])
    nbclient.NotebookClient(nb, timeout=300, kernel_name='python3').execute()
    nbformat.write(nb, tmp_path/'saved.ipynb')
    saved = nbformat.read(tmp_path/'saved.ipynb', as_version=4).cells[0].outputs
    said = ''.join(o.get('text', '') for o in saved if o.output_type == 'stream')
    html = ''.join(o.get('data', {}).get('text/html', '') for o in saved if 'data' in o)
    assert '<progress' in html or 'fastprogress' in html, 'no bars were drawn'
    assert 'SpikeGuard: rolled back over epoch' in said and 'made it spike and left the data' in said, said
    assert 'cannot be told apart' not in said
