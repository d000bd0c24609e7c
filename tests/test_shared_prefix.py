"""Packed scoring (`experiments.step.scoring.SharedPrefix`): each group's prompt fed once, the same numbers as feeding
every row."""

from __future__ import annotations

import pytest
import torch

from experiments.step.scoring import FED, Responses, ScoreOptions, position_ids, score_responses
from models.policy import ModelConfig, build_policy
from models.routing.trace import RoutingTrace
from models.shared_prefix import SharedPrefix
from tests.conftest import MICRO_MODEL
from tests.test_policy import _save, every_family

G, T = 3, 5


def _batch(tokenizer):
    """Three prompts of different lengths (left padding) x G completions; some end early (eos, then padding)."""
    prompts = [p for p in ["12+34=", "7+8=", "99+1="] for _ in range(G)]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    generator = torch.Generator().manual_seed(0)
    digits = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    response = digits[torch.randint(len(digits), (len(prompts), T), generator=generator)]
    response_mask = torch.ones(len(prompts), T, dtype=torch.long)
    for row, end in [(0, 1), (4, 2), (8, 0)]:  # eos at `end`, padding after it
        response[row, end] = tokenizer.eos_token_id
        response[row, end + 1 :] = tokenizer.pad_token_id
        response_mask[row, end + 1 :] = 0
    input_ids = torch.cat([enc["input_ids"], response], dim=1)
    attention_mask = torch.cat([enc["attention_mask"], response_mask], dim=1)
    return input_ids, attention_mask, enc["input_ids"].shape[1], response_mask.bool()


def _policy(tmp_path, config):
    if config is None:
        return build_policy(ModelConfig(**MICRO_MODEL, attn_implementation="grouped_eager"))
    return build_policy(ModelConfig(name="ckpt", path=_save(tmp_path, config), attn_implementation="grouped_eager"))


def _score(model, batch, group_size, **options):
    input_ids, attention_mask, width, response_mask = batch
    model.zero_grad(set_to_none=True)
    scores = score_responses(
        model,
        Responses(input_ids, attention_mask, width),
        0.7,
        ScoreOptions(aux_loss=True, group_size=group_size, **options),
    )
    # A loss that weighs every response token differently, so that no gradient is trivially zero.
    weights = torch.linspace(-1.0, 1.0, scores.logp.numel()).view_as(scores.logp)
    ((scores.logp * weights)[response_mask].sum() + scores.aux_loss).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return scores, grads


@every_family
def test_packed_scoring_equals_row_scoring(tmp_path, config):
    """Log-probs, entropy, load-balancing loss, every gradient and the recorded routing, with both kinds of padding."""
    model, tokenizer = _policy(tmp_path, config)
    model.eval()
    batch = _batch(tokenizer)
    (rows, row_grads), (packed, packed_grads) = (_score(model, batch, g, record=True) for g in (1, G))
    response_mask = batch[3]
    torch.testing.assert_close(packed.logp[response_mask], rows.logp[response_mask], rtol=0, atol=2e-6)
    torch.testing.assert_close(packed.entropy[response_mask], rows.entropy[response_mask], rtol=0, atol=2e-6)
    torch.testing.assert_close(packed.aux_loss, rows.aux_loss, rtol=1e-6, atol=1e-7)
    input_ids, attention_mask = batch[0][:, FED], batch[1][:, FED]
    with torch.no_grad():  # the family's own loss, as its forward computes it
        own = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids(attention_mask),
            output_router_logits=True,
        ).aux_loss
    torch.testing.assert_close(rows.aux_loss.detach(), own, rtol=1e-6, atol=1e-7)
    metric = score_responses(
        model, Responses(*batch[:3]), 0.7, ScoreOptions(aux_loss=True, group_size=G, aux_loss_grad=False)
    ).aux_loss
    assert not metric.requires_grad, "logged only: no graph behind it"
    torch.testing.assert_close(metric, own, rtol=1e-6, atol=1e-7)
    assert packed_grads.keys() == row_grads.keys()
    assert any("experts" in name for name in packed_grads) and any("gate.weight" in name for name in packed_grads)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, row_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert packed.routes.shape == rows.routes.shape == (2, 3 * G, batch[0].shape[1] - 1, 2)
    assert torch.equal(packed.routes.experts, rows.routes.experts), "NO_ROUTE on the same padding, same experts"


