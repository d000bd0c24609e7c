"""Rollouts and scoring: sample G completions per prompt with a KV cache, then per-token log-probs in fp32.

Layout of a rollout batch (what every later stage indexes into):
    input_ids      [N, P + T]  left-padded prompt (width P), then the response, right-padded after eos
    attention_mask [N, P + T]  1 on prompt tokens and on response tokens up to and including eos
    response_mask  [N, T]      1 on response tokens (eos included): the tokens the objective scores
N = prompts x group size, rows of one prompt contiguous (prompt j owns rows j*G .. j*G+G-1).

Log-probs are taken from `logits / temperature`, the distribution the tokens were sampled from, in fp32.
Position ids follow the attention mask (left padding does not shift positions), exactly as `generate` builds
them, so scoring a rollout reproduces the rollout's own computation up to the KV-cache path.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from experiments.tasks import Example, Task
from models.routing import RoutingTrace, record_routing


@dataclass
class Rollout:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_width: int
    examples: list[Example]
    completions: list[str]
    rewards: torch.Tensor  # [N] float
    correct: torch.Tensor  # [N] bool
    truncated: torch.Tensor  # [N] bool: no eos within the generation budget
    trace: RoutingTrace | None = None  # routing recorded during generation (R3)
    rollout_logp: torch.Tensor | None = None  # [N, T] fp32 log-probs of the sampled tokens (0 after eos)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_tokens(self) -> int:
        return int(self.response_mask.sum())


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as `generate` computes them: cumsum of the mask minus one."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def _response_layout(sequences: torch.Tensor, prompt_width: int, eos_id: int, pad_id: int):
    """Cut each response after its first eos; return (input_ids, response_mask [N, T], truncated [N])."""
    response = sequences[:, prompt_width:]
    is_eos = response == eos_id
    seen_eos_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    response_mask = ~seen_eos_before
    truncated = ~is_eos.any(-1)
    response = response.masked_fill(~response_mask, pad_id)
    return torch.cat([sequences[:, :prompt_width], response], dim=1), response_mask, truncated


def _prefill_once_per_prompt(
    model: PreTrainedModel, unique: dict[str, torch.Tensor], group_size: int, record: bool
) -> tuple[Cache, RoutingTrace | None]:
    """The KV cache of every prompt but its last token, computed once per prompt and copied to its G rows.

    The G completions of a prompt share it, so the prefill over B·G rows would compute each prompt G times.
    `generate` continues from this cache: its first forward feeds only the last prompt token (and yields the
    first sampled token's logits), then decodes as usual. With `record`, the prefix's routing comes back laid
    out like the B·G rows, to be put in front of the routing recorded during `generate`.
    """
    device = next(model.parameters()).device
    ids = unique["input_ids"][:, :-1].to(device)
    mask = unique["attention_mask"][:, :-1].to(device)
    with record_routing(model) if record else contextlib.nullcontext() as recording:
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=True, logits_to_keep=1
        )
    cache = out.cache
    cache.batch_repeat_interleave(group_size)
    if not record:
        return cache, None
    return cache, recording.trace.rows(torch.arange(ids.shape[0]).repeat_interleave(group_size))


@torch.no_grad()
def generate_rollout(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[Example],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    greedy: bool = False,
    fixed_length: bool = False,
    record: bool = False,
    logprobs: bool = False,
) -> Rollout:
    """Sample `group_size` completions for each example (one batched `generate` call), decode and score them.

    `record`: keep the routing of every generated position (`Rollout.trace`). `logprobs`: keep the log-probs of the
    sampled tokens under `logits / temperature` (`Rollout.rollout_logp`), from the raw logits, before the
    sampling-time processors (e.g. `fixed_length`'s eos ban), the same distribution that `experiments.scoring` scores.
    """
    device = next(model.parameters()).device
    unique = tokenizer([ex.prompt for ex in examples], return_tensors="pt", padding=True, add_special_tokens=False)
    encoded = {key: value.repeat_interleave(group_size, dim=0).to(device) for key, value in unique.items()}
    prompt_width = encoded["input_ids"].shape[1]
    options = dict(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        return_dict_in_generate=True,
        output_logits=logprobs,
    )
    if not greedy:
        options.update(temperature=temperature, top_k=0, top_p=1.0)
    if fixed_length:
        options["min_new_tokens"] = max_new_tokens
    prefix_trace = None
    if group_size > 1 and prompt_width > 1:
        options["cache"], prefix_trace = _prefill_once_per_prompt(model, unique, group_size, record)
    if record:
        with record_routing(model, generate=True) as recording:
            generated = model.generate(**encoded, **options)
        trace = recording.trace
        if prefix_trace is not None:
            trace = replace(trace, experts=torch.cat([prefix_trace.experts, trace.experts], dim=2))
    else:
        generated = model.generate(**encoded, **options)
        trace = None
    sequences = generated.sequences
    input_ids, response_mask, truncated = _response_layout(
        sequences, prompt_width, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    attention_mask = torch.cat([encoded["attention_mask"], response_mask.long()], dim=1)
    completions = tokenizer.batch_decode(input_ids[:, prompt_width:], skip_special_tokens=True)
    rows = [example for example in examples for _ in range(group_size)]
    rewards = torch.tensor([task.reward(text, ex) for text, ex in zip(completions, rows)], dtype=torch.float32)
    correct = torch.tensor([task.is_correct(text, ex) for text, ex in zip(completions, rows)])
    rollout_logp = None
    if logprobs:
        logits = torch.stack(generated.logits, dim=1).float() / temperature  # [N, T_generated, V]
        taken = sequences[:, prompt_width:]
        rollout_logp = torch.log_softmax(logits, dim=-1).gather(-1, taken.unsqueeze(-1)).squeeze(-1)
        rollout_logp = rollout_logp.masked_fill(~response_mask, 0.0)
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        prompt_width=prompt_width,
        examples=rows,
        completions=completions,
        rewards=rewards,
        correct=correct,
        truncated=truncated,
        trace=trace,
        rollout_logp=rollout_logp,
    )
