"""MegaBlocks' grouped dMoE kernels run on routing decisions that our own router already made (CUDA only).

What runs. The dropless GLU computation of `models.dmoe_reference`, with MegaBlocks' kernels doing the work,
in the order of MegaBlocks' grouped path (`megablocks/layers/dmoe.py::grouped_permute_and_compute`,
`megablocks/layers/glu.py::GroupedGLU`):
  sort the T*k token-slots by expert (`ops.sort`, a CUB radix sort), count them (`ops.histogram`,
  `ops.inclusive_cumsum`), copy each token to its slots (`ops.gather`), three grouped GEMMs
  (`grouped_gemm.ops.gmm`: gate and up with `trans_b`, then down), and a weighted scatter that sums the k
  slots of each token (`ops.scatter`, which also gives the routing weights their gradient).
MegaBlocks' router and its `dMoE` layer are not used: routing stays in transformers' router module, where
record / replay / drift act, and nothing here appends to MegaBlocks' load-balancing list.

Why grouped and not sparse. MegaBlocks 0.10's sparse path (stanford-stk, Triton block-sparse) needs an
expert width that is a multiple of its 128 blocking, and `Arguments` refuses it outright with triton >= 3.2
(megablocks issues #170, #178). The grouped path has neither limit. Its kernels set their own:
  - bfloat16 only: grouped_gemm checks `a.scalar_type() == kBFloat16` (tgale96/grouped_gemm issue #19);
  - hidden size and expert width multiples of 8: the CUTLASS grouped kernel (A100 builds) loads operands
    in 16-byte vectors of 8 bfloat16 values;
  - CUDA tensors, and a host copy of the per-expert counts (one device sync per MoE layer, as in MegaBlocks).
`megablocks_kernel_problem` and `load_megablocks_kernels` check these, so that a refusal is one line at start-up.

Install (CUDA machine). megablocks 0.10.0 pins `torch>=2.7.0,<2.7.1`, builds against torch 2.7.0 in an
isolated build, and ships only an sdist; stanford-stk 0.7.1 and grouped_gemm 0.3.0 are sdists too. Build all
three against the CUDA torch already installed (it brings triton), without letting pip touch torch; this needs
a CUDA toolkit whose nvcc matches `torch.version.cuda`:

    pip install ninja packaging numpy wheel "setuptools<79"
    export TORCH_CUDA_ARCH_LIST="9.0"        # H100/H200; "8.0" for A100
    pip install --no-build-isolation --no-deps megablocks==0.10.0 stanford-stk==0.7.1 grouped_gemm==0.3.0

`pip install -e '.[megablocks]'` alone resolves megablocks' pins and replaces torch with 2.7.0.

Status: written and CPU-tested, not yet run on a GPU. The CPU tests cover the refusals and run `grouped_glu`
on CPU stand-ins of MegaBlocks' ops that follow their contracts as read in the v0.10 source, against
`models.dmoe_reference`; `tests/test_megablocks_gpu.py` and `benchmarks/gpu_checks.py` hold the GPU checks.
"""

import functools
import math
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch

from models.dmoe_reference import RoutedGLU

INSTALL_HINT = (
    "on a CUDA machine run `pip install --no-build-isolation --no-deps megablocks==0.10.0 stanford-stk==0.7.1 "
    "grouped_gemm==0.3.0` (README 'MegaBlocks (CUDA)'; plain `pip install -e '.[megablocks]'` "
    "downgrades torch to 2.7.0)"
)
# The CUTLASS grouped GEMM reads bfloat16 operands in 16-byte vectors.
ALIGNMENT = 8


class MegaBlocksKernels(NamedTuple):
    """The two entry points used: MegaBlocks' permutation ops module and grouped_gemm's autograd `gmm`."""

    ops: ModuleType
    gmm: Callable[..., torch.Tensor]


