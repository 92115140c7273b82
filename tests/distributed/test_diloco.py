"""DiLoCo over replica groups (`TorchFT(sync='diloco')`, CPU, gloo, a lighthouse on loopback): one group that
syncs every step with an outer SGD of lr 1 is the plain fit; two groups are the DiLoCo loop written by hand in
plain torch (each group's inner AdamW on its half of every batch, the pseudo-gradients averaged every H steps,
Nesterov SGD on the global weights); `sync='local_sgd'` averages the weights."""
import copy, os
from functools import partial
from pathlib import Path
import pytest, torch
from torch import nn
torchft = pytest.importorskip('torchft')
from learncb.all import *
from learncb.files import load_torch_file
from learncb.distributed.replicas import Lighthouse, replica_env
from learncb.distributed.diloco import nesterov_outer, averaging_outer, model_fragments
from conftest import start_forked, start_torchrun_group, CrashAt
from diloco_script import N, BS, LR, EPOCHS, batches, make_model, make_learner

SCRIPT = Path(__file__).parent/'diloco_script.py'
WAIT = 240          # seconds any one wait may take, on a loaded 2-core machine

def hand_written(sync_every, n_groups=2, outer=nesterov_outer):
    """DiLoCo in plain torch: each group's copy of the model and its AdamW on its rows of every batch; every
    `sync_every` steps the mean of `global - local` as the global weights' gradient, the outer step, every
    group from the new global weights (`hand_written_with_a_fault` with every group at every step)"""
    steps = range(1, EPOCHS * N // BS + 1)
    return hand_written_with_a_fault({'steady' if g == 0 else g: [(t, g, n_groups, 0) for t in steps]
                                      for g in range(n_groups)}, sync_every, outer)

def max_rel(a, b): return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)

@pytest.fixture
def group_env(monkeypatch):
    "This process as replica group 0 of 1 under a lighthouse of its own"
    with Lighthouse() as lh:
        for k in ('WORLD_SIZE', 'RANK'): monkeypatch.delenv(k, raising=False)
        for k,v in {**replica_env(lh, 0, 1), 'RUST_LOG': 'warn'}.items(): monkeypatch.setenv(k, v)
        yield lh

def test_one_group_syncing_every_step_with_an_outer_sgd_of_lr_1_is_the_plain_fit(group_env):
    plain = make_learner()
    plain.fit(EPOCHS)
    learn = make_learner()
    ft = TorchFT(sync='diloco', sync_every=1, outer_opt=partial(torch.optim.SGD, lr=1.))
    with learn.distrib_ctx(strategy=ft): learn.fit(EPOCHS)
    assert learn.train_iter == plain.train_iter == 12 and ft.semi.inner_steps == 12      # a sync after each
    assert max_rel(learn.model.state_dict(), plain.model.state_dict()) <= 1e-6
    assert learn.recorder.losses == pytest.approx(plain.recorder.losses, rel=1e-6)
    assert not torch.equal(learn.model[0].weight, make_model()[0].weight)            # it trained
    assert ft.semi.rolled_back == 0

def fit_one_group(path, crash_at=None, resume=None, **streams):
    """One group's fit, H = 4, Nesterov outer (`streams`: streaming DiLoCo's settings), a checkpoint each
    step; `crash_at`: an error after that step"""
    learn,ft = make_learner(path),TorchFT(sync='diloco', sync_every=4, **streams)
    cbs = [CheckpointCallback(every_n_steps=1)] + ([CrashAt(crash_at)] if crash_at else [])
    with learn.distrib_ctx(strategy=ft): learn.fit(EPOCHS, cbs=cbs, resume=resume)
    return learn,ft

def test_a_fit_stopped_between_syncs_resumes_exactly(group_env, tmp_path):
    """A fit that fails after step 6: its checkpoint holds the inner weights and AdamW of step 6, the global
    weights of step 4 and the outer momentum; resumed, it ends as the fit never stopped, bit for bit"""
    ref,_ = fit_one_group(tmp_path/'ref')
    with pytest.raises(RuntimeError, match='the machine went away'): fit_one_group(tmp_path/'run', crash_at=6)
    got,ft = fit_one_group(tmp_path/'run', resume='auto')
    assert got.train_iter == ref.train_iter == 12 and ft.semi.inner_steps == 12
    assert all(torch.equal(a, b) for a,b in zip(got.model.state_dict().values(),
                                                ref.model.state_dict().values()))
    assert got.recorder.losses[-6:] == ref.recorder.losses[-6:]

