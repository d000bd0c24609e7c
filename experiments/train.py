"""The RL loop: one rollout loop for every objective, with Routing Replay as a switch orthogonal to it.

One RL step (GSPO paper §5.1 setup: each rollout batch is split into minibatches, so every update after the
first is off-policy and the objectives differ):

1. sample B prompts from the task's train split; generate G completions each with the current policy θ_old
   (KV cache, temperature; the sampler's per-token log-probs and routing are kept when a later stage uses them);
   the task scores them.
2. group advantages Â_i = (r_i − mean_group) / (std_group + eps) (no std division for Dr. GRPO).
3. split the batch into N minibatches (`trainer.minibatch_layout`: whole groups, shuffled by prompt, each group
   fed as one packed sequence that computes its prompt once; or completions shuffled across groups, fed row by
   row), each with per-token log π_θold:
   - `trainer.old_logprobs=rollout` (the default without replay): the sampler's own log-probs. The sampler *is*
     θ_old — the same weights in the same fp32 model — so a second forward would only recompute them (up to the
     KV-cache path's rounding, ~1e-6). θ_old's routing for the drift metrics is the rollout's too.
   - `recompute` (always under replay): score each minibatch again without gradient, with the same shapes as
     training; r2 records θ_old's routing in this pass, r3 replays the rollout's routing in it.
   The first minibatch is on-policy (θ = θ_old at its update) and takes θ_old's log-probs and routing from its
   update's own forward, so its importance ratios are exactly 1 (under r3 it is scored like the others, for the
   rollout mismatch metrics).
4. for each minibatch j: forward θ (replaying the old routing under r2/r3), objective(logp, old_logp, Â, mask)
   (+ β·KL to a frozen reference, + the router load-balancing loss when configured), backward, clip, AdamW step.
   The routers still compute their own top-k, so the drift of θ's routing against θ_old's — after j updates —
   is measured on the same tokens at no extra forward.
5. log every metric (per step, and per minibatch) to metrics.jsonl and W&B; evaluate on held-out prompts.

Run: `python -m experiments.train algo=gspo routing.replay=none model.path=checkpoints/cold_start`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from algos import build_objective, group_advantages, zero_std_group_frac
from algos.common import k3, masked_mean
from experiments.config import (
    LR_SCHEDULES,
    MINIBATCH_LAYOUTS,
    OLD_LOGPROB_SOURCES,
    REPLAY_MODES,
    WANDB_MODES,
    algo_hyperparameters,
    register_configs,
)
from experiments.evaluate import evaluate
from experiments.logger import RunLogger
from experiments.rollout import Rollout, generate_rollout
from experiments.scoring import FED, PACKED_ATTENTION, Scores, can_pack, score_responses
from experiments.tasks import build_task
from models.moe_backend import clear_moe_bookkeeping
from models.policy import ModelConfig, build_policy, describe_policy, find_routers
from models.routing import RoutingTrace, load_max_violation, routing_drift

register_configs()


class ConfigError(ValueError):
    """A bad setting, found before any work starts."""


def validate(cfg: DictConfig) -> None:
    """Refuse bad input at start-up with one line naming the value and what is allowed."""
    t = cfg.trainer
    if cfg.routing.replay not in REPLAY_MODES:
        raise ConfigError(f"routing.replay={cfg.routing.replay!r} is not one of {list(REPLAY_MODES)}")
    if t.group_size < 2:
        raise ConfigError(f"trainer.group_size={t.group_size}: group advantages need at least 2 completions per prompt")
    if t.prompts_per_step < 1 or t.steps < 1 or t.max_new_tokens < 1:
        raise ConfigError(
            f"trainer.prompts_per_step={t.prompts_per_step}, trainer.steps={t.steps} and "
            f"trainer.max_new_tokens={t.max_new_tokens} must all be >= 1"
        )
    batch = t.prompts_per_step * t.group_size
    if t.minibatches < 1 or batch % t.minibatches:
        raise ConfigError(
            f"trainer.minibatches={t.minibatches} does not divide the batch of "
            f"{t.prompts_per_step} prompts x {t.group_size} completions = {batch}"
        )
    if t.temperature <= 0:
        raise ConfigError(f"trainer.temperature={t.temperature} must be > 0")
    if t.lr <= 0 or t.grad_clip <= 0:
        raise ConfigError(f"trainer.lr={t.lr} and trainer.grad_clip={t.grad_clip} must be > 0")
    if t.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"trainer.lr_schedule={t.lr_schedule!r} is not one of {list(LR_SCHEDULES)}")
    if cfg.logger.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"logger.wandb.mode={cfg.logger.wandb.mode!r} is not one of {list(WANDB_MODES)}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={cfg.device!r} but this machine has no CUDA device; use device=cpu")
    old_logprob_source(cfg)
    minibatch_layout(cfg, packable=True)  # the model's attention is checked once it is built


def old_logprob_source(cfg: DictConfig) -> str:
    """`rollout` or `recompute`: where the off-policy minibatches' log π_θold come from (`trainer.old_logprobs`)."""
    source, replay = cfg.trainer.old_logprobs, cfg.routing.replay
    if source not in OLD_LOGPROB_SOURCES:
        raise ConfigError(f"trainer.old_logprobs={source!r} is not one of {list(OLD_LOGPROB_SOURCES)}")
    if source == "auto":
        return "rollout" if replay == "none" else "recompute"
    if source == "rollout" and replay != "none":
        raise ConfigError(
            f"trainer.old_logprobs=rollout with routing.replay={replay}: replay's old log-probs come from the "
            "recompute pass that records (r2) or replays (r3) the routing; use trainer.old_logprobs=auto or recompute"
        )
    return source