def megablocks_kernel_problem(hidden_size: int, expert_width: int, dtype: torch.dtype) -> str | None:
    """Why the grouped kernels cannot take experts of this shape and dtype, or None when they can."""
    if dtype != torch.bfloat16:
        return (
            f"MegaBlocks' grouped GEMM (grouped_gemm 0.3.0) takes bfloat16 only, the experts are {dtype}: "
            "set model.dtype=bfloat16 or use moe_backend=torch_dmoe"
        )
    for name, size in (("hidden size", hidden_size), ("expert width", expert_width)):
        if size % ALIGNMENT:
            return (
                f"MegaBlocks' grouped GEMM needs a {name} that is a multiple of {ALIGNMENT}, got {size}: "
                "use moe_backend=torch_dmoe for this model"
            )
    return None


@functools.cache
def load_megablocks_kernels() -> MegaBlocksKernels:
    """Import MegaBlocks' ops and grouped_gemm (lazily: both need CUDA builds); refuse in one line if missing.

    Only a success is cached: a failed import raises again on the next call.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "moe_backend=megablocks needs a CUDA GPU and torch.cuda.is_available() is False: "
            "use moe_backend=torch_dmoe (same computation in PyTorch) on this machine"
        )
    try:
        import grouped_gemm.ops
        import megablocks.ops
    except Exception as error:  # an ImportError, or a broken CUDA/Triton build failing at import time
        cause = f"{type(error).__name__}: {error}".replace("\n", " ")
        message = f"moe_backend=megablocks cannot import MegaBlocks' kernels ({cause}); {INSTALL_HINT}"
        raise RuntimeError(message) from error
    return MegaBlocksKernels(ops=megablocks.ops, gmm=grouped_gemm.ops.gmm)


def require_megablocks(hidden_size: int, expert_width: int, dtype: torch.dtype) -> MegaBlocksKernels:
    """The kernels, once CUDA, the packages, the dtype and the shapes are all fine; otherwise a one-line error."""
    kernels = load_megablocks_kernels()
    problem = megablocks_kernel_problem(hidden_size, expert_width, dtype)
    if problem is not None:
        raise ValueError(problem)
    return kernels


def megablocks_glu_forward(kernels: MegaBlocksKernels, call: RoutedGLU) -> torch.Tensor:
    """Dropless GLU experts with MegaBlocks' kernels; same contract as `dmoe_glu_reference`, on CUDA bfloat16."""
    if not call.hidden_states.is_cuda or call.hidden_states.dtype != torch.bfloat16 or call.w1.dtype != torch.bfloat16:
        raise ValueError(
            "moe_backend=megablocks runs on CUDA bfloat16 tensors, got hidden states "
            f"{call.hidden_states.dtype} on {call.hidden_states.device} and experts {call.w1.dtype} on {call.w1.device}"
        )
    return grouped_glu(kernels, call)


def grouped_glu(kernels: MegaBlocksKernels, call: RoutedGLU) -> torch.Tensor:
    """The grouped dMoE GLU written against MegaBlocks' op interface, whatever implements it (no checks)."""
    ops = kernels.ops
    hidden_states, top_k_index, num_experts = call.hidden_states, call.top_k_index, call.num_experts
    num_tokens, top_k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    slot_experts = top_k_index.reshape(-1).int()
    with torch.no_grad():
        sort_end_bit = max(math.ceil(math.log2(num_experts)), 1)
        bin_ids, slot_order = ops.sort(slot_experts, sort_end_bit)
        tokens_per_expert = ops.histogram(slot_experts, num_experts)
        bins = ops.inclusive_cumsum(tokens_per_expert, 0).view(-1)  # a 0-d tensor when E == 1
        batch_sizes = tokens_per_expert.cpu().to(torch.long)

    routed = ops.gather(hidden_states.contiguous(), slot_order, bin_ids, bins, top_k)  # [T*k, H] by expert
    gate, up, down = (w.view(num_experts, -1, hidden) for w in (call.w1, call.v1, call.w2))
    glu = call.act_fn(kernels.gmm(routed, gate, batch_sizes, trans_b=True)) * kernels.gmm(
        routed, up, batch_sizes, trans_b=True
    )
    expert_out = kernels.gmm(glu, down, batch_sizes)
    # The scatter kernel reads the weights in the activations' dtype (Mixtral's router hands over float32).
    weights = call.top_k_weights.reshape(-1).to(expert_out.dtype)
    out = ops.scatter(expert_out, slot_order, bin_ids, weights, bins, top_k)
    return out.view(num_tokens, hidden)
