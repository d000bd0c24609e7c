"""The RL loop end to end on the micro MoE: every objective x replay mode, determinism, bad input, skipped steps."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from algos import OBJECTIVES, group_advantages
from algos.objective import (
    CLIP,
    CLIP_SEQ,
    KL_OLD,
    KL_REF,
    POLICY_LOSS,
    SEQ_RATIO_MEAN,
    SEQ_RATIO_VAR,
    TOKEN_RATIO_MAX,
    TOKEN_RATIO_MEAN,
    TOKEN_RATIO_VAR,
)
from experiments.config import PROJECT_ROOT
from experiments.run.stops import StopRequested
from experiments.step.batch import minibatch_order, split_minibatches
from experiments.step.metrics import (
    AUX_LOSS,
    DRIFT,
    DRIFT_OVER_MINIBATCHES,
    DRIFT_PER_UPDATE,
    ENGINE_EXPERTS,
    ENTROPY,
    ESS,
    EVAL_ACCURACY,
    EVAL_GREEDY,
    EVAL_SPLIT_GREEDY,
    FRAGILE,
    GATE_DRIFT_PER_UPDATE,
    GRAD_NORM,
    LENGTH,
    LOAD_MAX_VIOLATION,
    LR,
    MARGIN,
    MISMATCH_K1,
    MISMATCH_K3,
    REWARD,
    REWARD_ACCURACY,
    REWARD_STD,
    ROLLOUT_TIME,
    ROLLOUT_TOKENS_PER_S,
    SKIPPED,
    STEP,
    STEP_TIME,
    TOKEN_DRIFT_PER_UPDATE,
    TOKENS,
    TOPK_MASS,
    TRAIN_TIME,
    TRUNCATED,
    ZERO_STD_GROUPS,
    per_layer,
    started,
)
from experiments.step.scoring import FED, ScoreOptions, score_responses
from experiments.train import RLTrainer, train
from models.routing.measures import routing_drift
from models.routing.trace import find_routers
from models.shared_prefix import SharedPrefix
from tests.conftest import MICRO_RUN

CONF = str(PROJECT_ROOT / "conf")

STEP_METRICS = [
    STEP,
    TOKENS,
    REWARD,
    REWARD_STD,
    REWARD_ACCURACY,
    ZERO_STD_GROUPS,
    LENGTH,
    TRUNCATED,
    TOKEN_RATIO_MEAN,
    TOKEN_RATIO_VAR,
    TOKEN_RATIO_MAX,
    SEQ_RATIO_MEAN,
    SEQ_RATIO_VAR,
    CLIP,
    CLIP_SEQ,
    KL_OLD,
    POLICY_LOSS,
    ENTROPY,
    GRAD_NORM,
    LR,
    SKIPPED,
    AUX_LOSS,
    LOAD_MAX_VIOLATION,
    DRIFT_PER_UPDATE,
    per_layer(DRIFT_PER_UPDATE, 0),
    GATE_DRIFT_PER_UPDATE,
    per_layer(GATE_DRIFT_PER_UPDATE, 1),
    per_layer(DRIFT_PER_UPDATE, 1),
    TOKEN_DRIFT_PER_UPDATE,
    DRIFT_OVER_MINIBATCHES,
    TOPK_MASS,
    per_layer(MARGIN, 1),
    FRAGILE,
    MISMATCH_K1,
    ESS,
    STEP_TIME,
    ROLLOUT_TIME,
    TRAIN_TIME,
    ROLLOUT_TOKENS_PER_S,
]


def compose_train(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=[*MICRO_RUN, *overrides])


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_stopped_after(steps: int, cfg, run_dir: Path, monkeypatch) -> None:
    """Train `cfg` into `run_dir`, stopped as SIGTERM stops a run once `steps` steps are done (its checkpoints left
    for `resume=auto`). Undoes `monkeypatch` after, the caller's patches with it."""
    real_step = RLTrainer.step

    def stopped(trainer):
        if trainer.step_index == steps:
            raise StopRequested(signal.SIGTERM)
        return real_step(trainer)

    monkeypatch.setattr(RLTrainer, "step", stopped)
    with pytest.raises(SystemExit):
        train(cfg, run_dir)
    monkeypatch.undo()