def minibatch_layout(cfg: DictConfig, packable: bool) -> str:
    """`groups` or `rows` (`trainer.minibatch_layout`); `packable`: the model's attention follows packed layouts."""
    t = cfg.trainer
    layout = t.minibatch_layout
    if layout not in MINIBATCH_LAYOUTS:
        raise ConfigError(f"trainer.minibatch_layout={layout!r} is not one of {list(MINIBATCH_LAYOUTS)}")
    divides = t.prompts_per_step % t.minibatches == 0
    if layout == "auto":
        return "groups" if divides and packable else "rows"
    if layout == "groups" and not divides:
        raise ConfigError(
            f"trainer.minibatch_layout=groups puts whole groups in each minibatch, but trainer.minibatches="
            f"{t.minibatches} does not divide trainer.prompts_per_step={t.prompts_per_step}; use rows or auto"
        )
    if layout == "groups" and not packable:
        raise ConfigError(
            f"trainer.minibatch_layout=groups feeds packed groups, which needs model.attn_implementation="
            f"{PACKED_ATTENTION} (this model uses {cfg.model.attn_implementation!r}); use rows or auto"
        )
    return layout


def lr_lambda(schedule: str, warmup: int, total: int):
    """Multiplier of the base learning rate after `update` optimizer updates (linear warm-up, then decay)."""

    def factor(update: int) -> float:
        if warmup and update < warmup:
            return (update + 1) / warmup
        progress = (update - warmup) / max(1, total - warmup)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


