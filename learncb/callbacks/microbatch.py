__all__ = ['is_oom', 'batch_len', 'split_inputs', 'cat_outputs', 'AutoMicrobatch']

import math, contextlib, warnings
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.nn.parallel import DistributedDataParallel
from ..core import *
from ..utils import *
from ..ranks import *

def is_oom(e):
    "Whether `e` is an out-of-memory error: `torch.OutOfMemoryError` (CUDA), or the CPU allocator's `RuntimeError`"
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)): return True
    return isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or 'out of memory' in str(e))

def batch_len(xs):
    "The number of items of the inputs `xs` (a pytree): the first dimension of their first tensor"
    return next((t.shape[0] for t in tree_flatten(xs)[0] if isinstance(t, torch.Tensor) and t.ndim), None)

def split_inputs(xs, size):
    "The inputs `xs` (a pytree) cut into micro-batches of `size` items: each tensor with the batch's first dimension"
    leaves,spec = tree_flatten(xs)
    n = batch_len(leaves)
    cut = lambda t,s: t[s:s+size] if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == n else t
    return [tree_unflatten([cut(t, s) for t in leaves], spec) for s in range(0, n, size)]

def cat_outputs(outs):
    "The outputs of the micro-batches joined into the whole batch's: each tensor concatenated on its first dimension"
    flat = [tree_flatten(o) for o in outs]
    joined = [torch.cat(ts) if isinstance(ts[0], torch.Tensor) and ts[0].ndim else ts[0]
              for ts in zip(*(leaves for leaves,_ in flat))]
    return tree_unflatten(joined, flat[0][1])

def _rng_of(device):
    "The state of the generators a forward on `device` draws from (dropout): the CPU's, and `device`'s"
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == 'cuda' else None)

def _set_rng(state, device):
    torch.set_rng_state(state[0])
    if state[1] is not None: torch.cuda.set_rng_state(state[1], device)

def _autocast_like(device_type):
    "A context that autocasts as the one open now does on `device_type` (nothing when none is open)"
    if not torch.is_autocast_enabled(device_type): return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type))

@contextlib.contextmanager
def _buffers_kept(model):
    "Put `model`'s buffers (BatchNorm's running statistics) back as they were on leaving"
    saved = [b.clone() for b in model.buffers()]
    try: yield
    finally:
        with torch.no_grad():
            for b,s in zip(model.buffers(), saved): b.copy_(s)

def _free_memory():
    if torch.cuda.is_available(): torch.cuda.empty_cache()

def _too_big(n, sizes):
    return (f"learncb: AutoMicrobatch split this batch of {n} items into micro-batches of {', '.join(map(str, sizes))} "
            f"items and each ran out of memory: one item does not fit. Free memory (a smaller model, MixedPrecision, "
            f"fewer activations kept) and fit again")

def _sum_grads(total, grads):
    if total is None: return list(grads)
    return [t if g is None else g if t is None else t.add_(g) for t,g in zip(total, grads)]

_slots = 64       # halvings the ranks can agree on: one slot each in the collective