def found(o, key):
    "Every value of `key` in the dicts and lists of `o`"
    if isinstance(o, dict):
        return ([o[key]] if key in o else []) + [v for x in o.values() for v in found(x, key)]
    return [v for x in o for v in found(x, key)] if isinstance(o, (list, tuple)) else []

def test_a_fit_stopped_while_an_exchange_runs_resumes_exactly(group_env, tmp_path):
    """Streaming DiLoCo (2 fragments, each exchange started a step before its sync): a fit that fails after
    step 5, whose exchange was to end at step 6; its checkpoint holds the exchange's sum, and resumed the fit
    ends as the one never stopped, bit for bit"""
    streams = dict(num_fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5)
    ref,_ = fit_one_group(tmp_path/'ref', **streams)
    with pytest.raises(RuntimeError, match='the machine went away'):
        fit_one_group(tmp_path/'run', crash_at=5, **streams)
    saved = load_torch_file(tmp_path/'run'/'checkpoints'/'checkpoint_00000005_batch.pt')
    assert [p['fragment'] for p in found(saved, 'pending')] == [0]        # the exchange running at step 5
    got,ft = fit_one_group(tmp_path/'run', resume='auto', **streams)
    assert got.train_iter == 12 and ft.semi.synced == 6 and ft.semi.rolled_back == 0
    assert all(torch.equal(a, b) for a,b in zip(got.model.state_dict().values(),
                                                ref.model.state_dict().values()))
    assert got.recorder.losses[-7:] == ref.recorder.losses[-7:]

@pytest.mark.parametrize('sync,sync_every', [('diloco', 4), ('local_sgd', 3)])
def test_two_groups_are_the_hand_written_loop(tmp_path, sync, sync_every):
    """Two groups of one process from the same start: each group's weights at the end (a sync) within 1e-6
    of the hand-written loop's global weights"""
    with Lighthouse(min_replicas=2, join_timeout=10, heartbeat_timeout=2) as lh:
        procs = [start_forked(SCRIPT, tmp_path, sync, sync_every, out=tmp_path/f'log{g}',
                              env={**os.environ, **replica_env(lh, g, 2), 'RUST_LOG': 'warn'})
                 for g in range(2)]
        try: codes = [p.wait(WAIT) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None: p.kill()
    assert codes == [0, 0], [(tmp_path/f'log{g}').read_text()[-3000:] for g in range(2)]
    ref = hand_written(sync_every, outer=nesterov_outer if sync == 'diloco' else averaging_outer)
    a, b = [torch.load(tmp_path/f'group{g}.pt', weights_only=False) for g in range(2)]
    assert a['train_iter'] == b['train_iter'] == 12
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in ref)     # every group: the global weights
    assert max_rel(a['model'], ref) <= 1e-6
    assert a['losses'] != b['losses']                # between syncs each group trains on its own half

