"""The step's data: a rollout scored by the task (`Rollout`), and the minibatches an update trains on (`Minibatch`).

    examples    = draw_examples(train, count, generator)              the step's prompts, from its seeded generator
    rollout     = collect_rollout(engine, task, examples, ...)        μ_old's samples and the task's rewards
    served      = Served(rollout, versions, ...)                      with the weight version that sampled each row
    share       = rank_share(served, ranks)                           a rank's rows of a batch sampled whole
    order       = minibatch_order(layout, size, group_size, generator) whole groups, or rows shuffled (GSPO §5.1)
    minibatches = split_minibatches(rollout, advantages, order, count) pure: slices with μ_old's numbers for them

`evaluate` is the held-out accuracy of an engine on a fixed set of prompts, through the same rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from experiments.ranks import Ranks
from experiments.step import metrics as m
from experiments.step.engines import RolloutEngine, Samples, Sampling
from experiments.step.plan import Layout
from experiments.step.scoring import FED
from experiments.tasks import Example, Task
from models.routing.trace import RoutingTrace


def step_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed for (run seed, step, rank), different for every triple a run meets."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + 7) % (2**63 - 1)


def draw_examples(examples: list[Example], count: int, generator: torch.Generator) -> list[Example]:
    """`count` examples drawn uniformly with replacement: a step's prompts."""
    return [examples[i] for i in torch.randint(len(examples), (count,), generator=generator).tolist()]


@dataclass(kw_only=True)
class Rollout(Samples):
    """Samples with the task's verdict: one row per completion, `examples[i]` the prompt row i answers."""

    examples: list[Example]
    rewards: torch.Tensor  # [N] float
    correct: torch.Tensor  # [N] bool


def collect_rollout(engine: RolloutEngine, task: Task, examples: list[Example], sampling: Sampling) -> Rollout:
    """Sample the examples' prompts with `engine` as `sampling` says and score the completions with the task."""
    samples = engine.sample([example.prompt for example in examples], sampling)
    rows = [example for example in examples for _ in range(sampling.group_size)]
    rewards = torch.tensor([task.reward(text, ex) for text, ex in zip(samples.completions, rows)], dtype=torch.float32)
    correct = torch.tensor([task.is_correct(text, ex) for text, ex in zip(samples.completions, rows)])
    return Rollout(**vars(samples), examples=rows, rewards=rewards, correct=correct)


@dataclass(frozen=True)
class Served:
    """A step's rollout as its source served it (`RLTrainer.rollouts`): sampled by the trainer's engine in the step, or
    by the concurrent sampler's worker before it (`experiments.step.sources`)."""

    rollout: Rollout
    versions: torch.Tensor  # [N] the weight version each row was sampled with (version t: the weights after step t)
    sample_s: float  # the seconds its engine spent sampling it
    metrics: dict[str, float]  # its `async/*` record: the versions and how far behind θ_old (none in the plain loop)


def rollout_rows(rollout: Rollout, rows: slice) -> Rollout:
    """The rollout of rows `rows`: every per-row field sliced (the routing trace's too), the positions kept."""
    return replace(
        rollout,
        input_ids=rollout.input_ids[rows],
        attention_mask=rollout.attention_mask[rows],
        response_mask=rollout.response_mask[rows],
        completions=rollout.completions[rows],
        truncated=rollout.truncated[rows],
        logp=None if rollout.logp is None else rollout.logp[rows],
        routes=None if rollout.routes is None else rollout.routes.rows(rows),
        examples=rollout.examples[rows],
        rewards=rollout.rewards[rows],
        correct=rollout.correct[rows],
    )


def rank_share(served: Served, ranks: Ranks) -> Served:
    """Rank r's share of a step's batch sampled whole (by the concurrent source's workers): of its N rows, rows
    [r·N/W, (r+1)·N/W), whole groups (`trainer.prompts_per_step` splits over the ranks: a start-up check), as each
    rank of the synchronous loop samples its own share of the step's prompts."""
    if not ranks.active:
        return served
    size = served.rollout.size // ranks.world
    rows = slice(ranks.rank * size, (ranks.rank + 1) * size)
    return replace(served, rollout=rollout_rows(served.rollout, rows), versions=served.versions[rows])


