"""Which CPU kernels compute, and the fingerprint of the weights they computed.

The same command gives other bits on another x86 CPU: ATen picks its vectorised kernels by the CPU's capability
(AVX2, AVX-512, ...) and MKL picks its code path by the CPU's vendor and instruction set, and over hundreds of SFT
steps other rounding is another checkpoint (measured: tiny_moe's cold start stopped at 280 steps and 53.5% on an
AMD EPYC with AVX2, at 260 steps and 45.3% on the machine that documented it). `portable` pins both to a path
every x86-64 CPU of the last decade has, meant to run identically on each. It does not across vendors: pinned, an
Intel Xeon with AVX-512 and AMX made another tiny_moe cold start than the AMD EPYC that documented it, because MKL's
single-precision vector sqrt (AdamW's `exp_avg_sq.sqrt()`) starts, on its COMPATIBLE branch, from the `rsqrtps`
approximation, whose bits are each vendor's own (docs/reproduce.md, with a candidate fix left unapplied: it would
change every start's bits on every machine):

- ATen's AVX2 kernels (`ATEN_CPU_CAPABILITY=avx2`): every x86-64 CPU since 2013 (Intel Haswell, AMD Zen) has them;
- MKL's conditional numerical reproducibility branch `COMPATIBLE` (`MKL_CBWR`): the one branch MKL documents as
  giving the same results on Intel and non-Intel processors (an ISA branch such as `AVX2` is honoured on Intel CPUs
  only: on an AMD EPYC MKL reports `AUTO` for it, measured). It costs: MKL's fp32 GEMMs run ~1.7x slower on this
  machine's shapes;
- oneDNN capped at AVX2 (`ONEDNN_MAX_CPU_ISA`), for the kernels that go through it (bf16 matmuls).

Both libraries read these variables once, at their first computation, so `pin` sets them before any and then
checks that they took: ATen's capability through torch, MKL's branch through MKL's own service call. `native`
leaves the machine's and the environment's choice (faster; other bits on another CPU) and records it.
What this cannot pin: another torch or MKL build (both recorded by `describe`), another thread count (cold starts
run on one thread), a non-x86 CPU (refused).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
from collections.abc import Callable
from enum import StrEnum
from functools import cache
from pathlib import Path

import torch

from models.registry import ConfigError


class CpuKernels(StrEnum):
    portable = "portable"  # ATen avx2, MKL COMPATIBLE, oneDNN <= AVX2: one path on every x86-64 CPU with AVX2
    native = "native"  # the machine's own choice: faster, other bits on another CPU


PORTABLE_ENVIRONMENT = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
_ATEN_CAPABILITY = "AVX2"  # what torch reports once ATen runs its AVX2 kernels
_MKL_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE"}  # mkl_cbwr_get's codes (mkl_service.h) for the branches seen
_MKL_COMPATIBLE = 3
_X86 = ("x86_64", "amd64")


@cache
def _mkl_branch_getter() -> Callable[[int], int] | None:
    """MKL's `mkl_serv_cbwr_get` from torch's own library (MKL is linked into it), or None where this build has no
    MKL or does not export it."""
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        getter = ctypes.CDLL(str(library)).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    getter.restype, getter.argtypes = ctypes.c_int, [ctypes.c_int]
    return getter


def mkl_branch() -> str:
    """The branch MKL computes with (`MKL_CBWR_BRANCH` asked of MKL itself), or `unknown` where it cannot be asked."""
    getter = _mkl_branch_getter()
    if getter is None:
        return "unknown"
    code = getter(1)
    return _MKL_BRANCHES.get(code, f"code {code}")


def pin(mode: CpuKernels | str) -> None:
    """Make this process compute with the kernels `mode` names. Call it before the process computes anything: both
    libraries fix their choice at their first computation. `ConfigError` where the portable path cannot be had (not
    x86-64, no AVX2) or where this process already computed with another choice."""
    mode = CpuKernels(mode)
    if mode == CpuKernels.native:
        return
    machine = platform.machine().lower()
    if machine not in _X86:
        raise ConfigError(
            f"cpu_kernels=portable pins x86-64 kernels; this machine is {machine}: use cpu_kernels=native"
        )
    os.environ.update(PORTABLE_ENVIRONMENT)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != _ATEN_CAPABILITY:
        raise ConfigError(
            f"cpu_kernels=portable needs ATen's AVX2 kernels, but this process computes with {capability} (a CPU "
            "without AVX2, or a process that computed before the pin): use cpu_kernels=native"
        )
    branch = mkl_branch()
    if branch not in ("COMPATIBLE", "unknown"):
        raise ConfigError(
            f"cpu_kernels=portable needs MKL's COMPATIBLE branch, but MKL already computes with {branch} in this "
            "process (it computed before the pin): start a new process, or use cpu_kernels=native"
        )


def describe(mode: CpuKernels | str) -> dict[str, str]:
    """What computed: the mode, ATen's capability, MKL's branch, the environment that chose them, torch and MKL's
    builds and the CPU: the record a result needs to be re-run to the bit, or to say why it was not."""
    return {
        "mode": str(CpuKernels(mode)),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_branch": mkl_branch(),
        **{variable.lower(): os.environ.get(variable, "unset") for variable in PORTABLE_ENVIRONMENT},
        "torch": torch.__version__,
        "mkl": _first_line(torch.__config__.show(), "Math Kernel Library") or "none",
        "cpu": _cpu_model(),
    }


def _first_line(text: str, containing: str) -> str | None:
    return next((line.strip(" -") for line in text.splitlines() if containing in line), None)


def _cpu_model() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = _first_line(cpuinfo, "model name")
    return name.split(":", 1)[1].strip() if name else platform.machine()


def weights_sha256(model: torch.nn.Module) -> str:
    """The sha256 of a model's weights: every tensor of its state dict in name order, with its name, dtype and shape.
    The same for a model built, trained or loaded, whatever the file layout it came from: a start's identity."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
