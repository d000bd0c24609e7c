"""One RL step, top to bottom, for every objective; Routing Replay is a switch orthogonal to it.

Three policies are named in the step. μ_old is the rollout engine that sampled (its own log-probs and routing);
π_old is the trainer at the weights θ_old the step started from; π_θ is the policy being updated. The token ratio
the objectives clip is π_θ / π_old.

    rollout     = self.rollout()                             μ_old: tokens, log-probs, routing when asked; rewards
    advantages  = group_advantages(rollout.rewards)          Â_i = (r_i − mean_group) / (std_group + eps)
    minibatches = split_minibatches(rollout, advantages, order)   pure: whole groups or shuffled rows (GSPO §5.1)
    old         = [old_policy(mb) for mb in minibatches]      π_old (and the KL reference), before any update
    for mb, old: update(mb, old)                              π_θ: forward (replaying), objective, backward, AdamW
    engine.sync_weights(model)

Where π_old comes from is decided once at start-up (`experiments.step.plan`, recorded in `summary.json`): `bypass`
reuses μ_old's log-probs (when the engine is the trainer's own fp32 model they are π_old's own numbers, up to the
KV-cache path's ~1e-6), `decoupled` recomputes π_old without gradient in the training shapes (r2 records θ_old's
routing in that pass, r3 replays the engine's). When the engine is the trainer, the first minibatch is on-policy:
θ = θ_old at its update, whose own forward is what a recompute would run, so its π_old is that forward's log-probs
(ratios exactly 1) and θ_old's routing is that forward's routing.

Routing. Under replay the routers still compute their own top-k (`models.routing`), so the drift of θ's routing
against θ_old's, after j updates, is measured on the same tokens at no extra forward (`routing/*` per minibatch).
A routing variant (`algos.routing_variants`, `routing_variant=`) decides what the replayed forwards compute with
(the recorded gate weights too; only the replayed experts the router still ranks high) or reweighs each token's
ratio by how far the router moved on θ_old's experts (RSPO), reading θ's router in the update's own forward.
Router switches (`algos.routers`, `routers=[...]`) act at fixed points: at start-up (freezing the routers), on each
update's loss (load-balancing losses), after each applied optimizer step (the selection bias, the weight history of
lagged replay) and on what R2 replays (lagged replay: the experts of older weights instead of θ_old's).

Ranks. Under torchrun each rank samples, scores and trains on whole groups of its share of the prompts; the policy
is sharded with FSDP2 (`shard`), whose reduce-scatter averages the gradients, and the loss aggregates with the whole
minibatch's token and sequence counts (`algos.objective.Totals`), so the averaged gradient is the gradient of one
process with the whole batch (verl's `agg_loss` with `dp_size`). Every metric is computed on the gathered batch
(`gather`, `reduce`), so every logged number is the global value; on one rank these are identities.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from algos.objective import Totals, group_advantages, masked, masked_mean, zero_std_group_frac
from algos.corrections import CorrectionInputs
from algos.routing_variants.router_shift import Shift, response_positions
from experiments.step import metrics as m
from experiments.step.checks import check_run
from experiments.step.engines import HFEngine, KVCache, RolloutEngine, Samples
from experiments.step.optimizer import rl_optimizer
from experiments.step.plan import Layout, PiOld, Replay
from experiments.step.scoring import FED, Scores, margin_stats, score_responses
from experiments.tasks import Example, Task
from models.cpu_kernels import weights_sha256
from models.policy import build_policy
from models.registry import Diverged
from models.router_perturbation import perturb_routers, router_inputs
from models.routing import (
    NO_ROUTE, RouterCalls, RoutingTrace, find_routers, flip_routing, load_max_violation, routing_drift,
)

FLIP_STREAM = 0x5EED  # offsets the flips' seed from the step's: their draws are not the sampler's draws
PERTURB_STREAM = 0xD21F7  # and the router perturbation's, likewise


@dataclass(kw_only=True)
class Rollout(Samples):
    """Samples with the task's verdict: one row per completion, `examples[i]` the prompt row i answers."""

    examples: list[Example]
    rewards: torch.Tensor  # [N] float
    correct: torch.Tensor  # [N] bool


