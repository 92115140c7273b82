"""Models that compute their own loss from dict batches: a tiny `transformers` BERT built from a
config (no download) on synthetic tokens."""
import pytest, torch
from torch.utils.data import DataLoader, Dataset
from fastcore.basics import noop
from learncb.all import *
from conftest import FailAfterEpoch

transformers = pytest.importorskip('transformers')

class Tokens(Dataset):
    "Sequences of 12 token ids; the label says whether token 7 is in the sequence"
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 20, (n, 12), generator=g)
        self.labels = (self.ids == 7).any(1).long()
    def __len__(self): return len(self.ids)
    def __getitem__(self, i):
        return {'input_ids': self.ids[i], 'attention_mask': torch.ones(12, dtype=torch.long),
                'labels': self.labels[i]}

def tiny_bert():
    cfg = transformers.BertConfig(vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)

def hf_learner(path='.', **kw):
    train = DataLoader(Tokens(256, 0), batch_size=32, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    valid = DataLoader(Tokens(64, 1), batch_size=32)
    learn = Learner(DataLoaders(train, valid), tiny_bert(), loss_func=None, metrics=accuracy, lr=3e-3,
                    path=path, device='cpu', **kw)
    learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, ProgressCallback)])
    learn.logger = noop
    return learn

@pytest.mark.slow
def test_the_model_loss_trains_and_metrics_and_get_preds_work():
    learn = hf_learner()
    seen = []
    learn.fit(4, cbs=Callback(after_loss=lambda self: seen.append((type(self.pred), self.yb[0].shape))
                              if not seen else None))
    assert seen[0] == (torch.Tensor, (32,))                    # pred: the logits; yb: the labels
    vals = learn.recorder.values
    assert vals[-1][0] < vals[0][0] and vals[-1][1] < vals[0][1]     # training and validation loss fall
    preds, targs = learn.get_preds()
    assert preds.shape == (64, 2) and torch.equal(targs, learn.dls.valid.dataset.labels)
    assert abs(accuracy(preds, targs).item() - vals[-1][2]) < 1e-6
    items = [learn.dls.valid.dataset[i] for i in range(3)]
    unlabelled = [{k: v for k, v in it.items() if k != 'labels'} for it in items]
    p, t = learn.get_preds(dl=DataLoader(unlabelled, batch_size=3))   # no labels: no loss, predictions only
    assert t is None and torch.allclose(p, preds[:3], atol=1e-5)

def test_a_model_without_a_loss_says_to_pass_loss_func():
    learn = hf_learner()
    learn.model.config.problem_type = None
    learn.dls.train.dataset.__class__ = type('NoLabels', (Tokens,), {'__getitem__': lambda self, i: {
        'input_ids': self.ids[i], 'labels_': self.labels[i]}})
    learn.label_key = 'labels_'  # targets found, but the model gets no labels: no loss
    learn.model.forward = (lambda f: lambda input_ids,
                           labels_=None: f(input_ids=input_ids))(learn.model.forward)
    with pytest.raises(ValueError, match="no loss_func, so the loss must come from the model.s output"):
        learn.fit(1)

def test_names_are_configurable():
    learn = hf_learner()
    learn.pred_key,learn.metrics = 'hidden_states',[]
    learn.model.config.output_hidden_states = True
    seen = []
    learn.fit(1, cbs=Callback(after_pred=lambda self: seen.append(self.pred), run_valid=False))
    assert isinstance(seen[0], tuple) and len(seen[0]) == 3               # embeddings + 2 layers
    assert learn.recorder.values[0][0] > 0                                # the loss is still the model's

@pytest.mark.slow
def test_checkpoints_resume_exactly(tmp_path):
    def run(path, cbs=(), resume=None):
        learn = hf_learner(path)
        learn.fit(3, cbs=[CheckpointCallback(every_n_steps=3), *cbs], resume=resume)
        return learn
    ref = run(tmp_path/'ref')
    with pytest.raises(RuntimeError): run(tmp_path/'run', cbs=[FailAfterEpoch()])
    resumed = run(tmp_path/'run', resume=True)
    for (k, a), b in zip(ref.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
    assert ref.recorder.losses == resumed.recorder.losses

def test_summary_of_a_dict_batch_model():
    learn = hf_learner()
    s = learn.summary()
    assert s.total_params == sum(p.numel() for p in learn.model.parameters())
    assert 'input_ids: 32 x 12' in s and 'classifier' in s