def experts_used(model) -> tuple[list[torch.Tensor], list]:
    """The top-k expert ids every experts module is called with, one `[tokens, K]` entry per layer and forward (the
    ids actually computed with, replayed or not); and the hook handles to remove."""
    used: list[torch.Tensor] = []
    handles = [
        model.get_submodule(name.rsplit(".", 1)[0]).experts.register_forward_pre_hook(
            lambda module, args: used.append(args[1].detach().clone())
        )
        for name in find_routers(model)
    ]
    return used, handles


def first_step_inputs(trainer: RLTrainer):
    """What `RLTrainer.step` builds before its updates: the rollout, the minibatches and their π_old."""
    t = trainer.cfg.trainer
    rollout = trainer.rollout(trainer.rollouts.engine)
    advantages = group_advantages(rollout.rewards, t.group_size)
    order = minibatch_order(trainer.plan.layout, rollout.size, t.group_size, trainer.generator)
    minibatches = split_minibatches(rollout, advantages, order, t.minibatches, trainer.device)
    return rollout, advantages, minibatches, [trainer.old_policy(mb) for mb in minibatches]


def test_the_whole_test_split_is_evaluated_at_start_and_end_and_the_curve_gives_the_mean_gain(tmp_path):
    summary = train(compose_train("trainer.eval_every=1"), tmp_path)
    lines = read_metrics(tmp_path)
    assert started(EVAL_SPLIT_GREEDY) in lines[0] and EVAL_SPLIT_GREEDY in lines[-1]
    assert EVAL_SPLIT_GREEDY not in lines[0] and EVAL_SPLIT_GREEDY not in lines[1], "the whole split: end only"
    # the whole split is every test prompt (20 here), not the first eval_prompts (4): the start's policy, evaluated
    # anew on all 20, scores what the run logged
    whole = RLTrainer(compose_train("trainer.eval_prompts=20", "trainer.eval_samples=0")).evaluate()[EVAL_GREEDY]
    assert lines[0][started(EVAL_SPLIT_GREEDY)] == pytest.approx(whole)
    curve = [lines[0][started(EVAL_GREEDY)], *(line[EVAL_GREEDY] for line in lines)]
    by_hand = (0.5 * (curve[0] + curve[1]) + 0.5 * (curve[1] + curve[2]) + 0.5 * (curve[2] + curve[3])) / 3 - curve[0]
    assert summary["eval_greedy_gain_area"] == pytest.approx(by_hand)
    assert summary["eval_split_greedy_accuracy"] == lines[-1][EVAL_SPLIT_GREEDY]


