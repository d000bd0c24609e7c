"""`python -m benchmarks.experts_paths`: the experts' matmul for many narrow experts, four ways, at bench-deep's shapes.

bench-deep's experts (qwen30b_l16: 128 experts top-8, hidden 64, expert width 24, so gate/up is 64 -> 48) see two
shapes in a step: the rollout's decode, 256 tokens (2,048 rows, ~16 per expert), and a training minibatch, ~3,300
tokens (26,400 rows). Each way computes gate/up for rows already sorted by expert (`models.sorted_experts`'s layout):

  grouped_mm  `torch.nn.functional.grouped_mm` with the experts' offsets (what `sorted_mm` and `grouped_mm` run; on
              CPU a loop of one small `mm` per expert inside ATen)
  loop        the same loop in Python, `torch.mm` per expert over `split` rows (one host sync for the counts)
  padded bmm  every expert's rows padded to the largest expert's, one `bmm` [E, C, H] x [E, H, 2F], rows gathered
              back: one kernel, at the price of the padding (C = max load)
  MKL batch   MKL's batch GEMM (`cblas_sgemm_batch`, exported by torch's CPU library where it links MKL): one call
              of E products of each expert's own rows, addresses built with tensor ops, so no per-expert dispatch
              and no padding (skipped where this torch has no MKL)

Routing is drawn from logits with a per-expert slope (`--skew`), since real routers are uneven: max / mean load is
printed beside each time. Every way is checked equal to grouped_mm before it is timed; times are medians of
`--rounds` rounds, the ways interleaved in each round, as ratios to grouped_mm (absolute times drift on a shared
machine).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

EXPERTS, TOP_K, HIDDEN, GATE_UP = 128, 8, 64, 48  # qwen30b_l16's experts (conf/model/qwen30b_l48.yaml)
SHAPES = {"decode": 256, "training minibatch": 3300}  # tokens: 32 prompts x 8; a minibatch of 64 x ~52 positions


@dataclass
class SortedRows:
    """(token, slot) rows sorted by expert, as the experts forward sees them."""

    rows: torch.Tensor  # [T*k, H]
    experts: torch.Tensor  # [T*k] expert of each row, ascending
    counts: torch.Tensor  # [E] rows per expert

    @classmethod
    def draw(cls, tokens: int, skew: float, generator: torch.Generator) -> SortedRows:
        logits = torch.randn(tokens, EXPERTS, generator=generator) + skew * torch.linspace(0, 1, EXPERTS)
        experts, _ = torch.sort(logits.topk(TOP_K, dim=-1).indices.reshape(-1))
        rows = torch.randn(tokens * TOP_K, HIDDEN, generator=generator)
        return cls(rows, experts, torch.bincount(experts, minlength=EXPERTS))

    @property
    def max_over_mean_load(self) -> float:
        return float(self.counts.max()) / (len(self.experts) / EXPERTS)


def ways(batch: SortedRows, weight: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The three computations of `batch.rows` @ its experts' `weight` [E, H, 2F]."""
    offsets = torch.cumsum(batch.counts, 0, dtype=torch.int32)
    counts = batch.counts.tolist()
    capacity = max(counts)
    slot = torch.arange(len(batch.experts)) - torch.repeat_interleave(offsets - batch.counts, batch.counts)

    def grouped() -> torch.Tensor:
        return F.grouped_mm(batch.rows, weight, offs=offsets)

    def loop() -> torch.Tensor:
        out = batch.rows.new_empty(len(batch.experts), weight.shape[-1])
        for expert, (rows, into) in enumerate(zip(batch.rows.split(counts), out.split(counts))):
            if len(rows):
                torch.mm(rows, weight[expert], out=into)
        return out

    def padded() -> torch.Tensor:
        buffer = batch.rows.new_zeros(EXPERTS, capacity, HIDDEN)
        buffer[batch.experts, slot] = batch.rows
        return torch.bmm(buffer, weight)[batch.experts, slot]

    calls = {"grouped_mm": grouped, "loop": loop, "padded bmm": padded}
    gemm = _mkl_batch_gemm()
    if gemm is None:
        return calls
    starts = (offsets - batch.counts).long()
    every = lambda value, dtype=torch.int32: torch.full((EXPERTS,), value, dtype=dtype)  # noqa: E731
    no_trans, m = every(111), batch.counts.to(torch.int32)  # CBLAS_TRANSPOSE NoTrans; each expert's rows
    n, k, alpha, beta, one = (
        every(GATE_UP),
        every(HIDDEN),
        every(1.0, torch.float32),
        every(0.0, torch.float32),
        every(1),
    )
    weights_at = weight.data_ptr() + torch.arange(EXPERTS) * (HIDDEN * GATE_UP * 4)

    def mkl_batch() -> torch.Tensor:
        out = batch.rows.new_empty(len(batch.experts), GATE_UP)
        rows_at = batch.rows.data_ptr() + starts * (HIDDEN * 4)
        out_at = out.data_ptr() + starts * (GATE_UP * 4)
        gemm(
            101,
            no_trans.data_ptr(),
            no_trans.data_ptr(),
            m.data_ptr(),
            n.data_ptr(),
            k.data_ptr(),  # 101: row-major
            alpha.data_ptr(),
            rows_at.data_ptr(),
            k.data_ptr(),
            weights_at.data_ptr(),
            n.data_ptr(),
            beta.data_ptr(),
            out_at.data_ptr(),
            n.data_ptr(),
            EXPERTS,
            one.data_ptr(),
        )
        return out

    return {**calls, "MKL batch": mkl_batch}


