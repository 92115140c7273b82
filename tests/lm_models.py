"""A transformers GPT-2 from a small config and the dict batches it takes, for the tests of a language model's
fit (no download: the model is built from its config)."""
import pytest, torch
from torch import nn
from learncb.test_utils import TinyLM, padded_tokens

def gpt2(vocab=24, tie=True):
    "A one-layer GPT-2 of width 16, no dropout (fits are compared to each other), from seed 0"
    transformers = pytest.importorskip('transformers')
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tie,
                                  resid_pdrop=0., embd_pdrop=0., attn_pdrop=0.)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)

def hf_rows(x, y):
    """Dict rows as a transformers model takes them: `input_ids`, `attention_mask`, `labels` (-100 on the
    padding)"""
    labels = torch.where(y == -100, -100, x)          # the model shifts the labels itself
    return [{'input_ids': x[i], 'attention_mask': (y[i] != -100).long(), 'labels': labels[i]}
            for i in range(len(x))]

def hf_tokens(n=32, lengths=(2, 24), seed=0, vocab=24):
    "`padded_tokens` as dict rows (`hf_rows`)"
    return hf_rows(*padded_tokens(n, vocab=vocab, lengths=lengths, seed=seed).tensors)

def hf_collate(rows):
    """Dict rows cut to the longest of the batch (its attention mask), as a padding collator does; labels if
    they have"""
    n = max(int(r['attention_mask'].sum()) for r in rows)
    return {k: torch.stack([r[k][:n] for r in rows]) for k in rows[0]}

class TooBig(nn.Module):
    "The tiny LM (`TinyLM`), out of memory on more than `limit` rows: what `AutoMicrobatch` splits"
    def __init__(self, limit=4): super().__init__(); self.lm,self.limit = TinyLM(),limit
    def forward(self, x):
        if torch.is_grad_enabled() and len(x) > self.limit:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return self.lm(x)
