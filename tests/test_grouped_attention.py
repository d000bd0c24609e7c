"""`grouped_eager` attention: eager's numbers without copying keys and values for grouped-query heads."""

from __future__ import annotations

import pytest
import torch

from experiments.step.scoring import position_ids
from models.grouped_attention import grouped_eager_attention
from models.policy import ModelConfig, build_policy
from tests.conftest import MICRO_MODEL


def _run(attention: str):
    model, tokenizer = build_policy(ModelConfig(**MICRO_MODEL, attn_implementation=attention))
    assert model.config.num_attention_heads > model.config.num_key_value_heads, "grouped-query heads under test"
    enc = tokenizer(["12+34=5", "7+8=15", "99+1=100"], return_tensors="pt", padding=True, add_special_tokens=False)
    logits = model(**enc, position_ids=position_ids(enc["attention_mask"])).logits
    valid = enc["attention_mask"].bool()
    (logits[valid].log_softmax(-1) * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    generated = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return logits[valid].detach(), grads, generated


def test_grouped_eager_matches_eager_with_padding_and_a_kv_cache():
    (ref_logits, ref_grads, ref_generated), (logits, grads, generated) = _run("eager"), _run("grouped_eager")
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert torch.equal(generated, ref_generated), "greedy decoding through the KV cache must not change"


def test_grouped_eager_refuses_heads_that_do_not_group():
    query, key = torch.zeros(1, 3, 2, 4), torch.zeros(1, 2, 2, 4)
    with pytest.raises(ValueError, match="3 query heads do not split into 2 key/value groups"):
        grouped_eager_attention(torch.nn.Identity(), query, key, key, None, scaling=0.5)
