"""torchrun's elastic agent: two agents on localhost, started with the torchrun command of the
cluster page (`--nnodes=1:2`, c10d rendezvous, `last_call_timeout=1`), run one script with a global batch. One
agent is SIGKILLed with its worker mid-run and started again: the world goes 2 -> 1 -> 2 and the run ends as
the uninterrupted one did, within 1e-6. Each change's recovery time (from the kill, or the node's new start,
to the first step in the new world) is printed. Bounded by timeouts."""
import os, signal, subprocess, sys, time
from pathlib import Path
from conftest import child_pythonpath
import pytest, torch
from test_preemption import free_port

HERE = Path(__file__).parent

def recipe_command():
    "The torchrun command of the cluster page: its environment variables and options"
    from fastcore.nbio import read_nb
    page = '\n'.join(c.source for c in read_nb(HERE.parents[1]/'nbs'/'23d_cluster.ipynb').cells)
    words = next(l for l in page.splitlines() if ' torchrun ' in l
                 and l.rstrip().endswith('train.py')).split()
    i = words.index('torchrun')
    return dict(w.split('=', 1) for w in words[:i]), words[i+1:-1]

def agent(out, port, log):
    """One torchrun agent (a node of one process) of the elastic job, with the page's command, in a session of
    its own"""
    env_vars,opts = recipe_command()
    opts = [o.replace('$HEAD:29400', f'127.0.0.1:{port}') for o in opts]
    cmd = [sys.executable, '-m', 'torch.distributed.run', *opts, str(HERE/'elastic_script.py'), str(out),
           '--secs', '0.25', '--hold']
    env = dict(os.environ, **env_vars, OMP_NUM_THREADS='1',
               PYTHONPATH=child_pythonpath())
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

def descendants(pid):
    "The processes `pid` started, and theirs (torchrun starts its workers in sessions of their own)"
    kids = []
    for task in Path(f'/proc/{pid}/task').glob('*'):
        try: kids += [int(k) for k in (task/'children').read_text().split()]
        except OSError: pass
    return kids + [d for k in kids for d in descendants(k)]

def kill_node(agent):
    "SIGKILL an agent and its workers at once, as when a node is lost"
    for pid in descendants(agent.pid) + [agent.pid]:
        try: os.kill(pid, signal.SIGKILL)
        except ProcessLookupError: pass

def progress(out):
    "The (world, step, time) rank 0 noted after each training batch so far"
    f = out/'progress.txt'
    if not f.exists(): return []
    return [(int(w), int(i), float(t)) for w,i,t in (l.split() for l in f.read_text().splitlines()
                                                     if l.count(' ') == 2)]

def wait_for(out, cond, what, timeout=300):
    "Wait until `cond(progress)`; the progress"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond(p := progress(out)): return p
        time.sleep(0.1)
    raise AssertionError(f'timed out waiting for {what}: {progress(out)[-5:]}')

def recovery(p, t, world):
    "Seconds from time `t` to the first step after it in a world of `world` processes"
    return min(s for w,_,s in p if s > t and w == world) - t

def test_the_page_command_is_elastic():
    env_vars,opts = recipe_command()
    assert env_vars == {'TORCH_DISABLE_SHARE_RDZV_TCP_STORE': '1'}
    assert {'--nnodes=1:2', '--rdzv-backend=c10d', '--rdzv-conf=last_call_timeout=1'} <= set(opts), opts

@pytest.mark.slow
def test_elastic_world_shrinks_and_grows_and_the_run_ends_as_the_uninterrupted_one(tmp_path):
    ref = subprocess.run([sys.executable, str(HERE/'elastic_script.py'), str(tmp_path/'ref')],
                         capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=child_pythonpath()))
    assert ref.returncode == 0, ref.stderr[-3000:]
    out, port = tmp_path/'run', free_port()
    with open(tmp_path/'a.log', 'w') as la, open(tmp_path/'b.log', 'w') as lb, open(tmp_path/'b2.log',
            'w') as lb2:
        a = agent(out, port, la)                                    # a first: it hosts the rendezvous store
        procs = [a]
        try:
            time.sleep(2)
            procs.append(b := agent(out, port, lb))
            wait_for(out, lambda p: any(w == 2 and i >= 6 for w,i,_ in p), 'the 2-node run')
            kill_node(b)                                            # a node lost: its agent and its worker
            killed = time.time()
            p = wait_for(out, lambda p: any(w == 1 and t > killed for w,_,t in p) and
                         sum(w == 1 for w,_,_ in p) >= 4, 'the run on the node left')
            procs.append(b2 := agent(out, port, lb2))               # the node comes back
            joined = time.time()
            p = wait_for(out, lambda p: any(w == 2 and t > joined for w,_,t in p), 'the run on both nodes '
                         'again')
            assert (a.wait(timeout=300) == 0
                    and b2.wait(timeout=60) == 0), (tmp_path/'a.log').read_text()[-4000:]
        finally:
            for q in procs:
                if q.poll() is None: kill_node(q)
    p = progress(out)
    worlds = [w for w,_,_ in p]
    changes = [worlds[0]] + [w for v,w in zip(worlds, worlds[1:]) if w != v]
    # a fast first agent may train alone until the second joins
    assert changes in ([2, 1, 2], [1, 2, 1, 2]), changes
    print(f'\nelastic recovery: 2 -> 1 in {recovery(p, killed, 1):.1f} s after the kill, '
          f'1 -> 2 in {recovery(p, joined, 2):.1f} s after the node started again')
    got, want = torch.load(out/'result.pt'), torch.load(tmp_path/'ref'/'result.pt')
    assert got['world'] == 2
    for k in want['model']: torch.testing.assert_close(got['model'][k], want['model'][k], rtol=0, atol=1e-6)