def _mkl_batch_gemm() -> Callable[..., None] | None:
    """`cblas_sgemm_batch` (32-bit sizes) from torch's CPU library, or None where it does not link MKL."""
    try:
        gemm = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).cblas_sgemm_batch
    except (OSError, AttributeError):
        return None
    gemm.restype, gemm.argtypes = None, [ctypes.c_int, *[ctypes.c_void_p] * 13, ctypes.c_int, ctypes.c_void_p]
    return gemm


def measure(tokens: int, skew: float, rounds: int, seed: int = 0) -> tuple[float, dict[str, list[float]]]:
    """Max / mean load and each way's seconds per call over `rounds` interleaved rounds."""
    generator = torch.Generator().manual_seed(seed)
    batch = SortedRows.draw(tokens, skew, generator)
    weight = torch.randn(EXPERTS, HIDDEN, GATE_UP, generator=generator)
    calls = ways(batch, weight)
    reference = calls["grouped_mm"]()
    for name, call in calls.items():
        torch.testing.assert_close(call(), reference, rtol=1e-4, atol=1e-4, msg=f"{name} differs from grouped_mm")
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start, repeats = time.perf_counter(), 0
            while time.perf_counter() - start < 0.2:
                call()
                repeats += 1
            seconds[name].append((time.perf_counter() - start) / repeats)
    return batch.max_over_mean_load, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--skew",
        type=float,
        nargs="+",
        default=[0.0, 3.0],
        help="slope of the routing logits across experts (0: balanced routing)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per shape (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: %(default)s)")
    args = parser.parse_args()
    if args.rounds < 1 or args.threads < 1:
        parser.error(f"--rounds={args.rounds} and --threads={args.threads} must be >= 1")
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s); ms per call, median of {args.rounds} rounds "
        "(ratio to grouped_mm)"
    )
    header = None
    for shape, tokens in SHAPES.items():
        for skew in args.skew:
            load, seconds = measure(tokens, skew, args.rounds)
            if header is None:
                header = ["shape", "tokens", "max / mean load", *seconds]
                print("| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|")
            base = statistics.median(seconds["grouped_mm"])
            cells = [f"{statistics.median(s) * 1e3:.2f} ({statistics.median(s) / base:.2f}x)" for s in seconds.values()]
            print(f"| {shape} | {tokens} | {load:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
