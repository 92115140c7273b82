"Several optimizers (a GAN: Adam for D, SGD for G) and closure optimizers (LBFGS) port bit for bit"
import copy, math, signal
from functools import partial
import numpy as np, pytest, torch
from torch import nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves
from learncb.all import *
from learncb.test_utils import synth_learner
from conftest import run_script
import gan_port

def same(a, b):
    "Whether two nests of tensors and numbers are equal, bit for bit"
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x,
                                      y in zip(la, lb))

def test_the_dcgan_port_with_adam_for_d_and_sgd_for_g_equals_its_hand_written_loop():
    ref = gan_port.hand_written()
    learn = gan_port.port()
    learn.fit(2)
    assert isinstance(learn.opt['D'], torch.optim.Adam) and isinstance(learn.opt['G'], torch.optim.SGD)
    assert learn.opt['D'].param_groups[0]['lr'] == 2e-4 and learn.opt['G'].param_groups[0]['lr'] == 1e-2
    assert same(ref, gan_port.port_state(learn))
    assert learn.train_iter == 8 and len(learn.recorder.losses) == 8  # one loss a batch: D's and G's summed

def test_the_dcgan_port_killed_mid_epoch_and_resumed_equals_the_hand_written_loop(tmp_path):
    ref = gan_port.hand_written()
    killed = run_script(gan_port.__file__, tmp_path, '--kill', '5')      # epoch 1, after its first batch
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run_script(gan_port.__file__, tmp_path, '--resume')
    assert resumed.returncode == 0, resumed.stderr
    assert same(ref, torch.load(tmp_path/'final.pt'))

def test_each_turn_fires_the_step_events_with_its_optimizer_and_the_batch_events_once():
    learn = gan_port.port()
    seen = []
    log = lambda event: (lambda cb: seen.append((event, cb.turn)))
    events = ('before_batch', 'after_loss', 'before_backward', 'after_backward', 'before_step', 'after_step',
              'after_batch')
    learn.fit(1, cbs=Callback(**{e: log(e) for e in events}))
    one_batch = [('before_batch', None)] + [(e, t) for t in 'DG' for e in events[1:-1]] + [('after_batch',
        None)]
    assert seen == one_batch * 4 and learn.turn is None

def test_several_optimizers_take_an_lr_per_name_and_a_schedule_moves_each():
    learn = gan_port.port()
    learn.fit_one_cycle(1, lr_max={'D': 1e-3, 'G': 1e-1})
    lrs, moms = learn.param_scheduler.hps['lr'], learn.param_scheduler.hps['mom']
    assert lrs[0] == pytest.approx([1e-3 / 25, 1e-1 / 25]) and len(lrs) == 4
    assert all(g == pytest.approx(100 * d) for d, g in lrs) and lrs[1][0] > lrs[0][0]
    # 'mom': Adam's betas[0], SGD's momentum
    d, g = learn.opt['D'].param_groups[0], learn.opt['G'].param_groups[0]
    assert (d['lr'] == lrs[-1][0] and g['lr'] == lrs[-1][1]
            and d['betas'][0] == g['momentum'] == moms[-1] != 0.9)
    learn.fit(1, lr=3e-4)
    assert [pg['lr'] for pg in learn.opt.param_groups] == [3e-4, 3e-4]

def test_a_checkpoint_of_several_optimizers_loads_only_into_the_same_names(tmp_path):
    learn = gan_port.port(path=tmp_path)
    learn.fit(1)
    learn.save('gan')
    other = gan_port.port(path=tmp_path)
    other.load('gan')
    assert same(learn.opt.state_dict(), other.opt.state_dict())
    renamed = gan_port.GANLearner(learn.dls, learn.model, gan_port.gan_loss, path=tmp_path,
                                  splitter=lambda m: {'disc': m.D.parameters(), 'gen': m.G.parameters()})
    with pytest.raises(ValueError, match=r"optimizers \['D', 'G'\], this learner has \['disc', 'gen'\]"):
        renamed.load('gan')

@pytest.mark.parametrize('kwargs, match', [
    (dict(lr={'D': 1e-3}), r"lr gives the optimizers \['D'\], but the splitter names 'G' too"),
    (dict(opt_func={'D': torch.optim.Adam}), r"opt_func gives the optimizers \['D'\], but the splitter names "
                                             r"'G' too"),
    (dict(splitter=lambda m: {'D': m.D.parameters(), 'G': m.D}), r"returned Discriminator for the optimizer "
                                                                 r"'G'")])
def test_several_optimizers_misnamed_say_which_name(kwargs, match):
    learn = gan_port.port(**kwargs)
    with pytest.raises((ValueError, TypeError), match=match): learn.fit(1)

