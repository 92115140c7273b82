"""A padded language model's fit with its step cut into pieces over processes
(tests/distributed/test_lm_items.py): each piece weighed by the tokens its loss counts, so that every way
trains as the whole batch in one process. python tests/distributed/lm_script.py OUT --way WAY, WAY one of
one|ddp|fsdp|ddp_accumulation|ddp_microbatch|fsdp_microbatch|torchft|torchft_ranks|torchft_microbatch|
torchft_fsdp_microbatch. 'one': this process, the whole global batch of 16 a step; the others: two processes
(DDP, FSDP, `launch`), or two replica groups of one process or of two ranks (torchft). Rank 0 (of group 0)
saves OUT/<way>.pt: the weights."""
import argparse, os, sys
from functools import partial
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader
from learncb.all import *
from learncb.test_utils import TinyLM, padded_tokens
sys.path.insert(0, str(Path(__file__).parents[1]))
from lm_models import TooBig

N_ROWS,GLOBAL_BATCH = 32,16

def ways():
    "`{way: (strategy, global batch, callbacks, model)}`"
    ft = lambda **kw: TorchFT(timeout=30, **kw)
    return {'one': (None, GLOBAL_BATCH, [], TinyLM), 'ddp': ('ddp', GLOBAL_BATCH, [], TinyLM),
            'fsdp': ('fsdp', GLOBAL_BATCH, [], TinyLM),
            'ddp_accumulation': ('ddp', GLOBAL_BATCH // 4, [GradientAccumulation(GLOBAL_BATCH)], TinyLM),
            'ddp_microbatch': ('ddp', GLOBAL_BATCH, [AutoMicrobatch()], TooBig),
            'fsdp_microbatch': ('fsdp', GLOBAL_BATCH, [AutoMicrobatch()], TooBig),
            'torchft': (ft(), GLOBAL_BATCH, [], TinyLM), 'torchft_ranks': (ft(), GLOBAL_BATCH, [], TinyLM),
            'torchft_microbatch': (ft(), GLOBAL_BATCH, [AutoMicrobatch()], TooBig),
            'torchft_fsdp_microbatch': (ft(within='fsdp'), GLOBAL_BATCH, [AutoMicrobatch()],
                                        partial(TooBig, 2))}

def fit(out, way):
    torch.set_num_threads(1)
    strategy,bs,cbs,model = ways()[way]
    torch.manual_seed(0)
    dls = DataLoaders(DataLoader(padded_tokens(N_ROWS, lengths=(2, 24)), batch_size=bs), None)
    learn = Learner(dls, model(), CrossEntropyLossFlat(), opt_func=torch.optim.SGD, lr=1.0, device='cpu')
    learn.remove_cb(ProgressCallback)
    ctx = learn.distrib_ctx(global_batch=bs) if strategy is None else learn.distrib_ctx(
        strategy=strategy, global_batch=bs)
    with learn.no_logging(), ctx: learn.fit(1, cbs=cbs)
    weights = getattr(learn.model, 'lm', learn.model).state_dict()
    first = os.environ.get('RANK', '0') == '0' and os.environ.get('REPLICA_GROUP_ID', '0') == '0'
    if first: torch.save({'weights': weights, 'train_iter': learn.train_iter}, Path(out)/f'{way}.pt')

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--way', default='one')
    args = p.parse_args()
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    if args.way == 'one': fit(out, 'one')
    elif args.way.startswith('torchft'):
        with Lighthouse(min_replicas=2) as lh:
            ranks = 2 if args.way in ('torchft_ranks', 'torchft_fsdp_microbatch') else 1
            launch_replicas(fit, out, args.way, n=2, ranks=ranks, lighthouse=lh, timeout=600)
    else: launch(fit, out, args.way, nprocs=2)
