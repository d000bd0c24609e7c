"""`benchmarks.gpu_checks` without a GPU: every step runs or says why it skipped, and one step's failure is its own."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_checks

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA records")


@needs_no_cuda
def test_cpu_run_records_parity_and_replay_and_why_the_gpu_steps_skipped(tmp_path):
    out = tmp_path / "checks.json"
    steps = ["versions", "parity", "replay", "rl_runs", "expert_speed", "rl_step", "probe"]
    assert gpu_checks.main(["--out", str(out), *(f"--step={step}" for step in steps)]) == 0
    results = json.loads(out.read_text())
    assert [results[step]["status"] for step in steps] == ["done"] * len(steps)
    for step in ("rl_runs", "expert_speed", "rl_step", "probe"):
        assert "CUDA" in results[step]["result"]["skipped"]
    assert "no CUDA" in results["versions"]["result"]["bf16_matmul_peak_tflops"]

    rows = results["parity"]["result"]["rows"]
    assert {row["family"] for row in rows} == set(gpu_checks.FAMILIES)
    for row in rows:
        if row["backend"] == "megablocks":
            assert "CUDA" in row["refused"] and "\n" not in row["refused"]
        elif row["dtype"] == "float32":
            assert max(row["errors"].values()) <= gpu_checks.FLOAT32_TOL, row

    replay = results["replay"]["result"]
    for model in gpu_checks.REPLAY_MODELS:
        assert "CUDA" in replay[f"{model}/megablocks"]["refused"]
        for backend in ("hf", "torch_dmoe"):
            entry = replay[f"{model}/{backend}"]
            assert entry["passed"], entry
            assert entry["r2"]["routers_moved"]["drift_expert_change_frac"] > 0


def test_a_failing_step_records_its_error_and_the_next_step_still_runs(tmp_path, monkeypatch):
    def broken(context):
        raise RuntimeError("a kernel refused\nsecond line")

    monkeypatch.setitem(gpu_checks.STEPS, "parity", broken)
    out = tmp_path / "checks.json"
    gpu_checks.main(["--out", str(out), "--step=parity", "--step=versions"])
    results = json.loads(out.read_text())
    assert results["parity"]["status"] == "failed"
    assert results["parity"]["error"] == "RuntimeError: a kernel refused"
    assert "broken" in results["parity"]["traceback"]
    assert results["versions"]["status"] == "done"


def test_a_note_marks_a_step_cut_off_and_keeps_the_others_and_its_finished_parts(tmp_path):
    out = tmp_path / "checks.json"
    gpu_checks.main(["--out", str(out), "--step=versions"])
    gpu_checks.main(["--out", str(out), "--note", "replay", "cut off at its limit of 60 s"])
    results = json.loads(out.read_text())
    assert results["replay"] == {"status": "failed", "error": "cut off at its limit of 60 s"}

    results["rl_step"] = {"status": "running", "partial": {"bench-deep/hf": {"perf/step_s": [1.0]}}}
    out.write_text(json.dumps(results))
    gpu_checks.main(["--out", str(out), "--note", "rl_step", "cut off at its limit of 180 s"])
    cut = json.loads(out.read_text())["rl_step"]
    assert cut["status"] == "failed" and cut["partial"] == {"bench-deep/hf": {"perf/step_s": [1.0]}}
    assert results["versions"]["status"] == "done"
