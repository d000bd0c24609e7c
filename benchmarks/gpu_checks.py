"""Every GPU check of the experts backends and the RL loop, one step at a time, each step's result kept when another
fails.

    python -m benchmarks.gpu_checks --out gpu_checks.json                 # every step, in order
    python -m benchmarks.gpu_checks --out gpu_checks.json --step parity   # one step, merged into the same JSON
    bash benchmarks/gpu_checks.sh                                         # a bare CUDA machine: install, build, run

Steps, in order of worth (`STEPS`):
  versions      Python, torch and its CUDA, transformers, megablocks, grouped_gemm, stanford-stk, triton, the GPU,
                the build log of `gpu_checks.sh` when given, and the measured bf16 matmul peak (8192^3, mean of 10).
  parity        one MoE layer on fixed routing, per experts layout (Qwen3-MoE, Mixtral, and the sigmoid + bias
                family's DeepSeek-V3 and GLM-4.5 experts, routed with sigmoid gates renormalised x 2.5): each backend
                (`hf`, `torch_dmoe`, `megablocks`) in float32 and bfloat16 against transformers' eager experts in
                float32, output and every gradient (`relative_errors`), MegaBlocks judged by `BFLOAT16_FACTOR` and
                `BFLOAT16_SLACK`, also with experts that get no token (their gradients exactly zero); a backend
                that refuses a setting records its one-line refusal.
  replay        routing record / replay / drift on one softmax model and one sigmoid + bias model, bfloat16, each
                experts backend: R2 (a trace recorded in a teacher-forced forward, replayed on the same weights and
                after the routers moved) and R3 (recorded across `generate`, replayed in a teacher-forced forward),
                exact experts and log-probabilities within `LOGP_ATOL_BF16`.
  rl_runs       `python -m experiments.train` for 3 steps with R2 (arm grpo_r2), bfloat16, each backend: summary.json.
  expert_speed  one MoE layer's experts at Qwen3-30B-A3B's shapes (hidden 2048, width 768, 128 experts, top-8),
                forward + backward, MegaBlocks, transformers' grouped_mm and eager: ms, TFLOP/s, share of the peak.
  rl_step       seconds per RL step of bench-deep (`benchmarks.workload`) and of a ~1B-parameter random Qwen3-MoE.
  gpu_tests     `pytest -m gpu tests/test_megablocks_gpu.py` in a subprocess: exit code and the report's tail.
  probe         `python -m experiments.probe` at lr 1e-4 on qwen30b_l16 built at Qwen3-30B-A3B's width: drift.
Every step writes its entry (`seconds`, then `result`, or `error` and `traceback`) and the JSON is rewritten after
it, and after each part of a step that has several (`partial`), so a run cut short keeps what finished. Without CUDA
every step still runs: the GPU-only parts record why they were skipped (parity and replay run on CPU with the backends
CPU has), which keeps the script testable anywhere.

What travels to a GPU machine (`gpu_checks.sh`): the repository, the wheels of what the machine lacks in `.gpu/whl`
and the source packages of MegaBlocks, stanford-stk and grouped_gemm in `.gpu/src` (built there against its torch).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import (
    DeepseekV3Config,
    GenerationMixin,
    Glm4MoeConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3MoeConfig,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from benchmarks.workload import compose_workload, fixed_length
from experiments.step import metrics as m
from experiments.step.scoring import position_ids
from experiments.step.trainer import RLTrainer
from models.dmoe_reference import FusedExperts
from models.moe_backend import DroplessGLUExperts, MoEBackend, apply_moe_backend, hf_to_megablocks
from models.policy import DType, ExpertsImplementation, ModelConfig, build_policy
from models.routing.families import router_weight
from models.routing.hooks import record_routing, replay_routing
from models.routing.measures import routing_drift
from models.routing.trace import find_routers

BACKENDS = ("hf", "torch_dmoe", "megablocks")
PACKAGES = ("torch", "transformers", "megablocks", "grouped_gemm", "stanford-stk", "triton", "hydra-core")
# bfloat16 parity (relative error max|a - b| / max|b| against transformers' eager experts in float32): MegaBlocks may
# be at most twice as far from that truth as transformers' own experts in bfloat16, plus 5e-3 (bfloat16 rounds at
# 4e-3; MegaBlocks also rounds the routing weights and the top-k sum to bfloat16, transformers keeps them in float32).
FLOAT32_TOL = 1e-5
BFLOAT16_FACTOR, BFLOAT16_SLACK = 2.0, 5e-3
# Token log-probabilities of two bfloat16 forwards of the same routing (replayed against recorded, a full forward
# against generate's cached decode) differ by rounding only: a few bfloat16 steps of a logit of order 1.
LOGP_ATOL_BF16 = 5e-2
ROUTED_SCALING = 2.5  # the sigmoid family's gates are renormalised, then multiplied by this (DeepSeek-V3, GLM-4.5)


# -- versions and the machine's peak --------------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Installed versions of everything the GPU path depends on, and the GPU itself."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in PACKAGES:
        found[package] = _version(package)
    found["torch_cuda"] = torch.version.cuda
    found["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if torch.cuda.is_available():
        found["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return found


def cuda_ms(step: Callable[[], object], warmup: int, iters: int) -> float:
    """Mean milliseconds of `step` on the GPU over `iters` calls after `warmup`, timed by CUDA events."""
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def matmul_peak_tflops(size: int = 8192, warmup: int = 3, iters: int = 10) -> float:
    """bfloat16 TFLOP/s of one size^3 product on random data: the ceiling the experts' kernels are set against."""
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = cuda_ms(lambda: a @ b, warmup, iters)
    return 2 * size**3 / (ms * 1e-3) / 1e12


