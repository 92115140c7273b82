"""`SpikeGuard` finds the rows of a batch that spiked: shuffled data with a few poisoned rows trains to the
end, each row found once (at most one rollback a row), and the run equals the fit over the same shuffled
batches without those rows. A regression, a classifier, a loss given as a plain function, a poisoned row in
the fit's first batch, the compiled step, and DDP (the rows one rank finds, skipped by all)."""
import contextlib, io, random
from pathlib import Path
import pytest, torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset
from learncb.all import *
from guard_script import regression_learner
from learncb.test_utils import padded_tokens

N, BS = 480, 16

class Without:
    "The batches `batch_sampler` draws, without the rows `out`; `out` a dict: each row out from that epoch on"
    def __init__(self, batch_sampler, out): self.batch_sampler, self.out, self.epoch = batch_sampler, out, -1
    def __len__(self): return len(self.batch_sampler)
    def __iter__(self):
        self.epoch += 1
        out = self.out
        out = {r for r, e in out.items() if e <= self.epoch} if isinstance(out, dict) else set(out)
        for b in self.batch_sampler:
            if (b := [i for i in b if i not in out]): yield b

def shuffled(ds, seed, out=None):
    "A shuffled `DataLoader` of `ds` in batches of 16; `out`: the same batches without those rows (`Without`)"
    g = torch.Generator().manual_seed(seed)
    if out is None: return DataLoader(ds, batch_size=BS, shuffle=True, generator=g)
    batches = Without(BatchSampler(RandomSampler(ds, generator=g), BS, False), out)
    return DataLoader(ds, batch_sampler=batches, generator=g)

def regression_data(bad):
    "A regression of 480 rows whose rows `bad` have inputs 10,000 times too large"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    y = x @ torch.tensor([[1.], [-2.], [.5], [3.]]) + .1 * torch.randn(N, 1, generator=g)
    x[bad] *= 1e4
    return TensorDataset(x, y)

def classes_data(bad, poison=1e4):
    "Three classes of 480 rows whose rows `bad` have inputs 10,000 times too large (or `inf`)"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    x[bad] = x[bad] * poison
    return TensorDataset(x, y)

def classifier(dl):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(.1), nn.Linear(32, 3))
    learn = Learner(DataLoaders(dl), model, nn.CrossEntropyLoss(), lr=1e-2, device='cpu',
                    opt_func=torch.optim.Adam)
    learn.remove_cb(ProgressCallback)
    learn.logger = lambda row: None
    return learn

class FoundIn(Callback):
    "The epoch each row of `learn.skipped_items` was found in"
    order = Order.LAST
    def before_fit(self): self.found = {}
    def after_train(self):
        for r in self.learn.skipped_items: self.found.setdefault(r, self.epoch)

def guarded_fit(learn, epochs=3, **kwargs):
    "A fit with `SpikeGuard(max_rollbacks=10)`: the guard, the epoch each row was found in, what was told"
    guard, found, out = SpikeGuard(max_rollbacks=10, **kwargs), FoundIn(), io.StringIO()
    with contextlib.redirect_stdout(out): learn.fit(epochs, cbs=[guard, found])
    return guard, found.found, out.getvalue()

def max_diff(a, b):
    pairs = zip(a.model.state_dict().values(), b.model.state_dict().values())
    return max((p - q).abs().max().item() for p, q in pairs)

@pytest.mark.parametrize('seed', [0, 1, 2])
def test_a_shuffled_regression_finds_exactly_its_poisoned_rows_and_equals_the_fit_without_them(seed):
    bad = sorted(random.Random(seed).sample(range(N), 6))
    ds = regression_data(bad)
    learn = regression_learner(DataLoaders(shuffled(ds, seed)))
    guard, found, said = guarded_fit(learn)
    assert learn.skipped_items == bad and 1 <= guard.rollbacks <= 6, said
    assert learn.skipped_batches == () and 'stands out' not in said and 'made it spike' in said
    without = regression_learner(DataLoaders(shuffled(ds, seed, out=bad)))
    without.fit(3)
    assert max_diff(learn, without) <= 1e-6

