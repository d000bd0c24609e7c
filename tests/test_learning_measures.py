"""What tells a run that learns from one that holds level (docs/results/learnability): the unbiased pass@k of the
held-out evaluation against every subset of the samples, each update's size against the weights, the KL from the
start, the reward's spread within groups, and training-prompt accuracy beside held-out accuracy."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from algos.advantages import within_group_std
from analysis import learnability
from experiments.step import metrics as m
from experiments.step.batch import pass_at_k
from experiments.step.hooks import LearningMeasures, Update
from experiments.step.metrics import STEP
from experiments.train import train
from tests.synthetic_runs import config, write_run
from tests.test_train import compose_train, read_metrics


@pytest.mark.parametrize("n, k", [(8, 8), (10, 8), (16, 8), (5, 1)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_right_answer(n, k):
    """Unbiased: the mean over every k-subset of n samples of whether it holds a right answer, for each count c."""
    for c in range(n + 1):
        right = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(right, k))
        expected = sum(any(subset) for subset in subsets) / len(subsets)
        assert float(pass_at_k(torch.tensor([c]), n, k)) == pytest.approx(expected, abs=1e-12), (n, k, c)
        assert expected == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_within_group_std_is_the_mean_of_each_groups_unbiased_std():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    assert within_group_std(rewards, 4) == pytest.approx((0 + torch.tensor([0.0, 1.0, 0.0, 1.0]).std().item()) / 2)
    assert rewards.std().item() != pytest.approx(within_group_std(rewards, 4)), "not the step's overall spread"


def test_the_update_ratio_is_the_norm_of_the_move_over_the_norm_of_the_weights():
    model = torch.nn.Linear(3, 2)
    hook, update = LearningMeasures(model, model, score=None), Update(step=1, mb=None, old=None)
    hook.before_step(update)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    ratio = hook.after_step(update)[m.UPDATE_RATIO]
    assert ratio == pytest.approx(float((after - before).norm() / before.norm()), rel=1e-5)
    assert not update.held, "the snapshot is dropped once measured"


@pytest.mark.slow
def test_a_run_that_barely_moves_stays_at_the_start_and_one_that_moves_leaves_it(tmp_path):
    """The KL from the start and the update's size follow the learning rate; the evaluations carry pass@8, the share
    of prompts whose samples agree, and the training prompts' greedy accuracy."""
    logs = {}
    for lr in ("1e-9", "3e-2"):
        train(
            compose_train(
                "trainer.measure_learning=true",
                "trainer.eval_train=true",
                "trainer.eval_samples=8",
                "trainer.eval_every=3",
                f"trainer.lr={lr}",
            ),
            tmp_path / lr,
        )
        logs[lr] = read_metrics(tmp_path / lr)
    still, moved = logs["1e-9"][-1], logs["3e-2"][-1]
    assert still[m.KL_TO_START] < 1e-6 < 1e-3 < moved[m.KL_TO_START]
    assert still[m.UPDATE_RATIO] < 1e-7 < 1e-3 < moved[m.UPDATE_RATIO]
    for key in (m.EVAL_PASS_AT_K, m.EVAL_ALL_SAME, m.EVAL_TRAIN_GREEDY, m.WITHIN_GROUP_STD):
        assert key in moved and 0 <= moved[key] <= 1, key
    assert moved[m.EVAL_PASS_AT_K] >= moved[m.EVAL_ACCURACY], "pass@8 of the same samples is at least their pass@1"