def collect_rollout(
    engine: RolloutEngine,
    task: Task,
    examples: list[Example],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    greedy: bool = False,
    record_routing: bool = False,
    record_gates: bool = False,
) -> Rollout:
    """Sample `group_size` completions per example with `engine` and score them with the task."""
    samples = engine.sample(
        [example.prompt for example in examples], group_size, max_new_tokens, temperature, greedy, record_routing,
        record_gates,
    )
    rows = [example for example in examples for _ in range(group_size)]
    rewards = torch.tensor([task.reward(text, ex) for text, ex in zip(samples.completions, rows)], dtype=torch.float32)
    correct = torch.tensor([task.is_correct(text, ex) for text, ex in zip(samples.completions, rows)])
    return Rollout(**vars(samples), examples=rows, rewards=rewards, correct=correct)


def evaluate(engine: RolloutEngine, task: Task, examples: list[Example], samples: int, max_new_tokens: int,
             temperature: float, batch: int | None = None) -> dict[str, float]:
    """Held-out accuracy on `examples` (the same fixed prefix of the test split at every evaluation and in every
    run, so curves compare point by point): `EVAL_ACCURACY`, the mean over prompts of the share of `samples` sampled
    completions that are correct (the unbiased pass@1 estimate; absent when `samples` is 0), and `EVAL_GREEDY`, the
    share of prompts answered correctly by greedy decoding. `batch`: at most this many prompts per rollout (the
    whole split's, sized by `experiments.step.memory`); None: all at once."""
    metrics = {}
    chunks = [examples[i: i + batch] for i in range(0, len(examples), batch)] if batch else [examples]
    if samples > 0:
        sampled = [collect_rollout(engine, task, chunk, samples, max_new_tokens, temperature) for chunk in chunks]
        metrics[m.EVAL_ACCURACY] = float(torch.cat([rollout.correct for rollout in sampled]).float().mean())
    greedy = [collect_rollout(engine, task, chunk, 1, max_new_tokens, temperature, greedy=True) for chunk in chunks]
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


@dataclass(frozen=True)
class OldPolicy:
    """What the update of one minibatch takes from the policies that stay fixed during the step.

    `on_policy`: π_old is the update's own forward (θ = θ_old there), so `logp` and `routes` come from it.
    Otherwise `logp` is π_old's log-probs (μ_old's under bypass, a recompute under decoupled) and `routes` θ_old's
    own routing when routing is tracked (with its gates when the routing variant reads or replays them).
    `replay`: the experts π_θ's forward is forced through (r2: θ_old's, r3: the engine's). `ref_logp`: the frozen
    reference's log-probs, for the KL term.
    """

    on_policy: bool
    logp: torch.Tensor | None = None
    routes: RoutingTrace | None = None
    replay: RoutingTrace | None = None
    ref_logp: torch.Tensor | None = None


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


# -- ranks: identities on one -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's ranks (rank 0 of 1 without torchrun; `experiments.run.launch.start`)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def step_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed for (run seed, step, rank), different for every triple a run meets."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + 7) % (2**63 - 1)


