"""What an RL step measures: the name of every metric it logs, once, and the maths of those the step computes itself.

Names are constants: the producers (the step, `scoring`) and the readers (`analysis/`, the probe, the benchmarks,
the tests) import them from here. The objectives' shared metrics (`ratio/*`, `clip/*`, `kl/*`, `loss/policy`) are
named in `algos.objective`; a correction's, a routing variant's and MiniRL's in their own modules.
Namespaces in `metrics.jsonl` and W&B: `train/*`, `reward/*`, `response/*`, `eval/*` (and `eval_start/*` for the
starting policy), `ratio/*`, `clip/*`, `kl/*`, `loss/*`, `policy/*`, `optim/*`, `routing/*`, `mismatch/*`,
`decompose/*`, `moe/*`, `perf/*`, `async/*`. Per-minibatch values sit under `minibatches` (index = updates since θ_old).
"""

from __future__ import annotations

import math

import torch

from algos.aggregation import masked, masked_mean, sequence_mean
from algos.objective import SEQ_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND
from models.routing.measures import GateShift, RoutingDrift, routing_drift
from models.routing.trace import RoutingTrace

# The step record
STEP = "train/step"
TOKENS = "train/tokens"  # completion tokens so far
REWARD = "reward/mean"
REWARD_STD = "reward/std"
REWARD_ACCURACY = "reward/accuracy"  # share of the step's completions with full reward
ZERO_STD_GROUPS = "reward/zero_std_group_frac"  # groups whose rewards are all equal: no learning signal
WITHIN_GROUP_STD = "reward/within_group_std"  # the reward's spread within a group, averaged over the step's groups
LENGTH = "response/length_mean"
TRUNCATED = "response/truncated_frac"  # completions without eos within the budget
SKIPPED = "optim/skipped_steps"  # updates refused so far for a non-finite loss or gradient
STEP_TIME = "perf/step_s"
ROLLOUT_TIME = "perf/rollout_s"  # the step's time to get its rollouts: sampling them, or waiting for the worker's
SCORE_TIME = "perf/score_s"  # π_old of every minibatch
TRAIN_TIME = "perf/train_s"
ROLLOUT_TOKENS_PER_S = "perf/rollout_tokens_per_s"
THREADS = "perf/threads"  # torch threads the step ran with (`experiments.run.threads`)
ELAPSED = "perf/elapsed_s"  # since the run's first step
# Under rollout.source=lagged or concurrent: the weight version the step's rollouts were sampled with (the oldest of
# their samples')
ENGINE_VERSION = "async/engine_version"
LAG = "async/lag"  # lagged: how many versions that is behind θ_old (rollout.lag once the run is that far)
# Under rollout.source=concurrent (`experiments.step.sources.concurrent`): each sample's staleness, θ_old's version
# minus the version that sampled it, mean and max over the step's samples (above rollout.max_staleness only under
# rollout.overflow=count); the seconds the worker waited for its policy's gate before sampling the step's batches
# (under wait: at the bound), and sampling the one trained; the batches dropped past the bound before it (drop), and
# its rows trained past the bound (count).
STALENESS_MEAN = "async/staleness_mean"
STALENESS_MAX = "async/staleness_max"
SAMPLER_WAIT_TIME = "async/sampler_wait_s"
SAMPLE_TIME = "async/sample_s"
DROPPED_BATCHES = "async/dropped_batches"
PAST_BOUND_ROWS = "async/past_bound_rows"
MINIBATCHES = "minibatches"  # the list of per-minibatch records
MINIBATCH = "minibatch"  # the index of one: updates since θ_old
# Held-out evaluation (`experiments.step.batch.evaluate`)
EVAL = "eval/"
EVAL_ACCURACY = EVAL + "accuracy"  # mean pass@1 over `eval_samples` samples per prompt
EVAL_GREEDY = EVAL + "greedy_accuracy"
# With `eval_samples` >= PASS_K: the unbiased pass@PASS_K over the same samples (the headroom RL can sharpen pass@1
# towards), and the share of prompts whose samples are all right or all wrong (a group of `eval_samples` on them
# has no advantage to learn from).
PASS_K = 8
EVAL_PASS_AT_K = EVAL + f"pass_at_{PASS_K}"
EVAL_ALL_SAME = EVAL + "all_same_frac"
# With `trainer.eval_train`: greedy accuracy on the first `eval_prompts` prompts of the train split, beside the held-out
# one (a policy that learns its training prompts and not the task overfits).
EVAL_TRAIN_GREEDY = "eval_train/greedy_accuracy"
# The whole test split, greedy, at the start and at the last step: the endpoint with the least noise (500 prompts)
EVAL_SPLIT = "eval_split/"
EVAL_SPLIT_GREEDY = EVAL_SPLIT + "greedy_accuracy"
START = "_start/"  # step 1's record holds the starting policy's evaluations as eval_start/..., eval_split_start/...
# Per minibatch
ENTROPY = "policy/entropy"
GRAD_NORM = "optim/grad_norm"
# With `trainer.measure_learning`: how far the policy moves, per update and from the start
UPDATE_RATIO = "optim/update_ratio"  # ||θ after − θ before|| / ||θ before|| of one optimizer update
KL_TO_START = "policy/kl_to_start"  # k3 estimate of KL(π_θ ‖ π_start) on the minibatch's response tokens
LR = "optim/lr"
AUX_LOSS = "moe/aux_loss"  # the global-batch load-balancing loss (added to the loss only by routers=[aux_loss])
LOAD_MAX_VIOLATION = "moe/load_max_violation"
FLIP_FRAC = "routing/synthetic_flip_frac"  # experts swapped by the SYNTHETIC flips (routing.flip_rate)
# experts the SYNTHETIC router noise moved after the update, on its tokens, mean over layers (routing.perturb_rate)
PERTURB_FRAC = "routing/synthetic_perturb_frac"
# Routing drift since θ_old: per minibatch, then per step after one update (the GSPO paper's statistic) and the mean
# over minibatches (minibatch 0 is 0 by construction)
DRIFT = "routing/expert_change_frac"
TOKEN_DRIFT = "routing/token_any_change_frac"
DRIFT_PER_UPDATE = "routing/expert_change_per_update"
TOKEN_DRIFT_PER_UPDATE = "routing/token_any_change_per_update"
DRIFT_OVER_MINIBATCHES = "routing/expert_change_mean_over_minibatches"
# Drift by the gate mass it moves (`models.routing.measures.gate_shift`): the total-variation distance between a
# token's gate weights under θ_old and θ, mean over tokens and layers (per layer too); per minibatch, then after one
# update. Logged where both routings carry their gates (an engine that reports none, under bypass: absent).
GATE_DRIFT = "routing/gate_tv"
GATE_DRIFT_PER_UPDATE = "routing/gate_tv_per_update"
# How decisive the routers are (`experiments.step.scoring.router_fragility`), on the family's selection scores
TOPK_MASS = "routing/topk_mass"
MARGIN = "routing/margin"
FRAGILE = "routing/fragile_frac"
LOGIT_MARGIN = "routing/logit_margin"
# The scale-free margin (s[k−1] − s[k]) / (s[0] − s[2k−1]) of colibri issue #119
# (`models.routing.measures.topk_margin`), over tokens and layers: median and mean (the anchors:
# `models.routing.measures.MARGIN_ANCHORS`), share below 0.01
TOPK_MARGIN_MEDIAN = "routing/topk_margin_median"
TOPK_MARGIN_MEAN = "routing/topk_margin_mean"
TOPK_MARGIN_SMALL = "routing/topk_margin_small_frac"
# The engine against the trainer at θ_old: routing, then log-probs (ρ = π_old/μ_old)
ENGINE_EXPERTS = "mismatch/expert_frac"
ENGINE_TOKENS = "mismatch/token_any_expert_frac"
ENGINE_GATES = "mismatch/gate_tv"  # the gate mass the engine's routing moves against the trainer's at θ_old
MISMATCH_K1 = "mismatch/kl_k1"
MISMATCH_K3 = "mismatch/kl_k3"
CHI2_TOKEN = "mismatch/chi2_token"
CHI2_SEQ = "mismatch/chi2_seq"
ESS = "mismatch/ess"
LOG_PPL_GAP = "mismatch/log_ppl_gap"
MAX_ABS_LOGP_DIFF = "mismatch/max_abs_logp_diff"
EXTREME_TOKENS = "mismatch/extreme_token_frac"
IS_WEIGHT_MEAN = "mismatch/is_weight_mean"
IS_WEIGHT_MIN = "mismatch/is_weight_min"
IS_WEIGHT_MAX = "mismatch/is_weight_max"
# A cold start's own (`experiments.sft`; besides STEP, LR, ELAPSED and the evaluation)
SFT_LOSS = "sft/loss"  # the next-token loss on the demonstrations (in the pretraining phase: on every token)
SFT_PRETRAINING = "sft/pretraining"  # 1 in a step of the pretraining phase, 0 in the task's (with sft.pretrain_steps)
# The ratio decomposition (routing.decompose_every)
ROUTING_VAR = "decompose/routing_var"
WEIGHTS_VAR = "decompose/weights_var"
TOTAL_VAR = "decompose/total_var"
ROUTING_SHARE = "decompose/routing_share"


