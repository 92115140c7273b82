"Training tweaks: gradient accumulation, clipping, mixed precision, moving modules, channels last"
import pytest, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from learncb.all import *
from learncb.callbacks.training import *
from conftest import synth_learner, synth_dls, EventLog, SyncCounter

class CountingSGD(torch.optim.SGD):
    "SGD that counts the real calls of `step`"
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.n_steps = 0
    def step(self, *args, **kw):
        self.n_steps += 1
        return super().step(*args, **kw)

def mlp():
    return nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))

def learner(bs=8, n_train=128, cbs=None, model=None, dls=None, **kw):
    "A learner with plain SGD (no momentum: its steps depend only on the gradient) on a small MLP"
    learn = synth_learner(cbs=cbs, dls=dls or synth_dls(n_train=n_train, bs=bs), opt_func=CountingSGD, **kw)
    torch.manual_seed(1)
    learn.model = model if model is not None else mlp()
    return learn

def weights(learn): return torch.cat([p.detach().flatten() for p in learn.model.parameters()])

class Batches(Callback):
    "Writes down, per training batch, the loss the learner computed and whether the optimizer stepped"
    order = 100
    def __init__(self): self.losses,self.stepped,self._cancelled = [],[],False
    def after_loss(self):
        if self.learn.training: self.losses.append(self.learn.loss.clone())
    def after_cancel_step(self): self._cancelled = True
    def after_step(self):
        self.stepped.append(not self._cancelled)
        self._cancelled = False

# ---------------------------------------------------------------- GradientAccumulation

