"""The confound searches' calibration: the knob value where a grid's per-update measure meets the target's, by log-log
interpolation between bracketing grid points, from the off-policy minibatches of the first steps only."""

from __future__ import annotations

import json
import math

import pytest
import synthetic_runs as syn

from analysis.calibrate import main

KL = "kl/old_k3"


def _run(root, name, algo, lr, seed, kl_at):
    """A run whose minibatch j (after j updates) logs KL `kl_at(step)` for j ≥ 1 and 0 on the on-policy one."""
    records = []
    for step in range(1, 13):
        record = syn.step_record(algo, seed, step, 0.5)
        for entry in record["minibatches"]:
            entry[KL] = kl_at(step) if entry["minibatch"] >= 1 else 0.0
        records.append(record)
    syn.write_run(root / name, syn.config(algo, seed, lr=lr), records)


def test_the_matched_learning_rate_interpolates_log_kl_between_the_bracketing_grid_points(tmp_path, capsys):
    for seed in (100, 101):
        # GRPO's KL grows as lr²; step 11 and later (outside the measured steps) would say otherwise
        for lr in (1e-4, 2e-4, 4e-4):
            _run(
                tmp_path,
                f"grpo{lr}-{seed}",
                "grpo",
                lr,
                seed,
                lambda step, lr=lr: (lr / 1e-4) ** 2 if step <= 10 else 1e3,
            )
        _run(tmp_path, f"gspo-{seed}", "gspo", 3e-4, seed, lambda step: 5.0 if step <= 10 else 1e3)
    out = tmp_path / "out"
    main(
        [
            str(tmp_path),
            "--knob",
            "trainer.lr",
            "--measure",
            KL,
            "--target",
            "algo.name=gspo",
            "--grid",
            "algo.name=grpo",
            "--out",
            str(out),
        ]
    )
    # between 2e-4 (KL 4) and 4e-4 (KL 16): log-linear in log lr reaches 5 at 1e-4 · √5 ≈ 2.236e-4 → 2.2e-4
    result = json.loads((out / "calibration.json").read_text())
    assert result["target_value"] == pytest.approx(5.0) and result["matched"] == pytest.approx(
        float(f"{1e-4 * math.sqrt(5):.2g}")
    )
    assert "matches it at **trainer.lr = 0.00022**" in capsys.readouterr().out


def test_a_grid_that_does_not_bracket_the_target_is_said_and_not_extrapolated(tmp_path, capsys):
    for lr in (1e-4, 2e-4):
        _run(tmp_path, f"grpo{lr}", "grpo", lr, 100, lambda step, lr=lr: lr * 1e4)
    _run(tmp_path, "gspo", "gspo", 3e-4, 100, lambda step: 50.0)
    main(
        [
            str(tmp_path),
            "--knob",
            "trainer.lr",
            "--measure",
            KL,
            "--target",
            "algo.name=gspo",
            "--grid",
            "algo.name=grpo",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert "no two neighbouring grid points bracket it" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(
            [
                str(tmp_path),
                "--knob",
                "trainer.lr",
                "--measure",
                KL,
                "--target",
                "algo.name=ppo",
                "--grid",
                "algo.name=grpo",
                "--out",
                str(tmp_path / "out"),
            ]
        )
    assert stop.value.code == 2