def test_an_lr_per_name_with_one_optimizer_says_how_to_have_several():
    learn = synth_learner(lr={'D': 1e-3})
    with pytest.raises(ValueError, match="one optimizer: pass one lr, or a splitter that returns"):
        learn.fit(1)

# PyTorch's time_sequence_prediction: LSTM cells in float64, trained by LBFGS on sine waves
class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1, self.lstm2, self.linear = nn.LSTMCell(1, 51), nn.LSTMCell(51, 51), nn.Linear(51, 1)
    def forward(self, input, future=0):
        outputs = []
        h_t, c_t, h_t2, c_t2 = (torch.zeros(input.size(0), 51, dtype=torch.double) for _ in range(4))
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs += [self.linear(h_t2)]
        for i in range(future):
            h_t, c_t = self.lstm1(outputs[-1], (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs += [self.linear(h_t2)]
        return torch.cat(outputs, dim=1)

def sine_waves(T=20, L=60, N=12):
    "The example's data (generate_sine_wave.py), smaller: N waves of L points, shifted at random"
    rng = np.random.RandomState(2)
    x = np.empty((N, L), 'int64')
    x[:] = np.arange(L) + rng.randint(-4 * T, 4 * T, N).reshape(N, 1)
    data = torch.from_numpy(np.sin(x / 1.0 / T).astype('float64'))
    return data[3:, :-1], data[3:, 1:], data[:3, :-1], data[:3, 1:]

def seeded_sequence():
    torch.manual_seed(0)
    seq = Sequence().double()
    calls = []
    seq.register_forward_hook(lambda *_: calls.append(1))
    return seq, calls

def test_lbfgs_trains_with_the_default_step_as_time_sequence_prediction_does_by_hand():
    input, target, test_input, test_target = sine_waves()
    seq, calls = seeded_sequence()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=5)
    for i in range(3):
        def closure():
            optimizer.zero_grad()
            loss = criterion(seq(input), target)
            loss.backward()
            return loss
        optimizer.step(closure)
        with torch.no_grad(): test_loss = criterion(seq(test_input), test_target)
    ref, ref_calls = seq.state_dict(), len(calls)

    seq, calls = seeded_sequence()
    learn = Learner(DataLoaders([(input, target)], [(test_input, test_target)]), seq, nn.MSELoss(),
                    opt_func=partial(torch.optim.LBFGS, lr=0.8, max_iter=5))
    learn.fit(3)
    assert type(learn.step) is Step and same(ref, seq.state_dict())
    assert len(calls) == ref_calls  # the closure computes the batch again as often as by hand, no more
    assert learn.recorder.values[-1][1] == pytest.approx(test_loss.item(), rel=1e-6)

class SpikeAt(Callback):
    "G's loss NaN at batch `at` (epoch, batch): after D stepped on it, so a rollback must undo both turns"
    def __init__(self, at): self.at = at
    def after_loss(self):
        learn = self.learn
        if learn.training and learn.turn == 'G' and (learn.epoch, learn.iter) == self.at:
            learn.loss_grad = learn.loss_grad * torch.nan
            learn.loss = learn.loss_grad.detach()

def gan_with_tricks(*cbs):
    """The port with bf16, each turn's gradients clipped, an EMA of the weights; the training weights and the
    average"""
    learn = gan_port.port()
    ema = EMACallback(0.9, validate=False)
    learn.fit(2, cbs=[MixedPrecision('bf16'), GradientClip(0.5), ema, *cbs])
    average = {k: v.clone() for k, v in learn.model.state_dict().items()}
    ema.swap()
    return learn, {k: v.clone() for k, v in learn.model.state_dict().items()}, average

def close(ref, got, tol=1e-6):
    within = lambda k, v: ((got[k] - v).abs().max() <= tol * v.abs().max().clamp_min(1e-12)).item()
    return all(within(k, v) for k, v in ref.items()
               if v.is_floating_point())

def test_a_gan_in_bf16_with_clipped_gradients_and_an_ema_and_a_spike_rolled_back_over_both_turns():
    """Each turn autocast and clipped (its own optimizer's gradients), the EMA once a batch, the spike's batch
    left out"""
    ref, ref_ema = gan_port.hand_written_with_tricks(skip=(0, 2))
    guard = SpikeGuard(check_every=1, snapshot_every=1, warmup=0)
    learn, weights, average = gan_with_tricks(guard, SpikeAt((0, 2)))
    assert learn.skipped_batches == ((0, 2),)
    assert close(ref, weights)
    names = [k for k, _ in (*learn.model.named_parameters(), *learn.model.named_buffers())]
    assert close(dict(zip(names, ref_ema)), average)

def test_gradient_accumulation_with_turns_steps_each_optimizer_on_the_mean_of_its_rows():
    ref, ref_ema = gan_port.hand_written_with_tricks(n_acc=32)
    learn, weights, average = gan_with_tricks(GradientAccumulation(32))
    assert close(ref, weights)

class OneStepOnly(Callback):
    "A callback of the user's that acts on the one optimizer step of a batch"
    takes_turns = False

@pytest.mark.parametrize('cb', [OneStepOnly()], ids=lambda cb: type(cb).__name__)
def test_a_callback_of_the_one_step_of_a_batch_is_refused_with_turns_before_the_first_batch(cb):
    learn = gan_port.port()
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with pytest.raises(ValueError, match=f"^{type(cb).__name__}: acts on the one optimizer step of a batch, "
                                         f"and DCGANStep steps 2 optimizers in turn"): learn.fit(1, cbs=cb)
    assert learn.train_iter == 0 and all(torch.equal(v, learn.model.state_dict()[k]) for k,
                                         v in before.items())

def test_turns_need_optimizers_of_those_names():
    learn = gan_port.port(splitter=None, opt_func=torch.optim.Adam, lr=1e-3)
    with pytest.raises(ValueError, match=r"DCGANStep takes turns \('D', 'G'\), but learn.opt has no "
                                         r"optimizer "
                                         r"\['D', 'G'\] \(its optimizers: Adam\): give the splitter a dict"):
        learn.fit(1)

def test_a_compiled_step_refuses_a_closure_optimizer():
    learn = synth_learner(opt_func=partial(torch.optim.LBFGS, lr=0.1))
    learn.compile(step=True)
    with pytest.raises(ValueError, match="LBFGS's step takes a closure"): learn.fit(1)

def test_a_torch_scheduler_steps_its_optimizer_once_a_batch_and_a_step_schedule_counts_batches():
    learn = gan_port.port()
    sched = LRSchedulerCallback(lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                                opt_name='G')
    by_step = ParamScheduler({'mom': lambda pos: 0.9 - 0.1 * pos / 8}, by='step')
    learn.fit(1, cbs=[sched, by_step])
    assert (learn.opt['G'].param_groups[0]['lr'] == 1e-2 * 0.5 ** 4
            and learn.opt['D'].param_groups[0]['lr'] == 2e-4)
    assert by_step.n_steps == 4 and by_step.hps['mom'] == pytest.approx([0.9 - 0.1 * i / 8 for i in range(4)])
    with pytest.raises(ValueError, match=r"several optimizers, \['D', 'G'\]: say which one the scheduler "
                                         r"steps"):
        learn.fit(1, cbs=LRSchedulerCallback(lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1)))