def pass_at_k(correct: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The unbiased pass@k of each prompt from `correct` right answers among `n` samples (Chen et al. 2021, the Codex
    paper's estimator): 1 − C(n − c, k) / C(n, k), as the product Π_{i<k} (n − c − i) / (n − i), which is 0 once
    fewer than k samples are wrong."""
    wrong = (n - correct).double()
    steps = torch.arange(k, dtype=torch.float64)
    none_right = ((wrong[:, None] - steps).clamp(min=0) / (n - steps)).prod(-1)
    return 1 - none_right


def evaluate(
    engine: RolloutEngine,
    task: Task,
    examples: list[Example],
    samples: int,
    max_new_tokens: int,
    temperature: float,
    batch: int | None = None,
) -> dict[str, float]:
    """Held-out accuracy on `examples` (the same fixed prefix of the test split at every evaluation and in every
    run, so curves compare point by point): `EVAL_ACCURACY`, the mean over prompts of the share of `samples` sampled
    completions that are correct (the unbiased pass@1 estimate; absent when `samples` is 0), with `samples` >=
    `PASS_K` the mean pass@PASS_K (`pass_at_k`) and the share of prompts whose samples all agree (`EVAL_ALL_SAME`), and
    `EVAL_GREEDY`, the share of prompts answered correctly by greedy decoding. `batch`: at most this many prompts per
    rollout (the whole split's, sized by `experiments.step.memory`); None: all at once."""
    metrics = {}
    chunks = [examples[i : i + batch] for i in range(0, len(examples), batch)] if batch else [examples]
    if samples > 0:
        sampled = [
            collect_rollout(engine, task, chunk, Sampling(samples, max_new_tokens, temperature)) for chunk in chunks
        ]
        correct = torch.cat([rollout.correct for rollout in sampled]).view(-1, samples)  # [prompts, samples]
        metrics[m.EVAL_ACCURACY] = float(correct.float().mean())
        if samples >= m.PASS_K:
            metrics[m.EVAL_PASS_AT_K] = float(pass_at_k(correct.sum(-1), samples, m.PASS_K).mean())
            metrics[m.EVAL_ALL_SAME] = float((correct.all(-1) | ~correct.any(-1)).float().mean())
    greedy = [
        collect_rollout(engine, task, chunk, Sampling(1, max_new_tokens, temperature, greedy=True)) for chunk in chunks
    ]
    metrics[m.EVAL_GREEDY] = float(torch.cat([rollout.correct for rollout in greedy]).float().mean())
    return metrics


@dataclass(frozen=True)
class Minibatch:
    """One slice of the rollout batch: the rows an optimizer update trains on, with μ_old's numbers for them."""

    index: int  # updates since θ_old when this minibatch is trained on
    prompt_width: int
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor  # [n, T] the tokens the objective scores
    token_mask: torch.Tensor  # [n, P+T-1] response positions among those a scoring forward feeds (`FED`)
    advantages: torch.Tensor
    mu_logp: torch.Tensor | None  # [n, T] the engine's log-probs (None: the engine returns none)
    engine_routes: RoutingTrace | None  # the engine's routing of the fed positions, when it recorded one


def minibatch_order(layout: Layout, size: int, group_size: int, generator: torch.Generator) -> torch.Tensor:
    """The row order the batch is split in: whole groups in a shuffled prompt order, or rows shuffled across groups."""
    if layout == Layout.groups:
        prompts = torch.randperm(size // group_size, generator=generator)
        return (prompts[:, None] * group_size + torch.arange(group_size)).reshape(-1)
    return torch.randperm(size, generator=generator)


def split_minibatches(
    rollout: Rollout, advantages: torch.Tensor, order: torch.Tensor, count: int, device: torch.device
) -> list[Minibatch]:
    """`count` minibatches of the rows in `order` (a pure function of its inputs)."""
    prompt_pad = torch.zeros(len(rollout.examples), rollout.prompt_width, dtype=torch.bool)
    token_mask = torch.cat([prompt_pad, rollout.response_mask], dim=1)[:, FED]
    # Routing is compared and replayed on the positions a scoring forward feeds; the engine's trace has one more
    # column, the last sampled token's, which never went through the model (NO_ROUTE).
    engine_routes = rollout.routes.positions(FED) if rollout.routes is not None else None
    return [
        Minibatch(
            index=j,
            prompt_width=rollout.prompt_width,
            input_ids=rollout.input_ids[rows].to(device),
            attention_mask=rollout.attention_mask[rows].to(device),
            response_mask=rollout.response_mask[rows].to(device),
            token_mask=token_mask[rows],
            advantages=advantages[rows].to(device),
            mu_logp=rollout.logp[rows].to(device) if rollout.logp is not None else None,
            engine_routes=engine_routes.rows(rows) if engine_routes is not None else None,
        )
        for j, rows in enumerate(order.chunk(count))
    ]