def per_layer(name: str, layer: int | str) -> str:
    """The name of a metric's value in one MoE layer (layer "": the prefix every layer's name starts with)."""
    return f"{name}/layer_{layer}"


def started(name: str) -> str:
    """The name an evaluation metric has for the starting policy: `eval/x` -> `eval_start/x`,
    `eval_split/x` -> `eval_split_start/x`."""
    prefix, rest = name.split("/", 1)
    return f"{prefix}{START}{rest}"


def unstarted(name: str) -> str | None:
    """The evaluation metric a starting policy's name stands for (`started`'s inverse), or None for other names."""
    prefix, slash, rest = name.partition("/")
    return f"{prefix.removesuffix(START[:-1])}/{rest}" if slash and prefix.endswith(START[:-1]) else None


def gain_area(steps: list[float], values: list[float]) -> float:
    """The area under a held-out curve above its start, per step: (1/(t_n − t_0)) ∫ (v(t) − v(t_0)) dt by the
    trapezoid rule over the evaluations (t_0 the start), i.e. the mean gain over the run. Every evaluation counts, so
    it is far less noisy than the last one alone, and a run that gains early and holds scores above one that only
    recovers by the end. NaN with fewer than two evaluations."""
    if len(steps) < 2:
        return float("nan")
    area = sum((b - a) * (u + v) / 2 for a, b, u, v in zip(steps, steps[1:], values, values[1:]))
    return area / (steps[-1] - steps[0]) - values[0]


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def drift_metrics(drift: RoutingDrift, experts: str = DRIFT, tokens: str = TOKEN_DRIFT) -> dict[str, float]:
    """A `routing_drift` under `experts` (and per layer) and `tokens`."""
    metrics = {experts: drift.expert_change_frac, tokens: drift.token_any_change_frac}
    metrics.update({per_layer(experts, i): v for i, v in enumerate(drift.per_layer.tolist())})
    return metrics


