"""Ports under several processes (tests/distributed/test_ports.py): PyTorch's dcgan example
(tests/gan_port.py), as its hand-written loop under DDP and as learncb's port under DDP and FSDP, and
time_sequence_prediction's LBFGS fit in one process and under DDP. python tests/distributed/ports_script.py
OUT --way gan_hand_ddp|gan_ddp|gan_fsdp|lbfgs_one|lbfgs_ddp Each way but lbfgs_one runs on two processes
(learncb's `launch`, gloo); rank 0 saves OUT/<way>.pt."""
import argparse, os, sys
from functools import partial
from pathlib import Path
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from learncb.all import *
sys.path.insert(0, str(Path(__file__).parents[1]))
import gan_port
from test_several_optimizers import sine_waves, seeded_sequence

def gan_hand_ddp(n_epoch=2, lr_d=2e-4, lr_g=1e-2):
    """The dcgan example's loop as it is written for DDP: each net in `DistributedDataParallel`, a
    `DistributedSampler`, half the batch on each rank; D's two losses in one backward"""
    netG, netD, dl = gan_port.nets_and_data()
    sampler = DistributedSampler(dl.dataset, shuffle=True, seed=0)
    loader = DataLoader(dl.dataset, batch_size=dl.batch_size // 2, sampler=sampler)
    netG, netD = DistributedDataParallel(netG), DistributedDataParallel(netD)
    criterion = nn.BCELoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=lr_d, betas=(0.5, 0.999))
    optimizerG = torch.optim.SGD(netG.parameters(), lr=lr_g, momentum=0.9)
    for epoch in range(n_epoch):
        sampler.set_epoch(epoch)
        for data in loader:
            netD.zero_grad()
            real = data[0]
            output = netD(real)
            errD_real = criterion(output, torch.full((len(real),), 1.))
            fake = netG(torch.randn(len(real), gan_port.nz, 1, 1))
            errD_fake = criterion(netD(fake.detach()), torch.full((len(real),), 0.))
            (errD_real + errD_fake).backward()
            optimizerD.step()
            netG.zero_grad()
            errG = criterion(netD(fake), torch.full((len(real),), 1.))
            errG.backward()
            optimizerG.step()
    return {'G': netG.module.state_dict(), 'D': netD.module.state_dict()}

def gan_learncb(strategy):
    learn = gan_port.port()
    learn.remove_cb(ProgressCallback)
    with learn.no_logging(), learn.distrib_ctx(strategy=strategy, global_batch=16): learn.fit(2)
    return {'G': learn.model.G.state_dict(), 'D': learn.model.D.state_dict()}

def lbfgs(strategy=None):
    "time_sequence_prediction's fit (float64, LBFGS), 3 epochs of one batch of 8 waves"
    input, target, _, _ = sine_waves(N=11)
    seq, _ = seeded_sequence()
    dl = DataLoader(TensorDataset(input, target), batch_size=8)
    lbfgs = partial(torch.optim.LBFGS, lr=0.8, max_iter=5)
    learn = Learner(DataLoaders(dl), seq, nn.MSELoss(), opt_func=lbfgs)
    learn.remove_cb(ProgressCallback)
    ctx = learn.distrib_ctx(global_batch=8) if strategy is None else learn.distrib_ctx(strategy=strategy,
                                                                                       global_batch=8)
    with learn.no_logging(), ctx: learn.fit(3)
    return seq.state_dict()

ways = {'gan_hand_ddp': gan_hand_ddp, 'gan_ddp': partial(gan_learncb, 'ddp'),
        'gan_fsdp': partial(gan_learncb, 'fsdp'),
        'lbfgs_one': lbfgs, 'lbfgs_ddp': partial(lbfgs, 'ddp')}

def run(out, way):
    torch.set_num_threads(1)
    group = way == 'gan_hand_ddp'
    if group: torch.distributed.init_process_group('gloo')
    try: state = ways[way]()
    finally:
        if group: torch.distributed.destroy_process_group()
    if os.environ.get('RANK', '0') == '0': torch.save(state, Path(out)/f'{way}.pt')

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--way')
    args = p.parse_args()
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    if args.way == 'lbfgs_one': run(out, args.way)
    else: launch(run, out, args.way, nprocs=2)