@dataclass
class Minibatch:
    """One slice of the rollout batch, with everything the update needs from the old policy."""

    prompt_width: int
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    token_mask: torch.Tensor  # [n, P+T-1]: response positions among those a scoring forward feeds (`FED`)
    advantages: torch.Tensor
    old_logp: torch.Tensor | None  # None: on-policy, θ_old's log-probs come from the update's own forward
    ref_logp: torch.Tensor | None = None
    old_trace: RoutingTrace | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class RLTrainer:
    """Holds the policy, optimizer, objective and task; `step()` runs one RL step and returns its metrics."""

    def __init__(self, cfg: DictConfig) -> None:
        validate(cfg)
        self.cfg = cfg
        t = cfg.trainer
        name, self.advantage_std, hyperparameters = algo_hyperparameters(cfg.algo)
        self.objective = build_objective(name, **hyperparameters)
        self.kl_coef = float(hyperparameters.get("kl_coef", 0.0))
        self.replay = cfg.routing.replay
        if t.threads:
            torch.set_num_threads(t.threads)
        torch.manual_seed(cfg.seed)
        self.device = torch.device(cfg.device)
        model_cfg = ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))
        self.model, self.tokenizer = build_policy(model_cfg)
        self.model.to(self.device)
        # No dropout in these models; eval() also keeps Mixtral-style router jitter off, so that two passes of the
        # same weights route identically and every measured drift comes from an update.
        self.model.eval()
        is_moe = bool(find_routers(self.model))
        if not is_moe and self.replay != "none":
            raise ConfigError(
                f"routing.replay={self.replay!r} needs an MoE model, but model {cfg.model.name!r} has no MoE layers; "
                "use routing.replay=none"
            )
        if not is_moe and t.router_aux_loss_coef > 0:
            raise ConfigError(f"trainer.router_aux_loss_coef={t.router_aux_loss_coef} needs an MoE model")
        self.track_routing = is_moe and (cfg.routing.metrics or self.replay != "none")
        self.old_logprobs = old_logprob_source(cfg)
        self.minibatch_layout = minibatch_layout(cfg, packable=can_pack(self.model))
        self.packed_group = t.group_size if self.minibatch_layout == "groups" else 1
        self.reference = None
        if self.kl_coef > 0:
            self.reference, _ = build_policy(model_cfg)
            self.reference.to(self.device).eval().requires_grad_(False)
        dataset = dict(OmegaConf.to_container(cfg.dataset, resolve=True))
        self.task = build_task(dataset.pop("name"), **dataset)
        self.train_examples = self.task.examples("train")
        self.test_examples = self.task.examples("test")
        # fused: one kernel for all parameters instead of a Python loop over them (4x faster on the tiny MoE's CPU
        # update); the same AdamW.
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2),
            weight_decay=t.weight_decay,
            fused=True,
        )
        total_updates = t.steps * t.minibatches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.lr_schedule, t.warmup_steps, total_updates)
        )
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.step_index = 0
        self.tokens_seen = 0
        self.skipped_updates = 0
        self.consecutive_skips = 0

    # -- 1-3: rollout, advantages, old-policy scoring ------------------------------------------------------------

    def rollout(self) -> Rollout:
        t = self.cfg.trainer
        picks = torch.randint(len(self.train_examples), (t.prompts_per_step,), generator=self.generator)
        examples = [self.train_examples[i] for i in picks.tolist()]
        return generate_rollout(
            self.model,
            self.tokenizer,
            self.task,
            examples,
            group_size=t.group_size,
            max_new_tokens=t.max_new_tokens,
            temperature=t.temperature,
            fixed_length=t.fixed_length,
            # r3 replays the rollout's routing; with rollout log-probs, θ_old's routing for the drift metrics is the
            # rollout's too (no other θ_old forward happens).
            record=self.replay == "r3" or (self.old_logprobs == "rollout" and self.track_routing),
            logprobs=self.replay == "r3" or self.old_logprobs == "rollout",
        )

    @torch.no_grad()
    def score_old(self, rollout: Rollout, advantages: torch.Tensor) -> list[Minibatch]:
        """Split the shuffled batch into minibatches and score each with θ_old (no gradient)."""
        t = self.cfg.trainer
        if self.minibatch_layout == "groups":
            prompts = torch.randperm(rollout.size // t.group_size, generator=self.generator)
            order = (prompts[:, None] * t.group_size + torch.arange(t.group_size)).reshape(-1)
        else:
            order = torch.randperm(rollout.size, generator=self.generator)
        prompt_pad = torch.zeros(rollout.size, rollout.prompt_width, dtype=torch.bool)
        token_mask = torch.cat([prompt_pad, rollout.response_mask], dim=1)[:, FED]
        # Routing statistics and replay cover the positions a scoring forward feeds; the rollout's trace has one
        # more column, the last sampled token's, which never went through the model (NO_ROUTE).
        rollout_trace = rollout.trace.positions(FED) if rollout.trace is not None else None
        minibatches = []
        for rows in order.chunk(t.minibatches):
            mb = Minibatch(
                prompt_width=rollout.prompt_width,
                input_ids=rollout.input_ids[rows].to(self.device),
                attention_mask=rollout.attention_mask[rows].to(self.device),
                response_mask=rollout.response_mask[rows].to(self.device),
                token_mask=token_mask[rows],
                advantages=advantages[rows].to(self.device),
                old_logp=None,
            )
            if self.replay == "r3":
                mb.old_trace = rollout_trace.rows(rows)
                replayed = self._score(self.model, mb, replay=mb.old_trace.to(self.device))
                mb.old_logp = replayed.logp
                mismatch = routing_drift(mb.old_trace, replayed.routes.to("cpu"), mb.token_mask)
                log_rho = mb.old_logp - rollout.rollout_logp[rows].to(self.device)
                mb.metrics["rollout/expert_mismatch_frac"] = mismatch.expert_change_frac
                mb.metrics["rollout/token_any_mismatch_frac"] = mismatch.token_any_change_frac
                mb.metrics["rollout/kl_k3"] = float(masked_mean(k3(log_rho), mb.response_mask))
            elif minibatches and self.old_logprobs == "rollout":
                mb.old_logp = rollout.rollout_logp[rows].to(self.device)
                mb.old_trace = rollout_trace.rows(rows) if self.track_routing else None
            elif minibatches:  # the first, on-policy minibatch is scored by its own update forward (`update`)
                scored = self._score(self.model, mb, record=self.track_routing)
                mb.old_logp = scored.logp
                mb.old_trace = scored.routes.to("cpu") if self.track_routing else None
            if self.reference is not None:
                mb.ref_logp = self._score(self.reference, mb).logp
            minibatches.append(mb)
        return minibatches

    def _score(self, model: torch.nn.Module, mb: Minibatch, **options: Any) -> Scores:
        """`score_responses` of the minibatch, packed by group under `minibatch_layout=groups` (`options`: its
        aux_loss / record / replay / aux_loss_grad)."""
        t = self.cfg.trainer
        return score_responses(
            model, mb.input_ids, mb.attention_mask, mb.prompt_width, t.temperature, group_size=self.packed_group,
            **options,
        )

    # -- 4: one optimizer update per minibatch -------------------------------------------------------------------

    def update(self, mb: Minibatch, index: int) -> dict[str, float]:
        t = self.cfg.trainer
        aux_coef = t.router_aux_loss_coef
        on_policy = mb.old_logp is None  # θ = θ_old here: this forward is θ_old's (see `score_old`)
        replaying = self.replay != "none" and not on_policy
        self.optimizer.zero_grad(set_to_none=True)
        scores = self._score(
            self.model,
            mb,
            aux_loss=aux_coef > 0 or self.track_routing,
            aux_loss_grad=aux_coef > 0,  # otherwise only logged
            record=self.track_routing and not replaying,
            replay=mb.old_trace.to(self.device) if replaying else None,
        )
        if on_policy:
            mb.old_logp = scores.logp.detach()
        result = self.objective(
            logp=scores.logp,
            old_logp=mb.old_logp,
            advantages=mb.advantages,
            mask=mb.response_mask,
            ref_logp=mb.ref_logp,
        )
        loss = result.loss
        if aux_coef > 0:
            loss = loss + aux_coef * scores.aux_loss
        finite_loss = bool(torch.isfinite(loss))
        if finite_loss:
            loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)) if finite_loss else float("nan")
        metrics = {"minibatch": index, **result.metrics, **mb.metrics}
        metrics["policy/entropy"] = float(masked_mean(scores.entropy, mb.response_mask))
        metrics["optim/grad_norm"] = grad_norm
        metrics["optim/lr"] = self.scheduler.get_last_lr()[0]
        if scores.aux_loss is not None:
            metrics["moe/aux_loss"] = float(scores.aux_loss.detach())
        if self.track_routing:
            own = scores.routes.to("cpu")  # under replay: the router's own top-k, beside the replayed experts
            if on_policy:
                mb.old_trace = own
            drift = routing_drift(mb.old_trace, own, mb.token_mask)
            metrics.update(drift.metrics)
        if finite_loss and math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()  # the schedule counts applied updates
            self.consecutive_skips = 0
        else:
            # A non-finite loss or gradient is never applied: one bad batch must not poison every parameter.
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= t.max_consecutive_skips:
                raise RuntimeError(
                    f"stopping at step {self.step_index}: {self.consecutive_skips} optimizer updates in a row had a "
                    f"non-finite loss or gradient (trainer.max_consecutive_skips={t.max_consecutive_skips}); "
                    "lower trainer.lr or check the objective's clip range"
                )
        clear_moe_bookkeeping(self.model)
        return metrics

    # -- one RL step -----------------------------------------------------------------------------------------------

    def step(self) -> dict[str, Any]:
        t = self.cfg.trainer
        self.step_index += 1
        start = time.perf_counter()
        rollout = self.rollout()
        rollout_s = time.perf_counter() - start
        advantages = group_advantages(rollout.rewards, t.group_size, scale_by_std=self.advantage_std)
        score_start = time.perf_counter()
        minibatches = self.score_old(rollout, advantages)
        score_s = time.perf_counter() - score_start
        train_start = time.perf_counter()
        per_minibatch = [self.update(mb, j) for j, mb in enumerate(minibatches)]
        train_s = time.perf_counter() - train_start
        step_s = time.perf_counter() - start
        self.tokens_seen += rollout.response_tokens
        lengths = rollout.response_mask.sum(-1).float()
        record: dict[str, Any] = {
            "train/step": self.step_index,
            "train/tokens": self.tokens_seen,
            "reward/mean": float(rollout.rewards.mean()),
            "reward/std": float(rollout.rewards.std()),
            "reward/accuracy": float(rollout.correct.float().mean()),
            "reward/zero_std_group_frac": zero_std_group_frac(rollout.rewards, t.group_size),
            "response/length_mean": float(lengths.mean()),
            "response/truncated_frac": float(rollout.truncated.float().mean()),
        }
        keys = [key for key in per_minibatch[0] if key != "minibatch"]
        for key in keys:
            record[key] = _mean([m[key] for m in per_minibatch if key in m and m[key] is not None])
        if self.track_routing:
            old = [mb.old_trace for mb in minibatches]
            masks = [mb.token_mask for mb in minibatches]
            record["moe/load_max_violation"] = _mean([load_max_violation(tr, m) for tr, m in zip(old, masks)])
        record["optim/skipped_steps"] = self.skipped_updates
        record["perf/step_s"] = step_s
        record["perf/rollout_s"] = rollout_s
        record["perf/score_s"] = score_s
        record["perf/train_s"] = train_s
        record["perf/rollout_tokens_per_s"] = rollout.response_tokens / max(rollout_s, 1e-9)
        record["minibatches"] = per_minibatch
        return record

    def evaluate(self) -> dict[str, float]:
        t = self.cfg.trainer
        return evaluate(
            self.model,
            self.tokenizer,
            self.task,
            self.test_examples[: t.eval_prompts],
            samples=t.eval_samples,
            max_new_tokens=t.max_new_tokens,
            temperature=t.temperature,
        )


