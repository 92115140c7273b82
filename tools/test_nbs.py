"""Run each notebook of `nbs/` with `nbdev-test`, every one in a process of its own, `-j` at a time (default 2).

`nbdev-test nbs` runs several notebooks one after the other in each of its worker processes, and a notebook's export
cells redefine the library's classes in that process (a page's `Recorder`, put among `defaults.callbacks` by its tests):
the next notebook in the same process then mixes two `Recorder` classes and fails or passes by the luck of which worker
it lands on. A process per notebook makes each notebook's result its own."""
import argparse, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

root = Path(__file__).resolve().parent.parent

def run(nb):
    start = time.time()
    res = subprocess.run(['nbdev-test', str(nb)], cwd=root, capture_output=True, text=True)
    return nb, res.returncode, time.time() - start, res.stdout + res.stderr

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('notebooks', nargs='*', help='notebooks to test (default: every one in nbs/)')
    p.add_argument('-j', type=int, default=2, help='notebooks run at once')
    args = p.parse_args()
    nbs = [Path(n) for n in args.notebooks] or sorted((root/'nbs').glob('*.ipynb'))
    failed = []
    with ThreadPoolExecutor(args.j) as pool:
        for nb, rc, secs, out in pool.map(run, nbs):
            print(f"{'ok  ' if rc == 0 else 'FAIL'} {nb.name} ({secs:.1f} s)", flush=True)
            if rc: failed.append(nb.name); print(out[-6000:], flush=True)
    print(f"{len(nbs) - len(failed)} of {len(nbs)} notebooks passed" + (f"; failed: {', '.join(failed)}" if failed else ''))
    sys.exit(1 if failed else 0)
