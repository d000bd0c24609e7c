"""The synthetic flip switch (`routing.flip_rate`, `models.routing.flips.flip_routing`): what it swaps, that rate 0 is
the
untouched forward, that replay overrides it, and that it reaches only π_θ's update forwards."""

from __future__ import annotations

import pytest
import torch

from algos.objective import CLIP, POLICY_LOSS, TOKEN_RATIO_VAR
from experiments.step.metrics import DRIFT_PER_UPDATE, FLIP_FRAC, REWARD
from models.routing.flips import flip_routing, next_ranked
from models.routing.hooks import record_routing, replay_routing
from models.routing.trace import find_routers
from tests.test_routing import ExpertsSpy, _batch, _forward


def test_next_ranked_takes_the_experts_after_the_top_k_in_order():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    top = torch.tensor([[0, 1]])
    assert next_ranked(logits, top, torch.tensor([[False, False]])).tolist() == [[0, 1]]
    assert next_ranked(logits, top, torch.tensor([[False, True]])).tolist() == [[0, 2]]
    assert next_ranked(logits, top, torch.tensor([[True, False]])).tolist() == [[2, 1]]
    assert next_ranked(logits, top, torch.tensor([[True, True]])).tolist() == [[2, 3]]
    # three experts, top-2: one expert outside the top-k, so a second flipped slot keeps its expert
    assert next_ranked(logits[:, :3], top, torch.tensor([[True, True]])).tolist() == [[2, 1]]


def test_rate_zero_is_the_untouched_forward_bit_for_bit(micro_policy):
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer)
    with record_routing(model) as plain:
        expected = _forward(model, ids, mask).logits
    with flip_routing(model, 0.0, torch.Generator().manual_seed(0)) as flips, record_routing(model) as flipped:
        got = _forward(model, ids, mask).logits
    assert torch.equal(got, expected)
    assert torch.equal(flipped.trace.experts, plain.trace.experts)
    assert flips.share == 0.0


def test_rate_one_computes_with_the_next_ranked_experts_and_records_them(micro_policy):
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer)
    with record_routing(model) as plain:
        expected = _forward(model, ids, mask).logits
    spy = ExpertsSpy(model)
    with flip_routing(model, 1.0, torch.Generator().manual_seed(0)) as flips, record_routing(model) as flipped:
        got = _forward(model, ids, mask).logits
    spy.remove()
    valid = mask.bool()
    own, new = plain.trace.experts[:, valid], flipped.trace.experts[:, valid]
    # every slot holds an expert outside the old top-k, and the experts computed with are the recorded ones
    assert not (new.unsqueeze(-1) == own.unsqueeze(-2)).any()
    assert torch.equal(spy.used().reshape(new.shape[0], *ids.shape, -1)[:, valid].to(new.dtype), new)
    assert flips.share == 1.0
    assert not torch.allclose(got, expected)


def test_a_share_is_flipped_and_the_router_keeps_its_gradient(micro_policy):
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer, texts=("12+34=46",) * 64)
    with flip_routing(model, 0.25, torch.Generator().manual_seed(0)) as flips:
        loss = _forward(model, ids, mask).logits.square().mean()
    loss.backward()
    assert 0.2 < flips.share < 0.3
    assert all(router.weight.grad.abs().sum() > 0 for router in find_routers(model).values())


def test_replay_overrides_the_flips(micro_policy):
    model, tokenizer = micro_policy
    ids, mask = _batch(tokenizer)
    with record_routing(model) as recording:
        _forward(model, ids, mask)
    with replay_routing(model, recording.trace):
        replayed = _forward(model, ids, mask).logits
    with flip_routing(model, 1.0, torch.Generator().manual_seed(0)), replay_routing(model, recording.trace) as replay:
        flipped = _forward(model, ids, mask).logits
    # Padding carries no route to replay and feeds nothing; the valid tokens compute with the replayed experts, to
    # the rounding of matmuls over other row counts (the flipped padding lands in other experts).
    valid = mask.bool()
    torch.testing.assert_close(flipped[valid], replayed[valid], rtol=0, atol=1e-6)
    # the router's own (flipped) choice is still what replay reports as the drift it removed
    assert not torch.equal(replay.router_choice.experts, recording.trace.experts)


def test_rate_outside_a_probability_is_refused(micro_policy):
    with pytest.raises(ValueError, match=r"flip rate 1.5 is not a probability in \[0, 1\]"):
        with flip_routing(micro_policy[0], 1.5, torch.Generator()):
            pass


def _run(tmp_path, name, *overrides):
    from experiments.train import train
    from tests.test_train import compose_train, read_metrics

    run_dir = tmp_path / name
    summary = train(compose_train("trainer.steps=2", "trainer.threads=1", *overrides), run_dir)
    return summary, read_metrics(run_dir)


def test_flips_reach_the_update_forwards_only_and_r2_removes_them(tmp_path):
    _, plain = _run(tmp_path, "plain")
    summary, flipped = _run(tmp_path, "flipped", "routing.flip_rate=0.3")
    _, r2 = _run(tmp_path, "r2", "routing.replay=r2")
    _, r2_flipped = _run(tmp_path, "r2_flipped", "routing.replay=r2", "routing.flip_rate=0.3")
    assert summary["synthetic_flip_rate"] == 0.3 and not summary["first_minibatch_on_policy"]
    # Not in the rollout: the same samples and rewards. In the updates: minibatch 0's ratios are no longer exactly 1,
    # and about the asked share of activated experts is flipped.
    assert flipped[0][REWARD] == plain[0][REWARD]
    # Without flips minibatch 0 is on-policy: its π_old is its own update forward, so its ratios are 1 and their
    # variance 0 by the hooks' wiring (the baseline, not a finding). The flipped run is the measurement: the flips
    # make minibatch 0 off-policy, and its ratios move.
    assert plain[0]["minibatches"][0][TOKEN_RATIO_VAR] == 0.0
    assert flipped[0]["minibatches"][0][TOKEN_RATIO_VAR] > 1e-6
    assert 0.2 < flipped[0][FLIP_FRAC] < 0.4
    assert flipped[0][DRIFT_PER_UPDATE] > plain[0][DRIFT_PER_UPDATE] + 0.1
    assert FLIP_FRAC not in plain[0]
    # R2 replays θ_old's experts: the flips change what the router would choose (drift is logged) but not the loss.
    assert r2_flipped[0][DRIFT_PER_UPDATE] > r2[0][DRIFT_PER_UPDATE] + 0.1
    for key in (POLICY_LOSS, TOKEN_RATIO_VAR, CLIP):
        assert r2_flipped[0][key] == pytest.approx(r2[0][key], rel=1e-4, abs=1e-7), key
    assert r2_flipped[1][REWARD] == pytest.approx(r2[1][REWARD])


@pytest.mark.parametrize("rate", ["-0.1", "1.5", "nan"])
def test_a_flip_rate_outside_0_1_is_refused_in_one_line(tmp_path, rate):
    from experiments.train import train
    from tests.test_train import compose_train

    with pytest.raises(SystemExit) as refused:
        train(compose_train(f"routing.flip_rate={rate}"), tmp_path)
    assert str(refused.value) == (
        f"moe-rl-lab: routing.flip_rate={float(rate)} must be a probability in [0, 1] (the share of experts flipped)"
    )
    assert not (tmp_path / "metrics.jsonl").exists()