def run_name(cfg: DictConfig) -> str:
    replay = "" if cfg.routing.replay == "none" else f"+{cfg.routing.replay}"
    return f"{cfg.algo.name}{replay}-{cfg.model.name}-s{cfg.seed}"


def _sweep_group() -> str | None:
    """Runs of one Hydra multirun share a W&B group: the sweep directory's name."""
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:
        return None
    if hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN":
        return Path(hydra_cfg.sweep.dir).name
    return None


def summary_paragraph(summary: dict[str, Any]) -> str:
    return (
        f"{summary['run']}: {summary['steps']} steps in {summary['wall_s']:.0f} s "
        f"({summary['step_s_mean']:.2f} s/step). Reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} "
        f"(best {summary['reward_best']:.3f}); held-out pass@1 {summary.get('eval_accuracy', float('nan')):.3f}, "
        f"greedy {summary.get('eval_greedy_accuracy', float('nan')):.3f}. Mean clipped-token fraction "
        f"{summary['clip_token_frac_mean']:.2e}, token-ratio variance {summary['ratio_token_var_mean']:.2e}, "
        f"expert change per update {summary.get('expert_change_frac_mean', float('nan')):.2%}; "
        f"{summary['skipped_steps']} skipped updates. Logs: {summary['run_dir']}"
    )