class AutoMicrobatch(Callback):
    "On an out-of-memory error, split the batch into micro-batches and add up their gradients: the same step, in less memory"
    order = Order.SETUP + 1          # after DDP wraps the model; its backward runs before anyone reads the gradients
    _state_attrs = ('halvings', 'since_change', 'history')
    def __init__(self, grow_every=100):
        self.grow_every = check_int(grow_every, 'grow_every (a number of steps)', ge=1, who='AutoMicrobatch')
        self.halvings,self.valid_halvings,self.since_change,self.history = 0,0,0,[]

    # the loop's model call comes here
    def before_fit(self):
        m = self.learn.model
        if any(is_sharded(p) for p in m.parameters()): raise ValueError(
            "AutoMicrobatch does not run under FSDP yet (the ranks gather each shard in the forward, so they would "
            "have to split alike before it): fit with DDP, or with a smaller batch")
        self._outer,self.inner = m,(m.module if isinstance(m, DistributedDataParallel) else m)
        # the model's own forward, without the hooks around the call (they ran once, around the whole batch); under
        # DDP, the plain model's call: the gradients are averaged here, in one collective that carries the split too
        self._call = m.module if m is not self.inner else m.forward
        self._forward_was,m.forward = m.__dict__.get('forward'),self._forward
        self._armed,self._graph,self._leaves = False,None,None

    def after_fit(self):
        if self._forward_was is None: self._outer.__dict__.pop('forward', None)
        else: self._outer.forward = self._forward_was
        self._graph = self._leaves = self._inputs = None

    def before_batch(self): self._armed,self._cancelled = True,False
    def after_cancel_backward(self): self._cancelled = True

    def _forward(self, *args, **kw):
        "The loop's model call: the whole batch, or its micro-batches once the whole ran out of memory"
        if not self._armed: return self._call(*args, **kw)          # a callback's own call: as it is
        self._armed = False
        if not torch.is_grad_enabled(): return self._predict(args, kw)
        self._inputs,self._device = (args, kw),next((p.device for p in self.inner.parameters()), torch.device('cpu'))
        self._rng,self._cast = _rng_of(self._device),_autocast_like(self._device.type)
        self._start,self._kept = self.halvings,0
        if self.halvings and self.since_change >= self.grow_every:
            self._kept,self.halvings,self.since_change = self.halvings,0,0     # try the whole batch again
        if not self.halvings:
            try: self._graph = self._call(*args, **kw)
            except Exception as e:
                if not is_oom(e): raise
            if self._graph is not None: return self._leaves_of(self._graph)
            self._shrink()
        return self._leaves_of(self._split_forward(), split=True)

    def _leaves_of(self, out, split=False):
        "`out` with a leaf for each tensor with a graph (`split`: each float tensor): the loop's backward stops there"
        flat,spec = tree_flatten(out)
        has_grad = lambda t: (t.is_floating_point() or t.is_complex()) if split else t.requires_grad
        self._leaves = [(i, t.detach().requires_grad_()) for i,t in enumerate(flat)
                        if isinstance(t, torch.Tensor) and has_grad(t)]
        for i,l in self._leaves: flat[i] = l
        return tree_unflatten(flat, spec)

    def _size(self, n, halvings): return max(1, math.ceil(n / 2**halvings))

    def _shrink(self):
        "One more halving (straight back to the size that fitted, after a try at the whole batch failed)"
        self.halvings,self._kept = max(self.halvings + 1, self._kept),0
        _free_memory()

    def _micro(self, inputs, halvings, body, restart=lambda: None):
        "`(halvings, [body(args, kw) for each micro-batch])`, halving on an out-of-memory error until it fits"
        n,sizes = batch_len(inputs),[]
        while True:
            size = self._size(n, halvings)
            sizes.append(size)
            restart()
            try: return halvings,[body(a, k) for a,k in split_inputs(inputs, size)]
            except Exception as e:
                if not is_oom(e): raise
                if size == 1: raise add_note(e, _too_big(n, sizes))
            halvings += 1
            _free_memory()

    def _split_forward(self):
        "The whole batch's output made of its micro-batches', without a graph: the backward computes each again"
        with torch.no_grad():
            h,outs = self._micro(self._inputs, self.halvings, lambda a,k: self._call(*a, **k),
                                 lambda: _set_rng(self._rng, self._device))
        self.halvings = h
        return cat_outputs(outs)

    def _predict(self, args, kw):
        "Validation and prediction: the whole batch, or its micro-batches once the whole ran out of memory"
        if not self.valid_halvings:
            try: return self._call(*args, **kw)
            except Exception as e:
                if not is_oom(e): raise
            self.valid_halvings += 1
            _free_memory()
        self.valid_halvings,outs = self._micro((args, kw), self.valid_halvings, lambda a,k: self._call(*a, **k))
        return cat_outputs(outs)

    # the backward the loop's stopped at the outputs
    def after_backward(self):
        "Carry the loop's backward into the model: for the whole batch, or micro-batch by micro-batch"
        leaves,graph,self._leaves,self._graph = self._leaves,self._graph,None,None
        if self._cancelled or not leaves: return
        grad_outs = [(i, l.grad) for i,l in leaves if l.grad is not None]
        params = [p for p in self.inner.parameters() if p.requires_grad]
        grads = None
        if graph is not None:
            flat = tree_flatten(graph)[0]
            try: grads = torch.autograd.grad([flat[i] for i,_ in grad_outs], params, [g for _,g in grad_outs],
                                             allow_unused=True)
            except Exception as e:
                if not is_oom(e): raise
            del flat, graph
            if grads is None: self._shrink()
        if grads is None: grads = self._split_backward(params, grad_outs)
        if num_distrib() > 1: grads = self._averaged(params, grads)
        for p,g in zip(params, grads):
            if g is None: continue
            if p.grad is None: p.grad = g
            else: p.grad.add_(g)
        self._note_size()

    def _note_size(self):
        "Count the steps at this size; a new size starts the count again, and goes in `history`"
        if self.halvings == self._start: self.since_change += 1; return
        learn,self.since_change = self.learn,0
        n = batch_len(self._inputs)
        self.history.append((learn.epoch, learn.iter, self._size(n, self.halvings)))
        if self.halvings > self._start and is_rank0(): warnings.warn(
            f"AutoMicrobatch: batch {learn.iter} of epoch {learn.epoch} ({n} items) ran out of memory: micro-batches of "
            f"{self._size(n, self.halvings)} items from here (the whole batch is tried again every {self.grow_every} steps)")

    def _split_backward(self, params, grad_outs):
        "The gradients of `params`, summed over the micro-batches, each computed again with its graph"
        total,now = None,_rng_of(self._device)
        def backward(a, k):
            nonlocal total
            s = backward.start
            out = tree_flatten(self._call(*a, **k))[0]
            n = batch_len((a, k))
            grads = torch.autograd.grad([out[i] for i,_ in grad_outs], params, [g[s:s+n] for _,g in grad_outs],
                                        allow_unused=True)
            backward.start += n
            total = _sum_grads(total, grads)
        def restart():
            nonlocal total
            total,backward.start = None,0
            _set_rng(self._rng, self._device)
        with _buffers_kept(self.inner), self._cast:
            self.halvings,_ = self._micro(self._inputs, self.halvings, backward, restart)
        _set_rng(now, self._device)
        return total

    def _averaged(self, params, grads):
        "The gradients averaged over the ranks, in one collective that carries each rank's halvings too (the largest wins)"
        import torch.distributed as dist
        world,ref = num_distrib(),params[0]
        flat = torch.cat([(torch.zeros_like(p) if g is None else g).flatten().to(ref.dtype) for p,g in zip(params, grads)])
        flat.div_(world)
        agree = flat.new_zeros(_slots)
        agree[min(self.halvings, _slots - 1)] = 1
        both = torch.cat([flat, agree]).to(ref.device)
        dist.all_reduce(both)
        self.halvings = int(both[-_slots:].nonzero().max())
        out,s = [],0
        for p in params:
            out.append(both[s:s+p.numel()].view_as(p).to(p.dtype))
            s += p.numel()
        return out
