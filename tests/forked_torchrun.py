"""torchrun for the tests, its workers forked from its agent rather than started as new Pythons.

`python forked_torchrun.py [torchrun's options] SCRIPT ARGS...` is torch's own launcher
(`torch.distributed.run`: its options, elastic agent, rendezvous, restarts and exit status) with `--run-path
--start-method fork`: each worker is a fork of the agent that runs SCRIPT as `__main__`. Started by
`conftest.run_forked`, the agent is itself a fork of a process that imported `learncb.all`, so a worker
starts in milliseconds instead of after the 3 to 4 s of CPU its imports take (a launch of two: from about
20 s of CPU to 4). A worker's output goes line by line, as under `python -u`, so what it printed before it
was killed is there, and its signal handlers are those of before the agent set its own (a new Python's).
The tests of torchrun's own agent (test_elastic.py, the restart of test_preemption.py) and the runs whose
environment must be set before Python starts (test_microbatch.py's capped ones: the allocator) run the real
command."""
import os, signal, sys
from pathlib import Path
import torch
from torch.distributed import run

run_script_path = run.run_script_path     # torch's: `script` as `__main__` in this process
# the agent sets handlers of its own for these, which a worker it forks would keep
agent_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
handlers = {}

def run_as_main(script, *args):
    """A worker: `script` run as `__main__` with `args`, its folder first on the path and its output line
    buffered, as `python -u script args` would; torch's threads as `OMP_NUM_THREADS` says (torchrun sets
    it), its signal handlers those of before the agent's"""
    for sig, handler in handlers.items(): signal.signal(sig, handler)
    for stream in (sys.stdout, sys.stderr): stream.reconfigure(line_buffering=True)
    threads = os.environ.get('OMP_NUM_THREADS', '')
    if threads.isdigit(): torch.set_num_threads(int(threads))
    sys.path.insert(0, str(Path(script).resolve().parent))
    run_script_path(script, *args)

if __name__ == '__main__':
    handlers.update({sig: signal.getsignal(sig) for sig in agent_signals})
    run.run_script_path = run_as_main          # the function `--run-path` makes each worker call
    run.main(['--run-path', '--start-method=fork', *sys.argv[1:]])