def test_a_row_in_the_first_batch_of_the_fit_is_judged_against_its_batch_mates():
    "The fit's first batch has no batch before it: its rows are judged against each other; exact"
    order = DataLoader(range(N), batch_size=BS, shuffle=True, generator=torch.Generator().manual_seed(3))
    first = next(iter(order))
    bad = sorted([int(first[5]), 100, 200])
    ds = regression_data(bad)
    learn = regression_learner(DataLoaders(shuffled(ds, 3)))
    guard, found, said = guarded_fit(learn)
    assert learn.skipped_items == bad and found[int(first[5])] == 0
    assert f"rolled back over epoch 0 batch 0 (the fit's first" in said
    without = regression_learner(DataLoaders(shuffled(ds, 3, out=bad)))
    without.fit(3)
    assert max_diff(learn, without) <= 1e-6

@pytest.mark.parametrize('seed', [0, 4])
def test_a_classifier_skips_only_poisoned_rows_each_from_where_it_was_found(seed):
    """Inputs 10,000 times too large: a row the model happens to classify right has no loss and no gradient
    then, so it is found when it first does harm; the run equals the fit without each row from the epoch it
    was found in"""
    bad = sorted(random.Random(seed).sample(range(N), 6))
    ds = classes_data(bad)
    learn = classifier(shuffled(ds, seed))
    guard, found, said = guarded_fit(learn)
    assert learn.skipped_items and set(learn.skipped_items) <= set(bad) and guard.rollbacks <= 6, said
    without = classifier(shuffled(ds, seed, out=found))
    without.fit(3)
    assert max_diff(learn, without) <= 1e-6

def test_a_classifier_with_rows_that_are_not_finite_equals_the_fit_without_them():
    bad = sorted(random.Random(5).sample(range(N), 6))
    ds = classes_data(bad, poison=float('inf'))
    learn = classifier(shuffled(ds, 5))
    guard, found, said = guarded_fit(learn)
    assert learn.skipped_items == bad and guard.rollbacks <= 6, said
    without = classifier(shuffled(ds, 5, out=bad))
    without.fit(3)
    assert max_diff(learn, without) <= 1e-6

def test_a_loss_given_as_a_plain_function_skips_its_bad_batches_and_says_why():
    "No loss per row: the rows of the batch that spiked cannot be told apart, so all of them leave, once"
    bad = sorted(random.Random(6).sample(range(N), 3))
    ds = regression_data(bad)
    learn = regression_learner(DataLoaders(shuffled(ds, 6)))
    learn.loss_func = lambda pred, y: ((pred - y) ** 2).mean()
    guard, found, said = guarded_fit(learn)
    assert set(bad) <= set(learn.skipped_items) and len(learn.skipped_items) <= 3 * BS
    assert guard.rollbacks <= 3
    told = [l for l in said.splitlines() if 'rolled back' in l]
    why = 'its rows cannot be told apart (loss_func takes no reduction argument'
    assert len(told) == guard.rollbacks and all(why in l for l in told), said
    without = regression_learner(DataLoaders(shuffled(ds, 6, out=found)))
    without.loss_func = learn.loss_func
    without.fit(3)
    assert max_diff(learn, without) <= 1e-6

def test_a_checkpoint_keeps_the_rows_found_and_a_resumed_run_leaves_them_out(tmp_path):
    "Stopped after the rows were found, resumed from its last checkpoint: the uninterrupted run"
    bad = sorted(random.Random(7).sample(range(N), 4))
    ds = regression_data(bad)
    class Stop(Callback):
        def after_epoch(self):
            if self.epoch == 1: raise SystemExit(1)
    def run(path, *extra, resume=None):
        learn = regression_learner(DataLoaders(shuffled(ds, 7)), path=path)
        with contextlib.redirect_stdout(io.StringIO()):
            cbs = [SpikeGuard(max_rollbacks=10), CheckpointCallback(every_n_steps=7), *extra]
            learn.fit(3, cbs=cbs, resume=resume)
        return learn
    whole = run(tmp_path/'whole')
    with pytest.raises(SystemExit): run(tmp_path/'run', Stop())
    resumed = run(tmp_path/'run', resume='auto')
    assert resumed.skipped_items == whole.skipped_items == bad and max_diff(resumed, whole) == 0