@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
@pytest.mark.parametrize("algo", sorted(OBJECTIVES))
def test_every_objective_and_replay_mode_runs_and_logs(tmp_path, algo, replay):
    summary = train(compose_train(f"algo={algo}", f"routing.replay={replay}", "trainer.eval_every=3"), tmp_path)
    lines = read_metrics(tmp_path)
    assert len(lines) == 3 and [line[STEP] for line in lines] == [1, 2, 3]
    for name in STEP_METRICS:
        assert name in lines[0], name
    assert EVAL_ACCURACY in lines[-1] and EVAL_GREEDY in lines[-1]
    assert summary["eval_greedy_accuracy_start"] == lines[0][started(EVAL_GREEDY)], "the start's evaluation"
    assert MISMATCH_K3 in lines[0], "the first minibatch's forward is π_old: the mismatch is measured"
    if replay == "r3":
        assert ENGINE_EXPERTS in lines[0] and per_layer(ENGINE_EXPERTS, 1) in lines[0]
    assert [mb["minibatch"] for mb in lines[0]["minibatches"]] == [0, 1]
    assert summary["status"] == "finished"
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize("layout", ["groups", "rows"])
def test_r2_replays_recorded_experts_while_drift_stays_measurable(layout):
    trainer = RLTrainer(
        compose_train(
            "algo=grpo",
            "routing.replay=r2",
            "trainer.lr=5e-2",
            "trainer.minibatches=4",
            f"trainer.minibatch_layout={layout}",
        )
    )
    assert trainer.plan.layout == layout
    _, _, minibatches, old = first_step_inputs(trainer)
    used, handles = experts_used(trainer.model)
    drifts = []
    assert old[0].on_policy and old[0].replay is None, "the on-policy minibatch routes as θ_old does: nothing to replay"
    for j, (mb, old_policy) in enumerate(zip(minibatches, old)):
        used.clear()
        metrics = trainer.update(mb, old_policy)
        drifts.append(metrics[DRIFT])
        if j == 0:
            continue
        L, B, S, K = old_policy.replay.shape
        recorded = old_policy.replay.experts.reshape(L, B * S, K).long()
        fed = mb.attention_mask[:, FED]  # the positions a scoring forward feeds
        routed = torch.stack(used)
        if layout == "groups":  # the experts saw each group as one packed sequence: lay it out as rows again
            packing = SharedPrefix.from_rows(fed, mb.prompt_width - 1, trainer.cfg.trainer.group_size, torch.float32)
            routed = packing.unpack(routed.reshape(L, packing.groups, packing.length, K), dim=1)
        valid = fed.reshape(-1).bool()
        assert torch.equal(routed.reshape(L, B * S, K)[:, valid], recorded[:, valid])
    for handle in handles:
        handle.remove()
    # Minibatch 0 is on-policy (asserted above): the hooks take θ_old's routing from its own update forward, so its
    # drift compares that forward with itself and is 0 by the wiring. Exactly 0 guards the wiring (a π_old recomputed
    # for it would give float noise, not 0); the measurement is the later minibatches'.
    assert drifts[0] == 0.0
    assert max(drifts[1:]) > 0.0, "with a large learning rate the router's own choice must drift from θ_old's"


def test_same_config_and_seed_give_the_same_metrics(tmp_path):
    cfg = compose_train("algo=gspo", "routing.replay=r2")
    train(cfg, tmp_path / "a")
    train(cfg, tmp_path / "b")

    def strip(lines):
        return [{k: v for k, v in line.items() if not k.startswith("perf/")} for line in lines]

    assert strip(read_metrics(tmp_path / "a")) == strip(read_metrics(tmp_path / "b"))


def test_dense_control_runs_without_routing_metrics(tmp_path):
    train(
        compose_train(
            "model=tiny_dense",
            "model.hidden_size=32",
            "model.num_hidden_layers=2",
            "model.head_dim=8",
            "model.intermediate_size=64",
        ),
        tmp_path,
    )
    line = read_metrics(tmp_path)[0]
    assert REWARD in line and DRIFT not in line


def test_non_finite_losses_are_skipped_then_end_the_run_as_diverged(tmp_path, monkeypatch):
    cfg = compose_train("trainer.max_consecutive_skips=3", "trainer.steps=5")

    class PoisonedTrainer(RLTrainer):
        """The real loop, with an objective whose loss is NaN."""

        def __init__(self, cfg, ranks):
            super().__init__(cfg, ranks)
            honest = self.objective

            def poisoned(*args):
                out = honest(*args)
                return replace(out, loss=out.loss * float("nan"))

            self.objective = poisoned
            self.initial = {name: p.detach().clone() for name, p in self.model.named_parameters()}

    trainers = []
    monkeypatch.setattr(
        "experiments.train.RLTrainer", lambda cfg, ranks: trainers.append(PoisonedTrainer(cfg, ranks)) or trainers[-1]
    )
    with pytest.raises(SystemExit) as raised:
        train(cfg, tmp_path)
    message = str(raised.value)
    assert "the run diverged in step 2: 3 optimizer updates in a row had a non-finite loss" in message
    assert "\n" not in message
    lines = read_metrics(tmp_path)
    assert [line[SKIPPED] for line in lines] == [2], "step 1's two updates were refused, step 2 stopped"
    trainer = trainers[0]
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, trainer.initial[name]), f"{name} changed although every update was skipped"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["steps"] == 1 and summary["skipped_steps"] == 3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.clip_low=-0.1"], "clip_low"),
        (["algo.clip_low=1.5"], "clip_low"),
        (["trainer.minibatches=3"], "trainer.minibatches=3 does not divide"),
        (["trainer.group_size=1"], "trainer.group_size=1"),
        (["model.path=/nonexistent/checkpoint"], "model.path='/nonexistent/checkpoint' does not exist"),
        (["model=tiny_dense", "routing.replay=r2"], "needs an MoE model"),
        (["model=checkpoint"], "(model=checkpoint) needs model.path=/local/checkpoint"),
        (["trainer.pi_old=bypass", "routing.replay=r2"], "trainer.pi_old=bypass with routing.replay=r2"),
        (["trainer.lr=inf"], "trainer.lr=inf must be a finite number > 0"),
        (
            ["trainer.minibatch_layout=groups", "trainer.minibatches=8"],
            "trainer.minibatches=8 does not divide trainer.prompts_per_step=4",
        ),
        (
            ["trainer.minibatch_layout=groups", "model.attn_implementation=sdpa"],
            "needs model.attn_implementation=grouped_eager (this model uses 'sdpa')",
        ),
    ],
)
def test_bad_input_is_refused_with_one_line(tmp_path, overrides, message):
    with pytest.raises(SystemExit) as raised:
        train(compose_train(*overrides), tmp_path)
    text = str(raised.value)
    assert message in text and "\n" not in text


