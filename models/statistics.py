"""Weighted statistics of token values: the lower weighted median, and its cluster bootstrap over sequences. On the
lowest floor because the routing margins (`models.routing.measures`) and a cold start's routing profile
(`experiments.sft`) take them; the statistics over runs and seeds are `analysis.statistics`'."""

from __future__ import annotations

import torch


def weighted_median(values: torch.Tensor, weights: torch.Tensor) -> float:
    """The lower weighted median of `values [N]` under `weights [N]` (>= 0): the smallest value whose cumulative
    weight reaches half the total (padding has weight 0; a packed prompt token counts once per row it stands for)."""
    order = values.argsort()
    cumulative = weights.float()[order].cumsum(0)
    position = int(torch.searchsorted(cumulative, cumulative[-1] / 2))
    return float(values[order][min(position, len(values) - 1)])


RESAMPLED_VALUES = 20_000_000  # values one step of `median_interval` holds (80 MB in fp32)


def median_interval(
    values: torch.Tensor,
    weights: torch.Tensor,
    groups: torch.Tensor,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """The percentile bootstrap interval at `level` of `weighted_median(values, weights)` (`values`, `weights`,
    `groups [N]`), resampling whole groups with replacement: the tokens of one sequence, and its layers, are not
    independent draws, so a sequence is the unit a held-out set samples (a cluster bootstrap). Its own seeded stream:
    the same data give the same interval. Groups are 0..G−1; padding has weight 0. Computed on the CPU."""
    if not 0 < level < 1:
        raise ValueError(f"level={level} must lie in (0, 1)")
    values, weights, groups = values.detach().cpu(), weights.detach().cpu().float(), groups.cpu().long()
    order = values.argsort()
    values, weights, groups = values[order], weights[order], groups[order]
    n_groups = int(groups.max()) + 1
    generator = torch.Generator().manual_seed(seed)
    chunk = max(1, min(100, RESAMPLED_VALUES // len(values)))  # resamples at a time: [chunk, N] weights in memory
    medians = []
    for start in range(0, resamples, chunk):
        draws = torch.randint(n_groups, (min(chunk, resamples - start), n_groups), generator=generator)
        counts = torch.zeros(len(draws), n_groups).scatter_add_(1, draws, torch.ones(draws.shape))
        cumulative = (counts[:, groups] * weights).cumsum(1)
        position = torch.searchsorted(cumulative, cumulative[:, -1:] / 2).squeeze(1)
        medians.append(values[position.clamp(max=len(values) - 1)])
    low, high = torch.quantile(
        torch.cat(medians).double(), torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.double)
    ).tolist()
    return low, high
