"""GPU checks of the experts backends: MegaBlocks' kernels against transformers' experts, a policy, an RL run.

Every test is marked `gpu` and skipped, with the reason shown by `pytest -ra`, without CUDA or MegaBlocks.
`python -m benchmarks.gpu_checks` runs this file together with the micro-benchmark.

Tolerances (relative error max|a - b| / max|b| against transformers' eager experts in float32, same weights and
routing) are `benchmarks.gpu_checks`'s, where they are explained: float32 1e-5 (the PyTorch reference, TF32 off);
bfloat16 at most twice as far from that truth as transformers' own experts in bfloat16, plus 5e-3.
"""

import json
import subprocess
import sys

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from benchmarks.gpu_checks import BFLOAT16_FACTOR, BFLOAT16_SLACK, FLOAT32_TOL, LOGP_ATOL_BF16, experts_parity
from models.megablocks_experts import load_megablocks_kernels
from models.moe_backend import apply_moe_backend, describe_experts_backend


def megablocks_unavailable() -> str | None:
    """Why the MegaBlocks backend cannot run here (the refusal line), or None."""
    try:
        load_megablocks_kernels()
    except RuntimeError as refusal:
        return str(refusal)
    return None


NO_MEGABLOCKS = megablocks_unavailable()
pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_megablocks = pytest.mark.skipif(NO_MEGABLOCKS is not None, reason=f"needs MegaBlocks on CUDA: {NO_MEGABLOCKS}")


@needs_megablocks
def test_megablocks_output_and_gradients_match_hf_in_bfloat16():
    megablocks = experts_parity("megablocks", torch.bfloat16, "cuda")
    baseline = experts_parity("hf", torch.bfloat16, "cuda")
    assert "refused" not in megablocks, megablocks
    for name, error in megablocks["errors"].items():
        assert error <= BFLOAT16_FACTOR * baseline["errors"][name] + BFLOAT16_SLACK, (name, megablocks, baseline)


@needs_megablocks
def test_megablocks_refuses_float32_in_one_line():
    result = experts_parity("megablocks", torch.float32, "cuda")
    assert "bfloat16 only" in result["refused"] and "\n" not in result["refused"]


@needs_cuda
def test_torch_dmoe_output_and_gradients_match_hf_on_cuda_in_float32():
    result = experts_parity("torch_dmoe", torch.float32, "cuda")
    assert max(result["errors"].values()) <= FLOAT32_TOL, result


def tiny_bf16_policy() -> Qwen3MoeForCausalLM:
    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.weight.normal_(0.0, 1.0)  # decisive routing: bfloat16 noise must not flip experts
    model.set_experts_implementation("eager")
    return model.to(torch.bfloat16)


@needs_megablocks
def test_megablocks_policy_log_probs_match_hf_and_leave_megablocks_lists_empty(tmp_path):
    hf_model = tiny_bf16_policy()
    mb_model = tiny_bf16_policy()
    apply_moe_backend(mb_model, "megablocks")
    assert describe_experts_backend(mb_model) == "megablocks:grouped"
    hf_model, mb_model = hf_model.cuda().eval(), mb_model.cuda().eval()
    input_ids = torch.randint(1, 64, (4, 16), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5] = 0
    with torch.no_grad():
        logps = [
            torch.log_softmax(m(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float(), -1)
            .gather(-1, input_ids[:, 1:, None])
            .squeeze(-1)
            for m in (hf_model, mb_model)
        ]
    real = attention_mask[:, 1:].bool()
    torch.testing.assert_close(logps[1][real], logps[0][real], atol=LOGP_ATOL_BF16, rtol=0)

    from megablocks.layers.moe import get_load_balancing_loss

    # Our experts call MegaBlocks' kernels below its dMoE layer, which is what appends to this list: nothing to clear.
    assert len(get_load_balancing_loss()) == 0


@needs_megablocks
@pytest.mark.slow
def test_three_step_rl_run_with_megablocks(tmp_path):
    command = [
        sys.executable,
        "-m",
        "experiments.train",
        "model.moe_backend=megablocks",
        "model.dtype=bfloat16",
        "device=cuda",
        "trainer.steps=3",
        "logger.wandb.mode=disabled",
        f"hydra.run.dir={tmp_path}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert all(isinstance(json.loads(line), dict) for line in lines)
