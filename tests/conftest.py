import os, sys
from collections import Counter
from pathlib import Path
import pytest, torch
from learncb.all import *
from learncb.test_utils import synth_dls, synth_learner, EventLog   # the tests import them from here too

# The tests mirror the source folders (tests/checkpoint/ for learncb/checkpoint/, ...), each folder with its helper
# scripts. A test imports another folder's helpers by module name (`from transparent_script import make_learner`):
# every folder is on the path here, and `child_pythonpath()` gives it to the processes a test starts.
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
test_folders = [TESTS, *(TESTS/d for d in ('callbacks', 'checkpoint', 'distributed', 'inference', 'integrations'))]
for folder in reversed(test_folders):
    if str(folder) not in sys.path: sys.path.insert(0, str(folder))

def child_pythonpath(*first):
    "`PYTHONPATH` for a process a test starts: `first`, the test folders, then the one of this process"
    return os.pathsep.join([*map(str, first), *map(str, test_folders), os.environ.get('PYTHONPATH', '')])

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
    "Raises `RuntimeError(message)` after training batch `at` (after the checkpoint of that batch, if any, was written)"
    order = 99
    def __init__(self, at, message='the machine went away'): self.at,self.message = at,message
    def after_batch(self):
        if self.training and self.train_iter == self.at: raise RuntimeError(self.message)

class FailAfterEpoch(Callback):
    "Raises `RuntimeError('boom')` at the end of epoch `at`: between batches, so the checkpoint it leaves is exact"
    order = 99
    def __init__(self, at=1): self.at = at
    def after_epoch(self):
        if self.epoch == self.at: raise RuntimeError('boom')
