"""PyTorch's dcgan example, small (16x16 images), as its hand-written loop and as learncb's port: Adam for D,
SGD for G"""
import sys
from functools import partial
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *

nz = 8
ngf = 8
ndf = 8
nc = 3

def weights_init(m):
    "The example's initialisation: conv weights N(0, 0.02), batchnorm weights N(1, 0.02) and biases 0"
    name = type(m).__name__
    if 'Conv' in name: nn.init.normal_(m.weight, 0.0, 0.02)
    elif 'BatchNorm' in name: nn.init.normal_(m.weight, 1.0, 0.02); nn.init.zeros_(m.bias)

class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh())
    def forward(self, x): return self.main(x)

class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2,
            inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid())
    def forward(self, x): return self.main(x).view(-1, 1).squeeze(1)

def nets_and_data(n=64, bs=16):
    """The generator, the discriminator and a shuffled loader of (image, label) pairs, as ImageFolder gives,
    all seeded"""
    torch.manual_seed(0)
    netG, netD = Generator(), Discriminator()
    netG.apply(weights_init); netD.apply(weights_init)
    images = torch.rand(n, nc, 16, 16) * 2 - 1
    return netG, netD, DataLoader(TensorDataset(images, torch.zeros(n, dtype=torch.long)), batch_size=bs,
                                  shuffle=True)

def hand_written(n_epoch=2, lr_d=2e-4, lr_g=1e-2):
    "The example's loop, as it is written (its optimizers: Adam for D, SGD with momentum for G here)"
    netG, netD, dataloader = nets_and_data()
    criterion = nn.BCELoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=lr_d, betas=(0.5, 0.999))
    optimizerG = torch.optim.SGD(netG.parameters(), lr=lr_g, momentum=0.9)
    real_label, fake_label = 1, 0
    for epoch in range(n_epoch):
        for i, data in enumerate(dataloader, 0):
            netD.zero_grad()
            real_cpu = data[0]
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
            output = netD(real_cpu)
            errD_real = criterion(output, label)
            errD_real.backward()
            noise = torch.randn(batch_size, nz, 1, 1)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            optimizerD.step()
            netG.zero_grad()
            label.fill_(real_label)
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            optimizerG.step()
    return {'G': netG.state_dict(), 'D': netD.state_dict(), 'opt': {'D': optimizerD.state_dict(),
                                                                    'G': optimizerG.state_dict()}}

def hand_written_with_tricks(n_epoch=2, lr_d=2e-4, lr_g=1e-2, clip=0.5, decay=0.9, skip=None, n_acc=None):
    """The example's loop as people grow it: each turn's forward and loss in bf16 autocast, each optimizer's
    gradients clipped to `clip`, an EMA of every weight after each batch's steps; batch `skip` (epoch, batch)
    left out (a spike, rolled back over both turns); `n_acc`: each optimizer steps once every `n_acc` rows, on
    the mean gradient of the rows since its last step. Returns the training weights and the average"""
    netG, netD, dataloader = nets_and_data()
    gan = GAN(netG, netD)
    optimizerD = torch.optim.Adam(netD.parameters(), lr=lr_d, betas=(0.5, 0.999))
    optimizerG = torch.optim.SGD(netG.parameters(), lr=lr_g, momentum=0.9)
    bf16 = lambda: torch.autocast('cpu', dtype=torch.bfloat16)
    weights = lambda: [t.detach() for t in (*gan.parameters(), *gan.buffers())]
    def step(net, opt, rows):
        if n_acc is not None and rows != n_acc:
            for p in net.parameters(): p.grad.mul_(n_acc / rows)        # the mean over the rows it summed
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step(); opt.zero_grad()
    ema, rows = None, 0
    for epoch in range(n_epoch):
        for i, (real, _) in enumerate(dataloader):
            if (epoch, i) == skip: continue
            rows += len(real)
            steps = n_acc is None or rows >= n_acc or i == len(dataloader) - 1
            weight = 1. if n_acc is None else len(real) / n_acc
            with bf16():
                out_real = netD(real)
                fake = netG(torch.randn(len(real), nz, 1, 1))
                errD = gan_loss((out_real, netD(fake.detach())), None)
            (errD * weight).backward(inputs=list(netD.parameters()))
            if steps: step(netD, optimizerD, rows)
            with bf16(): errG = gan_loss((netD(fake),), None)
            (errG * weight).backward(inputs=list(netG.parameters()))
            if not steps: continue
            step(netG, optimizerG, rows)
            rows = 0
            if ema is None: ema = [w.clone() for w in weights()]
            else:
                pairs = list(zip(ema, weights()))
                floats = [(a, w) for a, w in pairs if a.is_floating_point()]
                torch._foreach_lerp_([a for a, _ in floats], [w for _, w in floats], 1 - decay)
                for a, w in pairs:
                    if not a.is_floating_point(): a.copy_(w)
    return {k: v.clone() for k, v in gan.state_dict().items()}, ema

# learncb's port: the lines below are the whole of it, model and data aside
class GAN(nn.Module):
    def __init__(self, G, D): super().__init__(); self.G, self.D = G, D

class DCGANStep(Step):
    "Each batch, D's turn (real images against fakes), then G's (fakes that D takes for real)"
    turns = ('D', 'G')
    def predict(self):
        learn, gan = self.learn, self.learn.model
        if learn.turn == 'D':
            real = gan.D(learn.x)
            self.fake = gan.G(torch.randn(len(learn.x), nz, 1, 1))
            learn.pred = real, gan.D(self.fake.detach())
        else: learn.pred = (gan.D(self.fake),)

def gan_loss(pred, _):
    """D's turn: its outputs on real images against 1, on fakes against 0; G's turn: D's output on fakes
    against 1"""
    return sum(F.binary_cross_entropy(p, torch.full_like(p, t)) for p, t in zip(pred, (1., 0.)))

class GANLearner(Learner): step_class = DCGANStep

def port(lr_d=2e-4, lr_g=1e-2, **kwargs):
    netG, netD, dl = nets_and_data()
    return GANLearner(DataLoaders(dl), GAN(netG, netD), gan_loss, **{
        'lr': {'D': lr_d, 'G': lr_g},
        'opt_func': {'D': partial(torch.optim.Adam, betas=(0.5, 0.999)), 'G': partial(torch.optim.SGD,
        momentum=0.9)},
        'splitter': lambda m: {'D': m.D.parameters(), 'G': m.G.parameters()}, **kwargs})

def port_state(learn):
    gan = learn.model
    return {'G': gan.G.state_dict(), 'D': gan.D.state_dict(), 'opt': learn.opt.state_dict()}

# python gan_port.py FOLDER [--kill ITER] [--resume]: a checkpointed fit of 2 epochs
if __name__ == '__main__':
    import os, signal
    folder, args = sys.argv[1], sys.argv[2:]
    class KillAt(Callback):
        order = 99
        def after_batch(self):
            if self.train_iter == int(args[args.index('--kill') + 1]): os.kill(os.getpid(), signal.SIGKILL)
    learn = port(path=folder)
    cbs = [CheckpointCallback(every_n_steps=1)] + ([KillAt()] if '--kill' in args else [])
    learn.fit(2, cbs=cbs, resume=True if '--resume' in args else None)
    torch.save(port_state(learn), os.path.join(folder, 'final.pt'))
