"""Run each notebook of `nbs/` as `nbdev-test` does, every one in a process of its own, `-j` at a time
(default 2).

`nbdev-test nbs` runs several notebooks one after the other in each of its worker processes, and a notebook's
export
cells redefine the library's classes in that process (a page's `Recorder`, put among `defaults.callbacks` by
its tests):
the next notebook in the same process then mixes two `Recorder` classes and fails or passes by the luck of
which worker
it lands on. A process per notebook makes each notebook's result its own.

Each of those processes is forked from this one after it imported nbdev's test runner, IPython and
`learncb.all`: a
notebook starts from the state a fresh process has after those imports, without paying for them (about 4 s of
CPU a
notebook, 60 notebooks). Nothing has run in this process before the forks but imports: no threads, no torch
kernels."""
import argparse, os, sys, tempfile, time
from pathlib import Path

root = Path(__file__).resolve().parent.parent

def preload():
    "Import what every notebook imports, once, before the forks"
    import nbdev.test, execnb.shell, IPython, learncb.all   # noqa: F401

def test_one(nb, log):
    """In a forked child: `nbdev-test nb` (nbdev's own function, config and all), its output to the file
    `log`; never returns"""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd)
        from nbdev.test import nbdev_test
        nbdev_test.__wrapped__(str(nb))  # the function under the CLI: no parsing of this script's arguments
        code = 0
    # it exits 1 when it fails
    except SystemExit as e: code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback; traceback.print_exc()
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)

def start(nb, logs):
    log = logs/f'{nb.stem}.log'
    pid = os.fork()
    if pid == 0: test_one(nb, log)
    return pid, (nb, log, time.time())

def run_all(nbs, j):
    "Fork a child per notebook, `j` at a time; print each result as it ends; the names of those that failed"
    failed, running, todo = [], {}, list(nbs)
    with tempfile.TemporaryDirectory() as d:
        logs = Path(d)
        while todo or running:
            while todo and len(running) < j:
                pid, info = start(todo.pop(0), logs); running[pid] = info
            pid, status = os.waitpid(-1, 0)
            nb, log, began = running.pop(pid)
            rc = os.waitstatus_to_exitcode(status)
            print(f"{'ok  ' if rc == 0 else 'FAIL'} {nb.name} ({time.time() - began:.1f} s)", flush=True)
            if rc: failed.append(nb.name); print(f'exit {rc}\n' + log.read_text()[-6000:], flush=True)
    return failed

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('notebooks', nargs='*', help='notebooks to test (default: every one in nbs/)')
    p.add_argument('-j', type=int, default=2, help='notebooks run at once')
    args = p.parse_args()
    nbs = [Path(n).resolve() for n in args.notebooks] or sorted((root/'nbs').glob('*.ipynb'))
    preload()
    failed = run_all(nbs, args.j)
    print(f"{len(nbs) - len(failed)} of {len(nbs)} notebooks passed" + (f"; failed: {', '.join(failed)}"
        if failed else ''))
    sys.exit(1 if failed else 0)