@pytest.mark.parametrize(
    "overrides, layout",
    [
        ([], "groups"),
        (["model.attn_implementation=sdpa"], "rows"),
        (["trainer.minibatches=8"], "rows"),
        (["trainer.minibatch_layout=rows"], "rows"),
    ],
)
def test_minibatch_layout_auto_packs_groups_where_it_can(tmp_path, overrides, layout):
    assert train(compose_train("trainer.steps=1", *overrides), tmp_path)["minibatch_layout"] == layout


@pytest.mark.parametrize("layout", ["groups", "rows"])
def test_reference_kl_and_router_aux_loss_enter_the_update(tmp_path, layout):
    cfg = compose_train(
        "algo.kl_coef=0.05",
        "routers=[aux_loss]",
        "routers.aux_loss.coef=0.01",
        f"trainer.minibatch_layout={layout}",
        "trainer.steps=2",
    )
    assert train(cfg, tmp_path)["minibatch_layout"] == layout
    lines = read_metrics(tmp_path)
    assert lines[0]["minibatches"][0][KL_REF] == pytest.approx(0.0, abs=1e-7), "θ = reference before any update"
    assert lines[-1][KL_REF] > 0.0
    assert all(0.0 < line[AUX_LOSS] < float("inf") for line in lines)


@pytest.mark.parametrize("layout", ["groups", "rows"])
def test_group_minibatches_hold_whole_groups(layout):
    trainer = RLTrainer(compose_train(f"trainer.minibatch_layout={layout}"))
    rollout, advantages, minibatches, _ = first_step_inputs(trainer)
    G = trainer.cfg.trainer.group_size
    prompts = torch.cat([mb.input_ids[:, : mb.prompt_width] for mb in minibatches]).view(-1, G, rollout.prompt_width)
    whole = bool((prompts == prompts[:, :1]).all())
    assert whole == (layout == "groups"), "rows are shuffled across groups; groups stay together"
    assert sorted(torch.cat([mb.advantages for mb in minibatches]).tolist()) == sorted(advantages.tolist())


def test_checkpoint_model_group_trains_a_local_checkpoint_with_transformers_kernels(tmp_path):
    from models.policy import ModelConfig, build_policy
    from tests.conftest import MICRO_MODEL

    model, tokenizer = build_policy(ModelConfig(**MICRO_MODEL))
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    trainer = RLTrainer(compose_train("model=checkpoint", f"model.path={tmp_path / 'ckpt'}"))
    assert trainer.model.config._attn_implementation == "sdpa"
    assert trainer.model.config._experts_implementation == "grouped_mm"
    assert trainer.step()[STEP] == 1


@pytest.mark.slow
def test_cli_refuses_bad_input_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", *MICRO_RUN, "trainer.minibatches=3", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=120,
    )
    assert result.returncode != 0
    assert "trainer.minibatches=3 does not divide" in result.stderr
    assert "Traceback" not in result.stderr


def test_misspelt_key_fails_at_composition():
    with pytest.raises(Exception, match="clip_hgh"):
        compose_train("algo.clip_hgh=0.3")


