"""The fsdp_tp example (tests/llama_port.py) under torchrun (gloo). `--way example`: its own loop on a 2x2
mesh; `--way learncb`: learncb's port with `ModelParallel`; each rank saves OUT/<way><rank>.pt, its whole
weights after the fit. `--way all` (4 processes, under `--max-restarts=1`): both, then a language-model fit
of the example's model on a 2x2 mesh uninterrupted (OUT/whole) and checkpointed every step, killed once,
resumed by itself (OUT/killed); what each rank holds (memory_script.py); HSDP, alone (OUT/hsdp)
and with tensor parallel (OUT/hsdp_tp). `--way down --ckpt CKPT` (2 processes): that fit resumed from
checkpoint CKPT on a 1x2 mesh."""
import argparse, os, signal, sys
from functools import partial
from pathlib import Path
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from learncb.all import *
sys.path.insert(0, str(Path(__file__).parents[1]))
from llama_port import Transformer, tp_plan, tokens, example_loop, ITERS, VOCAB, SEQ
from memory_script import measure_memory

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

def next_token_loss(out, y): return F.cross_entropy(out.flatten(0, 1), y.flatten())

class KillOnce(Callback):
    "SIGKILLs rank 1 at training batch 5, once (the file `flag` says it was done)"
    def __init__(self, flag): self.flag = Path(flag)
    def after_batch(self):
        if self.training and self.train_iter == 5 and rank_distrib() == 1 and not self.flag.exists():
            self.flag.touch()
            os.kill(os.getpid(), signal.SIGKILL)

def lm_fit(folder, mesh, bs, cbs=(), resume=None):
    """A language-model fit of the example's model, 2 epochs of 32 rows (shuffled), `bs` rows per
    data-parallel rank, on `mesh`; checkpoints in `folder`; the whole weights after it"""
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(VOCAB, (32, SEQ + 1), generator=g)
    train = DataLoader(TensorDataset(rows[:, :-1], rows[:, 1:]), batch_size=bs, shuffle=True)
    torch.manual_seed(0)
    # eps=1e-5: AdamW divides a small gradient by its own size, and the meshes sum gradients in other orders
    learn = Learner(DataLoaders(train, None), Transformer(), next_token_loss, path=folder, lr=3e-3,
                    opt_func=partial(torch.optim.AdamW, foreach=True, eps=1e-5))
    with learn.distrib_ctx(strategy=ModelParallel(mesh=mesh, plan=tp_plan())):
        learn.fit(2, cbs=list(cbs), resume=resume)
    return learn.model.state_dict()

def down(out, ckpt):
    "On 1x2: the checkpoint refused with the batch per rank kept (4, not 8), then resumed with 8"
    try: lm_fit(Path(out)/'down', {'dp': 1, 'tp': 2}, 4, resume=ckpt)
    except ValueError as e: (Path(out)/'refused.txt').write_text(str(e))
    save(lm_fit(Path(out)/'down', {'dp': 1, 'tp': 2}, 8, resume=ckpt), out, 'down')

def save(weights, out, name):
    torch.save(weights, Path(out)/f"{name}{os.environ['RANK']}.pt")

def all_ways(out):
    """What each rank holds (estimated before the process group starts, then measured), the example, its port,
    the whole LM fit and the one killed (again after the restart: none is left half)"""
    if not (Path(out)/f"memory{os.environ['RANK']}.pt").exists(): measure_memory(out)
    if not (Path(out)/f"learncb{os.environ['RANK']}.pt").exists():
        torch.distributed.init_process_group('gloo')
        save(example_loop(), out, 'example')
        torch.distributed.destroy_process_group()
        save(ported(), out, 'learncb')
        every_epoch = [CheckpointCallback(keep_last=2)]
        save(lm_fit(Path(out)/'whole', {'dp': 2, 'tp': 2}, 4, every_epoch), out, 'whole')
    if not (Path(out)/f"hsdp{os.environ['RANK']}.pt").exists():        # HSDP: 4 data-parallel ranks, 2 each
        save(lm_fit(Path(out)/'hsdp', {'dp_replicate': 2, 'dp': 2}, 2), out, 'hsdp')
        save(lm_fit(Path(out)/'hsdp_tp', {'dp_replicate': 2, 'tp': 2}, 4), out, 'hsdp_tp')
    killed = [CheckpointCallback(every_n_steps=1), KillOnce(Path(out)/'killed.flag')]
    save(lm_fit(Path(out)/'killed', {'dp': 2, 'tp': 2}, 4, killed, resume='auto'), out, 'killed')

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--way', default='learncb'); p.add_argument('--ckpt', default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.way == 'all': all_ways(args.out)
    elif args.way == 'down': down(args.out, args.ckpt)
    elif args.way == 'example':
        torch.distributed.init_process_group('gloo')
        save(example_loop(), args.out, 'example')
        torch.distributed.destroy_process_group()
    else: save(ported(), args.out, 'learncb')
