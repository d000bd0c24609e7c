"""Cold start: demonstrations are laid out right, training lowers the loss, the checkpoint reloads exactly."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.config import PROJECT_ROOT
from experiments.sft import IGNORE, cold_start, demonstration_batch
from experiments.step.metrics import LR, SFT_LOSS
from experiments.step.scoring import position_ids
from experiments.tasks import Example
from models.policy import ModelConfig, build_policy
from tests.conftest import MICRO_MODEL


def test_demonstration_batch_masks_prompts_and_pads_left(micro_policy):
    _, tokenizer = micro_policy
    examples = [Example("12+34=", "46", "46"), Example("1+1=", "2", "2")]
    input_ids, attention_mask, labels = demonstration_batch(tokenizer, examples)
    assert input_ids.shape == (2, 9)  # "12+34=" + "46" + eos
    assert tokenizer.decode(input_ids[1][attention_mask[1].bool()]) == "1+1=2<eos>"
    assert attention_mask[1].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    taught = labels[0][labels[0] != IGNORE]
    assert tokenizer.decode(taught) == "46<eos>"


def test_cold_start_trains_and_its_checkpoint_reloads_to_identical_logits(tmp_path):
    overrides = [f"model.{key}={value}" for key, value in MICRO_MODEL.items()] + [
        "sft.max_steps=6", "sft.batch_size=16", "sft.eval_every=3", "sft.eval_prompts=8", "sft.lr=3e-3",
        "sft.warmup_steps=3", "sft.lr_schedule=linear",
        f"sft.output_dir={tmp_path / 'ckpt'}", "dataset.train_size=200", "dataset.test_size=20",
        "logger.wandb.mode=disabled",
        "cpu_kernels=native",  # this process has computed already: the portable pin would refuse (test_cpu_kernels)
    ]
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose("sft", overrides=overrides)
    with pytest.warns(UserWarning, match="below sft.target_accuracy=0.45"):  # 6 steps teach little: it says so
        model, summary = cold_start(cfg, tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [line[SFT_LOSS] for line in lines]
    assert len(losses) == 6 and losses[-1] < losses[0]
    # linear warm-up over 3 steps to 3e-3, then linear decay to 0 at sft.max_steps
    assert [line[LR] for line in lines] == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3, 2e-3, 1e-3])
    assert summary["checkpoint"] == str(tmp_path / "ckpt")

    reloaded, tokenizer = build_policy(ModelConfig(name="micro_moe", path=str(tmp_path / "ckpt"),
                                                   experts_implementation=cfg.model.experts_implementation,
                                                   attn_implementation=cfg.model.attn_implementation))
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