def gate_drift_metrics(shift: GateShift) -> dict[str, float]:
    """A `gate_shift` under `GATE_DRIFT` (and per layer)."""
    return {GATE_DRIFT: shift.mean, **{per_layer(GATE_DRIFT, i): v for i, v in enumerate(shift.per_layer.tolist())}}


def routing_mismatch(engine: RoutingTrace, trainer: RoutingTrace, mask: torch.Tensor) -> dict[str, float]:
    """The engine's experts against the trainer's at θ_old on the same tokens: the share of activated experts the
    engine chose that the trainer did not (per layer too), and the share of tokens routed differently in any layer
    (R3's router disagreement, train against inference)."""
    return drift_metrics(routing_drift(trainer, engine, mask), ENGINE_EXPERTS, ENGINE_TOKENS)


def gate_mismatch_metrics(shift: GateShift) -> dict[str, float]:
    """A `gate_shift` of the engine's routing against the trainer's at θ_old under `ENGINE_GATES` (and per layer): the
    share of a token's gate mass on experts the two do not share, or weigh differently (`routing_mismatch` counts the
    experts alone). Under `rollout.lag` it is how far the stale engine's routes are from θ_old's."""
    return {ENGINE_GATES: shift.mean, **{per_layer(ENGINE_GATES, i): v for i, v in enumerate(shift.per_layer.tolist())}}