def test_accumulation_equals_large_batches():
    small = learner(bs=8, cbs=[GradientAccumulation(32), Batches()])
    w0 = weights(small)
    small.fit(2)
    large = learner(bs=32)
    assert torch.equal(weights(large), w0)                  # same start
    large.fit(2)
    assert torch.allclose(weights(small), weights(large), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(weights(small), w0)
    assert small.opt.n_steps == large.opt.n_steps == 8       # 128 samples / 32, twice
    assert small.batches.stepped == [False, False, False, True] * 8
    assert small.train_iter == 32

def test_recorded_losses_are_not_scaled():
    learn = learner(bs=8, cbs=[GradientAccumulation(32), Batches()])
    torch.manual_seed(1); m0 = mlp()                         # the weights before the first step
    learn.fit(1)
    x, y = next(iter(DataLoader(learn.dls.train.dataset, batch_size=32)))
    expected = [nn.functional.cross_entropy(m0(x[i:i+8]), y[i:i+8]) for i in range(0, 32, 8)]
    assert torch.allclose(torch.stack(learn.batches.losses[:4]), torch.stack(expected).detach(), atol=1e-6)
    mean = torch.stack(learn.batches.losses).mean().item()   # equal batches: the epoch's loss is their mean
    assert learn.recorder.values[0][0] == pytest.approx(mean, rel=1e-5)

def test_loss_grad_is_replaced_not_changed_in_place():
    seen = {}
    def before(self):
        seen['orig'], seen['value'] = self.learn.loss_grad, self.learn.loss_grad.detach().clone()
    def after(self): seen['new'], seen['loss'] = self.learn.loss_grad, self.learn.loss
    learn = learner(bs=8, cbs=[GradientAccumulation(32), Callback(before_backward=before, order=4),
                               Callback(before_backward=after, order=6)])
    learn.fit(1)
    assert seen['new'] is not seen['orig'] and torch.equal(seen['orig'].detach(), seen['value'])
    assert torch.allclose(seen['new'].detach(), seen['loss'] * 8 / 32)
    assert torch.equal(seen['loss'], seen['value'])

def test_remainder_steps_at_the_end_of_each_epoch():
    "64 samples, n_acc=48: a step of 48 samples, then one of 16 at the end of the epoch, like batch_size=48"
    acc = learner(bs=8, n_train=64, cbs=[GradientAccumulation(48), Batches()])
    acc.fit(2)
    large = learner(bs=48, n_train=64)
    large.fit(2)
    assert acc.batches.stepped == ([False] * 5 + [True, False, True]) * 2
    assert torch.allclose(weights(acc), weights(large), rtol=1e-5, atol=1e-7)
    assert acc.opt.n_steps == 4

def test_batch_size_that_does_not_divide_n_acc():
    "bs=12, n_acc=32: a step every 3 batches (36 samples), with the mean gradient of those 36 samples"
    acc = learner(bs=12, n_train=72, cbs=[GradientAccumulation(32), Batches()])
    acc.fit(1)
    large = learner(bs=36, n_train=72)
    large.fit(1)
    assert acc.batches.stepped == [False, False, True] * 2
    assert torch.allclose(weights(acc), weights(large), rtol=1e-5, atol=1e-7)

class NoLen:
    "A dataloader without `__len__`: the learner cannot know which batch is the last"
    def __init__(self, dl): self.dl = dl
    def __iter__(self): return iter(self.dl)

def test_without_len_the_remainder_carries_over_then_is_dropped():
    dls = synth_dls(n_train=64, bs=8)
    grads_at_end = []
    learn = learner(dls=DataLoaders(NoLen(dls.train), dls.valid),
                    cbs=[GradientAccumulation(24), Batches(),
                         Callback(after_train=lambda self: grads_at_end.append(
        self.model[0].weight.grad is not None))])
    learn.fit(2)
    # 8 batches of 8 per epoch: steps at 24 and 48 samples, 16 left, carried into the second epoch
    assert learn.batches.stepped == [False, False, True] * 2 + [False, False] + [True] + [False, False,
        True] * 2 + [False]
    assert grads_at_end == [True, True]                     # a remainder was waiting at the end of each epoch
    assert all(p.grad is None for p in learn.model.parameters())   # and was dropped at the end of the fit
    assert learn.gradient_accumulation.count == 0

def test_accumulation_then_clipping_clips_the_whole_gradient():
    "Clipping acts once, on the accumulated gradient: the result equals clipping the large batch's gradient"
    acc = learner(bs=8, cbs=[GradientAccumulation(32), GradientClip(0.05)])
    acc.fit(1)
    large = learner(bs=32, cbs=GradientClip(0.05))
    large.fit(1)
    assert torch.allclose(weights(acc), weights(large), rtol=1e-5, atol=1e-7)
    # deciding after the clip clips each small batch: different
    late = GradientAccumulation(32); late.order = 25
    wrong = learner(bs=8, cbs=[late, GradientClip(0.05)])
    wrong.fit(1)
    assert not torch.allclose(weights(wrong), weights(large), rtol=1e-5, atol=1e-7)

def test_a_run_resumed_inside_a_group_finishes_it(tmp_path):
    """`count` and `items` are checkpointed with the gradients: a run stopped after 3 of 4 batches of a group
    resumes exactly"""
    class Crash(Exception): pass
    def save_then_crash(self):
        if self.train_iter == 7:  # 7 batches of 8 done: the second group of 32 is 3/4 full
            state = self.learn.gradient_accumulation.state_dict()
            assert state['count'] == 24 and int(state['items']) == 24     # the rows, and what the loss counts
            self.learn.save_checkpoint(tmp_path/'mid.pth')
            raise Crash()
    full = learner(bs=8, n_train=64, cbs=GradientAccumulation(32))
    full.fit(2)
    crashed = learner(bs=8, n_train=64, cbs=[GradientAccumulation(32), Callback(after_batch=save_then_crash,
        run_valid=False)])
    with pytest.raises(Crash): crashed.fit(2)
    resumed = learner(bs=8, n_train=64, cbs=GradientAccumulation(32))
    resumed.fit(2, resume=tmp_path/'mid.pth')
    assert torch.allclose(weights(resumed), weights(full), rtol=1e-6, atol=1e-7)

@pytest.mark.parametrize('n_acc', [0, -4, 2.5, '32', True, None])
def test_n_acc_must_be_a_positive_int(n_acc):
    with pytest.raises(ValueError, match=r"n_acc .*must be a positive int, not " + repr(n_acc).replace('.',
            r'\.')):
        GradientAccumulation(n_acc)

def test_accumulation_does_not_touch_validation():
    learn = learner(bs=8, cbs=GradientAccumulation(32))
    learn.fit(1)
    w = weights(learn)
    learn.validate()
    assert torch.equal(weights(learn), w) and learn.gradient_accumulation.count == 0

# ---------------------------------------------------------------- GradientClip

class Grads(Callback):
    "Copies of the gradients just before (order 19) or just after (order 21) `GradientClip` acts"
    def __init__(self, order): self.order,self.seen = order,[]
    def before_step(self):
        self.seen.append(torch.cat([p.grad.flatten() for p in self.learn.model.parameters()]))

@pytest.mark.parametrize('norm_type', [2., 1., float('inf')])
def test_clip_bounds_the_norm_and_keeps_the_direction(norm_type):
    before, after = Grads(19), Grads(21)
    big = Callback(before_backward=lambda self: setattr(self.learn, 'loss_grad', self.learn.loss_grad * 1000))
    learn = learner(cbs=[GradientClip(0.3, norm_type), before, after, big])
    learn.fit(1)
    for g0, g1 in zip(before.seen, after.seen):
        assert g0.norm(norm_type) > 0.3                      # clipping was needed
        assert g1.norm(norm_type) <= 0.3 * (1 + 1e-5)
        assert g1.norm(norm_type) == pytest.approx(0.3, rel=1e-4)
        assert torch.allclose(g1 / g1.norm(), g0 / g0.norm(), atol=1e-6)

def test_clip_leaves_small_gradients_alone():
    before, after = Grads(19), Grads(21)
    learn = learner(cbs=[GradientClip(1e6), before, after])
    learn.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(before.seen, after.seen))

