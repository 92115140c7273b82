import os, sys, threading
from collections import Counter
from pathlib import Path
import pytest, torch
from learncb.all import *
from learncb.test_utils import synth_dls, synth_learner, EventLog   # the tests import them from here too

# The tests mirror the source folders (tests/checkpoint/ for learncb/checkpoint/, ...), each folder with its
# helper
# scripts. A test imports another folder's helpers by module name (`from transparent_script import
# make_learner`):
# every folder is on the path here, and `child_pythonpath()` gives it to the processes a test starts.
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
test_folders = [TESTS, *(TESTS/d for d in ('callbacks', 'checkpoint', 'distributed', 'inference',
                                           'integrations'))]
for folder in reversed(test_folders):
    if str(folder) not in sys.path: sys.path.insert(0, str(folder))

def child_pythonpath(*first):
    "`PYTHONPATH` for a process a test starts: `first`, the test folders, then the one of this process"
    return os.pathsep.join([*map(str, first), *map(str, test_folders), os.environ.get('PYTHONPATH', '')])

_forkserver = []

def _run_as_main(argv, env, cwd, out, err):
    """In the forked process: `python *argv` (a script and its arguments, or `-m module ...`), its output to
    `out`, `err`"""
    import atexit, multiprocessing, runpy
    # the platform's default, as in a new process (not forkserver: a DataLoader worker started from there
    # outlives a SIGKILL)
    multiprocessing.set_start_method(None, force=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC); os.dup2(fd, 1); os.close(fd)
    if err == out: os.dup2(1, 2)
    else: fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC); os.dup2(fd, 2); os.close(fd)
    os.environ.clear(); os.environ.update(env); os.chdir(cwd)
    module = argv[1] if argv[0] == '-m' else None
    sys.argv = list(argv[1:] if module else argv)
    if not module: sys.path.insert(0, str(Path(argv[0]).parent))
    try:
        runpy.run_module(module, run_name='__main__', alter_sys=True) if module else runpy.run_path(argv[0],
            run_name='__main__')
    finally: atexit._run_exitfuncs()      # as at the end of a process (multiprocessing's children skip them)

# multiprocessing reads a child's exit status once, from a pipe, and `Process.start` polls every other live
# child: a start in one thread can take the status a `wait` in another thread was to read, which then sees
# the pipe's end and reports 255. Starts and polls go one at a time.
_polling = threading.Lock()

class ForkedProcess:
    """A process `start_forked` started, as `subprocess.Popen` shows one: `pid`, `poll`, `wait`, `kill`,
    `returncode`; safe to start and wait on from several threads"""
    def __init__(self, proc, argv): self.proc, self.args = proc, [sys.executable, *argv]
    @property
    def pid(self): return self.proc.pid
    @property
    def returncode(self): return self.poll()
    def poll(self):
        with _polling:
            if self.proc.exitcode is not None: self.proc.join(0)    # and multiprocessing forgets it
            return self.proc.exitcode
    def kill(self): self.proc.kill()
    def wait(self, timeout=None):
        import subprocess
        from multiprocessing.connection import wait
        wait([self.proc.sentinel], timeout)
        if self.poll() is None: raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()

def start_forked(*argv, out, err=None, env=None):
    """`subprocess.Popen([python, *argv], stdout=out, stderr=err or out, env=env)` with `out` and `err` file
    names, but forked from a process that imported `learncb.all` (a forkserver): no 2 to 3 s of CPU for
    imports. A process of its own all the same (it can SIGKILL itself: its return code is then -9), with this
    process's environment and folder of now. Not for what must be set before Python starts (`MALLOC_*`,
    `PYTHONWARNINGS`)."""
    import multiprocessing as mp
    if not _forkserver:
        ctx = mp.get_context('forkserver')
        ctx.set_forkserver_preload(['learncb.all'])
        _forkserver.append(ctx)
    argv = [str(a) for a in argv]
    proc = _forkserver[0].Process(target=_run_as_main, args=(argv, dict(os.environ if env is None else env),
                                                             os.getcwd(), str(out), str(err or out)))
    with _polling: proc.start()
    return ForkedProcess(proc, argv)

TORCHRUN_VARS = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')

def start_torchrun_group(script, env, log, *args, ranks=2):
    """`script` with `args` as torchrun starts a group of `ranks` processes (gloo) on its own `--standalone`
    rendezvous, with `env` less this process's own torchrun settings, its output in the file `log`"""
    import subprocess, sys
    env = {k: v for k,v in env.items() if k not in TORCHRUN_VARS}
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', str(ranks),
           '--max-restarts', '0', str(script), *map(str, args)]
    return subprocess.Popen(cmd, env=env, stdout=open(log, 'w'), stderr=subprocess.STDOUT)

def run_forked(*argv, timeout=300, env=None):
    """`subprocess.run([python, *argv], capture_output=True, text=True, timeout=timeout, env=env)`, forked:
    `start_forked`"""
    import subprocess, tempfile
    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d)/'out', Path(d)/'err'
        said = lambda f: f.read_text(errors='replace') if f.exists() else ''
        p = start_forked(*argv, out=out, err=err, env=env)
        try: p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill(); p.wait()
            raise subprocess.TimeoutExpired(p.args, timeout, said(out), said(err)) from None
        return subprocess.CompletedProcess(p.args, p.returncode, said(out), said(err))

def torchrun(nproc, *options):
    """The start of `run_forked`'s arguments for torchrun with `nproc` workers on a free port (and `options`),
    the workers forked from its agent (tests/forked_torchrun.py)"""
    from learncb.ranks import free_port
    return (TESTS/'forked_torchrun.py', f'--nproc_per_node={nproc}', f'--master-port={free_port()}', *options)

def run_script(script, *args, nproc=1, timeout=240, env=None):
    """`python script *args`, or `torchrun --nproc_per_node=nproc script *args` when `nproc` > 1, forked
    (`run_forked`, `torchrun`)"""
    return run_forked(*(torchrun(nproc) if nproc > 1 else ()), script, *args, timeout=timeout, env=env)

@pytest.fixture
def learner(): return synth_learner()

SYNCS = ('item', 'tolist', 'cpu', '__float__', '__bool__')

class SyncCounter:
    "Counts calls of the Tensor methods that copy data to the host (and so wait for the device)"
    def __init__(self): self.counts = Counter()
    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in SYNCS}
        for name, orig in self.saved.items():
            def counting(*args, _name=name, _orig=orig, **kw):
                self.counts[_name] += 1
                return _orig(*args, **kw)
            setattr(torch.Tensor, name, counting)
        return self
    def __exit__(self, *exc):
        for name, orig in self.saved.items(): setattr(torch.Tensor, name, orig)

class CrashAt(Callback):
    """Raises `RuntimeError(message)` after training batch `at` (after the checkpoint of that batch, if any,
    was written)"""
    order = 99
    def __init__(self, at, message='the machine went away'): self.at,self.message = at,message
    def after_batch(self):
        if self.training and self.train_iter == self.at: raise RuntimeError(self.message)

class FailAfterEpoch(Callback):
    """Raises `RuntimeError('boom')` at the end of epoch `at`: between batches, so the checkpoint it leaves is
    exact"""
    order = 99
    def __init__(self, at=1): self.at = at
    def after_epoch(self):
        if self.epoch == self.at: raise RuntimeError('boom')
