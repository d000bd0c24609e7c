"""How much memory one RL step will need, estimated from the model's sizes and the batch, before anything is built.

A step that cannot fit should be refused at start-up with the numbers, not found out minutes later in the
allocator. The estimate counts the tensors that scale with the batch, for the largest phase of a step:

    resident    weights + gradients + AdamW's two fp32 moments (+ the frozen reference's weights when kl_coef > 0)
    rollout     the KV cache of N = prompts x G rows over P + T positions, one step's fp32 log-softmax [N, V],
                and the prefill's attention scores (prompts x heads x P² in fp32)
    evaluation  the same for eval_prompts x eval_samples rows
    whole split the greedy evaluation of every test prompt (`trainer.eval_split`), in batches of as many prompts as
                fit within the largest of the step's other phases: it never raises the step's peak, however large
                the split (a GSM8K test file holds 1,319 prompts); the batch is a function of the settings and the
                data alone, so a run evaluates the same batches on every machine
    training    one minibatch of n = N / minibatches rows fed in full (the packed layout feeds fewer tokens):
                activations kept for backward, ~(12·hidden + 4·k·expert width + heads·S) values per token and
                layer, and the fp32 logits, log-softmax and its gradient over the T response positions

It is an estimate of the dominant terms (measured against the bench workload's peak RSS: the same order, below
it by the fixed cost of the Python process and its libraries), so it refuses only what is clearly out of reach.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from omegaconf import DictConfig
from transformers import AutoModelForCausalLM, PretrainedConfig

GIB = 1024**3


@dataclass(frozen=True)
class StepMemory:
    resident: float
    rollout: float
    evaluation: float
    training: float
    split_evaluation: float = 0.0  # one batch of the whole-split evaluation (0: trainer.eval_split=false)
    split_batch: int = 1  # test prompts per batch of the whole-split evaluation (per rank)

    @property
    def peak(self) -> float:
        return self.resident + max(self.rollout, self.evaluation, self.training, self.split_evaluation)

    def describe(self) -> str:
        parts = {
            "weights, gradients and AdamW": self.resident,
            "rollout": self.rollout,
            "evaluation": self.evaluation,
            "a training minibatch": self.training,
        }
        if self.split_evaluation:
            parts[f"the whole split's evaluation in batches of {self.split_batch}"] = self.split_evaluation
        return ", ".join(f"{name} {value / GIB:.1f} GiB" for name, value in parts.items())


def parameter_count(config: PretrainedConfig) -> int:
    """Parameters of the model `config` describes, counted on the meta device (no memory allocated)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def step_memory(
    config: PretrainedConfig,
    cfg: DictConfig,
    prompt_tokens: int,
    dtype_bytes: int,
    world: int = 1,
    split_prompts: int = 0,
) -> StepMemory:
    """The estimate (bytes) of one rank of `world` for the run `cfg` on the model `config` whose longest prompt has
    `prompt_tokens` (each rank samples and trains its share of the prompts, and holds the whole model while a layer
    is gathered: the resident part is not divided), and the batch its whole-split evaluation of `split_prompts` test
    prompts runs in."""
    t = cfg.trainer
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", heads) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    # every model here has one of them: the experts' width, or the dense MLP's
    expert_width = cast(int, getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 0))
    params = parameter_count(config)
    reference = params * dtype_bytes if cfg.algo.get("kl_coef", 0.0) > 0 else 0
    resident = params * (dtype_bytes + 4 + 8) + reference
    width = prompt_tokens + t.max_new_tokens

    def sampling(prompts: int, rows: int) -> float:
        kv_cache = 2 * layers * kv_heads * head_dim * width * rows * dtype_bytes
        step_logprobs = 2 * rows * vocab * 4
        prefill_scores = prompts * heads * prompt_tokens**2 * 4
        return kv_cache + step_logprobs + prefill_scores

    prompts = t.prompts_per_step // world
    rows = prompts * t.group_size
    minibatch = rows // max(t.minibatches, 1)
    per_token = layers * (12 * hidden + 4 * max(top_k, 1) * expert_width + heads * width) * dtype_bytes
    training = minibatch * width * per_token + 3 * minibatch * t.max_new_tokens * vocab * 4
    eval_prompts = -(-t.eval_prompts // world)
    evaluation = sampling(eval_prompts, eval_prompts * max(t.eval_samples, 1)) if t.eval_prompts else 0.0
    rollout = sampling(prompts, rows)
    # Greedy, one row per prompt: the batch's memory grows by sampling(1, 1) a prompt.
    split = max(1, -(-split_prompts // world))
    split_batch = max(1, min(split, int(max(rollout, evaluation, training) // sampling(1, 1))))
    split_evaluation = sampling(split_batch, split_batch) if t.eval_split and split_prompts else 0.0
    return StepMemory(resident, rollout, evaluation, training, split_evaluation, split_batch)


def available_bytes(device: str) -> float:
    """Memory a run may still take: free device memory on CUDA, `MemAvailable` of /proc/meminfo on CPU."""
    if device.startswith("cuda"):
        return float(torch.cuda.mem_get_info(torch.device(device))[0])
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float("inf")  # no way to know on this platform: nothing is refused