def step_versions(context: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"versions": versions()}
    if context["build_log"] is not None and context["build_log"].is_file():
        result["build"] = [line.split("\t") for line in context["build_log"].read_text().splitlines()]
    result["bf16_matmul_peak_tflops"] = matmul_peak_tflops() if torch.cuda.is_available() else "skipped: no CUDA"
    return result


# -- parity of the experts backends ---------------------------------------------------------------------------------

# experts layout -> (its config, its experts class, the config's names for expert count and width, router family)
FAMILIES: dict[str, tuple[type, type, str, str, str]] = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeExperts, "num_experts", "moe_intermediate_size", "softmax"),
    "mixtral": (MixtralConfig, MixtralExperts, "num_local_experts", "intermediate_size", "softmax"),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3Experts, "n_routed_experts", "moe_intermediate_size", "sigmoid"),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeExperts, "n_routed_experts", "moe_intermediate_size", "sigmoid"),
}


def make_hf_experts(
    num_experts: int, top_k: int, hidden: int, width: int, seed: int, family: str = "qwen3_moe"
) -> nn.Module:
    """transformers' eager experts of `family` in float32 on CPU, weights of unit-scale output."""
    config_class, experts_class, count_key, width_key, _ = FAMILIES[family]
    config = config_class(hidden_size=hidden, num_experts_per_tok=top_k, **{count_key: num_experts, width_key: width})
    config._experts_implementation = "eager"
    experts = experts_class(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=generator) * hidden**-0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=generator) * width**-0.5)
    return experts


def make_routing(
    tokens: int, num_experts: int, top_k: int, hidden: int, seed: int, family: str = "qwen3_moe", idle_experts: int = 0
) -> dict[str, torch.Tensor]:
    """Hidden states [T, H], distinct experts per token [T, k] (the last `idle_experts` get no token), gate weights
    [T, k] as the family's router gives them (softmax: rows sum to 1; sigmoid: sigmoid scores renormalised, times
    `ROUTED_SCALING`), upstream grad [T, H]."""
    generator = torch.Generator().manual_seed(seed)
    top_k_index = torch.rand(tokens, num_experts - idle_experts, generator=generator).topk(top_k, dim=-1).indices
    logits = torch.randn(tokens, top_k, generator=generator)
    if FAMILIES[family][4] == "softmax":
        weights = torch.softmax(logits, -1)
    else:
        scores = torch.sigmoid(logits)
        weights = scores / scores.sum(-1, keepdim=True) * ROUTED_SCALING
    return {
        "hidden_states": torch.randn(tokens, hidden, generator=generator),
        "top_k_index": top_k_index,
        "top_k_weights": weights,
        "upstream": torch.randn(tokens, hidden, generator=generator),
    }