def train(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Run the configured RL job in `run_dir`; return its summary (also written to `summary.json`)."""
    try:
        trainer = RLTrainer(cfg)
    except (ValueError, FileNotFoundError) as error:
        # Bad input found at start-up: one line that names it, not a stack trace.
        raise SystemExit(f"moe-rl-lab: {error}") from None
    t = cfg.trainer
    name = run_name(cfg)
    tags = [f"algo:{cfg.algo.name}", f"replay:{cfg.routing.replay}", f"model:{cfg.model.name}"]
    logger = RunLogger(run_dir, cfg, name, tags, _sweep_group())
    policy = describe_policy(trainer.model)
    history: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        bar = tqdm(range(t.steps), desc=name, unit="step", dynamic_ncols=True)
        for _ in bar:
            record = trainer.step()
            last = trainer.step_index == t.steps
            if last or (t.eval_every and trainer.step_index % t.eval_every == 0):
                record.update(trainer.evaluate())
            record["perf/elapsed_s"] = time.perf_counter() - start
            logger.log(record)
            history.append(record)
            bar.set_postfix(reward=f"{record['reward/mean']:.3f}", clip=f"{record['clip/token_frac']:.1e}")
    except BaseException:
        logger.abort()
        raise
    rewards = [r["reward/mean"] for r in history]
    final = history[-1]
    summary = {
        "status": "finished",
        "run": name,
        "run_dir": str(run_dir),
        "steps": len(history),
        "wall_s": time.perf_counter() - start,
        "step_s_mean": _mean([r["perf/step_s"] for r in history]),
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_best": max(rewards),
        "eval_accuracy": final.get("eval/accuracy"),
        "eval_greedy_accuracy": final.get("eval/greedy_accuracy"),
        "clip_token_frac_mean": _mean([r["clip/token_frac"] for r in history]),
        "ratio_token_var_mean": _mean([r["ratio/token_var"] for r in history]),
        "skipped_steps": trainer.skipped_updates,
        "old_logprobs": trainer.old_logprobs,
        "minibatch_layout": trainer.minibatch_layout,
        "policy": policy,
    }
    if trainer.track_routing:
        summary["expert_change_frac_mean"] = _mean([r["routing/expert_change_frac"] for r in history])
    if t.save_checkpoint:
        checkpoint = Path(run_dir) / "checkpoint"
        trainer.model.save_pretrained(checkpoint)
        trainer.tokenizer.save_pretrained(checkpoint)
        summary["checkpoint"] = str(checkpoint)
    logger.finish(summary)
    print(summary_paragraph(summary))
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float:
    run_dir = HydraConfig.get().runtime.output_dir
    summary = train(cfg, run_dir)
    return summary["reward_last"]


if __name__ == "__main__":
    main()