@torch.no_grad()
def kl_k3(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 = mean(ρ − 1 − log ρ) over the valid tokens of `mask` (Schulman's estimator of KL(q ‖ p) from tokens
    sampled from q, ρ = p / q; nonnegative token by token): log ρ in fp32, padding zeroed before the exp and bounded
    at ±TOKEN_LOG_RATIO_BOUND."""
    log_rho = masked(log_rho.float(), mask.bool()).clamp(-TOKEN_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND)
    return masked_mean(torch.expm1(log_rho) - log_rho, mask.bool())


@torch.no_grad()
def mismatch_metrics(log_rho: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's at θ_old, on the valid tokens of `mask`.

    With ρ_t = π_old(y_t)/μ_old(y_t) and tokens sampled from μ_old (verl's `rollout_corr/*` definitions):
    `kl_k1` = mean(−log ρ) and `kl_k3` = mean(ρ − 1 − log ρ), estimates of KL(μ_old ‖ π_old) (k3 ≥ 0 per token);
    `chi2_token` = mean ρ² − 1; `chi2_seq` = mean over responses of (Π_t ρ_t)² − 1 (log-sum clamped at 10);
    `ess` = (mean ρ)² / mean ρ², the effective sample size of the weights ρ as a share in (0, 1];
    `log_ppl_gap` = mean over responses of (mean_t log μ_old − mean_t log π_old) = log PPL(π_old) − log PPL(μ_old);
    `max_abs_logp_diff` = max |log ρ|; `extreme_token_frac` = share of tokens with |log ρ| > ln 2 (a ratio beyond
    2 or below 1/2, R3's F(2)); `is_weight_mean/min/max` = of ρ.
    """
    mask = mask.bool()
    log_rho = masked(log_rho.float(), mask).clamp(-TOKEN_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND)
    rho = torch.exp(log_rho)
    lengths = mask.sum(dim=1)
    nonempty = lengths > 0
    seq_sum = log_rho.sum(dim=1)
    mean_rho = masked_mean(rho, mask)
    second = masked_mean(rho**2, mask)
    values = {
        MISMATCH_K1: masked_mean(-log_rho, mask),
        MISMATCH_K3: kl_k3(log_rho, mask),
        CHI2_TOKEN: second - 1,
        CHI2_SEQ: sequence_mean(torch.exp(2 * seq_sum.clamp(max=SEQ_LOG_RATIO_BOUND)), nonempty) - 1,
        ESS: mean_rho**2 / second.clamp(min=1e-30),
        LOG_PPL_GAP: sequence_mean(-seq_sum / lengths.clamp(min=1), nonempty),
        MAX_ABS_LOGP_DIFF: masked(log_rho.abs(), mask).max() if mask.any() else log_rho.new_zeros(()),
        EXTREME_TOKENS: masked_mean((log_rho.abs() > math.log(2)).float(), mask),
        IS_WEIGHT_MEAN: mean_rho,
        IS_WEIGHT_MIN: torch.where(mask, rho, torch.inf).min() if mask.any() else rho.new_ones(()),
        IS_WEIGHT_MAX: masked(rho, mask).max() if mask.any() else rho.new_ones(()),
    }
    return dict(zip(values, torch.stack(list(values.values())).tolist()))


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
        ROUTING_VAR: masked_mean((routing - mean["r"]) ** 2, mask),
        WEIGHTS_VAR: masked_mean((weights - mean["w"]) ** 2, mask),
        TOTAL_VAR: var_t,
        ROUTING_SHARE: cov_rt / var_t.clamp(min=1e-30),
    }
    return dict(zip(values, torch.stack(list(values.values())).tolist()))


AFTER_ONE_UPDATE = {DRIFT: DRIFT_PER_UPDATE, TOKEN_DRIFT: TOKEN_DRIFT_PER_UPDATE, GATE_DRIFT: GATE_DRIFT_PER_UPDATE}


def step_means(per_minibatch: list[dict[str, float]]) -> dict[str, float]:
    """Step-level values: the mean over the step's minibatches, except routing drift, whose minibatch 0 is 0 by
    construction: the drift after one update (minibatch 1) is logged under `AFTER_ONE_UPDATE`'s names (per layer
    too), and the mean over minibatches under a name that says so."""
    means = {}
    keys = dict.fromkeys(key for m in per_minibatch for key in m if key != MINIBATCH)
    for key in keys:
        values = [m[key] for m in per_minibatch if m.get(key) is not None]
        drift = next((name for name in AFTER_ONE_UPDATE if key.startswith(name)), None)
        if drift is None:
            means[key] = mean_of(values)
            continue
        if key == DRIFT:
            means[DRIFT_OVER_MINIBATCHES] = mean_of(values)
        if len(per_minibatch) > 1 and key in per_minibatch[1]:
            means[AFTER_ONE_UPDATE[drift] + key[len(drift) :]] = per_minibatch[1][key]
    return means