def backend_module(hf_experts: nn.Module, backend: str) -> nn.Module:
    """`hf_experts` switched to `backend` through the model-level switch, so that its refusals are the real ones."""
    holder = nn.ModuleDict({"experts": hf_experts})
    apply_moe_backend(holder, backend)
    return holder["experts"]


def forward_backward(experts: nn.Module, routing: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Output and gradients (hidden states, routing weights, expert parameters in dMoE layout) as float32 on CPU."""
    dtype = next(experts.parameters()).dtype
    # Fresh leaves per call, so gradients of two backends never accumulate into one tensor.
    x = routing["hidden_states"].detach().to(dtype, copy=True).requires_grad_(True)
    w = routing["top_k_weights"].detach().to(dtype, copy=True).requires_grad_(True)
    out = experts(x, routing["top_k_index"], w)
    (out * routing["upstream"].to(dtype)).sum().backward()
    if isinstance(experts, DroplessGLUExperts):
        param_grads = (experts.w1.grad, experts.v1.grad, experts.w2.grad)
    else:
        fused = cast(FusedExperts, experts)  # not dMoE: transformers' fused experts
        # backward above reached both weights: their gradients are there
        param_grads = hf_to_megablocks(
            cast(torch.Tensor, fused.gate_up_proj.grad), cast(torch.Tensor, fused.down_proj.grad)
        )
    result = {"out": out, "d_hidden": x.grad, "d_weights": w.grad}
    result |= {f"d_{name}": grad for name, grad in zip(("w1", "v1", "w2"), param_grads)}
    return {name: value.detach().float().cpu() for name, value in result.items()}


def relative_errors(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        name: float((got[name] - truth[name]).abs().max() / truth[name].abs().max().clamp_min(1e-30)) for name in truth
    }


def experts_parity(
    backend: str,
    dtype: torch.dtype,
    device: str,
    num_experts: int = 8,
    top_k: int = 2,
    hidden: int = 256,
    width: int = 128,
    tokens: int = 512,
    seed: int = 0,
    family: str = "qwen3_moe",
    idle_experts: int = 0,
) -> dict[str, object]:
    """Relative errors of `backend` in `dtype` on `device` against transformers' eager experts in float32; with
    `idle_experts`, that many experts get no token, and their weights' gradients must be exactly zero.

    Returns {"family", "backend", "dtype", "device", "errors": {out, d_hidden, d_weights, d_w1, d_v1, d_w2}} or, when
    the backend refuses this setting, {..., "refused": message}.
    """
    record: dict[str, object] = {
        "family": family,
        "backend": backend,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "idle_experts": idle_experts,
    }
    try:
        experts = backend_module(make_hf_experts(num_experts, top_k, hidden, width, seed, family).to(dtype), backend)
    except (ValueError, RuntimeError) as refusal:
        return record | {"refused": str(refusal)}
    routing = make_routing(tokens, num_experts, top_k, hidden, seed, family, idle_experts)
    routing = {name: tensor.to(device) for name, tensor in routing.items()}
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity means float32 products
    try:
        truth = forward_backward(make_hf_experts(num_experts, top_k, hidden, width, seed, family).to(device), routing)
        got = forward_backward(experts.to(device), routing)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    return record | {"errors": relative_errors(got, truth)}


def megablocks_verdict(megablocks: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """Whether MegaBlocks in bfloat16 is within the bound set by transformers' experts in bfloat16, per quantity."""
    if "errors" not in megablocks or "errors" not in baseline:
        return {"judged": False, "why": megablocks.get("refused") or baseline.get("refused")}
    bounds = {name: BFLOAT16_FACTOR * error + BFLOAT16_SLACK for name, error in baseline["errors"].items()}
    within = {name: megablocks["errors"][name] <= bound for name, bound in bounds.items()}
    return {"judged": True, "within_bound": all(within.values()), "bounds": bounds, "within": within}


def step_parity(context: dict[str, Any]) -> dict[str, Any]:
    rows, verdicts = [], {}
    for family in FAMILIES:
        by_setting = {}
        for dtype in (torch.float32, torch.bfloat16):
            for backend in BACKENDS:
                row = experts_parity(backend, dtype, context["device"], family=family)
                by_setting[backend, dtype] = row
                rows.append(row)
                print(json.dumps(row), flush=True)
        verdicts[family] = megablocks_verdict(
            by_setting["megablocks", torch.bfloat16], by_setting["hf", torch.bfloat16]
        )
        context["progress"](family, verdicts[family])
    # Experts that receive no token: grouped_gemm's weight gradient is one GEMM per expert over its rows, and an
    # expert without rows must come out exactly zero, not whatever its output buffer held.
    idle = {
        backend: experts_parity(backend, torch.bfloat16, context["device"], idle_experts=2)
        for backend in ("hf", "megablocks")
    }
    rows += list(idle.values())
    verdicts["qwen3_moe, 2 of 8 experts idle"] = megablocks_verdict(idle["megablocks"], idle["hf"])
    return {"rows": rows, "megablocks_bf16": verdicts}


# -- record / replay / drift ----------------------------------------------------------------------------------------

PROMPTS = ("12+34=", "7+8=", "99+1=", "305+27=")
REPLAY_MODELS: dict[str, dict[str, Any]] = {
    # the softmax family, and the sigmoid + bias family with its grouped top-k and shared expert
    "qwen3_moe": {"architecture": "qwen3_moe"},
    "deepseek_v3": {"architecture": "deepseek_v3", "n_group": 4, "topk_group": 2},
}


def replay_policy(
    architecture: dict[str, Any], backend: str, device: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A small random policy of `architecture` (16 experts, top-2, hidden 256, 4 layers) in bfloat16 on `device`."""
    experts = ExpertsImplementation.grouped_mm if device == "cuda" else ExpertsImplementation.eager
    cfg = ModelConfig(
        **architecture, dtype=DType.bfloat16, moe_backend=MoEBackend(backend), experts_implementation=experts
    )
    model, tokenizer = build_policy(cfg)
    # functools.wraps hides from mypy that PreTrainedModel.to is a method (typeshed's _Wrapped binds no self).
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]


class ExpertsSpy:
    """The `top_k_index` each experts module received in each call: what the layer computed with."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[str, list[torch.Tensor]] = {}
        self.handles = []
        for name in find_routers(model):
            experts = cast(nn.Module, model.get_submodule(name.rsplit(".", 1)[0]).experts)  # the MoE block's experts
            self.handles.append(experts.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self.calls.setdefault(name, []).append(args[1].detach().clone())

        return hook

    def used(self) -> torch.Tensor:
        """[L, B*S, K]: the experts of the first call of each layer."""
        return torch.stack([calls[0] for calls in self.calls.values()])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) in float32, [B, S-1]."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def r2_check(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """R2: a teacher-forced forward's trace replayed on the same weights, then after every router moved."""

    def forward() -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits

    valid = mask.bool()
    scored = valid[:, 1:] & valid[:, :-1]
    with torch.no_grad():
        with record_routing(model, gates=True) as recording:
            recorded_logp = token_logprobs(forward(), ids)
        trace = recording.trace
        spy = ExpertsSpy(model)
        with replay_routing(model, trace, score_replayed=True, gates=True) as replay:
            replayed_logp = token_logprobs(forward(), ids)
        spy.remove()
        flat_valid = valid.reshape(-1)
        same_weights = {
            "experts_used_equal_trace": bool(
                torch.equal(spy.used()[:, flat_valid].long(), trace.experts.flatten(1, 2)[:, flat_valid].long())
            ),
            "router_choice_equals_trace": bool(
                torch.equal(replay.router_choice.experts[trace.recorded()], trace.experts[trace.recorded()])
            ),
            "token_logp_max_abs_diff": float((replayed_logp - recorded_logp)[scored].abs().max()),
            "router_logp_max_abs_diff": float(
                # recorded with gates: the trace holds its log-probabilities
                (replay.replayed_logprobs - cast(torch.Tensor, trace.logprobs))[trace.recorded()].abs().max()
            ),
        }
        generator = torch.Generator().manual_seed(1)
        for router in find_routers(model).values():
            weight = router_weight(router)
            noise = torch.randn(weight.shape, generator=generator) * weight.float().std().item() * 5
            weight.add_(noise.to(weight))
        with record_routing(model) as free:
            forward()
        spy = ExpertsSpy(model)
        with replay_routing(model, trace):
            forward()
        spy.remove()
    moved = {
        "drift_expert_change_frac": routing_drift(trace, free.trace, mask).expert_change_frac,
        "experts_used_equal_trace": bool(
            torch.equal(spy.used()[:, flat_valid].long(), trace.experts.flatten(1, 2)[:, flat_valid].long())
        ),
    }
    return {"same_weights": same_weights, "routers_moved": moved}


def r3_check(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    ids: torch.Tensor,
    mask: torch.Tensor,
    new_tokens: int = 8,
) -> dict[str, Any]:
    """R3: a trace recorded across `generate` replayed in one teacher-forced forward of the sampled sequences."""
    torch.manual_seed(0)
    with torch.no_grad():
        with record_routing(model, generate=True, gates=True) as recording:
            # A causal LM (transformers' *ForCausalLM) generates; PreTrainedModel alone does not say so.
            out = cast(GenerationMixin, model).generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        trace = recording.trace
        sequences = out.sequences
        full_mask = torch.cat([mask, torch.ones_like(sequences[:, ids.shape[1] :])], dim=1)
        # generate's own log-probabilities of the tokens it sampled, from its raw (unprocessed) logits
        sampled = sequences[:, ids.shape[1] :]
        engine_logp = torch.stack(
            [
                torch.log_softmax(step.float(), -1).gather(-1, sampled[:, i, None]).squeeze(-1)
                for i, step in enumerate(out.logits)
            ],
            dim=1,
        )
        spy = ExpertsSpy(model)
        with replay_routing(model, trace):
            logits = model(input_ids=sequences, attention_mask=full_mask, position_ids=position_ids(full_mask)).logits
        spy.remove()
    replayed_logp = token_logprobs(logits, sequences)[:, ids.shape[1] - 1 :]
    recorded = trace.recorded().reshape(trace.shape[0], -1)[0]
    return {
        "experts_used_equal_trace": bool(
            torch.equal(spy.used()[:, recorded].long(), trace.experts.flatten(1, 2)[:, recorded].long())
        ),
        "token_logp_max_abs_diff_vs_generate": float((replayed_logp - engine_logp).abs().max()),
        "tolerance": LOGP_ATOL_BF16,
    }


def step_replay(context: dict[str, Any]) -> dict[str, Any]:
    device = context["device"]
    results: dict[str, Any] = {"tolerance": LOGP_ATOL_BF16}
    for name, architecture in REPLAY_MODELS.items():
        for backend in BACKENDS:
            label = f"{name}/{backend}"
            try:
                model, tokenizer = replay_policy(architecture, backend, device)
            except (ValueError, RuntimeError) as refusal:
                results[label] = {"refused": str(refusal).splitlines()[0]}
                continue
            encoded = tokenizer(list(PROMPTS), return_tensors="pt", padding=True, add_special_tokens=False)
            ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
            entry = {"r3": r3_check(model, tokenizer, ids, mask), "r2": r2_check(model, ids, mask)}
            r2, r3 = entry["r2"], entry["r3"]
            entry["passed"] = (
                r2["same_weights"]["experts_used_equal_trace"]
                and r2["same_weights"]["router_choice_equals_trace"]
                and r2["same_weights"]["token_logp_max_abs_diff"] <= LOGP_ATOL_BF16
                and r2["routers_moved"]["experts_used_equal_trace"]
                and r3["experts_used_equal_trace"]
                and r3["token_logp_max_abs_diff_vs_generate"] <= LOGP_ATOL_BF16
            )
            results[label] = entry
            context["progress"](label, entry)
            print(label, json.dumps(entry), flush=True)
    return results


# -- RL runs --------------------------------------------------------------------------------------------------------


def gpu_overrides(backend: str) -> list[str]:
    """What a run on the GPU sets: CUDA, bfloat16, the backend, and transformers' grouped_mm for `hf`."""
    overrides = ["device=cuda", "model.dtype=bfloat16", f"model.moe_backend={backend}", "logger.wandb.mode=disabled"]
    return overrides + (["model.experts_implementation=grouped_mm"] if backend == "hf" else [])


def run_module(module: str, overrides: list[str], run_dir: Path, timeout_s: int) -> dict[str, Any]:
    """`python -m module overrides hydra.run.dir=run_dir`: exit code, seconds, the output's tail and summary.json."""
    command = [sys.executable, "-m", module, *overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(command), "returncode": None, "tail": f"timed out after {timeout_s} s"}
    summary = run_dir / "summary.json"
    return {
        "command": " ".join(command),
        "returncode": done.returncode,
        "seconds": time.perf_counter() - start,
        "tail": (done.stdout + done.stderr)[-2000:],
        "summary": json.loads(summary.read_text()) if summary.is_file() else None,
    }


def step_rl_runs(context: dict[str, Any]) -> dict[str, Any]:
    if context["device"] != "cuda":
        return {"skipped": "needs a CUDA GPU"}
    tiny = [
        "arm=grpo_r2",
        "trainer.steps=3",
        "trainer.prompts_per_step=8",
        "trainer.eval_every=0",
        "trainer.eval_prompts=0",
    ]
    results = {}
    for backend in ("hf", "megablocks"):
        results[backend] = run_module(
            "experiments.train",
            [*tiny, *gpu_overrides(backend)],
            context["work"] / f"train_{backend}",
            context["run_timeout"],
        )
        context["progress"](backend, results[backend])
    return results


# -- expert kernels at Qwen3-30B-A3B's shapes -----------------------------------------------------------------------

QWEN3_30B_EXPERTS = {"num_experts": 128, "top_k": 8, "hidden": 2048, "width": 768}
SPEED_TOKENS = (4096, 8192, 16384, 32768)
EAGER_MAX_TOKENS = 8192  # eager loops over the experts in Python: the larger sizes would spend the budget on it
SPEED_BACKENDS = (  # label, backend, transformers' experts implementation
    ("megablocks", "megablocks", None),
    ("hf:grouped_mm", "hf", "grouped_mm"),
    ("hf:eager", "hf", "eager"),
)


def experts_flops(tokens: int, top_k: int, hidden: int, width: int) -> int:
    """Forward FLOPs of the experts: gate, up and down products of every routed token slot, 2 per multiply-add."""
    return 3 * 2 * tokens * top_k * hidden * width


def time_experts(
    experts: nn.Module, routing: dict[str, torch.Tensor], warmup: int = 2, iters: int = 5
) -> dict[str, float]:
    """Forward and forward + backward milliseconds of `experts` on `routing` (bfloat16, CUDA)."""
    x = routing["hidden_states"].to(torch.bfloat16).requires_grad_(True)
    w = routing["top_k_weights"].to(torch.bfloat16).requires_grad_(True)
    upstream = routing["upstream"].to(torch.bfloat16)

    def forward() -> torch.Tensor:
        return experts(x, routing["top_k_index"], w)

    with torch.no_grad():
        forward_ms = cuda_ms(forward, warmup, iters)
    return {
        "forward_ms": forward_ms,
        "forward_backward_ms": cuda_ms(lambda: (forward() * upstream).sum().backward(), warmup, iters),
    }


def step_expert_speed(context: dict[str, Any]) -> dict[str, Any]:
    if context["device"] != "cuda":
        return {"skipped": "needs a CUDA GPU"}
    peak = context["results"].get("versions", {}).get("result", {}).get("bf16_matmul_peak_tflops")
    peak = peak if isinstance(peak, float) else matmul_peak_tflops()
    shape = QWEN3_30B_EXPERTS
    rows: list[dict[str, Any]] = []
    for label, backend, implementation in SPEED_BACKENDS:
        hf_experts = make_hf_experts(shape["num_experts"], shape["top_k"], shape["hidden"], shape["width"], seed=0)
        config = cast(PretrainedConfig, hf_experts.config)  # transformers' experts keep their model's config
        config._experts_implementation = implementation or "eager"
        try:
            experts = backend_module(hf_experts.to(torch.bfloat16), backend).cuda()
        except (ValueError, RuntimeError) as refusal:
            rows.append({"backend": label, "refused": str(refusal)})
            continue
        for tokens in SPEED_TOKENS:
            row: dict[str, Any] = {"backend": label, "tokens": tokens, **shape}
            if implementation == "eager" and tokens > EAGER_MAX_TOKENS:
                rows.append(
                    row
                    | {
                        "skipped": f"eager above {EAGER_MAX_TOKENS} tokens: its Python loop over the "
                        "experts would spend the time budget"
                    }
                )
                continue
            routing = make_routing(tokens, shape["num_experts"], shape["top_k"], shape["hidden"], seed=0)
            routing = {name: tensor.cuda() for name, tensor in routing.items()}
            row |= time_experts(experts, routing)
            flops = experts_flops(tokens, shape["top_k"], shape["hidden"], shape["width"])
            row["forward_tflops"] = flops / (row["forward_ms"] * 1e-3) / 1e12
            row["forward_backward_tflops"] = 3 * flops / (row["forward_backward_ms"] * 1e-3) / 1e12
            row["forward_backward_share_of_peak"] = row["forward_backward_tflops"] / peak
            rows.append(row)
            context["progress"](f"{label}/{tokens}", row)
            print(json.dumps(row), flush=True)
        del experts, hf_experts
        torch.cuda.empty_cache()
    return {"peak_tflops": peak, "rows": rows}


# -- RL step seconds ------------------------------------------------------------------------------------------------

# A random Qwen3-MoE of about 1B parameters (10 layers of 64 experts, top-8, hidden 1024, width 512: 1.0 B in the
# experts), on bench-tiny's batch.
QWEN3_MOE_1B = [
    "model.name=qwen3_moe_1b",
    "model.hidden_size=1024",
    "model.num_hidden_layers=10",
    "model.num_attention_heads=16",
    "model.num_key_value_heads=4",
    "model.head_dim=64",
    "model.num_experts=64",
    "model.num_experts_per_tok=8",
    "model.moe_intermediate_size=512",
]
RL_STEP_WORKLOADS = {  # label -> (workload, overrides on top of it, backends)
    "bench-deep": ("deep", [], ("hf", "megablocks")),
    "qwen3_moe_1b": ("tiny", QWEN3_MOE_1B, ("hf", "megablocks")),
}


def time_rl_steps(workload: str, overrides: list[str], steps: int = 2) -> dict[str, Any]:
    """One warm-up RL step, then `steps` timed ones, of `workload` with `overrides` (in this process)."""
    build_start = time.perf_counter()
    cfg = compose_workload(overrides, workload)
    trainer = RLTrainer(cfg, min_new_tokens=fixed_length(cfg))
    result: dict[str, Any] = {
        "build_s": time.perf_counter() - build_start,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
    }
    trainer.step()
    records = [trainer.step() for _ in range(steps)]
    for key in (m.STEP_TIME, m.ROLLOUT_TIME, m.SCORE_TIME, m.TRAIN_TIME):
        result[key] = [record[key] for record in records]
    result["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del trainer
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


def step_rl_step(context: dict[str, Any]) -> dict[str, Any]:
    if context["device"] != "cuda":
        return {"skipped": "needs a CUDA GPU"}
    results: dict[str, Any] = {}
    for label, (workload, overrides, backends) in RL_STEP_WORKLOADS.items():
        for backend in backends:
            try:
                results[f"{label}/{backend}"] = time_rl_steps(workload, [*overrides, *gpu_overrides(backend)])
            except Exception as error:  # one workload's failure (memory, a refusal) must not hide the others
                results[f"{label}/{backend}"] = failure(error)
            context["progress"](f"{label}/{backend}", results[f"{label}/{backend}"])
            print(label, backend, json.dumps(results[f"{label}/{backend}"]), flush=True)
    return results


# -- GPU tests and the drift probe ----------------------------------------------------------------------------------


def run_pytest(arguments: list[str], timeout_s: int) -> dict[str, object]:
    """`pytest -q -rA <arguments>` in a subprocess: the command, its exit code and the tail of its report."""
    command = [sys.executable, "-m", "pytest", "-q", "-rA", *arguments]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(command), "returncode": None, "tail": f"timed out after {timeout_s} s"}
    return {"command": " ".join(command), "returncode": done.returncode, "tail": (done.stdout + done.stderr)[-4000:]}


def step_gpu_tests(context: dict[str, Any]) -> dict[str, Any]:
    return run_pytest(["-m", "gpu", "tests/test_megablocks_gpu.py"], context["run_timeout"])


# qwen30b_l16 (16 MoE layers, 128 experts top-8) at Qwen3-30B-A3B's width and attention, random weights.
PROBE_OVERRIDES = [
    "model=qwen30b_l16",
    "model.path=null",
    "model.hidden_size=2048",
    "model.moe_intermediate_size=768",
    "model.num_attention_heads=32",
    "model.num_key_value_heads=4",
    "model.head_dim=128",
    "probe.lrs=[1e-4]",
    "probe.warm_steps=1",
    "probe.measure_steps=2",
    "probe.precisions=[]",
    "trainer.threads=null",
]


def step_probe(context: dict[str, Any]) -> dict[str, Any]:
    if context["device"] != "cuda":
        return {"skipped": "needs a CUDA GPU"}
    return run_module(
        "experiments.probe", [*PROBE_OVERRIDES, *gpu_overrides("hf")], context["work"] / "probe", context["run_timeout"]
    )


STEPS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "versions": step_versions,
    "parity": step_parity,
    "replay": step_replay,
    "rl_runs": step_rl_runs,
    "expert_speed": step_expert_speed,
    "rl_step": step_rl_step,
    "gpu_tests": step_gpu_tests,
    "probe": step_probe,
}


# -- one step at a time, the JSON rewritten after each ------------------------------------------------------------


def failure(error: BaseException) -> dict[str, str]:
    """A failure as one line and the tail of its traceback."""
    line = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return {"error": line, "traceback": "".join(traceback.format_exception(error))[-3000:]}


def write_json(path: Path, results: dict[str, Any]) -> None:
    """Replace `path` in one rename, so that a run killed mid-write leaves the previous JSON whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(results, indent=2, default=str) + "\n")
    temporary.replace(path)


def run_step(name: str, context: dict[str, Any], out: Path) -> None:
    """Run step `name`, recording its seconds and its result or failure in `out` (before and after it runs)."""
    results = context["results"]
    results[name] = {"status": "running", "partial": {}}
    write_json(out, results)

    def progress(part: str, value: Any) -> None:
        results[name]["partial"][part] = value
        write_json(out, results)

    context["progress"] = progress
    start = time.perf_counter()
    try:
        entry: dict[str, Any] = {"status": "done", "result": STEPS[name](context)}
    except Exception as error:  # the next step still runs; this one's failure is its result
        entry = {"status": "failed", **failure(error), "partial": results[name]["partial"]}
    entry["seconds"] = time.perf_counter() - start
    results[name] = entry
    write_json(out, results)
    print(f"[{name}] {entry['status']} in {entry['seconds']:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON of results (steps already there are kept)")
    parser.add_argument("--step", action="append", choices=list(STEPS), help="run only these steps (repeatable)")
    parser.add_argument(
        "--note",
        nargs=2,
        action="append",
        metavar=("STEP", "MESSAGE"),
        help="record MESSAGE as STEP's failure, keeping its finished parts, without running anything "
        "(a step killed by a timeout, or left unrun); repeatable",
    )
    parser.add_argument("--build-log", type=Path, help="gpu_checks.sh's build log, reported by the versions step")
    parser.add_argument("--work", type=Path, help="where runs write their directories (default: a temporary one)")
    parser.add_argument("--run-timeout", type=int, default=240, help="seconds allowed to each subprocess")
    args = parser.parse_args(argv)

    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    if args.note:
        for step, message in args.note:
            results[step] = {**results.get(step, {}), "status": "failed", "error": message}  # its parts done stay
        write_json(args.out, results)
        return 0
    context = {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "results": results,
        "build_log": args.build_log,
        "work": args.work or Path(tempfile.mkdtemp(prefix="gpu_checks_")),
        "run_timeout": args.run_timeout,
    }
    for name in args.step or list(STEPS):
        run_step(name, context, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