@pytest.mark.slow
def test_multirun_gives_one_directory_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "-m",
            "algo=grpo,gspo",
            "routing.replay=none,r2",
            *MICRO_RUN,
            "trainer.steps=2",
            f"hydra.sweep.dir={sweep}",
        ],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    runs = sorted(p.parent for p in sweep.glob("*/metrics.jsonl"))
    assert len(runs) == 4
    names = sorted(p.name.split("_", 1)[1] for p in runs)
    assert names == ["grpo_none_micro_moe_s0", "grpo_r2_micro_moe_s0", "gspo_none_micro_moe_s0", "gspo_r2_micro_moe_s0"]
    for run in runs:
        assert len(read_metrics(run)) == 2 and (run / ".hydra" / "config.yaml").exists()


def test_wandb_failure_keeps_the_local_log(tmp_path, monkeypatch):
    import wandb

    def broken(*args, **kwargs):
        raise RuntimeError("no W&B today")

    monkeypatch.setattr(wandb, "init", broken)
    with pytest.warns(UserWarning, match="W&B did not start"):
        train(compose_train("logger.wandb.mode=offline", "trainer.steps=1"), tmp_path)
    assert len(read_metrics(tmp_path)) == 1


def test_drift_metric_matches_a_recomputation():
    """The logged drift of minibatch j equals routing_drift(old trace, the router's own routing) recomputed."""
    trainer = RLTrainer(compose_train("routing.replay=none", "trainer.lr=5e-2"))
    _, _, minibatches, old = first_step_inputs(trainer)
    trainer.update(minibatches[0], old[0])
    mb = minibatches[1]
    with torch.no_grad():
        routes = trainer.score(trainer.model, mb, ScoreOptions(record=True)).routes
    expected = routing_drift(old[1].routes, routes, mb.token_mask).expert_change_frac
    assert expected > 0.0, "a large learning rate moves the routing: the comparison must not be 0 == 0"
    assert trainer.update(mb, old[1])[DRIFT] == pytest.approx(expected)


@pytest.mark.parametrize(
    "replay, setting, source",
    [
        ("none", "auto", "bypass"),
        ("r2", "auto", "decoupled"),
        ("r3", "auto", "decoupled"),
        ("none", "decoupled", "decoupled"),
        ("r3", "bypass", "bypass"),
    ],
)
def test_pi_old_is_recomputed_only_where_replay_needs_it_or_asked(tmp_path, replay, setting, source):
    summary = train(compose_train(f"routing.replay={replay}", f"trainer.pi_old={setting}", "trainer.steps=1"), tmp_path)
    assert summary["pi_old"] == source and summary["pi_old_why"]


def test_rollout_logprobs_are_theta_olds_own_numbers():
    """Without replay the off-policy minibatches keep the sampler's log-probs and routing; a recompute with the same
    weights agrees up to the KV-cache path's rounding, and routes every scored token the same way."""
    trainer = RLTrainer(compose_train("routing.replay=none"))
    assert trainer.plan.pi_old == "bypass"
    _, _, minibatches, old = first_step_inputs(trainer)
    assert old[0].on_policy, "the on-policy minibatch takes θ_old's log-probs from its own forward"
    for mb, old_policy in zip(minibatches[1:], old[1:]):
        with torch.no_grad():
            recomputed = trainer.score(trainer.model, mb, ScoreOptions(record=True))
        assert torch.allclose(old_policy.logp, recomputed.logp, atol=1e-5)
        assert old_policy.logp[~mb.response_mask].eq(0).all()
        drift = routing_drift(old_policy.routes, recomputed.routes, mb.token_mask)
        assert drift.tokens > 0 and drift.expert_change_frac == 0.0