def test_the_summary_names_each_optimizer_and_a_model_without_forward_lists_its_layers():
    learn = gan_port.port()
    text = str(learn.summary())
    assert "no forward of its own" in text and "G.main.0" in text and "D: partial(Adam" in text
    learn.create_opt()
    text = str(learn.summary())
    assert "Optimizers: 2 (D, G)\n  'D': Adam, 1 param group\n    group 0: lr 0.0002" in text
    assert "  'G': SGD, 1 param group\n    group 0: lr 0.01, wd 0 (4,528 params)" in text

# The notes a port met
def test_a_column_output_against_flat_targets_is_told_once_a_fit():
    x = torch.randn(64, 3); y = (x.sum(1) > 0).float()
    dls = DataLoaders(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16))
    learn = Learner(dls, nn.Sequential(nn.Linear(3, 1), nn.Sigmoid()), nn.MSELoss())
    with pytest.warns(UserWarning, match=r"output has shape \(16, 1\) and the targets "
                                         r"\(16,\).*nn.Flatten\(0\)") as w:
        learn.fit(1)
    assert sum('output has shape' in str(m.message) for m in w) == 1

def test_a_loss_that_fails_on_the_wrong_target_is_told_what_pred_and_targets_were():
    """PyTorch's vae: the loader yields (image, label), the loss needs the image, and the model returns 3
    tensors"""
    x = torch.rand(32, 12)
    dls = DataLoaders(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(32,
        dtype=torch.long)), batch_size=8))
    class VAE(nn.Module):
        def __init__(self): super().__init__(); self.enc, self.dec = nn.Linear(12, 4), nn.Linear(2, 12)
        def forward(self, x):
            mu, logvar = self.enc(x).chunk(2, dim=1)
            return torch.sigmoid(self.dec(mu)), mu, logvar
    def vae_loss(out, y):
        recon, mu, logvar = out
        return F.binary_cross_entropy(recon, y, reduction='sum') - 0.5 * torch.sum(
            1 + logvar - mu.pow(2) - logvar.exp())
    learn = Learner(dls, VAE(), vae_loss)
    with pytest.raises(Exception) as e: learn.fit(1)
    notes = '\n'.join(getattr(e.value, '__notes__', []))
    assert "got pred = a tuple of 3 tensors" in notes and "targets = a tuple of 1 tensor" in notes, notes
    assert ("(batch[1:])" in notes and "learn.xb" in notes and "(x, x)" in notes and "HiddenStateCallback"
            in notes)