def test_the_learnability_table_reads_each_runs_start_gain_signal_and_evaluation_noise(tmp_path):
    """Two seeds of one recipe, with closed-form curves: the row of each run and the table's mean are what the
    curves give by hand."""
    greedy = {0: [0.40, 0.45, 0.50, 0.55], 1: [0.40, 0.38, 0.42, 0.40]}  # evaluations at steps 0, 10, 20, 30
    for seed, curve in greedy.items():
        records = []
        for step in range(1, 31):
            record = {
                STEP: step,
                m.REWARD: 0.4 + 0.01 * step * (seed == 0),
                m.ZERO_STD_GROUPS: 0.5,
                m.WITHIN_GROUP_STD: 0.3,
                m.GRAD_NORM: 1.0,
                m.UPDATE_RATIO: 1e-3,
                m.KL_TO_START: 1e-4 * step,
                m.ENTROPY: 0.5,
            }
            if step == 1:
                record.update(
                    {
                        m.started(m.EVAL_GREEDY): curve[0],
                        m.started(m.EVAL_ACCURACY): 0.3,
                        m.started(m.EVAL_PASS_AT_K): 0.7,
                        m.started(m.EVAL_ALL_SAME): 0.4,
                    }
                )
            if step % 10 == 0:
                record.update({m.EVAL_GREEDY: curve[step // 10], m.EVAL_ACCURACY: 0.3, m.EVAL_PASS_AT_K: 0.7})
            records.append(record)
        cfg = config("grpo", seed, prompts_per_step=8, eval_every=10, eval_prompts=500)
        write_run(tmp_path / "sweep" / f"{seed}_grpo_s{seed}", cfg, records)
    rows = learnability.run_rows([str(tmp_path / "sweep")]).sort_values("seed")
    first, second = rows.iloc[0], rows.iloc[1]
    assert (first["start_greedy"], first["start_pass1"], first["start_pass8"]) == (0.40, 0.3, 0.7)
    assert first["gain"] == pytest.approx(0.15) and second["gain"] == pytest.approx(0.0)
    assert first["gain_area"] == pytest.approx(m.gain_area([0, 10, 20, 30], greedy[0]))
    assert first["reward_first"] == pytest.approx(0.4 + 0.01 * 5.5) and first["reward_last"] == pytest.approx(0.655)
    assert second["eval_step_sd"] == pytest.approx(float(np.std(np.diff(greedy[1]), ddof=1)))
    assert first["kl_to_start_end"] == pytest.approx(1e-4 * 25.5)
    text = learnability.table(rows)
    assert "| tiny_moe |" in text
    assert "grpo: 8 prompts, N 3, G 8, lr 0.0001, 20 steps; evaluated on 500 | 2 | +0.150, +0.000 |" in text


def _map_run(
    root,
    rung: str,
    start: int,
    lever: dict,
    split: tuple[float, float],
    rise: float,
    cpu_s: float,
    arm: str = "grpo",
    finished: bool = True,
) -> None:
    """One run of a synthetic learnability map: the whole test split scored `split` at its start and end, a training
    reward that rises by `rise` between its first and last ten steps, and the CPU time its summary records."""
    trainer = {**learnability.MAP_RULE.centre, **lever}
    cfg = config(
        arm,
        100,
        prompts_per_step=trainer["prompts"],
        minibatches=trainer["N"],
        group_size=trainer["G"],
        lr=trainer["lr"],
        steps=trainer["steps"],
    )
    cfg["model"]["name"] = rung
    records = []
    for step in range(1, 21):
        record = {STEP: step, m.REWARD: 0.4 + rise * (step > 10)}
        if step == 1:
            record[m.started(m.EVAL_SPLIT_GREEDY)] = split[0]
        if step == 20:
            record[m.EVAL_SPLIT_GREEDY] = split[1]
        records.append(record)
    name = f"{rung}_{arm}_{'_'.join(f'{k}{v}' for k, v in lever.items()) or 'centre'}_start{start}"
    run_dir = write_run(root / name, cfg, records, finished=finished, start=f"s{start}-{rung}")
    if finished:
        summary = json.loads((run_dir / "summary.json").read_text())
        (run_dir / "summary.json").write_text(json.dumps({**summary, "cpu_s": cpu_s}))


def _learnability_map(root, skip: tuple[str, int] | None = None) -> None:
    """Every lever of the pre-registered map on three starts of both MoE rungs. Each lever learns everywhere except
    the centre (one softmax start gains +0.08) and lr3e-4 (the reward falls); lr3e-5 learns at the least CPU time
    and p32 at more. MiniRL at the centre and the dense control fail, and decide nothing."""
    rule = learnability.MAP_RULE
    cost = {"lr3e-5": 100.0, "p32": 400.0}
    for lever, change in rule.levers.items():
        for rung in rule.rungs:
            for start in range(rule.starts):
                if (lever, start) == skip:
                    continue
                gain = 0.08 if (lever, rung, start) == ("centre", "qwen30b_l16", 2) else 0.15
                rise = -0.05 if lever == "lr3e-4" else 0.12
                _map_run(root, rung, start, change, (0.45, 0.45 + gain), rise, cost.get(lever, 200.0))
    for start in range(rule.starts):
        _map_run(root, "glm4_moe_l16", start, {}, (0.45, 0.40), -0.1, 200.0, arm="minirl")
        _map_run(root, "qwen30b_l16_dense", start, {}, (0.45, 0.40), -0.1, 200.0)


def test_the_maps_rule_picks_the_cheapest_lever_that_learns_from_every_start(tmp_path):
    """The pre-registered rule, on a map whose answers are known: a lever learns only when every start of both MoE
    rungs gains ≥ +0.10 on the test split and its reward rises ≥ +0.10; the cheapest such lever is picked."""
    _learnability_map(tmp_path / "map")
    learnability.main([str(tmp_path / "map"), "--out", str(tmp_path / "out"), "--rule"])
    verdicts, words = learnability.apply_rule(learnability.run_rows([str(tmp_path / "map")]))
    verdicts = verdicts.set_index("lever")
    assert not verdicts.loc["centre", "learns"] and verdicts.loc["centre", "min_split_gain"] == pytest.approx(0.08)
    assert not verdicts.loc["lr3e-4", "learns"] and verdicts.loc["lr3e-4", "min_reward_rise"] == pytest.approx(-0.05)
    assert verdicts.loc[["p8", "p32", "lr3e-5", "g16", "h400"], "learns"].all()
    assert set(verdicts["runs"]) == {6}, "MiniRL and the dense control are not the rule's runs"
    assert "picks **lr3e-5**" in words
    report = (tmp_path / "out" / "rule.md").read_text()
    assert "| lr3e-5 | 6 | +0.150 | +0.150 | +0.120 | yes | 100 |" in report and words in report
    regime = json.loads((tmp_path / "out" / learnability.REGIME_FILE).read_text())
    assert regime["lever"] == "lr3e-5" and regime["learns"] and regime["smallest_split_gain"] == pytest.approx(0.15)
    assert set(regime["overrides"]) == {
        "trainer.prompts_per_step=16",
        "trainer.minibatches=2",
        "trainer.group_size=8",
        "trainer.lr=3e-05",
        "trainer.steps=150",
    }


def test_where_no_lever_learns_the_extension_is_asked_for_then_decides(tmp_path):
    """No lever learns: the rule asks for the declared extension and writes no regime; with the extension run and
    failing too, the family's regime is the setting whose smallest gain is largest, marked as not learning."""
    rule = learnability.MAP_RULE
    for index, change in enumerate(rule.levers.values()):
        for rung in rule.rungs:
            for start in range(rule.starts):
                gain = 0.01 * index + (0.02 if start == 1 else 0.0)
                _map_run(tmp_path / "map", rung, start, change, (0.45, 0.45 + gain), 0.12, 200.0)
    learnability.main([str(tmp_path / "map"), "--out", str(tmp_path / "out"), "--rule"])
    assert (
        "the declared extension (lr 3e-05, prompts 32, steps 400) is to be run"
        in (tmp_path / "out" / "rule.md").read_text()
    )
    assert not (tmp_path / "out" / learnability.REGIME_FILE).exists()
    for rung in rule.rungs:
        for start in range(rule.starts):
            _map_run(tmp_path / "map", rung, start, rule.extension, (0.45, 0.47), 0.12, 900.0)
    learnability.main([str(tmp_path / "map"), "--out", str(tmp_path / "out"), "--rule"])
    regime = json.loads((tmp_path / "out" / learnability.REGIME_FILE).read_text())
    best = list(rule.levers)[-1]  # the last lever's smallest gain, 0.06, is the largest
    assert regime["lever"] == best and not regime["learns"] and regime["smallest_split_gain"] == pytest.approx(0.06)
    assert "trainer.steps=400" in regime["overrides"]


def test_a_map_missing_a_start_or_an_unfinished_run_is_refused_in_one_line_naming_it(tmp_path, capsys):
    """The rule is not computed on part of the map: each lever and rung short of its starts is named, and nothing
    is written."""
    _learnability_map(tmp_path / "map", skip=("p8", 1))
    _map_run(tmp_path / "map", "qwen30b_l16", 0, {"G": 16}, (0.45, 0.6), 0.12, 200.0, finished=False)
    (tmp_path / "map" / "qwen30b_l16_grpo_G16_start0" / "summary.json").unlink(missing_ok=True)
    with pytest.raises(SystemExit) as exit_:
        learnability.main([str(tmp_path / "map"), "--out", str(tmp_path / "out"), "--rule"])
    assert exit_.value.code == 2 and not (tmp_path / "out").exists()
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: the map's rule cannot be computed: ")
    assert "p8 on glm4_moe_l16: 2 of 3 starts finished" in error and "p8 on qwen30b_l16: 2 of 3" in error
    assert "g16 on qwen30b_l16: 2 of 3 starts finished" in error and "centre" not in error
