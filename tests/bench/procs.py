"""What the multi-process benchmarks share: start `world` forked CPU processes that form a gloo group, and
read the figures rank 0 writes, never waiting longer than a timeout."""
import json, os, socket, tempfile, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def join_group(rank, world, port):
    "In a worker: the environment torchrun would set, one thread, then the gloo process group"
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group('gloo')

def write_figures(figures, out):
    "Rank 0 writes its figures to `out`, atomically"
    with open(out + '.tmp', 'w') as fh: json.dump(figures, fh)
    os.replace(out + '.tmp', out)

def run_workers(worker, args, world, timeout):
    """Run `worker(rank, world, port, *args, out)` in `world` processes: the figures rank 0 wrote to `out`, or
    why none"""
    if not dist.is_available() or not dist.is_gloo_available():
        return 'torch.distributed with gloo is not available'
    out = os.path.join(tempfile.mkdtemp(), 'figures.json')
    ctx = mp.start_processes(worker, args=(world, free_port(), *args, out), nprocs=world, start_method='fork',
                             join=False)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline: return f'no result in {timeout} s'
    except Exception as e:   # a rank failed (the others are stopped): the last line of its traceback
        lines = str(e).strip().splitlines()
        return f'a process failed: {lines[-1] if lines else repr(e)}'
    finally:
        for p in ctx.processes:
            if p.is_alive(): p.terminate(); p.join(5)
            if p.is_alive(): p.kill(); p.join()
    if not os.path.exists(out): return 'rank 0 wrote no figures'
    with open(out) as fh: return json.load(fh)
