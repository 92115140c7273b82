"""What each rank holds, estimated before launch and measured in the run: the fsdp_tp example's model
(tests/llama_port.py) as a language model, 4 processes under torchrun (gloo), three layouts: FSDP over 4,
tensor parallel over 4, 2D (2x2). Each rank, for each layout: `rank_memory` for its rank (before the process
group starts), then a fit whose callback measures the second batch's tensors; OUT/memory<rank>.pt. Run by
model_parallel_script.py's launch (test_model_parallel.py), or alone: torchrun --nproc-per-node 4 this OUT."""
import os, sys
from pathlib import Path
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
sys.path.insert(0, str(Path(__file__).parents[1]))
from llama_port import Transformer, tp_plan, VOCAB, SEQ

class MeasureMemory(Callback):
    "This rank's bytes of parameters, activations (saved for backward), gradients, optimizer state, batch 1"
    def before_batch(self):
        self.measuring = self.training and self.train_iter == 1
        if self.measuring: self.saved = SavedForBackward().__enter__()
    def after_loss(self):
        if not self.measuring: return
        self.saved.__exit__(None, None, None)
        self.got = {'params': tensor_bytes(self.model.parameters()),
                    'activations': self.saved.nbytes(self.model)}
    def after_backward(self):
        if self.measuring: self.got['grads'] = tensor_bytes(p.grad for p in self.model.parameters())
    def after_step(self):
        if self.measuring: self.got['opt_state'] = opt_state_bytes(self.opt)

def lm_learner():
    rows = torch.randint(VOCAB, (32, SEQ + 1), generator=torch.Generator().manual_seed(1))
    train = DataLoader(TensorDataset(rows[:, :-1], rows[:, 1:]), batch_size=4)
    torch.manual_seed(0)
    return Learner(DataLoaders(train, None), Transformer(), lambda out, y: F.cross_entropy(out.flatten(0, 1),
                   y.flatten()), opt_func=torch.optim.AdamW, lr=1e-3)

layouts = {'fsdp': lambda: FSDP(), 'tp': lambda: ModelParallel(mesh={'tp': 4}, plan=tp_plan()),
           '2d': lambda: ModelParallel(mesh={'dp': 2, 'tp': 2}, plan=tp_plan())}

def measure_memory(out):
    "Each process, each layout: `rank_memory` for its rank, then the fit's measure; OUT/memory<rank>.pt"
    rank,found = int(os.environ['RANK']),{}
    for name,make in layouts.items():
        learn = lm_learner()
        estimate = rank_memory(learn, make(), 4, rank=rank)
        measure = MeasureMemory()
        with learn.distrib_ctx(strategy=make()): learn.fit(1, cbs=[measure])
        found[name] = {'estimate': estimate, 'measured': measure.got}
    torch.save(found, Path(out)/f'memory{rank}.pt')

if __name__ == '__main__':
    torch.set_num_threads(1)
    measure_memory(sys.argv[1])
