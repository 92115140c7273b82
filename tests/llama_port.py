"""PyTorch's distributed/tensor_parallelism/fsdp_tp_example.py, at a size the CPU runs: a small Llama (written
here with the example's module names: tok_embeddings, layers.N.attention.wq, ..., norm, output), the example's
TP plan (its keys for every layer, as `layers.*`), and the example's loop on a 2x2 mesh (with the gradients
zeroed after each step, which the example leaves out). tests/distributed/model_parallel_script.py runs it."""
import math
import torch, torch.nn.functional as F
from torch import nn

VOCAB,SEQ,ROWS,ITERS = 64,16,8,6

def local(t):
    "torch's attention on the CPU has no DTensor rule: this rank's heads, as a plain tensor"
    return t.to_local() if hasattr(t, 'to_local') else t

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps,self.weight = eps,nn.Parameter(torch.ones(dim))
    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

def rotary(x, cos, sin):
    "Rotary position embedding: each pair of features turned by its position's angle"
    a,b = x[..., ::2],x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)

class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq,self.wk,self.wv,self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
    def forward(self, x, cos, sin):
        bs,n,_ = x.shape
        heads = lambda w: local(w(x)).view(bs, n, -1, self.head_dim).transpose(1, 2)
        q,k,v = heads(self.wq),heads(self.wk),heads(self.wv)
        cos,sin = local(cos),local(sin)
        out = F.scaled_dot_product_attention(rotary(q, cos, sin), rotary(k, cos, sin), v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, n, -1))

class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1,self.w3 = nn.Linear(dim, hidden, bias=False),nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
    def forward(self, x): return self.w2(F.silu(self.w1(x)) * self.w3(x))

class Block(nn.Module):
    def __init__(self, dim, n_heads, hidden):
        super().__init__()
        self.attention_norm,self.attention = RMSNorm(dim),Attention(dim, n_heads)
        self.ffn_norm,self.feed_forward = RMSNorm(dim),FeedForward(dim, hidden)
    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

class Transformer(nn.Module):
    def __init__(self, vocab=VOCAB, dim=32, n_layers=2, n_heads=4, hidden=64, max_len=SEQ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm,self.output = RMSNorm(dim),nn.Linear(dim, vocab, bias=False)
        hd = dim // n_heads
        angle = torch.arange(max_len)[:, None] / 10000 ** (torch.arange(0, hd, 2) / hd)
        self.register_buffer('cos', angle.cos(), persistent=False)
        self.register_buffer('sin', angle.sin(), persistent=False)
    def forward(self, tokens):
        h,n = self.tok_embeddings(tokens),tokens.shape[1]
        for layer in self.layers: h = layer(h, self.cos[:n], self.sin[:n])
        return self.output(self.norm(h)).float()

def tp_plan():
    "The example's plan: the embedding, norm and output, and each layer's (one key for all, `layers.*`)"
    from torch.distributed.tensor import Shard, Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, PrepareModuleInput,
                                                   SequenceParallel)
    return {'tok_embeddings': RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            'norm': SequenceParallel(),
            'output': ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            'layers.*.attention_norm': SequenceParallel(),
            'layers.*.attention': PrepareModuleInput(input_layouts=(Shard(1), Replicate(), Replicate()),
                                                     desired_input_layouts=(Replicate(),) * 3),
            'layers.*.attention.wq': ColwiseParallel(use_local_output=False),
            'layers.*.attention.wk': ColwiseParallel(use_local_output=False),
            'layers.*.attention.wv': ColwiseParallel(use_local_output=False),
            'layers.*.attention.wo': RowwiseParallel(output_layouts=Shard(1)),
            'layers.*.ffn_norm': SequenceParallel(),
            'layers.*.feed_forward': PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),)),
            'layers.*.feed_forward.w1': ColwiseParallel(),
            'layers.*.feed_forward.w2': RowwiseParallel(output_layouts=Shard(1)),
            'layers.*.feed_forward.w3': ColwiseParallel()}

def tokens(i, dp_rank):
    "The example's batch at iteration `i` on data-parallel rank `dp_rank`: random tokens seeded from both"
    return torch.randint(VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(i + dp_rank))

def example_loop(dp=2, tp=2):
    "The example's own loop (its gradients zeroed after each step); every rank's whole weights after it"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh('cpu', (dp, tp), mesh_dim_names=('dp', 'tp'))
    torch.manual_seed(0)
    model = Transformer()
    parallelize_module(model, mesh['tp'], tp_plan())
    fully_shard(model, mesh=mesh['dp'])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    for i in range(ITERS):
        model(tokens(i, mesh['dp'].get_local_rank())).sum().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor() for k,v in model.state_dict().items()}