def test_clip_arguments_are_checked():
    with pytest.raises(ValueError, match=r"max_norm must be a positive number, not 0"): GradientClip(0)
    with pytest.raises(ValueError, match=r"norm_type .* not 'l2'"): GradientClip(1., 'l2')
    assert GradientClip(norm_type='inf').norm_type == float('inf')

# ---------------------------------------------------------------- MixedPrecision

class Inside(nn.Module):
    "A model that writes down the dtype of a matmul computed inside its forward"
    def __init__(self):
        super().__init__(); self.lin, self.dtypes = nn.Linear(2, 2), []
    def forward(self, x):
        self.dtypes.append((x @ self.lin.weight.t()).dtype)
        return self.lin(x)

def test_bf16_autocast_in_forward_params_stay_float32():
    model = Inside()
    preds = set()
    learn = learner(model=model, cbs=[MixedPrecision(), Batches(),
                                      Callback(after_batch=lambda self: preds.add((self.training,
        self.pred.dtype)))])
    w0 = weights(learn)
    learn.fit(2)
    assert set(model.dtypes) == {torch.bfloat16}             # training and validation batches
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    assert not torch.equal(weights(learn), w0)
    assert learn.mixed_precision.scaler is None and learn.mixed_precision.amp_dtype('cpu') == torch.bfloat16
    # validation predictions are made float32
    assert preds == {(True, torch.bfloat16), (False, torch.float32)}
    assert all(l.dtype == torch.float32 for l in learn.batches.losses)
    assert not torch.is_autocast_enabled('cpu')
    vals = learn.recorder.values
    assert vals[1][0] < vals[0][0]                           # it learns

def test_validate_and_get_preds_outside_a_fit_use_autocast():
    model = Inside()
    learn = learner(model=model, cbs=MixedPrecision())
    learn.validate()
    preds, _ = learn.get_preds()
    assert set(model.dtypes) == {torch.bfloat16} and preds.dtype == torch.float32
    assert not torch.is_autocast_enabled('cpu')

def test_grad_scaler_on_cpu_is_available():
    "The fp16 tests below rely on torch.amp.GradScaler('cpu'), which torch has had since 2.3"
    scaler = torch.amp.GradScaler('cpu', init_scale=4.)
    p = nn.Parameter(torch.ones(2))
    scaler.scale((p * 2).sum()).backward()
    assert torch.equal(p.grad, torch.full((2,), 8.))

def fp16_learner(cbs=(), init_scale=2.**10, **kw):
    return learner(cbs=[MixedPrecision('fp16', init_scale=init_scale), *cbs], **kw)