def test_packed_replay_forces_the_trace_and_reports_the_routers_choice():
    model, tokenizer = _policy(None, None)
    model.eval()
    batch = _batch(tokenizer)
    with torch.no_grad():
        recorded = score_responses(model, Responses(*batch[:3]), 1.0, ScoreOptions(group_size=G, record=True)).routes
        # A different routing that still agrees within each group's prompt: shift every recorded expert by one.
        shifted = torch.where(recorded.experts >= 0, (recorded.experts + 1) % 8, recorded.experts)
        forced = RoutingTrace(shifted, recorded.layer_names, recorded.num_experts)
        packed = score_responses(model, Responses(*batch[:3]), 1.0, ScoreOptions(group_size=G, replay=forced))
        rows = score_responses(model, Responses(*batch[:3]), 1.0, ScoreOptions(group_size=1, replay=forced))
    torch.testing.assert_close(packed.logp[batch[3]], rows.logp[batch[3]], rtol=0, atol=2e-6)
    unreplayed = score_responses(model, Responses(*batch[:3]), 1.0).logp
    assert not torch.allclose(packed.logp, unreplayed), "the replay took effect"
    # The router's own choice is reported: the first layer's inputs are untouched by the replay, so it chose the
    # recorded experts; deeper layers see other inputs, and both layouts agree on what their routers chose.
    assert torch.equal(packed.routes.experts[0], recorded.experts[0])
    assert torch.equal(packed.routes.experts, rows.routes.experts)


def test_packed_scoring_refuses_what_it_cannot_pack():
    model, tokenizer = _policy(None, None)
    model.eval()
    input_ids, attention_mask, width, _ = _batch(tokenizer)
    with torch.no_grad():
        trace = score_responses(
            model, Responses(input_ids, attention_mask, width), 1.0, ScoreOptions(record=True)
        ).routes
        diverged = trace.experts.clone()
        diverged[:, 1, width - 2] = (diverged[:, 1, width - 2] + 1) % 8  # row 1 routes its prompt unlike row 0
        with pytest.raises(ValueError, match="route their shared prompt differently"):
            score_responses(
                model,
                Responses(input_ids, attention_mask, width),
                1.0,
                ScoreOptions(group_size=G, replay=RoutingTrace(diverged, trace.layer_names, trace.num_experts)),
            )
        mixed = input_ids.clone()
        mixed[1, width - 2] += 1  # row 1 no longer carries its group's prompt
        with pytest.raises(ValueError, match="do not share their prompt"):
            score_responses(model, Responses(mixed, attention_mask, width), 1.0, ScoreOptions(group_size=G))
    sdpa, _ = build_policy(ModelConfig(**MICRO_MODEL, attn_implementation="sdpa"))
    with pytest.raises(ValueError, match="needs attn_implementation='grouped_eager'; this model uses 'sdpa'"):
        score_responses(sdpa, Responses(input_ids, attention_mask, width), 1.0, ScoreOptions(group_size=G))


def test_pack_and_unpack_are_inverse_on_rows_that_share_their_prefix():
    mask = torch.ones(6, 7, dtype=torch.long)
    mask[3:, 0] = 0  # the second group's prompt is one token shorter (left padding)
    layout = SharedPrefix.from_rows(mask, prefix=3, group=3, dtype=torch.float32)
    rows = torch.arange(6 * 7).view(6, 7)
    rows[:, :3] = rows[::3, :3].repeat_interleave(3, dim=0)
    packed = layout.pack(rows)
    assert packed.shape == (2, 3 + 3 * 4) and layout.length == 15
    assert torch.equal(layout.unpack(packed), rows)
    assert torch.equal(layout.token_weights[1], torch.tensor([0.0, 3, 3] + [1.0] * 12))
    rows[4, 1] += 1
    assert not layout.prefix_agrees(rows)
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        SharedPrefix.from_rows(mask, prefix=3, group=4, dtype=torch.float32)
