"""One RL step, top to bottom, for every objective; what a run switches on acts through hooks at fixed points.

Three policies are named in the step. μ_old is the rollout engine that sampled (its own log-probs and routing);
π_old is the trainer at the weights θ_old the step started from; π_θ is the policy being updated. The token ratio
the objectives clip is π_θ / π_old. Where a step's rollout comes from is the rollout source `rollout.source` names
(`experiments.step.sources`), built once at start-up (`self.rollouts`), and nothing after it asks which: the engine
in the step (synchronous), the same engine with the weights of exactly `rollout.lag` versions before θ_old (lagged:
μ_old is that stale engine, π_old still the trainer at θ_old), or a worker process that samples the next steps'
rollouts while the trainer updates (concurrent).

    rollout     = self.rollouts.take(step)                   μ_old: tokens, log-probs, routing when asked; rewards
    advantages  = group_advantages(rollout.rewards)          Â_i = (r_i − mean_group) / (std_group + eps)
    minibatches = split_minibatches(rollout, advantages, order)   pure: whole groups or shuffled rows (GSPO §5.1)
    old         = [old_policy(mb) for mb in minibatches]      π_old (and the KL reference), before any update
    for mb, old: update(mb, old)                              π_θ: forward, objective, loss, backward, AdamW, measure
    publish()                                                 θ, as the next version, to the rollout source

What the step is made of is decided once at start-up (`experiments.step.plan`, recorded in `summary.json`) and
assembled into objects (`experiments.step.hooks.assemble`): where π_old comes from (`experiments.step.old_policy`:
bypass reuses μ_old's log-probs, recompute runs the trainer at θ_old without gradient, and the first minibatch is
on-policy where its own forward is π_old), and the hooks that act at the update's fixed points: Routing Replay and its
variants, RSPO's shift, the routing measurements and the ratio decomposition, the router switches, the SYNTHETIC
flips and router noise, a rollout correction, the mismatch measurements. `update` calls every hook at every fixed
point and asks none which it is.

Ranks. Under torchrun each rank samples, scores and trains on whole groups of its share of the prompts; the policy is
sharded with FSDP2 (`experiments.step.data_parallel.shard`), whose reduce-scatter averages the gradients, and the loss
aggregates with the whole minibatch's token and sequence counts (`algos.aggregation.Totals`), so the averaged gradient
is the gradient of one process with the whole batch (verl's `agg_loss` with `dp_size`). Every metric is measured once,
after the update, over every rank's rows gathered (`hooks.Rows`): every logged number is the global value, read from the
tensors the loss used; on one rank the gathers are identities.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, cast

import torch
from omegaconf import DictConfig
from transformers import PreTrainedModel

from algos.advantages import group_advantages, within_group_std, zero_std_group_frac
from algos.aggregation import Totals, masked_mean
from algos.objective import ObjectiveInputs, ObjectiveOutput
from experiments.ranks import Ranks
from experiments.step import metrics as m
from experiments.step.batch import (
    Minibatch,
    Rollout,
    collect_rollout,
    draw_examples,
    evaluate,
    minibatch_order,
    split_minibatches,
    step_seed,
)
from experiments.step.checks import check_run
from experiments.step.data_parallel import gather_rows, reduce_value, shard, summed
from experiments.step.engines import EngineFactory, HFEngine, KVCache, RolloutEngine, Sampling, full_weights
from experiments.step.hooks import Rows, StepParts, Update, assemble
from experiments.step.old_policy import OldPolicy
from experiments.step.optimizer import rl_optimizer
from experiments.step.plan import Layout
from experiments.step.scoring import ScoreOptions, Scores, score_responses
from experiments.step.sources import SamplingRun, SourceInputs
from experiments.tasks import Example
from models.cpu_kernels import weights_sha256
from models.policy import build_policy
from models.registry import Diverged, node_settings
from models.routing.predictor import policy_parameters
from models.routing.trace import find_routers

FLIP_STREAM = 0x5EED  # offsets the flips' seed from the step's: their draws are not the sampler's draws
PERTURB_STREAM = 0xD21F7  # and the router perturbation's, likewise


class RLTrainer:
    """Holds the policy, its rollout source, optimizer, objective and task; `step()` runs one RL step and returns its
    metrics. `min_new_tokens`: the engine bans eos before that many tokens (the benchmarks' fixed-length steps)."""

    def __init__(self, cfg: DictConfig, ranks: Ranks = Ranks(), min_new_tokens: int = 0) -> None:
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
        # functools.wraps hides from mypy that PreTrainedModel.to is a method (typeshed's _Wrapped binds no self).
        self.model.to(self.device).eval()  # type: ignore[arg-type]
        for switch in self.switches:  # before the engine copies the model and the optimizer takes its parameters
            switch.start(self.model)
        self.variant.start(self.model)  # likewise, and after the switches: a frozen router leaves its predictor trained
        # Where each step's rollout comes from, given what it needs and not the trainer: the engine (on the trainer's
        # own module where the plan says so, else a copy of its own, made before the trainer's model is sharded
        # across ranks), how a step's rollout is drawn, the trainer's weights, and the run for a worker's process.
        engines = EngineFactory(parts.engine, cfg, parts.numerics, self.plan.engine_records_routing, min_new_tokens)
        self.rollouts = parts.source.build(
            cfg.rollout,
            SourceInputs(
                make_engine=lambda: engines(self.model, self.tokenizer, ranks, on_model=self.plan.engine_is_trainer),
                sample=self.rollout,
                weights=lambda: full_weights(self.model),
                run=SamplingRun(
                    model=parts.model_cfg,
                    dataset=node_settings(cfg.dataset),
                    device=cfg.device,
                    seed=cfg.seed,
                    prompts=cfg.trainer.prompts_per_step,
                    sampling=self.sampling(),
                    engines=engines,
                    start_model=self.variant.start,
                ),
                ranks=ranks,
            ),
        )
        if ranks.active:
            shard(self.model)
        start = None  # the start, frozen: the KL term's reference, and what `measure_learning` measures the KL to
        if self.objective.kl_coef > 0 or cfg.trainer.measure_learning:
            start, _ = build_policy(parts.model_cfg)
            # functools.wraps hides from mypy that PreTrainedModel.to is a method (typeshed's _Wrapped binds no self).
            start.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]
        reference = start if self.objective.kl_coef > 0 else None
        self.optimizer, self.scheduler = rl_optimizer(self.model, cfg.trainer, self.variant.predictor_lr_scale)
        self.clipped = policy_parameters(self.model)  # the gradient clip bounds the policy's, not a predictor's
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.flip_generator = (
            torch.Generator()
        )  # the synthetic flips' own stream (routing.flip_rate), reseeded per step
        self.perturb_generator = torch.Generator()  # the synthetic router noise's (routing.perturb_rate), likewise
        assembly = assemble(
            StepParts(
                plan=self.plan,
                cfg=cfg,
                model=self.model,
                reference=reference,
                start=start,
                score=self.score,
                variant=self.variant,
                correction=self.correction,
                switches=self.switches,
                ranks=ranks,
                layers=len(find_routers(self.model)),
                flip_generator=self.flip_generator,
                perturb_generator=self.perturb_generator,
            )
        )
        self.old_policy, self.hooks = assembly.old_policy, assembly.hooks
        self.step_index = 0
        self.tokens_seen = 0
        self.skipped_updates = 0
        self.consecutive_skips = 0
        # Which libraries and kernels computed the steps so far, when not only this process (a checkpoint's load
        # sets it: `experiments.run.checkpoint`); None: this process, from the first step.
        self.computed_under: list[dict[str, Any]] | None = None

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
        start = time.perf_counter()
        served = self.rollouts.take(self.step_index, seed)
        rollout = served.rollout
        rollout_s = time.perf_counter() - start
        advantages = group_advantages(rollout.rewards, t.group_size, scale_by_std=self.advantage_std)
        order = minibatch_order(self.plan.layout, len(rollout.examples), t.group_size, self.generator)
        minibatches = split_minibatches(rollout, advantages, order, t.minibatches, self.device)
        score_start = time.perf_counter()
        with torch.no_grad():
            old = [self.old_policy(mb) for mb in minibatches]  # all before the first update: θ = θ_old
        score_s = time.perf_counter() - score_start
        train_start = time.perf_counter()
        per_minibatch = [self.update(mb, old_policy) for mb, old_policy in zip(minibatches, old)]
        train_s = time.perf_counter() - train_start
        self.publish()
        step_s = time.perf_counter() - start
        # The whole step's rows, every rank's (groups stay whole, so they gather in group order).
        rewards = gather_rows(rollout.rewards, self.ranks)
        lengths = gather_rows(rollout.response_mask.sum(-1).float(), self.ranks)
        self.tokens_seen += int(lengths.sum())
        return {
            m.STEP: self.step_index,
            m.TOKENS: self.tokens_seen,
            m.REWARD: float(rewards.mean()),
            m.REWARD_STD: float(rewards.std()),
            m.REWARD_ACCURACY: float(gather_rows(rollout.correct.float(), self.ranks).mean()),
            m.ZERO_STD_GROUPS: zero_std_group_frac(rewards, t.group_size),
            m.WITHIN_GROUP_STD: within_group_std(rewards, t.group_size),
            m.LENGTH: float(lengths.mean()),
            m.TRUNCATED: float(gather_rows(rollout.truncated.float(), self.ranks).mean()),
            **m.step_means(per_minibatch),
            m.SKIPPED: self.skipped_updates,
            m.STEP_TIME: step_s,
            m.ROLLOUT_TIME: rollout_s,
            m.SCORE_TIME: score_s,
            m.TRAIN_TIME: train_s,
            m.ROLLOUT_TOKENS_PER_S: float(lengths.sum()) / max(served.sample_s, 1e-9),
            m.MINIBATCHES: per_minibatch,
            **served.metrics,
        }

    def publish(self) -> None:
        """Hand the weights after this step's updates (version `step_index`) to what samples the next rollouts."""
        self.rollouts.publish(self.step_index)

    def close(self) -> None:
        """Stop what runs beside the trainer (the concurrent source's worker), however the run ends."""
        self.rollouts.close()

    def sampling(self) -> Sampling:
        """How a step's rollouts are sampled: `group_size` completions per prompt, with the routing the plan asks."""
        t = self.cfg.trainer
        return Sampling(
            t.group_size,
            t.max_new_tokens,
            t.temperature,
            record_routing=self.plan.engine_records_routing,
            record_gates=self.plan.engine_records_gates
            or (self.plan.engine_records_routing and self.plan.engine_gates_measured),
            predict_routes=self.plan.engine_predicts_routes,
        )

    def rollout(self, engine: RolloutEngine) -> Rollout:
        """μ_old: `prompts_per_step` train prompts (this rank's share), `group_size` completions each, from `engine`."""
        examples = draw_examples(
            self.train_examples, self.cfg.trainer.prompts_per_step // self.ranks.world, self.generator
        )
        return collect_rollout(engine, self.task, examples, self.sampling())

    def score(self, model: torch.nn.Module, mb: Minibatch, options: ScoreOptions = ScoreOptions()) -> Scores:
        """`score_responses` of the minibatch under `model`, packed by group under the `groups` layout, its balancing
        counts summed over ranks."""
        t = self.cfg.trainer
        group = t.group_size if self.plan.layout == Layout.groups else 1
        over_ranks = (lambda tensor: summed(tensor, self.ranks)) if self.ranks.active else None
        # Every model scored here is the policy's kind, a transformers causal LM (the policy, its start, a copy of it).
        return score_responses(
            cast(PreTrainedModel, model),
            mb,
            t.temperature,
            ScoreOptions(**{**vars(options), "group_size": group, "over_ranks": over_ranks}),
        )

    def update(self, mb: Minibatch, old: OldPolicy) -> dict[str, float]:
        """One optimizer update of π_θ on the minibatch, and its metrics, measured after it (ratios and drift after
        `mb.index` updates) over every rank's share of the minibatch."""
        update = Update(self.step_index, mb, old)
        self.optimizer.zero_grad(set_to_none=True)
        options = ScoreOptions()
        for hook in self.hooks:
            options = hook.options(update, options)
        with contextlib.ExitStack() as around:
            for hook in self.hooks:
                around.enter_context(hook.around_forward(update))
            update.scores = scores = self.score(self.model, mb, options)
        inputs = ObjectiveInputs(
            old_logp=old.pi_old_logp(scores),
            advantages=mb.advantages,
            mask=mb.response_mask,
            ref_logp=old.ref_logp,
            rollout_logp=mb.mu_logp,
        )
        for hook in self.hooks:
            inputs = hook.objective_inputs(update, inputs)
        result = self.objective(scores.logp, inputs, self._totals(mb.response_mask))
        loss = result.loss + sum(hook.loss(update) for hook in self.hooks)
        grad_norm = self._backward(loss)
        lr = cast(float, self.scheduler.get_last_lr()[0])  # a float learning rate (`trainer.lr`), never a tensor
        before = {name: value for hook in self.hooks for name, value in hook.before_step(update).items()}
        after = self._optimizer_step(math.isfinite(grad_norm), update)
        return {**self.measure(update, result, grad_norm, lr), **before, **after}

    def measure(self, update: Update, result: ObjectiveOutput, grad_norm: float, lr: float) -> dict[str, float]:
        """The update's metrics over every rank's rows: the objective's (read from the tensors its loss used), the
        policy's entropy, the step size, and what each hook measures."""
        rows = Rows.of(self.ranks, update.mb)
        metrics: dict[str, float] = {m.MINIBATCH: update.mb.index, **rows.gathered(result).metrics}
        for hook in self.hooks:
            metrics.update(hook.measure(update, rows))
        metrics[m.ENTROPY] = float(masked_mean(rows(update.scored.entropy), rows.mask))
        metrics[m.GRAD_NORM] = grad_norm
        metrics[m.LR] = lr
        return metrics

    def _backward(self, loss: torch.Tensor) -> float:
        """Backpropagate `loss` and clip the policy's gradient; its norm, or NaN when the loss is non-finite on any rank
        (no backward then: one bad batch must not poison every parameter)."""
        if reduce_value(float(torch.isfinite(loss)), self.ranks) != self.ranks.world:
            return float("nan")
        loss.backward()
        return float(torch.nn.utils.clip_grad_norm_(self.clipped, self.cfg.trainer.grad_clip))

    def _optimizer_step(self, finite: bool, update: Update) -> dict[str, float]:
        """Take the optimizer step of the update, then what the hooks do to the weights between updates (their
        metrics are returned). Or refuse a non-finite step. `Diverged` when the skips run out or the step left the
        weights non-finite."""
        t = self.cfg.trainer
        if finite:
            self.optimizer.step()
            self.scheduler.step()  # the schedule counts applied updates
            self.consecutive_skips = 0
            self._refuse_non_finite_weights(update.mb.index)
            return {name: value for hook in self.hooks for name, value in hook.after_step(update).items()}
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
            raise Diverged(
                f"update {update} of the step left the weights non-finite (largest |w| = {largest}); lower trainer.lr"
            )

    def _totals(self, mask: torch.Tensor) -> Totals:
        """The aggregation denominators of the whole minibatch, summed over ranks (`algos.aggregation.Totals`)."""
        local = Totals.local(mask)
        if not self.ranks.active:
            return local
        return Totals(
            reduce_value(local.tokens, self.ranks),
            reduce_value(local.sequences, self.ranks),
            reduce_value(local.nonempty, self.ranks),
            int(reduce_value(local.width, self.ranks, op="max")),
            self.ranks.world,
        )

    def evaluate(self, whole_split: bool = False) -> dict[str, float]:
        """Held-out accuracy of the trainer's own policy: on the first `eval_prompts` test prompts (`EVAL_*`), or
        greedy on every prompt of the test split (`EVAL_SPLIT_*`). On several ranks each takes every world-th prompt
        and the accuracies combine weighted by the prompts each rank held."""
        t = self.cfg.trainer
        engine = HFEngine(
            self.model, self.tokenizer, synced=self.ranks.active, kv_cache=KVCache(self.cfg.rollout.kv_cache)
        )

        def accuracy(prompts: list[Example], samples: int) -> dict[str, float]:
            mine = prompts[self.ranks.rank :: self.ranks.world]
            local = evaluate(
                engine,
                self.task,
                mine,
                samples=samples,
                max_new_tokens=t.max_new_tokens,
                temperature=t.temperature,
                batch=self.eval_split_batch if whole_split else None,
            )
            return {name: reduce_value(value * len(mine), self.ranks) / len(prompts) for name, value in local.items()}

        if whole_split:
            return {m.EVAL_SPLIT_GREEDY: accuracy(self.test_examples, 0)[m.EVAL_GREEDY]}
        metrics = accuracy(self.test_examples[: t.eval_prompts], t.eval_samples)
        if t.eval_train:
            metrics[m.EVAL_TRAIN_GREEDY] = accuracy(self.train_examples[: t.eval_prompts], 0)[m.EVAL_GREEDY]
        return metrics