def test_wandb_offline_run_is_written_next_to_the_local_log(tmp_path):
    train(compose_train("logger.wandb.mode=offline", "trainer.steps=1"), tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb")), "W&B offline run files missing"
    assert len(read_metrics(tmp_path)) == 1


def test_kl_to_a_frozen_reference_is_logged_and_starts_at_zero(tmp_path):
    train(compose_train("algo=grpo", "algo.kl_coef=0.05", "trainer.steps=2"), tmp_path)
    lines = read_metrics(tmp_path)
    first, later = lines[0]["minibatches"][0], lines[-1]["minibatches"][-1]
    assert first[KL_REF] == 0.0, "before any update the policy is the reference"
    assert later[KL_REF] > 0.0


def test_learning_rate_follows_the_schedule(tmp_path):
    train(compose_train("trainer.lr_schedule=linear", "trainer.warmup_steps=2", "trainer.steps=3"), tmp_path)
    lrs = [mb[LR] for line in read_metrics(tmp_path) for mb in line["minibatches"]]
    # 6 updates: warm-up 1/2, 2/2 of 1e-2, then linear decay over the remaining 4 updates.
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 7.5e-3, 5e-3, 2.5e-3])


@pytest.mark.slow
def test_cli_lists_the_valid_algorithms_for_an_unknown_one(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "algo=foo", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=120,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "Could not find 'algo/foo'" in result.stderr
    listed = result.stderr.split("Available options in 'algo':")[1].split("Config search path")[0].split()
    assert listed == sorted(OBJECTIVES)


@pytest.mark.parametrize("layout", ["groups", "rows"])
@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_first_minibatch_is_on_policy_against_an_independent_pass_of_theta_old(replay, layout, monkeypatch):
    """The first update's π_θ equals θ_old scored by a separate forward of a frozen copy (row by row, its own hooks):
    ratios 1 to float rounding, nothing clipped, the same experts (under r3, replaying the engine's routing)."""
    trainer = RLTrainer(
        compose_train(f"routing.replay={replay}", f"trainer.minibatch_layout={layout}", "trainer.lr=5e-2")
    )
    _, _, minibatches, old = first_step_inputs(trainer)
    mb = minibatches[0]
    theta_old = copy.deepcopy(trainer.model)
    replayed = mb.engine_routes if replay == "r3" else None
    with torch.no_grad():
        independent = score_responses(
            theta_old, mb, trainer.cfg.trainer.temperature, ScoreOptions(record=replayed is None, replay=replayed)
        )
    seen = {}
    objective, score = trainer.objective, trainer.score

    def spy_objective(logp, inputs, totals=None):
        seen["objective"] = {"logp": logp, **vars(inputs)}
        return objective(logp, inputs, totals)

    def spy_score(model, minibatch, options=ScoreOptions()):
        seen["scores"] = score(model, minibatch, options)
        return seen["scores"]

    monkeypatch.setattr(trainer, "objective", spy_objective)
    monkeypatch.setattr(trainer, "score", spy_score)
    metrics = trainer.update(mb, old[0])
    mask = mb.response_mask
    for name in ("logp", "old_logp"):
        torch.testing.assert_close(seen["objective"][name].detach()[mask], independent.logp[mask], rtol=0, atol=1e-5)
    assert metrics[TOKEN_RATIO_MEAN] == pytest.approx(1.0, abs=1e-5) and metrics[CLIP] == 0.0
    drift = routing_drift(independent.routes, seen["scores"].routes, mb.token_mask)
    assert drift.tokens > 0 and drift.expert_change_frac == 0.0
    later = trainer.update(minibatches[1], old[1])
    assert later[DRIFT] > 0.0 or later[TOKEN_RATIO_VAR] > 0.0, "the test must see an update"


def test_the_documented_example_step_hook_measures_every_update():
    """`Add a step hook` in docs/extending.md is code a newcomer copies: it runs as printed, at its fixed point, in the
    loop."""
    readme = (PROJECT_ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    code = readme.split("## Add a step hook", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {"__name__": "readme"}
    exec(compile(code, "docs/extending.md", "exec", dont_inherit=True), namespace)
    trainer = RLTrainer(compose_train("trainer.lr=5e-2"))
    trainer.hooks.append(namespace["LargeRatios"](above=1.0))  # any ratio above 1 counts
    record = trainer.step()
    shares = [mb["ratio/large_frac"] for mb in record["minibatches"]]
    assert shares[0] == 0.0, "the on-policy minibatch's ratios are 1"
    assert 0.0 < shares[1] < 1.0 and record["ratio/large_frac"] == pytest.approx(sum(shares) / len(shares))
