"""`sorted_mm` experts: the same numbers as transformers' `grouped_mm` (output and every gradient), on each family."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from experiments.step.scoring import position_ids
from models.policy import ModelConfig, build_policy
from models.sorted_experts import sorted_mm_experts_forward
from tests.conftest import MICRO_MODEL
from tests.test_policy import _save, every_family


def _forward_backward(model, tokenizer):
    enc = tokenizer(["12+34=5", "7+8=15", "99+1=100"], return_tensors="pt", padding=True, add_special_tokens=False)
    model.zero_grad(set_to_none=True)
    logits = model(**enc, position_ids=position_ids(enc["attention_mask"])).logits
    valid = enc["attention_mask"].bool()
    # A loss that weighs every position and vocabulary entry differently, so no gradient is trivially zero.
    weights = torch.linspace(-1.0, 1.0, logits.shape[-1])
    (logits[valid].log_softmax(-1) * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits[valid].detach(), grads


def _policies(path_or_micro):
    built = {}
    for impl in ("grouped_mm", "sorted_mm"):
        if isinstance(path_or_micro, str):
            cfg = ModelConfig(name="ckpt", path=path_or_micro, experts_implementation=impl)
        else:
            cfg = ModelConfig(**MICRO_MODEL, experts_implementation=impl)
        built[impl] = build_policy(cfg)
        assert built[impl][0].config._experts_implementation == impl
    return built


@every_family
def test_sorted_mm_matches_grouped_mm_in_output_and_gradients(tmp_path, config):
    built = _policies(None if config is None else _save(tmp_path, config))
    (ref_logits, ref_grads), (logits, grads) = (_forward_backward(*built[impl]) for impl in ("grouped_mm", "sorted_mm"))
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    assert any("experts" in name for name in grads) and any("gate.weight" in name for name in grads)
    for name, grad in grads.items():
        # sorted_mm scales the activations by the gate weight before the down projection, grouped_mm its output:
        # the same product, rounded in another order, so the tolerance scales with the gradient's size.
        scale = float(ref_grads[name].abs().max())
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6 * max(1.0, scale), msg=name)


def test_sorted_mm_refuses_an_experts_layout_it_does_not_implement():
    biased = SimpleNamespace(has_gate=True, has_bias=True, is_transposed=False)
    with pytest.raises(ValueError, match=r"has_bias=True, .* use experts_implementation='grouped_mm'"):
        sorted_mm_experts_forward(biased, torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
