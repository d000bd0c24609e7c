"""Roofline of one RL step: the model FLOPs the step must do, against the machine's measured fp32 matmul rate.

Model FLOPs count the matrix multiplications on the active path only, 2 FLOPs per multiply-add (Kaplan et al.
2020, "Scaling Laws for Neural Language Models", §2.1: C_forward ≈ 2·N per token, with N the parameters a token
touches). Per token and MoE layer: the q/k/v/o projections, the router (hidden x experts: every expert's logit
is computed), and the top-k experts' GLU (gate, up, down: 3 matrices of hidden x expert width each); the
attention scores and the weighted sum of values, 2·2·heads·head_dim FLOPs per attended position (causal: a
token at position p attends to p + 1 positions, left padding included, since it is computed); the LM head only
where logits are computed. Norms, activations, softmax, sampling and the optimizer are not counted; backward
is 2 x forward.

One RL step, with N = prompts x group size completions, prompt width P (left-padded) and T new tokens:
    generation  prefill of N·P tokens with logits on the last position, then T − 1 decode steps of N tokens
                (the last sampled token is never fed back), each attending to the cache;
    scoring     one forward over N·(P + T − 1) tokens (the last token's logits would predict nothing, so it is
                never fed), logits on the last T positions (`logits_to_keep`);
    training    the same forward plus its backward, over the N completions (in minibatches): 3 x scoring.
This is the work the RL step defines, the same for every loop. A loop that avoids part of it is credited with the
work avoided: without replay ours takes θ_old's log-probs from the rollout and never runs the scoring forward
(with r2/r3 it scores every minibatch but the on-policy one), and it computes each prompt once per group, in the
prefill and in packed training forwards; TRL scores all minibatches and feeds every row in full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a decoder's FLOPs per token; `experts = 0` for a dense model (MLP width `mlp_width`)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    mlp_width: int
    experts: int = 0
    top_k: int = 0

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelShape:
        """From a transformers config: Qwen3-MoE (every layer MoE) or a dense Qwen3/Llama-style model."""
        experts = getattr(config, "num_experts", 0) or 0
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            mlp_width=config.moe_intermediate_size if experts else config.intermediate_size,
            experts=experts,
            top_k=config.num_experts_per_tok if experts else 0,
        )

    @property
    def token_flops(self) -> int:
        """Forward FLOPs of one token through every layer's projections, router and active MLP (no attention
        scores, no LM head)."""
        projections = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        router = self.hidden * self.experts
        mlp = max(self.top_k, 1) * 3 * self.hidden * self.mlp_width
        return 2 * self.layers * (projections + router + mlp)

    def attention_flops(self, attended: int) -> int:
        """Forward FLOPs of scores and weighted values, all layers, summed over `attended` query-key pairs."""
        return 2 * 2 * self.heads * self.head_dim * self.layers * attended

    @property
    def lm_head_flops(self) -> int:
        return 2 * self.hidden * self.vocab


def _causal_pairs(first: int, last: int) -> int:
    """Query-key pairs of queries at positions first..last (inclusive, 0-based), each attending to p + 1 keys."""
    return sum(p + 1 for p in range(first, last + 1))


def rl_step_flops(shape: ModelShape, completions: int, prompt_width: int, new_tokens: int) -> dict[str, float]:
    """Model FLOPs of one RL step by phase: `generation`, `scoring`, `training` and their `total`."""
    N, P, T = completions, prompt_width, new_tokens
    prefill = N * (P * shape.token_flops + shape.attention_flops(_causal_pairs(0, P - 1)) + shape.lm_head_flops)
    decode = N * (
        (T - 1) * (shape.token_flops + shape.lm_head_flops) + shape.attention_flops(_causal_pairs(P, P + T - 2))
    )
    forward = N * (
        (P + T - 1) * shape.token_flops + shape.attention_flops(_causal_pairs(0, P + T - 2)) + T * shape.lm_head_flops
    )
    flops = {"generation": float(prefill + decode), "scoring": float(forward), "training": float(3 * forward)}
    flops["total"] = sum(flops.values())
    return flops


def matmul_gflops(size: int, seconds: float = 0.25, trials: int = 3) -> float:
    """Measured fp32 `size x size` matmul throughput in GFLOP/s with torch's current thread setting: the best of
    `trials` timings of as many products as fit in `seconds` (the best, since a shared machine only ever slows
    a kernel down)."""
    if size < 1 or seconds <= 0 or trials < 1:
        raise ValueError(f"matmul_gflops needs size >= 1, seconds > 0, trials >= 1; got {size}, {seconds}, {trials}")
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)
    start = time.perf_counter()
    torch.mm(a, b, out=out)
    repeats = max(1, int(seconds / max(time.perf_counter() - start, 1e-6)))
    rates = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b, out=out)
        rates.append(2 * size**3 * repeats / (time.perf_counter() - start) / 1e9)
    return max(rates)


def matmul_peak(sizes: tuple[int, ...] = (256, 512, 1024, 2048)) -> tuple[int, float, dict[int, float]]:
    """The machine's fp32 matmul peak as measured: (best size, its GFLOP/s, GFLOP/s of every size)."""
    rates = {size: matmul_gflops(size) for size in sizes}
    best = max(rates, key=rates.__getitem__)
    return best, rates[best], rates