def test_fp16_trains_with_a_scaled_loss():
    seen = []
    def grab(self): seen.append((self.learn.loss, self.learn.loss_grad.detach()))
    learn = fp16_learner(cbs=[Callback(before_backward=grab, order=11)], model=Inside())
    w0 = weights(learn)
    learn.fit(1)
    mp = learn.mixed_precision
    assert set(learn.model.dtypes) == {torch.float16}
    assert isinstance(mp.scaler,
                      torch.amp.GradScaler) and mp.skipped_steps == 0 and mp.scaler.get_scale() == 2.**10
    loss, scaled = seen[0]
    assert torch.allclose(scaled, loss * 2.**10)  # backward sees the scaled loss, the recorder does not
    assert learn.opt.n_steps == 16 and not torch.equal(weights(learn), w0)
    assert learn.recorder.values[0][0] < 1.  # the recorded loss is the real one, not times 1024

@pytest.mark.parametrize('how', ['grad', 'loss'])
def test_fp16_overflow_skips_the_step(how):
    def inf_grad(self):
        if self.train_iter == 2: self.learn.model[0].weight.grad[0, 0] = float('inf')
    def inf_loss(self):
        if self.train_iter == 2: self.learn.loss_grad = self.learn.loss_grad * float('inf')
    poison = Callback(after_backward=inf_grad) if how == 'grad' else Callback(before_backward=inf_loss,
        order=11)
    ws = []
    log = EventLog()
    learn = fp16_learner(cbs=[poison, log, Batches(),
                              Callback(after_batch=lambda self: ws.append(weights(self.learn)),
                                       run_valid=False)])
    learn.fit(1)
    mp = learn.mixed_precision
    assert mp.skipped_steps == 1 and mp.scaler.get_scale() == 2.**9
    assert torch.equal(ws[2], ws[1])                         # that batch did not move the weights
    assert not torch.equal(ws[3], ws[2])                     # the next one did: the inf gradient was dropped
    assert learn.batches.stepped == [True, True, False] + [True] * 13
    assert log.log.count('after_cancel_step') == 1
    assert learn.opt.n_steps == 15
    assert all(torch.isfinite(w).all() for w in ws)

def test_fp16_with_accumulation_unscales_once_per_step():
    updates = []
    class CountUpdates(Callback):
        def before_fit(self):
            scaler, update = self.learn.mixed_precision.scaler, self.learn.mixed_precision.scaler.update
            def counted(*a, **kw): updates.append(scaler.get_scale()); return update(*a, **kw)
            scaler.update = counted
    acc = fp16_learner(cbs=[GradientAccumulation(32), CountUpdates(order=11)])
    acc.fit(1)
    large = fp16_learner(bs=32)
    large.fit(1)
    assert len(updates) == 4 and acc.opt.n_steps == 4
    assert torch.allclose(weights(acc), weights(large), rtol=1e-3, atol=1e-4)

def test_a_step_cancelled_after_unscaling_is_scaled_again():
    """A callback that cancels steps after MixedPrecision: the kept gradients are put back on the scale of the
    next backward"""
    late = GradientAccumulation(32); late.order = 15
    acc = fp16_learner(cbs=[late])
    acc.fit(1)
    large = fp16_learner(bs=32)
    large.fit(1)
    assert acc.opt.n_steps == 4
    assert torch.allclose(weights(acc), weights(large), rtol=1e-3, atol=1e-4)

def test_autocast_is_closed_when_a_batch_is_cancelled():
    enabled = []
    def cancel(self):
        if self.iter == 1: raise CancelBatchException()
    learn = learner(cbs=[MixedPrecision(), Callback(after_pred=cancel),
                         Callback(after_batch=lambda self: enabled.append(torch.is_autocast_enabled('cpu')))])
    learn.fit(1)
    assert enabled and not any(enabled)

