"""The portable CPU kernels: a cold start is the same bits whatever kernels the machine's environment would choose,
and a process that already computed with other kernels is refused rather than silently mislabelled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from experiments.config import PROJECT_ROOT
from models import cpu_kernels
from tests.conftest import MICRO_MODEL

# Two environments that exist on every x86-64 machine and choose other kernels when nothing overrides them: ATen's
# scalar kernels with MKL's automatic branch, and the machine's own choice (AVX2 or better, MKL's vendor path).
OTHER_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO"}
MACHINE_KERNELS: dict[str, str] = {}


def cold_start_sha(tmp_path, environment: dict[str, str], mode: str) -> dict:
    """A micro cold start in a fresh process (its kernels are fixed at its first computation) under `environment`."""
    env = {k: v for k, v in os.environ.items() if k not in cpu_kernels.PORTABLE_ENVIRONMENT} | environment
    out = tmp_path / f"{mode}-{len(os.listdir(tmp_path))}"
    overrides = [f"model.{key}={value}" for key, value in MICRO_MODEL.items()] + [
        "sft.max_steps=4",
        "sft.batch_size=16",
        "sft.eval_every=4",
        "sft.eval_prompts=4",
        "sft.lr=3e-3",
        "dataset.train_size=64",
        "dataset.test_size=8",
        "logger.wandb.mode=disabled",
        f"cpu_kernels={mode}",
        f"sft.output_dir={out / 'ckpt'}",
        f"hydra.run.dir={out / 'run'}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "experiments.sft", *overrides],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((out / "ckpt" / "cold_start.json").read_text())


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "AVX512_VNNI"),
    reason="the portable kernels need an x86-64 CPU with AVX2",
)
def test_a_portable_cold_start_is_the_same_bits_whatever_kernels_the_environment_chose(tmp_path):
    machine = cold_start_sha(tmp_path, MACHINE_KERNELS, "portable")
    other = cold_start_sha(tmp_path, OTHER_KERNELS, "portable")
    assert machine["weights_sha256"] == other["weights_sha256"]
    assert machine["kernels"]["aten_capability"] == other["kernels"]["aten_capability"] == "AVX2"
    assert machine["kernels"]["mkl_branch"] in ("COMPATIBLE", "unknown")
    # The control: left to choose, the two environments compute other bits, which is what the pin removes.
    assert (
        cold_start_sha(tmp_path, MACHINE_KERNELS, "native")["weights_sha256"]
        != cold_start_sha(tmp_path, OTHER_KERNELS, "native")["weights_sha256"]
    )


@pytest.mark.slow
def test_a_process_that_computed_with_other_kernels_is_refused(tmp_path):
    script = "import torch; torch.randn(8).exp(); from models import cpu_kernels; cpu_kernels.pin('portable')"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "cpu_kernels=portable needs ATen's AVX2 kernels, but this process computes with DEFAULT" in done.stderr


def test_the_weights_fingerprint_sees_one_changed_bit_and_not_the_file_layout():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    copy = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    copy.load_state_dict(model.state_dict())
    assert cpu_kernels.weights_sha256(copy) == cpu_kernels.weights_sha256(model)
    with torch.no_grad():
        bits = copy[1].bias.view(torch.int32)
        bits[0] ^= 1  # the last bit of one weight
    assert cpu_kernels.weights_sha256(copy) != cpu_kernels.weights_sha256(model)