def shard(model: torch.nn.Module) -> None:
    """FSDP2: each decoder layer its own unit, then the root (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


_CARRIERS = {torch.bool: torch.uint8, torch.int16: torch.int32}


def gather(tensor: torch.Tensor, ranks: Ranks, dim: int = 0, fill: float = 0) -> torch.Tensor:
    """Every rank's `tensor` concatenated along `dim`, the other dimensions padded to the largest rank's with `fill`
    (padding on the right, where every batch layout here puts it). Identity on one rank."""
    if not ranks.active:
        return tensor
    if tensor.dtype in _CARRIERS:  # gloo sends neither bool nor int16: carry them in a type it does send
        return gather(tensor.to(_CARRIERS[tensor.dtype]), ranks, dim, fill).to(tensor.dtype)
    shape = torch.tensor(tensor.shape)
    largest = shape.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    target = [int(n) if i != dim else int(shape[i]) for i, n in enumerate(largest)]
    padded = tensor.new_full(target, fill)
    padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
    sizes = [torch.zeros((), dtype=torch.long) for _ in range(ranks.world)]
    dist.all_gather(sizes, torch.tensor(tensor.shape[dim]))
    # all_gather needs equal shapes: pad the gathered dimension too, then cut each piece back to its size.
    longest = max(int(size) for size in sizes)
    equal = [*target[:dim], longest, *target[dim + 1:]]
    mine = padded.new_full(equal, fill)
    mine.narrow(dim, 0, padded.shape[dim]).copy_(padded)
    pieces = [padded.new_empty(equal) for _ in range(ranks.world)]
    dist.all_gather(pieces, mine)
    return torch.cat([piece.narrow(dim, 0, int(size)) for piece, size in zip(pieces, sizes)], dim=dim)


def reduce(value: float, ranks: Ranks, op: str = "sum") -> float:
    """`value` summed (or its max) over ranks."""
    if not ranks.active:
        return value
    tensor = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return float(tensor)


def summed(tensor: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """`tensor` summed over ranks (a copy; no gradient flows through it)."""
    if not ranks.active:
        return tensor
    total = tensor.detach().clone()
    dist.all_reduce(total)
    return total


class RLTrainer:
    """Holds the policy, its engine, optimizer, objective and task; `step()` runs one RL step and returns its metrics."""

    def __init__(self, cfg: DictConfig, ranks: Ranks = Ranks()) -> None:
        self.cfg = cfg
        self.ranks = ranks
        parts = check_run(cfg, ranks.world)
        self.plan, self.objective, self.advantage_std = parts.plan, parts.objective, parts.advantage_std
        self.correction, self.variant, self.switches = parts.correction, parts.variant, parts.switches
        self.task, self.train_examples, self.test_examples = parts.task, parts.train_examples, parts.test_examples
        self.eval_split_batch = parts.eval_split_batch  # the whole split is evaluated in batches of this many prompts
        torch.manual_seed(cfg.seed)
        self.device = torch.device(cfg.device)
        self.model, self.tokenizer = build_policy(parts.model_cfg)
        self.start_sha256 = weights_sha256(self.model)  # the start's identity (a cold start's summary has the same)
        # No dropout in these models; eval() also keeps Mixtral-style router jitter off, so that two passes of the
        # same weights route identically and every measured drift comes from an update.
        self.model.to(self.device).eval()
        for switch in self.switches:  # before the engine copies the model and the optimizer takes its parameters
            switch.start(self.model)
        # An engine with its own numbers copies the whole model before the trainer's is sharded across ranks.
        self.engine = parts.engine.build(cfg, self.model, self.tokenizer, parts.numerics, ranks,
                                         self.plan.engine_records_routing)
        if ranks.active:
            shard(self.model)
        self.reference = None
        if self.objective.kl_coef > 0:
            self.reference, _ = build_policy(parts.model_cfg)
            self.reference.to(self.device).eval().requires_grad_(False)
        self.optimizer, self.scheduler = rl_optimizer(self.model, cfg.trainer)
        self.summed = lambda tensor: summed(tensor, ranks)  # a count over every rank's share of the batch
        self.over_ranks = self.summed if ranks.active else None
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.flip_generator = torch.Generator()  # the synthetic flips' own stream (routing.flip_rate), reseeded per step
        self.perturb_generator = torch.Generator()  # the synthetic router noise's (routing.perturb_rate), likewise
        self.step_index = 0
        self.tokens_seen = 0
        self.skipped_updates = 0
        self.consecutive_skips = 0

    # -- one RL step -----------------------------------------------------------------------------------------------

    def step(self) -> dict[str, Any]:
        t = self.cfg.trainer
        self.step_index += 1
        # Every random choice of the step (prompts, sampling, shuffling, router noise) from (seed, step, rank): a
        # multi-rank run is deterministic and a resumed run samples exactly what the uninterrupted one sampled.
        seed = step_seed(self.cfg.seed, self.step_index, self.ranks.rank)
        torch.manual_seed(seed)
        self.generator.manual_seed(seed)
        self.flip_generator.manual_seed(seed + FLIP_STREAM)
        self.perturb_generator.manual_seed(seed + PERTURB_STREAM)
        self.engine.reseed(seed)
        start = time.perf_counter()
        rollout = self.rollout()
        rollout_s = time.perf_counter() - start
        advantages = group_advantages(rollout.rewards, t.group_size, scale_by_std=self.advantage_std)
        order = minibatch_order(self.plan.layout, len(rollout.examples), t.group_size, self.generator)
        minibatches = split_minibatches(rollout, advantages, order, t.minibatches, self.device)
        score_start = time.perf_counter()
        old = [self.old_policy(mb) for mb in minibatches]  # all before the first update: θ = θ_old
        score_s = time.perf_counter() - score_start
        train_start = time.perf_counter()
        per_minibatch = [self.update(mb, old_policy) for mb, old_policy in zip(minibatches, old)]
        train_s = time.perf_counter() - train_start
        self.engine.sync_weights(self.model)
        step_s = time.perf_counter() - start
        # The whole step's rows, every rank's (groups stay whole, so they gather in group order).
        rewards = gather(rollout.rewards, self.ranks)
        lengths = gather(rollout.response_mask.sum(-1).float(), self.ranks)
        self.tokens_seen += int(lengths.sum())
        return {
            m.STEP: self.step_index,
            m.TOKENS: self.tokens_seen,
            m.REWARD: float(rewards.mean()),
            m.REWARD_STD: float(rewards.std()),
            m.REWARD_ACCURACY: float(gather(rollout.correct.float(), self.ranks).mean()),
            m.ZERO_STD_GROUPS: zero_std_group_frac(rewards, t.group_size),
            m.LENGTH: float(lengths.mean()),
            m.TRUNCATED: float(gather(rollout.truncated.float(), self.ranks).mean()),
            **m.step_means(per_minibatch),
            m.SKIPPED: self.skipped_updates,
            m.STEP_TIME: step_s,
            m.ROLLOUT_TIME: rollout_s,
            m.SCORE_TIME: score_s,
            m.TRAIN_TIME: train_s,
            m.ROLLOUT_TOKENS_PER_S: float(lengths.sum()) / max(rollout_s, 1e-9),
            m.MINIBATCHES: per_minibatch,
        }

    def rollout(self) -> Rollout:
        """μ_old: `prompts_per_step` train prompts, `group_size` completions each, from the engine."""
        t = self.cfg.trainer
        picks = torch.randint(len(self.train_examples), (t.prompts_per_step // self.ranks.world,), generator=self.generator)
        return collect_rollout(
            self.engine,
            self.task,
            [self.train_examples[i] for i in picks.tolist()],
            group_size=t.group_size,
            max_new_tokens=t.max_new_tokens,
            temperature=t.temperature,
            record_routing=self.plan.engine_records_routing,
            record_gates=self.plan.engine_records_gates,
        )

    @torch.no_grad()
    def old_policy(self, mb: Minibatch) -> OldPolicy:
        """π_old of one minibatch (and the KL reference's log-probs), computed before any update of the step."""
        plan = self.plan
        replay = self._replayed_from_elsewhere(mb)
        ref_logp = self._score(self.reference, mb).logp if self.reference is not None else None
        if mb.index == 0 and plan.first_minibatch_on_policy:
            return OldPolicy(on_policy=True, replay=replay, ref_logp=ref_logp)
        if plan.pi_old == PiOld.bypass:
            return OldPolicy(on_policy=False, logp=mb.mu_logp, routes=mb.engine_routes if plan.track_routing else None,
                             replay=replay, ref_logp=ref_logp)
        records = plan.track_routing or plan.pi_old_records_gates
        scored = self._score(self.model, mb, record=records and replay is None, record_gates=plan.pi_old_records_gates,
                             replay=replay, rule=self.variant.replay_rule() if replay is not None else None)
        routes = scored.routes.to("cpu") if scored.routes is not None else None
        return OldPolicy(
            on_policy=False,
            logp=scored.logp,
            routes=routes,
            replay=routes if plan.replay == Replay.r2 and replay is None else replay,
            ref_logp=ref_logp,
        )

    def _replayed_from_elsewhere(self, mb: Minibatch) -> RoutingTrace | None:
        """The experts the step replays that θ_old's own π_old pass does not record: the engine's under r3, those of
        older weights under lagged replay (`algos.routers.lagged_replay`); None otherwise."""
        if self.plan.replay == Replay.r3:
            return mb.engine_routes
        routing_model = next((m for m in (s.routing_model() for s in self.switches) if m is not None), None)
        return self._score(routing_model, mb, record=True).routes.to("cpu") if routing_model is not None else None

    def _score(self, model: torch.nn.Module, mb: Minibatch, **options: Any) -> Scores:
        """`score_responses` of the minibatch, packed by group under the `groups` layout (`options`: its aux_loss /
        record / record_gates / replay / rule / score_replayed / aux_loss_grad / fragile_margin / routers)."""
        t = self.cfg.trainer
        return score_responses(
            model, mb.input_ids, mb.attention_mask, mb.prompt_width, t.temperature,
            group_size=t.group_size if self.plan.layout == Layout.groups else 1, over_ranks=self.over_ranks, **options,
        )

    def update(self, mb: Minibatch, old: OldPolicy) -> dict[str, float]:
        """One optimizer update of π_θ on the minibatch; its metrics (ratios and drift after `mb.index` updates),
        computed over every rank's share of the minibatch."""
        t = self.cfg.trainer
        track = self.plan.track_routing
        variant = self.variant
        # RSPO reads θ's router on θ_old's experts in this forward, which keeps its own routing (the variant's rule).
        theta_old_experts = old.routes if variant.reads_old_router and not old.on_policy else None
        trace = old.replay if old.replay is not None else theta_old_experts
        rule = variant.replay_rule() if trace is not None else None  # a rule serves a replayed forward
        self.optimizer.zero_grad(set_to_none=True)
        with self.flips() as flips, self.router_inputs() as router_inputs:
            scores = self._score(
                self.model, mb,
                aux_loss=track,
                aux_loss_grad=False,  # logged; routers=[aux_loss] adds it to the loss
                routers=bool(self.switches),
                record=track and trace is None,
                replay=trace.to(self.device) if trace is not None else None,
                rule=rule,
                score_replayed=theta_old_experts is not None,
                fragile_margin=self.cfg.routing.margin_threshold if track else None,
            )
        pi_old_logp = scores.logp.detach() if old.on_policy else old.logp
        shift = self._router_shift(mb, old, scores) if variant.reads_old_router else None
        # RSPO: the objective sees π_θ/π_old · γ̃, γ̃ a constant: π_old's log-probs less log γ̃ (ratio and gradient).
        objective_old_logp = pi_old_logp - shift.log_weight if shift is not None else pi_old_logp
        # The trainer's own numbers at θ_old, where the step has them: the first minibatch's forward (θ = θ_old
        # there, unless synthetic flips changed it), or the decoupled recompute; under bypass π_old is μ_old itself.
        trainer_at_old = scores.logp.detach() if self._forward_at_old(mb) else (old.logp if self.plan.pi_old == PiOld.decoupled else None)
        inputs = dict(old_logp=objective_old_logp, advantages=mb.advantages, mask=mb.response_mask,
                      ref_logp=old.ref_logp, rollout_logp=mb.mu_logp)
        correction_inputs = None
        if self.correction.name != "none":
            log_rho = trainer_at_old - mb.mu_logp if trainer_at_old is not None else torch.zeros_like(mb.mu_logp)
            correction_inputs = CorrectionInputs(
                log_rho=masked(log_rho, mb.response_mask), mask=mb.response_mask, advantages=mb.advantages,
                theta_log_ratio=masked(scores.logp.detach() - mb.mu_logp, mb.response_mask),
            )
            inputs["weight"] = self.correction(correction_inputs).weight
        result = self.objective(logp=scores.logp, totals=self._totals(mb.response_mask), **inputs)
        loss = result.loss + sum(switch.loss(scores.routers, self.over_ranks) for switch in self.switches)
        finite_loss = reduce(float(torch.isfinite(loss)), self.ranks, op="sum") == self.ranks.world
        if finite_loss:
            loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)) if finite_loss else float("nan")
        # Metrics of the whole minibatch: on several ranks, of every rank's rows gathered (one rank: its own).
        rows = lambda tensor, fill=0: gather(tensor, self.ranks, fill=fill)  # noqa: E731
        mask = rows(mb.response_mask, False)
        metrics: dict[str, float] = {m.MINIBATCH: mb.index}
        if self.ranks.active:
            with torch.no_grad():
                gathered = {name: rows(value) if value is not None else None for name, value in inputs.items()}
                metrics.update(self.objective(logp=rows(scores.logp.detach()), **{**gathered, "mask": mask}).metrics)
        else:
            metrics.update(result.metrics)
        if correction_inputs is not None:
            corrected = self.correction(CorrectionInputs(rows(correction_inputs.log_rho),
                                                         rows(correction_inputs.theta_log_ratio), mask, rows(mb.advantages)))
            metrics.update({name: float(value) for name, value in corrected.metrics.items()})
        if trainer_at_old is not None and mb.mu_logp is not None:
            metrics.update(m.mismatch_metrics(rows(trainer_at_old - mb.mu_logp), mask))
        metrics[m.ENTROPY] = float(masked_mean(rows(scores.entropy), mask))
        metrics[m.GRAD_NORM] = grad_norm
        metrics[m.LR] = self.scheduler.get_last_lr()[0]
        if flips is not None:
            metrics[m.FLIP_FRAC] = reduce(flips.share, self.ranks) / self.ranks.world
        if rule is not None:
            metrics.update(variant.rule_metrics(rule, self.summed))
        if shift is not None:
            metrics.update(Shift(rows(shift.log_weight), gather(shift.deviation, self.ranks, dim=1),
                                 rows(shift.floored, False)).metrics(mask))
        if track:
            metrics.update(self._routing_metrics(mb, old, scores, pi_old_logp))
        metrics.update(self._apply(finite_loss and math.isfinite(grad_norm), mb.index, scores.routers, router_inputs))
        return metrics

    def _router_shift(self, mb: Minibatch, old: OldPolicy, scores: Scores) -> Shift:
        """RSPO's router shift of the minibatch's response tokens: θ's router (this update's forward) against θ_old's
        (the π_old pass) on θ_old's experts; none on the on-policy minibatch, where θ = θ_old."""
        if old.on_policy:
            return Shift.none(mb.response_mask, len(find_routers(self.model)))
        tokens = mb.response_mask.shape[1]
        current = response_positions(scores.replayed_logprobs, mb.prompt_width, tokens)
        theta_old = response_positions(old.routes.logprobs, mb.prompt_width, tokens).to(current.device)
        return self.variant.shift(current, theta_old, mb.response_mask)

    def _totals(self, mask: torch.Tensor) -> Totals:
        """The aggregation denominators of the whole minibatch, summed over ranks (`algos.objective.Totals`)."""
        local = Totals.local(mask)
        if not self.ranks.active:
            return local
        return Totals(reduce(local.tokens, self.ranks), reduce(local.sequences, self.ranks),
                      reduce(local.nonempty, self.ranks), int(reduce(local.width, self.ranks, op="max")),
                      self.ranks.world)

    def _routing_metrics(self, mb: Minibatch, old: OldPolicy, scores: Scores, pi_old_logp: torch.Tensor) -> dict[str, float]:
        """Drift since θ_old, load balance, fragility, the engine's routing against the trainer's, and (every
        `routing.decompose_every` steps) the ratio decomposition, over every rank's share of the minibatch."""
        traces = lambda trace: replace(trace, experts=gather(trace.experts, self.ranks, dim=1, fill=NO_ROUTE),  # noqa: E731
                                       weights=None, logprobs=None)
        token_mask = gather(mb.token_mask, self.ranks, fill=False)
        own = traces(scores.routes.to("cpu"))  # under replay: the router's own top-k, beside the replayed experts
        theta_old = own if old.on_policy else traces(old.routes)
        metrics = m.drift_metrics(routing_drift(theta_old, own, token_mask))
        metrics[m.LOAD_MAX_VIOLATION] = load_max_violation(theta_old, token_mask)
        metrics[m.AUX_LOSS] = scores.aux_loss_value
        fed = reduce(float(mb.attention_mask[:, FED].sum()), self.ranks)  # the weight of each rank's fragility means
        mine = float(mb.attention_mask[:, FED].sum())
        margins, weights = scores.router_margins
        margin = margin_stats(gather(margins, self.ranks, dim=1), gather(weights, self.ranks))  # medians: gathered
        metrics.update({name: reduce(value * mine, self.ranks) / fed for name, value in scores.router_stats.items()})
        metrics.update(margin)
        trainer_routes = own if self._forward_at_old(mb) else (traces(old.routes) if self.plan.pi_old == PiOld.decoupled else None)
        if mb.engine_routes is not None and trainer_routes is not None:
            metrics.update(m.routing_mismatch(traces(mb.engine_routes), trainer_routes, token_mask))
        every = self.cfg.routing.decompose_every
        if every and mb.index > 0 and self.step_index % every == 0:
            metrics.update(self.decompose(mb, old, scores.logp.detach(), pi_old_logp))
        return metrics

    @torch.no_grad()
    def decompose(self, mb: Minibatch, old: OldPolicy, logp: torch.Tensor, pi_old_logp: torch.Tensor) -> dict[str, float]:
        """Split log π_θ/π_old of an off-policy minibatch into a routing part, log π_θ(y | θ's experts) −
        log π_θ(y | θ_old's experts), and a weights part, log π_θ(y | θ_old's experts) − log π_old(y), with one extra
        no-grad forward at θ (before this minibatch's optimizer step): replayed when the update's forward was not,
        un-replayed when it was. θ_old's experts are the ones π_old was computed with: the replayed trace under
        r2 / r3, θ_old's recorded routing otherwise; replayed by ID, so a routing variant whose replayed forwards
        compute otherwise (full or soft replay) costs one more forward here."""
        if old.replay is None:
            own, replayed = logp, self._score(self.model, mb, replay=old.routes.to(self.device)).logp
        else:
            with self.flips():  # the counterfactual without replay drifts as the update's own routing would
                own = self._score(self.model, mb).logp
            replayed = self._score(self.model, mb, replay=old.replay.to(self.device)).logp if (
                self.variant.changes_replay) else logp
        rows = lambda tensor: gather(tensor, self.ranks)  # noqa: E731
        return m.decomposition_metrics(rows(own - replayed), rows(replayed - pi_old_logp),
                                       gather(mb.response_mask, self.ranks, fill=False))

    def _forward_at_old(self, mb: Minibatch) -> bool:
        """Whether the update's own forward of `mb` computed the trainer at θ_old: the first minibatch (no update has
        been taken yet), unless synthetic flips changed its routing."""
        return mb.index == 0 and not self.plan.flip_rate

    def flips(self) -> contextlib.AbstractContextManager:
        """The synthetic flips of π_θ's update forwards (`routing.flip_rate`), yielding their handle; or nothing."""
        if not self.plan.flip_rate:
            return contextlib.nullcontext()
        return flip_routing(self.model, self.plan.flip_rate, self.flip_generator)

    def router_inputs(self) -> contextlib.AbstractContextManager:
        """The routers' inputs in the update's forward, captured for the SYNTHETIC router perturbation that follows
        the optimizer step (`routing.perturb_rate`); or nothing."""
        if not self.plan.perturb_rate:
            return contextlib.nullcontext()
        return router_inputs(self.model)

    def _apply(self, finite: bool, update: int, routers: RouterCalls | None, inputs: Any) -> dict[str, float]:
        """Take the optimizer step of the step's update number `update`, then what acts on the weights between
        updates: the router switches (with the update's router calls) and the SYNTHETIC router perturbation (with
        the routers' inputs `inputs`); their metrics are returned. Or refuse a non-finite step: one bad batch must
        not poison every parameter. `Diverged` when the skips run out or the step left the weights
        non-finite."""
        t = self.cfg.trainer
        if finite:
            self.optimizer.step()
            self.scheduler.step()  # the schedule counts applied updates
            self.consecutive_skips = 0
            self._refuse_non_finite_weights(update)
            metrics: dict[str, float] = {}
            for switch in self.switches:  # `algos.routers`
                metrics.update(switch.after_update(self.model, routers, self.summed))
            if self.plan.perturb_rate:
                metrics[m.PERTURB_FRAC] = perturb_routers(self.model, inputs, self.plan.perturb_rate,
                                                          self.perturb_generator).share
            return metrics
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_updates += 1
        self.consecutive_skips += 1
        if self.consecutive_skips >= t.max_consecutive_skips:
            raise Diverged(
                f"{self.consecutive_skips} optimizer updates in a row had a non-finite loss or gradient "
                f"(trainer.max_consecutive_skips={t.max_consecutive_skips}); lower trainer.lr or check the objective's "
                "clip range"
            )
        return {}

    def _refuse_non_finite_weights(self, update: int) -> None:
        """A finite gradient can still leave non-finite weights (AdamW dividing by an underflowed second moment, a
        learning rate far too large), and every later forward would then be NaN. Norms over every rank's shards
        under FSDP2, so that every rank decides alike: the 2-norm first, one fused pass (1 ms for tiny_moe's 7.1 M
        weights on one core, where the largest |w| takes 20), finite unless a weight is NaN or inf, or the weights are
        so large (from ~1e19 on) that their squares overflow; the largest |w| then tells those apart."""
        weights = [p.detach() for p in self.model.parameters()]
        if math.isfinite(float(torch.nn.utils.get_total_norm(weights))):
            return
        largest = float(torch.nn.utils.get_total_norm(weights, norm_type=math.inf))
        if not math.isfinite(largest):
            raise Diverged(f"update {update} of the step left the weights non-finite (largest |w| = {largest}); "
                           "lower trainer.lr")

    def evaluate(self, whole_split: bool = False) -> dict[str, float]:
        """Held-out accuracy of the trainer's own policy: on the first `eval_prompts` test prompts (`EVAL_*`), or
        greedy on every prompt of the test split (`EVAL_SPLIT_*`). On several ranks each takes every world-th prompt
        and the accuracies combine weighted by the prompts each rank held."""
        t = self.cfg.trainer
        prompts = self.test_examples if whole_split else self.test_examples[: t.eval_prompts]
        mine = prompts[self.ranks.rank :: self.ranks.world]
        local = evaluate(
            HFEngine(self.model, self.tokenizer, synced=self.ranks.active,
                     kv_cache=KVCache(self.cfg.rollout.kv_cache)),
            self.task,
            mine,
            samples=0 if whole_split else t.eval_samples,
            max_new_tokens=t.max_new_tokens,
            temperature=t.temperature,
            batch=self.eval_split_batch if whole_split else None,
        )
        if whole_split:
            local = {m.EVAL_SPLIT_GREEDY: local[m.EVAL_GREEDY]}
        return {name: reduce(value * len(mine), self.ranks) / len(prompts) for name, value in local.items()}