@pytest.mark.parametrize('where', ['model', 'loss'])
def test_autocast_is_closed_after_an_error(where):
    learn = learner(cbs=MixedPrecision())
    class Boom(nn.Module):
        def __init__(self, inner): super().__init__(); self.inner = inner
        def forward(self, x):
            assert torch.is_autocast_enabled('cpu')
            raise RuntimeError('boom')
    def bad_loss(pred, y):
        assert torch.is_autocast_enabled('cpu')
        raise RuntimeError('boom')
    model, loss_func = learn.model, learn.loss_func
    if where == 'model': learn.model = Boom(model)
    else: learn.loss_func = bad_loss
    with pytest.raises(RuntimeError, match='boom'): learn.fit(1)
    assert not torch.is_autocast_enabled('cpu')
    learn.model, learn.loss_func = model, loss_func
    learn.fit(1)                                              # usable again
    assert not torch.is_autocast_enabled('cpu')

def test_an_outer_autocast_is_restored():
    learn = learner(cbs=MixedPrecision())
    with torch.autocast('cpu', dtype=torch.float16):
        learn.fit(1)
        assert torch.is_autocast_enabled('cpu') and torch.get_autocast_dtype('cpu') == torch.float16
    assert not torch.is_autocast_enabled('cpu')

def test_mixed_precision_errors():
    with pytest.raises(ValueError, match=r"dtype must be torch.bfloat16.*not torch.float32"):
        MixedPrecision(torch.float32)
    with pytest.raises(ValueError, match=r"dtype must be .* not 'int8'"): MixedPrecision('int8')
    with pytest.raises(ValueError, match=r"init_scale must be a positive number, not 0"):
        MixedPrecision(init_scale=0)
    with pytest.raises(ValueError, match=r"growth_interval must be a positive int"):
        MixedPrecision(growth_interval=2.5)
    with pytest.raises(ValueError, match=r"autocast on 'cpu' does not support "
                                         r"torch.float32.*dtype=torch.float16"):
        autocast_for('cpu', torch.float32)
    learn = learner(cbs=MixedPrecision())
    learn.model.to('meta')
    # when the fit starts
    with pytest.raises(ValueError, match=r"are on the meta device.*to_empty"): learn.fit(1)

def test_scaler_state_round_trip():
    def inf_grad(self):
        if self.train_iter == 1: self.learn.model[0].weight.grad[0, 0] = float('inf')
    learn = fp16_learner(cbs=[Callback(after_backward=inf_grad)])
    learn.fit(1)
    state = learn.mixed_precision.state_dict()
    assert state['skipped_steps'] == 1 and state['scaler']['scale'] == 2.**9
    mp = MixedPrecision('fp16')
    mp.load_state_dict(state)
    assert mp.state_dict() == state                          # before any fit: kept until the scaler exists
    other = learner(cbs=mp)
    other.fit(1)
    assert mp.scaler.get_scale() == 2.**9 and mp.skipped_steps == 1

def test_fp16_run_resumed_from_a_checkpoint_keeps_its_scale(tmp_path):
    class Crash(Exception): pass
    def inf_grad(self):
        if self.train_iter == 2: self.learn.model[0].weight.grad[0, 0] = float('inf')
    def save_then_crash(self):
        if self.train_iter == 5:
            self.learn.save_checkpoint(tmp_path/'mid.pth')
            raise Crash()
    poison = lambda: Callback(after_backward=inf_grad)
    full = fp16_learner(cbs=[poison()])
    full.fit(2)
    crashed = fp16_learner(cbs=[poison(), Callback(after_batch=save_then_crash, run_valid=False)])
    with pytest.raises(Crash): crashed.fit(2)
    resumed = fp16_learner()
    resumed.fit(2, resume=tmp_path/'mid.pth')
    mp = resumed.mixed_precision
    assert (mp.skipped_steps, mp.scaler.get_scale()) == (1, 2.**9)
    assert torch.equal(weights(resumed), weights(full))

def test_scale_carries_over_to_the_next_fit():
    learn = fp16_learner()
    learn.fit(1)
    scaler = learn.mixed_precision.scaler
    learn.fit(1)
    assert learn.mixed_precision.scaler is scaler

# ---------------------------------------------------------------- MoveModulesToDeviceCallback

