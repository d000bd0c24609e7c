"""Cold start: demonstrations are laid out right, training lowers the loss, the checkpoint reloads exactly."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from hydra import compose, initialize_config_dir

from algos.routers.bias_update import BIAS
from experiments.config import PROJECT_ROOT
from experiments.sft import IGNORE, cold_start, demonstration_batch, routing_profile
from experiments.step.metrics import EVAL_GREEDY, LR, SFT_LOSS, SFT_PRETRAINING, TOPK_MARGIN_MEDIAN, TOPK_MARGIN_SMALL
from experiments.step.scoring import position_ids
from experiments.tasks import Example, build_task
from models.policy import ModelConfig, build_policy
from models.routing.measures import MARGIN_ANCHORS
from models.routing.trace import find_routers
from tests.conftest import MICRO_MODEL
from tests.test_sigmoid_family import SIGMOID


def test_demonstration_batch_masks_prompts_and_pads_left(micro_policy):
    _, tokenizer = micro_policy
    examples = [Example("12+34=", "46", "46"), Example("1+1=", "2", "2")]
    input_ids, attention_mask, labels = demonstration_batch(tokenizer, examples)
    assert input_ids.shape == (2, 9)  # "12+34=" + "46" + eos
    assert tokenizer.decode(input_ids[1][attention_mask[1].bool()]) == "1+1=2<eos>"
    assert attention_mask[1].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    taught = labels[0][labels[0] != IGNORE]
    assert tokenizer.decode(taught) == "46<eos>"
    _, _, every = demonstration_batch(tokenizer, examples, every_token=True)  # pretraining: the prompt too
    assert tokenizer.decode(every[1][every[1] != IGNORE]) == "1+1=2<eos>"


def _sft_config(tmp_path, *overrides):
    overrides = [f"model.{key}={value}" for key, value in MICRO_MODEL.items()] + [
        "sft.max_steps=6",
        "sft.batch_size=16",
        "sft.eval_every=3",
        "sft.eval_prompts=8",
        "sft.lr=3e-3",
        f"sft.output_dir={tmp_path / 'ckpt'}",
        "dataset.train_size=200",
        "dataset.test_size=20",
        "logger.wandb.mode=disabled",
        "cpu_kernels=native",  # this process has computed already: the portable pin would refuse (test_cpu_kernels)
        *overrides,
    ]
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose("sft", overrides=overrides)


def test_cold_start_trains_and_its_checkpoint_reloads_to_identical_logits(tmp_path):
    cfg = _sft_config(tmp_path, "sft.warmup_steps=3", "sft.lr_schedule=linear")
    with pytest.warns(UserWarning, match="below sft.target_accuracy=0.45"):  # 6 steps teach little: it says so
        model, summary = cold_start(cfg, tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [line[SFT_LOSS] for line in lines]
    assert len(losses) == 6 and losses[-1] < losses[0]
    # linear warm-up over 3 steps to 3e-3, then linear decay to 0 at sft.max_steps
    assert [line[LR] for line in lines] == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3, 2e-3, 1e-3])
    assert summary["checkpoint"] == str(tmp_path / "ckpt")
    assert summary["versions"]["torch"] == torch.__version__, "the libraries that made the cold start"
    recorded = json.loads((tmp_path / "ckpt" / "cold_start.json").read_text())
    assert recorded["versions"] == summary["versions"]
    # its recipe: the SFT's settings but the start's own draws (seed, model.init_seed) and where it writes
    recipe = recorded["recipe"]
    assert recipe["sft.lr"] == 3e-3 and recipe["sft.lr_schedule"] == "linear" and recipe["cpu_kernels"] == "native"
    assert not {"seed", "model.init_seed", "sft.output_dir"} & set(recipe) and recorded["recipe_sha256"]
    # an RL run from it records the recipe its start is a draw of
    from experiments.run.recipe import start_recipe

    assert start_recipe(str(tmp_path / "ckpt")) == {
        "start_recipe": recipe,
        "start_recipe_sha256": recorded["recipe_sha256"],
    }

    reloaded, tokenizer = build_policy(
        ModelConfig(
            name="micro_moe",
            path=str(tmp_path / "ckpt"),
            experts_implementation=cfg.model.experts_implementation,
            attn_implementation=cfg.model.attn_implementation,
        )
    )
    fresh, _ = build_policy(ModelConfig(**MICRO_MODEL))
    enc = tokenizer(["12+34=", "7+8="], return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(enc, position_ids=position_ids(enc["attention_mask"]))
    with torch.no_grad():
        trained_logits = model.eval()(**kwargs).logits
        assert torch.equal(reloaded.eval()(**kwargs).logits, trained_logits)
        assert not torch.allclose(fresh.eval()(**kwargs).logits, trained_logits), "the checkpoint holds trained weights"
    assert tokenizer.padding_side == "left" and tokenizer("12")["input_ids"] == [5, 6]
    # what the cold start cost and reached, as analysis.cold_starts tabulates it
    from analysis.cold_starts import main as cold_starts

    cold_starts([str(tmp_path / "run"), "--out", str(tmp_path / "report")])
    row = next(line for line in (tmp_path / "report" / "report.md").read_text().splitlines() if "micro_moe" in line)
    assert row.startswith("| micro_moe | addition digits=2 | 2 | 8 / 2 | 32 |") and "| 6 |" in row


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_cold_start_counts_the_steps_its_log_holds(tmp_path, monkeypatch, signum):
    """A stop that cut a step: summary.json counted that step (4 where metrics.jsonl held 3), with its loss."""
    import experiments.sft as sft

    batch, made = sft.demonstration_batch, []

    def stopped_in_step_4(*args, **kwargs):
        made.append(1)
        if len(made) == 4:
            os.kill(os.getpid(), signum)
        return batch(*args, **kwargs)

    monkeypatch.setattr(sft, "demonstration_batch", stopped_in_step_4)
    with pytest.raises(SystemExit) as raised:
        cold_start(_sft_config(tmp_path), tmp_path / "run")
    assert raised.value.code == 128 + signum
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and len(lines) == 3
    assert summary["steps"] == 3 and summary["final_loss"] == lines[-1][SFT_LOSS]
    assert summary["eval_greedy_accuracy"] == lines[2][EVAL_GREEDY], "step 3's evaluation, the last committed"


def test_the_routing_profile_of_routers_that_tie_by_hand(micro_policy):
    """Routers of all-zero weights give every expert the same score: every token takes the first k = 2 of the E = 8
    experts, so the loads have entropy log 2 / log 8 = 1/3 and max / mean 8 / 2 = 4, and every margin is 0."""
    model, tokenizer = micro_policy
    for router in find_routers(model).values():
        router.weight.data.zero_()
    profile = routing_profile(model, tokenizer, build_task("addition", train_size=10, test_size=8).examples("test"))
    assert profile["load_entropy"] == pytest.approx(1 / 3, rel=1e-5)
    assert profile["load_max_over_mean"] == pytest.approx(4.0)
    assert profile[TOPK_MARGIN_MEDIAN] == 0.0 and profile[TOPK_MARGIN_SMALL] == 1.0
    assert profile["topk_margin_median_per_layer"] == [0.0, 0.0]
    # the best expert leads no one (share 0 where the spread is 0) and holds 1/8 of the probability
    assert profile["top_gap_share_median"] == 0.0 and profile["top_score_median"] == pytest.approx(1 / 8)
    # and its two chosen experts share each token's gate mass evenly
    assert profile["gate_share_best_median"] == pytest.approx(0.5) == profile["gate_share_last_median"]


def test_a_balanced_cold_start_pretrains_on_the_mixture_then_its_task(tmp_path):
    """The sigmoid family with its own balancing: 3 pretraining steps on every token of the mixture, then the task;
    the bias moves every step and the checkpoint keeps it; the summary reports how the cold start routes."""
    cfg = _sft_config(
        tmp_path,
        "model.architecture=glm4_moe",
        *(f"model.{k}={v}" for k, v in SIGMOID.items()),
        "routers=[bias_update]",
        "routers.bias_update.rate=0.01",
        "sft.pretrain_steps=3",
        "sft.max_steps=3",
        "sft.target_accuracy=1.0",
    )
    with pytest.warns(UserWarning, match="below sft.target_accuracy"):
        model, summary = cold_start(cfg, tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line[SFT_PRETRAINING] for line in lines] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    # each step moves every bias by ±0.01 (by 0 only on an exact tie of loads): mean |b| is 0.01 after the first,
    # at most 0.01 x steps later
    assert lines[0][BIAS] == pytest.approx(0.01) and all(
        0 < line[BIAS] <= 0.01 * step + 1e-6 for step, line in enumerate(lines, 1)
    )
    assert "eval/greedy_accuracy" in lines[-1] and all("eval/greedy_accuracy" not in line for line in lines[:3])
    assert summary["pretrain_steps"] == 3 and summary["routers"] == ["bias_update"] and summary["steps"] == 6
    profile = json.loads((tmp_path / "ckpt" / "cold_start.json").read_text())["routing"]
    assert 0 < profile["load_entropy"] <= 1 and profile["load_max_over_mean"] >= 1
    assert 0 <= profile[TOPK_MARGIN_MEDIAN] <= 1 and len(profile["topk_margin_median_per_layer"]) == 2
    reloaded, _ = build_policy(ModelConfig(name="ckpt", path=str(tmp_path / "ckpt")))
    for router, saved in zip(find_routers(model).values(), find_routers(reloaded).values()):
        assert torch.equal(router.e_score_correction_bias, saved.e_score_correction_bias)
        assert router.e_score_correction_bias.abs().max() > 0
    from analysis.cold_starts import main as cold_starts

    cold_starts([str(tmp_path / "run"), "--out", str(tmp_path / "report")])
    row = next(line for line in (tmp_path / "report" / "report.md").read_text().splitlines() if "micro_moe" in line)
    assert "3 + 3" in row and "bias_update" in row and f"{profile['load_entropy']:.3f}" in row


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["routers=[freeze]"], "routers.freeze acts on RL updates only, not on a cold start"),
        (
            ["routers=[bias_update]"],
            "routers.bias_update moves a selection bias, and model 'micro_moe' routes by softmax",
        ),
        (["sft.pretrain_steps=-1"], "sft.pretrain_steps=-1 must be >= 0"),
        (["sft.pretrain_tasks=[addition,countdown]"], "unknown task 'countdown'"),
    ],
)
def test_bad_cold_start_settings_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(SystemExit) as raised:
        cold_start(_sft_config(tmp_path, *overrides), tmp_path / "run")
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_the_margin_table_holds_each_checkpoint_against_its_familys_anchor(tmp_path):
    """A cold start (its task from cold_start.json) and a checkpoint without one (--dataset), softmax and sigmoid
    families: each row's median over its family's anchor, and one error line for a directory that is not one."""
    from analysis.margins import main as margins
    from analysis.margins import within_two_fold

    with pytest.warns(UserWarning, match="below sft.target_accuracy"):
        cold_start(
            _sft_config(tmp_path, "sft.max_steps=2", "dataset=sorting", "dataset.train_size=200"), tmp_path / "run"
        )
    model, tokenizer = build_policy(
        ModelConfig(
            **MICRO_MODEL, architecture="glm4_moe", **{k: v for k, v in SIGMOID.items() if k != "qk_rope_head_dim"}
        )
    )
    model.save_pretrained(tmp_path / "glm")
    tokenizer.save_pretrained(tmp_path / "glm")
    margins([str(tmp_path / "ckpt"), str(tmp_path / "glm"), "--out", str(tmp_path / "table"), "--prompts", "8"])
    rows = json.loads((tmp_path / "table" / "margins.json").read_text())
    assert [row["task"] for row in rows] == ["sorting train_size=200 test_size=20", "addition"]  # what differs
    softmax, sigmoid = (
        MARGIN_ANCHORS[next(name for name in MARGIN_ANCHORS if family in name)] for family in ("softmax", "sigmoid")
    )
    assert [row["anchor_margin"] for row in rows] == [softmax, sigmoid], "each checkpoint against its family's anchor"
    for row in rows:
        assert row["median_over_anchor"] == pytest.approx(row[TOPK_MARGIN_MEDIAN] / row["anchor_margin"])
        low, high = row["topk_margin_median_interval"]
        assert low <= row[TOPK_MARGIN_MEDIAN] <= high
        assert row["median_over_anchor_interval"] == pytest.approx(
            [low / row["anchor_margin"], high / row["anchor_margin"]]
        )
        assert 0.0 <= row["top_gap_share_median"] <= 1.0
    table = (tmp_path / "table" / "report.md").read_text()
    assert [within_two_fold(interval) for interval in ([0.6, 1.9], [2.1, 3.0], [0.4, 0.6])] == [
        "within 2x",
        "outside 2x",
        "undecided",
    ]
    recorded = json.loads((tmp_path / "ckpt" / "cold_start.json").read_text())["weights_sha256"]
    assert rows[0]["sha256"] == recorded, "the row names the start as its cold start and every RL run do"
    assert f"| ckpt | `{recorded[:12]}` | qwen3_moe (softmax) | 2 | 8 / 2 |" in table
    assert "| glm | `" in table and "` | glm4_moe (sigmoid + bias) |" in table
    with pytest.raises(SystemExit) as raised:
        margins([str(tmp_path / "nope"), "--out", str(tmp_path / "table")])
    assert raised.value.code == 2