@pytest.mark.slow
def test_the_compiled_step_finds_the_rows_and_stays_compiled():
    bad = sorted(random.Random(8).sample(range(N), 4))
    ds = regression_data(bad)
    def fit(out=None, guard=False):
        learn = regression_learner(DataLoaders(shuffled(ds, 8, out)))
        learn.compile(step=True, fallback=False)
        if guard: guarded_fit(learn)
        else: learn.fit(3)
        return learn
    guarded = fit(guard=True)
    assert guarded.skipped_items == bad and guarded.compiler.fell_back is None
    assert max_diff(guarded, fit(out=bad)) <= 1e-6

@pytest.mark.slow
@pytest.mark.parametrize('strategy', ['ddp', 'fsdp'])
def test_the_rows_one_rank_finds_are_skipped_by_every_rank(tmp_path, strategy):
    """Four rows with targets 1e4 times too large, shuffled over two ranks: each found by the rank that had
    it, and the fit the one-process fit of the same global batches"""
    from conftest import run_script
    rows = [3, 77, 150, 290]
    args = ('--guard', '--strategy', strategy, '--rows', ','.join(map(str, rows)), '--global-batch', '16',
            '--dropout', '0')                  # no dropout: one process draws other masks than two
    script = Path(__file__).parent/'guard_script.py'
    for n in (1, 2):
        res = run_script(script, tmp_path/str(n), *args, nproc=n, timeout=300)
        assert res.returncode == 0, res.stderr[-4000:]
    one, two = (torch.load(tmp_path/n/'result.pt', weights_only=False) for n in '12')
    assert two['items'] == [rows, rows] and one['items'] == [rows]
    assert two['skipped'] == one['skipped'] and two['train_iter'] == one['train_iter']
    rel = max(((two['model'][k] - w).abs().max() / w.abs().max()).item() for k, w in one['model'].items())
    assert rel <= 1e-5, rel            # each rank's mean weighed by its rows: the one-process batch's mean

def gpt2_learner(dl):
    """A GPT-2 computing its own loss, on dict rows; its embedding of token 23 is NaN (no other row uses that
    token)"""
    from lm_models import gpt2
    model = gpt2(tie=False)                     # tied, the NaN embedding would be every row's output weights
    with torch.no_grad(): model.transformer.wte.weight[23] = torch.nan
    learn = Learner(DataLoaders(dl), model, loss_func=None, lr=1e-2, device='cpu', opt_func=torch.optim.Adam)
    learn.remove_cb(ProgressCallback)
    learn.logger = lambda row: None
    return learn

def test_a_causal_lm_with_its_own_loss_skips_only_its_poisoned_rows():
    "The rows of a model's own loss told apart (each row's cross-entropy over its shifted labels): exact"
    from lm_models import hf_rows
    x, y = padded_tokens(160, vocab=23, lengths=(2, 24)).tensors
    bad = sorted(random.Random(7).sample(range(160), 3))
    x[bad, 1] = 23                               # a token whose embedding is NaN: those rows' losses are NaN
    rows = hf_rows(x, y)
    learn = gpt2_learner(shuffled(rows, 7))
    guard, found, said = guarded_fit(learn, epochs=2)
    assert learn.skipped_items == bad and guard.rollbacks <= 3, said
    assert 'cannot be told apart' not in said and 'made it spike' in said
    without = gpt2_learner(shuffled(rows, 7, out=bad))
    without.fit(2)
    ours, theirs = (dict(l.model.named_parameters()) for l in (learn, without))     # NaN where both are
    assert all(torch.allclose(ours[k], theirs[k], rtol=0, atol=1e-6, equal_nan=True) for k in theirs)