def test_a_float64_models_losses_stay_float64():
    x = torch.randn(64, 3, dtype=torch.float64); y = x.sum(1, keepdim=True) + 1e-9
    dls = DataLoaders(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16),
                      [(x, y)])
    learn = Learner(dls, nn.Linear(3, 1).double(), nn.MSELoss(), opt_func=torch.optim.SGD, lr=0.)
    learn.fit(1)
    with torch.no_grad(): exact = F.mse_loss(learn.model(x), y).item()
    assert learn.recorder.values[-1][1] == exact            # float32 would round it

def test_lr_find_and_freeze_act_on_every_optimizer():
    learn = synth_learner(splitter=lambda m: {'w': [m.weight], 'b': [m.bias]},
                          opt_func={'w': torch.optim.Adam, 'b': torch.optim.SGD})
    lrs = learn.lr_find(num_it=10, show_plot=False)
    assert len(learn.lr_finder.lrs) >= 2 and lrs.valley > 0
    learn.freeze()
    # the first one's group frozen
    assert not learn.model.weight.requires_grad and learn.model.bias.requires_grad
    gan = gan_port.port()                      # with turns: a point of its curve a batch (4 of 16 rows here)
    gan.lr_find(num_it=4, show_plot=False)
    lrs = gan.lr_finder.lrs
    assert len(lrs) == 4 and lrs == sorted(lrs) and gan.train_iter == 0

def body_and_head(**kwargs):
    torch.manual_seed(0)
    return synth_learner(model=nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2)), **kwargs)

capabilities = {'none': [], 'clip': [GradientClip(0.1)], 'accumulation': [GradientAccumulation(32)],
                'bf16': [MixedPrecision('bf16')], 'terminate_on_nan': [TerminateOnNaNCallback()],
                'spike_guard': [SpikeGuard()], 'ema': [EMACallback(0.9)], 'microbatch': [AutoMicrobatch()],
                'swa': [SWACallback(start_epoch=1, swa_lr=[1e-3, 2e-3])]}      # an SWALR for each optimizer

@pytest.mark.parametrize('cbs', capabilities.values(), ids=capabilities.keys())
@pytest.mark.parametrize('opt_func', [partial(torch.optim.SGD, momentum=0.9), torch.optim.Adam], ids=['sgd',
    'adam'])
def test_two_optimizers_of_one_class_train_as_the_one_optimizer_of_all_parameters(cbs, opt_func):
    """A capability means the same with several optimizers (one step a batch): the fit equals the
    one-optimizer fit"""
    one = body_and_head(opt_func=opt_func)
    one.fit_one_cycle(2, cbs=[copy.deepcopy(cb) for cb in cbs])
    two = body_and_head(opt_func=opt_func, splitter=lambda m: {'body': m[0].parameters(),
                                                               'head': m[2].parameters()})
    two.fit_one_cycle(2, cbs=cbs)
    assert isinstance(two.opt, NamedOptimizers) and same(one.model.state_dict(), two.model.state_dict())
    assert one.recorder.losses == two.recorder.losses

class EpochWeights(Callback):
    "The training weights at the end of each epoch"
    order = Order.FINAL
    def before_fit(self): self.seen = []
    def after_epoch(self): self.seen.append({k: v.clone() for k, v in self.learn.model.named_parameters()})

def test_swa_with_turns_anneals_each_optimizer_and_averages_every_epoch_from_its_start():
    "A GAN under SWA: each optimizer's lr annealed by its own SWALR to its swa_lr; the average of epochs 1, 2"
    learn, seen = gan_port.port(), EpochWeights()
    learn.fit(3, cbs=[SWACallback(start_epoch=1, swa_lr=[1e-3, 5e-3], update_bn=False), seen])
    assert [g['lr'] for g in learn.opt.param_groups] == [1e-3, 5e-3]           # D's, G's
    for k, v in learn.model.named_parameters():
        assert torch.allclose(v, (seen.seen[1][k] + seen.seen[2][k]) / 2, rtol=1e-6, atol=1e-7), k
