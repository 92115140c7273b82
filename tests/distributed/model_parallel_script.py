"""The fsdp_tp example (tests/llama_port.py) on a 2x2 mesh, 4 processes under torchrun (gloo): `--way
example`, its own loop; `--way learncb`, learncb's port with `ModelParallel`. Each rank saves
OUT/<way><rank>.pt, its whole weights after the fit."""
import argparse, os, sys
from functools import partial
from pathlib import Path
import torch
from torch.utils.data import DataLoader, IterableDataset
from learncb.all import *
sys.path.insert(0, str(Path(__file__).parents[1]))
from llama_port import Transformer, tp_plan, tokens, example_loop, ITERS

class Tokens(IterableDataset):
    "The example's batches, as a stream of this data-parallel rank's own (the strategy says which it is)"
    def __init__(self, strategy): self.strategy = strategy
    def __len__(self): return ITERS
    def __iter__(self):
        for i in range(ITERS): yield (tokens(i, self.strategy.dp_rank),)

def ported():
    torch.manual_seed(0)
    strategy = ModelParallel(mesh={'dp': 2, 'tp': 2}, plan=tp_plan())
    learn = Learner(DataLoaders(DataLoader(Tokens(strategy), batch_size=None), None), Transformer(),
                    loss_func=lambda out: out.sum(), opt_func=partial(torch.optim.AdamW, foreach=True),
                    lr=3e-3)
    with learn.distrib_ctx(strategy=strategy): learn.fit(1)
    return learn.model.state_dict()

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--way', default='learncb')
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.way == 'example':
        torch.distributed.init_process_group('gloo')
        weights = example_loop()
        torch.distributed.destroy_process_group()
    else: weights = ported()
    torch.save(weights, Path(args.out)/f"{args.way}{os.environ['RANK']}.pt")
