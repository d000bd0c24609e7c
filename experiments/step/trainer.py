"""One RL step, top to bottom, for every objective; Routing Replay is a switch orthogonal to it.

Three policies are named in the step. μ_old is the rollout engine that sampled (its own log-probs and routing);
π_old is the trainer at the weights θ_old the step started from; π_θ is the policy being updated. The token ratio
the objectives clip is π_θ / π_old.

    rollout     = collect_rollout(engine, ...)              μ_old: tokens, log-probs, routing when asked; rewards
    advantages  = group_advantages(rollout.rewards)          Â_i = (r_i − mean_group) / (std_group + eps)
    minibatches = split_minibatches(rollout, advantages, order)   pure: whole groups or shuffled rows (GSPO §5.1)
    old         = [old_policy(mb) for mb in minibatches]      π_old (and the KL reference), before any update
    for mb, old: update(mb, old)                              π_θ: forward (replaying), objective, backward, AdamW
    engine.sync_weights(model)

Where π_old comes from is decided once at start-up (`experiments.config.plan_step`, recorded in `summary.json`):
`bypass` reuses μ_old's log-probs (when the engine is the trainer's own fp32 model they are π_old's own numbers,
up to the KV-cache path's ~1e-6), `decoupled` recomputes π_old without gradient in the training shapes (r2
records θ_old's routing in that pass, r3 replays the engine's). When the engine is the trainer, the first
minibatch is on-policy: θ = θ_old at its update, whose own forward is what a recompute would run, so its π_old is
that forward's log-probs (ratios exactly 1) and θ_old's routing is that forward's routing.

Routing. Under replay the routers still compute their own top-k (`models.routing`), so the drift of θ's routing
against θ_old's, after j updates, is measured on the same tokens at no extra forward (`routing/*` per minibatch).
A routing variant (`algos.routing_variants`, `routing_variant=`) decides what the replayed forwards compute with
(the recorded gate weights too; only the replayed experts the router still ranks high) or reweighs each token's
ratio by how far the router moved on θ_old's experts (RSPO), reading θ's router in the update's own forward.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from algos import build_objective, group_advantages, zero_std_group_frac
from algos.common import Totals, masked, masked_mean
from algos.corrections import Correction, CorrectionInputs, build_correction, mismatch_metrics
from algos.objective import Objective
from algos.routing_variants import RoutingVariant, build_routing_variant
from algos.routing_variants.router_shift import Shift, response_positions
from experiments.run.launch import Ranks, gather, reduce, shard, step_seed, summed
from experiments.config import (
    Layout, LRSchedule, PiOld, Replay, RolloutConfig, StepPlan, algo_hyperparameters, plan_step,
)
from models.registry import Diverged
from experiments.step.engines.hf import EngineNumerics, HFEngine, Rollout, RolloutEngine, collect_rollout
from experiments.evaluate import evaluate
from experiments.step.memory import GIB, available_bytes, step_memory
from models.registry import ConfigError
from experiments.step.scoring import FED, Scores, score_responses
from experiments.tasks import Example, Task, build_task
from experiments.run.threads import ThreadBudget
from models.policy import DTYPES, ModelConfig, build_policy, is_moe, model_config
from models.routing import NO_ROUTE, RoutingTrace, find_routers, flip_routing, load_max_violation, routing_drift
from models.tokenizer import build_char_tokenizer


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
    mu_logp: torch.Tensor | None  # [n, T] the engine's log-probs
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


FLIP_STREAM = 0x5EED  # offsets the flips' seed from the step's: their draws are not the sampler's draws
DRIFT_KEYS = ("routing/expert_change_frac", "routing/token_any_change_frac")  # drift since θ_old, per minibatch


def routing_mismatch(engine: RoutingTrace, trainer: RoutingTrace, mask: torch.Tensor) -> dict[str, float]:
    """The engine's experts against the trainer's at θ_old on the same tokens: `mismatch/expert_frac` (per layer
    too), the share of activated experts the engine chose that the trainer did not, and the share of tokens routed
    differently in any layer (R3's router disagreement, train against inference)."""
    drift = routing_drift(trainer, engine, mask)
    metrics = {"mismatch/expert_frac": drift.expert_change_frac, "mismatch/token_any_expert_frac": drift.token_any_change_frac}
    metrics.update({f"mismatch/expert_frac/layer_{i}": v for i, v in enumerate(drift.per_layer.tolist())})
    return metrics


@torch.no_grad()
def decomposition_metrics(routing: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Where a minibatch's log-ratio noise comes from: the variance of each part over valid tokens, of their sum,
    and the routing part's share of the total's variance, Cov(routing, total) / Var(total) (the weights part's is
    one minus it: the two shares add up to 1 whatever the parts' covariance)."""
    mask = mask.bool()
    total = routing + weights
    mean = {name: masked_mean(x, mask) for name, x in (("r", routing), ("w", weights), ("t", total))}
    var_t = masked_mean((total - mean["t"]) ** 2, mask)
    cov_rt = masked_mean((routing - mean["r"]) * (total - mean["t"]), mask)
    values = {
        "decompose/routing_var": masked_mean((routing - mean["r"]) ** 2, mask),
        "decompose/weights_var": masked_mean((weights - mean["w"]) ** 2, mask),
        "decompose/total_var": var_t,
        "decompose/routing_share": cov_rt / var_t.clamp(min=1e-30),
    }
    return dict(zip(values, torch.stack(list(values.values())).tolist()))


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
    prompt_pad = torch.zeros(rollout.size, rollout.prompt_width, dtype=torch.bool)
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


@dataclass(frozen=True)
class RunParts:
    """Everything a run is made of that is cheap to build: what `check_run` builds, and RLTrainer starts from."""

    plan: StepPlan
    model_cfg: ModelConfig
    numerics: EngineNumerics
    engine: type[RolloutEngine]
    objective: Objective
    advantage_std: bool
    correction: Correction
    variant: RoutingVariant
    task: Task
    train_examples: list[Example]
    test_examples: list[Example]


def check_run(cfg: DictConfig, world: int = 1, memory: bool = True) -> RunParts:
    """Every start-up check of an RL run on `world` ranks, without building the model: settings, the model's files
    and sizes, the objective, the task and its splits, and (`memory`) whether one rank's step fits in the device's
    free memory. `ConfigError` names what is wrong."""
    t = cfg.trainer
    model_cfg = ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    hf_config = model_config(model_cfg)
    name, advantage_std, hyperparameters = algo_hyperparameters(cfg.algo)
    objective = build_objective(name, **hyperparameters)
    correction_params = dict(OmegaConf.to_container(cfg.correction, resolve=True))
    correction = build_correction(correction_params.pop("name"), **correction_params)
    variant_params = dict(OmegaConf.to_container(cfg.routing_variant, resolve=True))
    variant = build_routing_variant(variant_params.pop("name"), **variant_params)
    plan = plan_step(cfg, is_moe=is_moe(hf_config), reads_pi_old=correction.name if correction.needs_decoupled else None,
                     world=world, variant=variant)
    rollout = RolloutConfig(**cfg.rollout)
    engine = rollout.engine_class()
    engine.check(cfg, world)
    _check_correction(plan, objective, correction, engine)
    variant.check(plan.replay, cfg.model.name, is_moe(hf_config), engine.name, engine.returns_gate_weights)
    dataset = dict(OmegaConf.to_container(cfg.dataset, resolve=True))
    task = build_task(dataset.pop("name"), **dataset)
    train_examples, test_examples = task.examples("train"), task.examples("test")
    if t.eval_prompts > len(test_examples):
        raise ConfigError(
            f"trainer.eval_prompts={t.eval_prompts} is more than the {len(test_examples)} held-out examples of "
            f"dataset {task.name!r}"
        )
    tokenizer = _tokenizer(model_cfg)
    answers = longest_tokens(tokenizer, [example.answer for example in train_examples + test_examples])
    _check_generation_budget(t.max_new_tokens, answers, "trainer.max_new_tokens", task)
    if memory:
        prompt_tokens = longest_tokens(tokenizer, [e.prompt for e in train_examples + test_examples])
        _check_memory(cfg, hf_config, model_cfg, prompt_tokens, world)
    numerics = RolloutConfig(**cfg.rollout).numerics()
    return RunParts(plan, model_cfg, numerics, engine, objective, advantage_std, correction, variant, task,
                    train_examples, test_examples)


def _check_memory(cfg: DictConfig, hf_config: Any, model_cfg: ModelConfig, prompt_tokens: int, world: int) -> None:
    """Refuse a step that would not fit in the device's free memory, with the estimate's parts."""
    t = cfg.trainer
    memory = step_memory(hf_config, cfg, prompt_tokens, DTYPES[model_cfg.dtype].itemsize, world)
    available = available_bytes(cfg.device)
    if memory.peak > available:
        raise ConfigError(
            f"one RL step of trainer.prompts_per_step={t.prompts_per_step} x trainer.group_size={t.group_size} "
            f"(trainer.minibatches={t.minibatches}) needs about {memory.peak / GIB:.1f} GiB ({memory.describe()}), "
            f"and {cfg.device} has {available / GIB:.1f} GiB available: lower the batch or raise trainer.minibatches"
        )


def _check_correction(plan: StepPlan, objective: Objective, correction: Correction, engine: type[RolloutEngine]) -> None:
    """What the correction, the objective and the engine must agree on."""
    reads_mu = correction.name != "none" or objective.needs_rollout_logp
    if reads_mu and not engine.returns_logprobs:
        raise ConfigError(
            f"correction={correction.name} / algo={objective.name} read μ_old's log-probs, which rollout.engine="
            f"{engine.name} does not return"
        )
    if plan.replay == Replay.r3 and not engine.returns_routing:
        raise ConfigError(f"routing.replay=r3 replays the engine's experts, which rollout.engine={engine.name} does not report")
    if objective.needs_rollout_logp and correction.name in ("tis", "mis", "icepop"):
        raise ConfigError(
            f"algo={objective.name} already weighs each token by its truncated π_θ/μ_old; correction={correction.name} "
            "would weigh the mismatch twice: use correction=none, geo_rs or opsm with it"
        )



def _tokenizer(model_cfg: ModelConfig):
    if model_cfg.path is None:
        return build_char_tokenizer()
    return AutoTokenizer.from_pretrained(model_cfg.path, local_files_only=True)


def longest_tokens(tokenizer, texts: list[str]) -> int:
    """Tokens of the longest text (measured on the 32 longest in characters)."""
    longest = sorted(set(texts), key=len)[-32:]
    return max(len(ids) for ids in tokenizer(longest, add_special_tokens=False)["input_ids"])


def _check_generation_budget(max_new_tokens: int, answer_tokens: int, key: str, task: Task) -> None:
    """A budget that cannot hold the task's answers and their eos makes every long answer a truncated, wrong one."""
    if max_new_tokens < answer_tokens + 1:
        raise ConfigError(
            f"{key}={max_new_tokens} cannot hold the answers of dataset {task.name!r}: up to {answer_tokens} tokens, "
            f"plus eos; use {key} >= {answer_tokens + 1}"
        )


def lr_lambda(schedule: LRSchedule, warmup: int, total: int):
    """Multiplier of the base learning rate after `update` optimizer updates (linear warm-up, then decay)."""

    def factor(update: int) -> float:
        if warmup and update < warmup:
            return (update + 1) / warmup
        progress = (update - warmup) / max(1, total - warmup)
        if schedule == LRSchedule.linear:
            return max(0.0, 1.0 - progress)
        if schedule == LRSchedule.cosine:
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class RLTrainer:
    """Holds the policy, its engine, optimizer, objective and task; `step()` runs one RL step and returns its metrics."""

    def __init__(self, cfg: DictConfig, ranks: Ranks = Ranks()) -> None:
        self.cfg = cfg
        self.ranks = ranks
        t = cfg.trainer
        parts = check_run(cfg, ranks.world)
        self.plan, self.objective, self.advantage_std = parts.plan, parts.objective, parts.advantage_std
        self.correction, self.variant = parts.correction, parts.variant
        self.task, self.train_examples, self.test_examples = parts.task, parts.train_examples, parts.test_examples
        model_cfg = parts.model_cfg
        self.threads = ThreadBudget(t.threads)
        torch.manual_seed(cfg.seed)
        self.device = torch.device(cfg.device)
        self.model, self.tokenizer = build_policy(model_cfg)
        # No dropout in these models; eval() also keeps Mixtral-style router jitter off, so that two passes of the
        # same weights route identically and every measured drift comes from an update.
        self.model.to(self.device).eval()
        # An engine with its own numbers copies the whole model before the trainer's is sharded across ranks.
        self.engine = parts.engine.build(cfg, self.model, self.tokenizer, parts.numerics, ranks,
                                         parts.plan.engine_records_routing)
        if ranks.active:
            shard(self.model)
        self.reference = None
        if self.objective.kl_coef > 0:
            self.reference, _ = build_policy(model_cfg)
            self.reference.to(self.device).eval().requires_grad_(False)
        # fused: one kernel for all parameters instead of a Python loop over them (4x faster on the tiny MoE's CPU
        # update); the same AdamW.
        routers = {id(router.weight) for router in find_routers(self.model).values()}
        groups = [[p for p in self.model.parameters() if id(p) not in routers],
                  [p for p in self.model.parameters() if id(p) in routers]]
        self.optimizer = torch.optim.AdamW(
            [{"params": groups[0]}] + ([{"params": groups[1], "lr": t.lr * t.router_lr_scale}] if groups[1] else []),
            lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2),
            weight_decay=t.weight_decay,
            fused=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.lr_schedule, t.warmup_steps, t.steps * t.minibatches)
        )
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.flip_generator = torch.Generator()  # the synthetic flips' own stream (routing.flip_rate), reseeded per step
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
        self.engine.reseed(seed)
        threads = self.threads.threads
        self.threads.begin()
        start = time.perf_counter()
        rollout = self.rollout()
        rollout_s = time.perf_counter() - start
        advantages = group_advantages(rollout.rewards, t.group_size, scale_by_std=self.advantage_std)
        order = minibatch_order(self.plan.layout, rollout.size, t.group_size, self.generator)
        minibatches = split_minibatches(rollout, advantages, order, t.minibatches, self.device)
        score_start = time.perf_counter()
        old = [self.old_policy(mb) for mb in minibatches]  # all before the first update: θ = θ_old
        score_s = time.perf_counter() - score_start
        train_start = time.perf_counter()
        per_minibatch = [self.update(mb, old_policy) for mb, old_policy in zip(minibatches, old)]
        train_s = time.perf_counter() - train_start
        self.engine.sync_weights(self.model)
        step_s = time.perf_counter() - start
        self.threads.end()
        # The whole step's rows, every rank's (groups stay whole, so they gather in group order).
        rewards = gather(rollout.rewards, self.ranks)
        lengths = gather(rollout.response_mask.sum(-1).float(), self.ranks)
        self.tokens_seen += int(lengths.sum())
        record = {
            "train/step": self.step_index,
            "train/tokens": self.tokens_seen,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/accuracy": float(gather(rollout.correct.float(), self.ranks).mean()),
            "reward/zero_std_group_frac": zero_std_group_frac(rewards, t.group_size),
            "response/length_mean": float(lengths.mean()),
            "response/truncated_frac": float(gather(rollout.truncated.float(), self.ranks).mean()),
            **self.step_means(per_minibatch),
        }
        record["optim/skipped_steps"] = self.skipped_updates
        record["perf/step_s"] = step_s
        record["perf/threads"] = threads
        record["perf/rollout_s"] = rollout_s
        record["perf/score_s"] = score_s
        record["perf/train_s"] = train_s
        record["perf/rollout_tokens_per_s"] = float(lengths.sum()) / max(rollout_s, 1e-9)
        record["minibatches"] = per_minibatch
        return record

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
        replay = mb.engine_routes if plan.replay == Replay.r3 else None
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
            replay=routes if plan.replay == Replay.r2 else replay,
            ref_logp=ref_logp,
        )

    def _score(self, model: torch.nn.Module, mb: Minibatch, **options: Any) -> Scores:
        """`score_responses` of the minibatch, packed by group under the `groups` layout (`options`: its aux_loss /
        record / record_gates / replay / rule / score_replayed / aux_loss_grad / fragile_margin)."""
        t = self.cfg.trainer
        over_ranks = (lambda tensor: summed(tensor, self.ranks)) if self.ranks.active else None
        return score_responses(
            model, mb.input_ids, mb.attention_mask, mb.prompt_width, t.temperature,
            group_size=t.group_size if self.plan.layout == Layout.groups else 1, over_ranks=over_ranks, **options,
        )

    def update(self, mb: Minibatch, old: OldPolicy) -> dict[str, float]:
        """One optimizer update of π_θ on the minibatch; its metrics (ratios and drift after `mb.index` updates),
        computed over every rank's share of the minibatch."""
        t = self.cfg.trainer
        aux_coef = t.router_aux_loss_coef
        track = self.plan.track_routing
        variant, rule = self.variant, self.variant.replay_rule()
        # RSPO reads θ's router on θ_old's experts in this forward, which keeps its own routing (the variant's rule).
        theta_old_experts = old.routes if variant.reads_old_router and not old.on_policy else None
        trace = old.replay if old.replay is not None else theta_old_experts
        self.optimizer.zero_grad(set_to_none=True)
        with self.flips() as flips:
            scores = self._score(
                self.model,
                mb,
                aux_loss=aux_coef > 0 or track,
                aux_loss_grad=aux_coef > 0,  # otherwise only logged
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
        first_is_old = mb.index == 0 and not self.plan.flip_rate
        trainer_at_old = scores.logp.detach() if first_is_old else (old.logp if self.plan.pi_old == PiOld.decoupled else None)
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
        loss = result.loss + aux_coef * scores.aux_loss if aux_coef > 0 else result.loss
        finite_loss = reduce(float(torch.isfinite(loss)), self.ranks, op="sum") == self.ranks.world
        if finite_loss:
            loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)) if finite_loss else float("nan")
        # Metrics of the whole minibatch: on several ranks, of every rank's rows gathered (one rank: its own).
        rows = lambda tensor, fill=0: gather(tensor, self.ranks, fill=fill)  # noqa: E731
        mask = rows(mb.response_mask, False)
        metrics: dict[str, float] = {"minibatch": mb.index}
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
        if trainer_at_old is not None:
            metrics.update(mismatch_metrics(rows(trainer_at_old - mb.mu_logp), mask))
        metrics["policy/entropy"] = float(masked_mean(rows(scores.entropy), mask))
        metrics["optim/grad_norm"] = grad_norm
        metrics["optim/lr"] = self.scheduler.get_last_lr()[0]
        if scores.aux_loss_value is not None:
            metrics["moe/aux_loss"] = scores.aux_loss_value
        if flips is not None:
            metrics["routing/synthetic_flip_frac"] = reduce(flips.share, self.ranks) / self.ranks.world
        metrics.update(variant.rule_metrics(rule, lambda count: summed(count, self.ranks)))
        if shift is not None:
            metrics.update(Shift(rows(shift.log_weight), gather(shift.deviation, self.ranks, dim=1),
                                 rows(shift.floored, False)).metrics(mask))
        if track:
            metrics.update(self._routing_metrics(mb, old, scores, pi_old_logp))
        self._apply(finite_loss and math.isfinite(grad_norm), mb.index)
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
        """The aggregation denominators of the whole minibatch, summed over ranks (`algos.common.Totals`)."""
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
        metrics = dict(routing_drift(theta_old, own, token_mask).metrics)
        metrics["moe/load_max_violation"] = load_max_violation(theta_old, token_mask)
        fed = reduce(float(mb.attention_mask[:, FED].sum()), self.ranks)  # the weight of each rank's fragility means
        mine = float(mb.attention_mask[:, FED].sum())
        metrics.update({name: reduce(value * mine, self.ranks) / fed for name, value in scores.router_stats.items()})
        first_is_old = mb.index == 0 and not self.plan.flip_rate
        trainer_routes = own if first_is_old else (traces(old.routes) if self.plan.pi_old == PiOld.decoupled else None)
        if mb.engine_routes is not None and trainer_routes is not None:
            metrics.update(routing_mismatch(traces(mb.engine_routes), trainer_routes, token_mask))
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
        return decomposition_metrics(rows(own - replayed), rows(replayed - pi_old_logp),
                                     gather(mb.response_mask, self.ranks, fill=False))

    def flips(self) -> contextlib.AbstractContextManager:
        """The synthetic flips of π_θ's update forwards (`routing.flip_rate`), yielding their handle; or nothing."""
        if not self.plan.flip_rate:
            return contextlib.nullcontext()
        return flip_routing(self.model, self.plan.flip_rate, self.flip_generator)

    def _apply(self, finite: bool, update: int) -> None:
        """Take the optimizer step of the step's update number `update`, or refuse a non-finite one: one bad batch
        must not poison every parameter. `Diverged` when the skips run out or the step left the weights non-finite."""
        t = self.cfg.trainer
        if finite:
            self.optimizer.step()
            self.scheduler.step()  # the schedule counts applied updates
            self.consecutive_skips = 0
            self._refuse_non_finite_weights(update)
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_updates += 1
        self.consecutive_skips += 1
        if self.consecutive_skips >= t.max_consecutive_skips:
            raise Diverged(
                f"{self.consecutive_skips} optimizer updates in a row had a non-finite loss or gradient "
                f"(trainer.max_consecutive_skips={t.max_consecutive_skips}); lower trainer.lr or check the objective's "
                "clip range"
            )

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

    def step_means(self, per_minibatch: list[dict[str, float]]) -> dict[str, float]:
        """Step-level values: the mean over the step's minibatches, except routing drift, whose minibatch 0 is 0 by
        construction: `routing/expert_change_per_update` is the drift after one update (minibatch 1), and the mean
        over minibatches is logged under a name that says so."""
        means = {}
        keys = dict.fromkeys(key for m in per_minibatch for key in m if key != "minibatch")
        for key in keys:
            values = [m[key] for m in per_minibatch if m.get(key) is not None]
            if key.startswith(DRIFT_KEYS):
                if key == "routing/expert_change_frac":
                    means["routing/expert_change_mean_over_minibatches"] = mean_of(values)
                if len(per_minibatch) > 1 and key in per_minibatch[1]:
                    means[key.replace("_frac", "_per_update", 1)] = per_minibatch[1][key]
                continue
            means[key] = mean_of(values)
        return means

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy of the trainer's own policy; on several ranks each takes every world-th prompt and the
        accuracies combine weighted by the prompts each rank held."""
        t = self.cfg.trainer
        mine = self.test_examples[: t.eval_prompts][self.ranks.rank :: self.ranks.world]
        local = evaluate(
            HFEngine(self.model, self.tokenizer, synced=self.ranks.active),
            self.task,
            mine,
            samples=t.eval_samples,
            max_new_tokens=t.max_new_tokens,
            temperature=t.temperature,
        )
        return {name: reduce(value * len(mine), self.ranks) / t.eval_prompts for name, value in local.items()}