class Recording(nn.Module):
    "A module that writes down the devices it is moved to"
    def __init__(self):
        super().__init__(); self.register_buffer('w', torch.ones(2)); self.moves = []
    def to(self, *args, **kw):
        self.moves.append(torch.device(args[0] if args else kw['device']))
        return super().to(*args, **kw)

def test_modules_are_moved_to_the_model_device():
    learn = learner(cbs=MoveModulesToDeviceCallback())
    teacher, loss = Recording(), Recording()
    learn.teacher = teacher
    learn.loss_func = lambda pred, y: nn.functional.cross_entropy(pred, y, weight=loss.w)
    learn.extra_loss = loss
    model_moves = []
    orig_to = learn.model.to
    learn.model.to = lambda *a, **kw: model_moves.append(a) or orig_to(*a, **kw)
    learn.fit(1)
    assert teacher.moves and set(teacher.moves) == {torch.device('cpu')} and loss.moves
    assert model_moves == []                                 # the model itself is left alone
    n = len(teacher.moves)
    learn.validate()                                          # outside a fit too
    assert len(teacher.moves) == n + 1

def test_modules_follow_a_model_on_the_meta_device():
    learn = learner(cbs=MoveModulesToDeviceCallback())
    learn.loss_func = nn.CrossEntropyLoss(weight=torch.tensor([1., 3.]))
    learn.teacher = mlp()
    learn.model.to('meta')
    learn.move_modules_to_device.before_fit()
    assert learn.loss_func.weight.is_meta and all(p.is_meta for p in learn.teacher.parameters())

# ---------------------------------------------------------------- ChannelsLast

class Convs(nn.Module):
    def __init__(self):
        super().__init__(); self.conv, self.formats = nn.Conv2d(3, 4, 3, padding=1), []
    def forward(self, img, extra):
        self.formats.append((img.is_contiguous(memory_format=torch.channels_last), extra.is_contiguous()))
        return self.conv(img).mean((2, 3))[:, :2] + extra.sum() * 0

def conv_learner(cbs=None):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(16, 3, 6, 6, generator=g), torch.randn(16, 5, generator=g),
                       torch.randint(0, 2, (16,), generator=g))
    torch.manual_seed(0)
    learn = Learner(DataLoaders(DataLoader(ds, batch_size=4), DataLoader(ds, batch_size=8)), Convs(),
                    nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.1, cbs=cbs, device='cpu', n_inp=2)
    learn.remove_cb(ProgressCallback); learn.logger = lambda row: None
    return learn

def test_channels_last_converts_model_and_images_only():
    learn = conv_learner(cbs=ChannelsLast())
    learn.fit(1)
    assert learn.model.formats and all(f == (True, True) for f in learn.model.formats)
    assert learn.model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    plain = conv_learner()
    plain.fit(1)
    assert not any(f[0] for f in plain.model.formats)
    # same training, other layout
    assert torch.allclose(learn.model.conv.weight, plain.model.conv.weight, atol=1e-6)

# ---------------------------------------------------------------- speed


def syncs(n_batches):
    learn = synth_learner(dls=synth_dls(n_train=8 * n_batches, n_valid=16, bs=8), opt_func=torch.optim.SGD,
                          cbs=[GradientAccumulation(16), MixedPrecision(), GradientClip(0.5),
                               MoveModulesToDeviceCallback(), ChannelsLast()])
    with SyncCounter() as c: learn.fit(1)
    return c.counts

def test_no_host_sync_per_batch():
    few, many = syncs(40), syncs(120)
    assert few == many, f'40 batches: {dict(few)}, 120 batches: {dict(many)}'

def test_fp16_clipping_sees_unscaled_gradients():
    """GradientClip (order 20) runs after MixedPrecision (10) has unscaled: the clipped norm is max_norm, not
    max_norm/scale"""
    after = Grads(21)
    big = Callback(before_backward=lambda self: setattr(self.learn, 'loss_grad', self.learn.loss_grad * 100),
                   order=5)
    learn = fp16_learner(cbs=[GradientClip(0.3), after, big])
    learn.fit(1)
    assert learn.mixed_precision.skipped_steps == 0
    assert all(g.norm() == pytest.approx(0.3, rel=1e-3) for g in after.seen)