def run_two_groups(tmp_path, *args):
    "Two groups of one process from the same start, `diloco_script.py` with `args`; their results"
    with Lighthouse(min_replicas=2, join_timeout=10, heartbeat_timeout=2) as lh:
        procs = [start_forked(SCRIPT, tmp_path, *args, out=tmp_path/f'log{g}',
                              env={**os.environ, **replica_env(lh, g, 2), 'RUST_LOG': 'warn'})
                 for g in range(2)]
        try: codes = [p.wait(WAIT) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None: p.kill()
    assert codes == [0, 0], [(tmp_path/f'log{g}').read_text()[-3000:] for g in range(2)]
    return [torch.load(tmp_path/f'group{g}.pt', weights_only=False) for g in range(2)]

FRAGMENTS = [[0], [1, 2, 3]]       # the test model's weights of 64, 16, 32, 2 cut in two of about 57

def test_streaming_two_groups_are_the_hand_written_streaming_loop(tmp_path):
    """Streaming DiLoCo, H = 4 in 2 fragments (one synced every 2 steps, in turn), each exchange started a
    step before its sync and running while the group takes that step, half the weights kept at a sync: each
    group's weights at the end within 1e-6 of its weights in the hand-written streaming loop"""
    params = list(make_model().parameters())
    assert model_fragments(params, 2) == [[params[j] for j in f] for f in FRAGMENTS]
    got = run_two_groups(tmp_path, 'diloco', 4, '--fragments', 2, '--delay', 1, '--alpha', 0.5)
    steps = {'steady' if g == 0 else g: [(t, g, 2, 0) for t in range(1, 13)] for g in range(2)}
    ref = hand_written_with_a_fault(steps, 4, fragments=FRAGMENTS, delay=1, alpha=0.5, per_group=True)
    for g,r in zip(got, ('steady', 1)): assert max_rel(g['model'], ref[r]) <= 1e-6
    assert not torch.equal(got[0]['model']['2.weight'], got[1]['model']['2.weight'])   # alpha of their own
    assert got[0]['train_iter'] == got[1]['train_iter'] == 12

def test_the_settings_are_checked():
    with pytest.raises(ValueError, match="sync must be .* not 'bogus'"): TorchFT(sync='bogus')
    with pytest.raises(ValueError, match='needs sync_every'): TorchFT(sync='diloco')
    with pytest.raises(ValueError, match='sync_every must be a positive int, not 0'):
        TorchFT(sync='diloco', sync_every=0)
    with pytest.raises(ValueError, match="pass sync='diloco'"): TorchFT(sync_every=8)
    with pytest.raises(ValueError, match='averages the weights themselves'):
        TorchFT(sync='local_sgd', sync_every=2, outer_opt=nesterov_outer)
    ft = TorchFT(sync='diloco', sync_every=8)
    assert ft.semi.outer_opt is nesterov_outer and ft.reduces is None and 'sync_every=8' in repr(ft)
    assert TorchFT().reduces == 'step'
    assert TorchFT(sync='local_sgd', sync_every=2).semi.outer_opt is averaging_outer
    with pytest.raises(ValueError, match='sync_every=6 is not a multiple of num_fragments=4'):
        TorchFT(sync='diloco', sync_every=6, num_fragments=4)
    with pytest.raises(ValueError, match='fragment_sync_delay=2 .* below 2'):
        TorchFT(sync='diloco', sync_every=4, num_fragments=2, fragment_sync_delay=2)
    with pytest.raises(ValueError, match='fragment_update_alpha=1.5'):
        TorchFT(sync='diloco', sync_every=4, fragment_update_alpha=1.5)
    with pytest.raises(ValueError, match="num_fragments=2 are for groups that sync every few steps"):
        TorchFT(num_fragments=2)
    with pytest.raises(ValueError, match='num_fragments=5 cuts .* 4 trainable parameters'):
        model_fragments(make_model().parameters(), 5)
    assert 'num_fragments=2, fragment_sync_delay=1' in repr(TorchFT(sync='diloco', sync_every=4,
                                                                    num_fragments=2, fragment_sync_delay=1))

def hand_written_with_a_fault(steps, sync_every, outer=nesterov_outer, fragments=None, delay=0, alpha=0.,
                              per_group=False):
    """DiLoCo in plain torch over the steps each group took (`steps`: a group's role to its
    `(train_iter, rank, groups, rolled_back)` at each step): a group trains at the steps it took, on the
    rows of its rank among that step's groups; one that joins late starts as a copy of a group that took the
    step before (its weights, which are then the global ones, and its AdamW); a sync that the steady group
    rolled back puts every group back to the global weights, and a sync kept is the outer step on the mean
    over the groups that took that step. Streaming (`fragments`: lists of the parameters' indices): every
    `sync_every / len(fragments)` steps the next fragment in turn syncs, its mean pseudo-gradient taken
    `delay` steps before, and each group's weights of it become `alpha` of themselves and the rest the new
    global ones. The global weights, or with `per_group` each group's weights at the end"""
    x, y = batches()
    glob = make_model()
    gparams = list(glob.parameters())
    outer_opt = outer(gparams)
    fragments = fragments or [list(range(len(gparams)))]
    period, synced, sent = sync_every // len(fragments), 0, None
    at = {role: {t: (rank, n, rolled) for t,rank,n,rolled in s} for role,s in steps.items()}
    models, inner = {}, {}
    for t in range(1, max(at['steady']) + 1):
        i = (t - 1) % (N // BS) * BS
        xb, yb = x[i:i + BS], y[i:i + BS]
        took = [role for role in at if t in at[role]]
        for role in took:
            if role in models: continue
            source = next((r for r in models if t - 1 in at[r]), None)      # None: the start
            models[role] = copy.deepcopy(glob if source is None else models[source])
            inner[role] = torch.optim.AdamW(models[role].parameters(), lr=LR)
            if source: inner[role].load_state_dict(copy.deepcopy(inner[source].state_dict()))
        for role in took:
            rank, n, _ = at[role][t]
            assert n >= len(took), (t, role, at[role][t], took)       # fewer: a group died in the period
            lo, hi = rank * len(xb) // n, (rank + 1) * len(xb) // n
            nn.functional.cross_entropy(models[role](xb[lo:hi]), yb[lo:hi]).backward()
            inner[role].step(); inner[role].zero_grad()
        local = lambda role, j: list(models[role].parameters())[j]
        if t % period == (period - delay) % period:              # the exchange of the next fragment starts
            f = synced % len(fragments)
            sent = f, {j: sum(gparams[j].detach() - local(r, j).detach() for r in took) / len(took)
                       for j in fragments[f]}
        if t % period: continue
        f, mean = sent
        rolled = at['steady'][t][2] > at['steady'].get(t - 1, (0, 0, 0))[2]
        if not rolled:
            for j,d in mean.items(): gparams[j].grad = d
            outer_opt.step(); outer_opt.zero_grad(set_to_none=True)
            synced += 1
        with torch.no_grad():
            for role in took:
                for j in fragments[f]:
                    w = local(role, j)
                    w.copy_(gparams[j] if rolled or not alpha else alpha * w + (1 - alpha) * gparams[j])
    return {r: m.state_dict() for r,m in models.items()} if per_group else glob.state_dict()

def test_a_group_lost_between_syncs_is_rolled_back_and_healed_and_the_run_is_its_definition(tmp_path):
    """Two groups, H = 4, a new quorum asked at every sync (it forms at the start of the next period), a
    lighthouse that waits for two: group 1 SIGKILLs itself after step 2, in the middle of the first period;
    group 0's sync at step 4 fails (its peer is gone) and is rolled back; group 1 started again heals at the
    quorum of step 5 from group 0's state (the global weights, the outer optimizer's state, its AdamW, the
    loop's position), and both train to the end. Each group's weights at the end: the global weights of the
    hand-written loop over the steps each group took, within 1e-6"""
    with Lighthouse(min_replicas=2, join_timeout=10, heartbeat_timeout=2) as lh:
        start = lambda g, role: start_forked(SCRIPT, tmp_path, 'diloco', 4, role, out=tmp_path/f'log-{role}',
                                             env={**os.environ, **replica_env(lh, g, 2), 'RUST_LOG': 'warn'})
        procs = {'steady': start(0, 'steady'), 'dies': start(1, 'dies')}
        try:
            assert procs['dies'].wait(WAIT) == -9, (tmp_path/'log-dies').read_text()[-3000:]
            procs['restarted'] = start(1, 'restarted')
            codes = [procs[r].wait(WAIT) for r in ('steady', 'restarted')]
        finally:
            for p in procs.values():
                if p.poll() is None: p.kill()
    logs = {r: (tmp_path/f'log-{r}').read_text()[-3000:] for r in procs}
    assert codes == [0, 0], logs
    got = {r: torch.load(tmp_path/f'{r}.pt', weights_only=False) for r in procs}
    steady, restarted = got['steady'], got['restarted']
    assert [t for t,*_ in got['dies']['steps']] == [1, 2]
    assert steady['train_iter'] == restarted['train_iter'] == 24
    rolled = {t: r for t,_,_,r in steady['steps']}
    assert rolled[3] == 0 and rolled[4] == rolled[24] == 1, steady['steps']        # the sync at 4 alone
    assert [t for t,*_ in restarted['steps']] == list(range(5, 25))                # healed at step 5
    assert all(torch.equal(steady['model'][k], restarted['model'][k]) for k in steady['model'])
    ref = hand_written_with_a_fault({r: g['steps'] for r,g in got.items()}, 4)
    assert max_rel(steady['model'], ref) <= 1e-6

def start_fsdp_group(out, lh, g, *args, within='fsdp'):
    "Replica group `g` of 2 as torchrun starts it: 2 ranks, FSDP within, `diloco_script.py` with `args`"
    log = out/f'log{g}-{len(list(out.glob(f"log{g}-*")))}'
    env = {**os.environ, **replica_env(lh, g, 2), 'RUST_LOG': 'warn'}
    return start_torchrun_group(SCRIPT, env, log, out, *args, '--within', within)

def finish(procs):
    try: return [p.wait(WAIT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None: p.kill()

def logs(out): return '\n'.join(f'--- {f.name}\n{f.read_text()[-3000:]}' for f in sorted(out.glob('log*')))

@pytest.mark.slow
@pytest.mark.parametrize('within', ['fsdp', 'ddp'])
def test_two_groups_of_two_ranks_are_the_hand_written_loop(tmp_path, within):
    """2 replica groups of 2 ranks (torchrun), FSDP within each (or the whole model on each rank, the
    gradients their mean over the group's ranks), H = 4: the group's ranks train its half of each batch, the
    sync all-reduces each rank's shards of the pseudo-gradients with the same rank's of the other group, the
    outer step steps each rank's shards: all four ranks end with the same weights, within 1e-6 of the
    hand-written loop's global weights"""
    with Lighthouse(min_replicas=2, join_timeout=10, heartbeat_timeout=2) as lh:
        codes = finish([start_fsdp_group(tmp_path, lh, g, 'diloco', 4, within=within) for g in range(2)])
    assert codes == [0, 0], logs(tmp_path)
    got = [torch.load(tmp_path/f'group{g}-{r}.pt', weights_only=False) for g in range(2) for r in range(2)]
    ref = hand_written(4)
    for other in got[1:]: assert all(torch.equal(got[0]['model'][k], other['model'][k]) for k in ref)
    assert all(g['train_iter'] == 12 and g['sharded'] == (within == 'fsdp') for g in got)
    assert max_rel(got[0]['model'], ref) <= 1e-6

@pytest.mark.slow
def test_a_group_of_two_ranks_lost_between_syncs_heals_rank_by_rank(tmp_path):
    """The fault of `test_a_group_lost_between_syncs_...` with groups of 2 ranks, FSDP within: rank 1 of group
    1 SIGKILLs itself after step 2, torchrun ends its group, group 0's sync at step 4 is rolled back on both
    its ranks; group 1 started again by the same command heals at step 5, each rank its shards from the same
    rank of group 0; all four ranks end equal, within 1e-6 of the hand-written loop over the steps taken"""
    with Lighthouse(min_replicas=2, join_timeout=10, heartbeat_timeout=2) as lh:
        steady = start_fsdp_group(tmp_path, lh, 0, 'diloco', 4, 'steady')
        try:
            assert finish([start_fsdp_group(tmp_path, lh, 1, 'diloco', 4, 'dies')]) == [1], logs(tmp_path)
            codes = finish([steady, start_fsdp_group(tmp_path, lh, 1, 'diloco', 4, 'restarted')])
        finally: finish([steady])
    assert codes == [0, 0], logs(tmp_path)
    got = {f'{role}-{r}': torch.load(tmp_path/f'{role}-{r}.pt', weights_only=False)
           for role in ('steady', 'restarted') for r in range(2)}
    dies = torch.load(tmp_path/'dies.pt', weights_only=False)
    assert [t for t,*_ in dies['steps']] == [1, 2]
    rolled = {t: r for t,_,_,r in got['steady-0']['steps']}
    assert rolled[3] == 0 and rolled[4] == rolled[24] == 1, got['steady-0']['steps']
    for r in range(2): assert [t for t,*_ in got[f'restarted-{r}']['steps']] == list(range(5, 25))
    for other in list(got.values())[1:]:
        assert all(torch.equal(got['steady-0']['model'][k], other['model'][k]) for k in other['model'])
    ref = hand_written_with_a_fault({'steady': got['steady-0']['steps'], 'dies': dies['steps'],
                                     'restarted': got['restarted-0']['steps']}, 4)
    assert max_rel(got['steady-0']['model'], ref) <= 1e-6
