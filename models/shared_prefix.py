"""The packed layout of groups of completions that share a prompt: one sequence per group, the prompt once.

A group's G rows agree on their first S0 positions (the prompt but its last token) and differ after them. Fed row by
row, every token-wise operation (norms, projections, routers, experts) computes those S0 positions G times. Packed,
one sequence per group carries them once, followed by each completion's T positions:

    rows   [n, S0 + T]:  (prefix | tail_1), (prefix | tail_2), ..., (prefix | tail_G)     n = g·G
    packed [g, S0 + G·T]: prefix | tail_1 | tail_2 | ... | tail_G

Only attention sees the structure (`models.grouped_attention.packed_attention` reads this layout's masks): prefix
positions attend causally among themselves, and each tail attends the prefix and causally its own positions, never
another tail, exactly the attention of its own row. The scoring that packs a batch builds the layout
(`experiments.step.scoring`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedPrefix:
    """The packed layout of `groups` groups of `group` rows: `prefix` shared positions, `tail` positions per row.

    `prefix_mask [g, 1, S0, S0]` and `tail_mask [n, 1, T, S0+T]` are additive float masks (0 or the dtype's min,
    as eager attention's), built from the rows' attention mask: padding keys are never attended.
    `token_weights [g, S0+G·T]`: how many rows each packed position stands for (G on the prefix, 1 on a tail),
    0 on padding.
    """

    prefix: int
    tail: int
    group: int
    prefix_mask: torch.Tensor
    tail_mask: torch.Tensor
    token_weights: torch.Tensor

    @property
    def groups(self) -> int:
        return self.prefix_mask.shape[0]

    @property
    def length(self) -> int:
        """Positions of one packed sequence."""
        return self.prefix + self.group * self.tail

    @classmethod
    def from_rows(cls, attention_mask: torch.Tensor, prefix: int, group: int, dtype: torch.dtype) -> SharedPrefix:
        """The layout of rows with `attention_mask [n, S0+T]` (1 = token), groups of `group` consecutive rows."""
        n, width = attention_mask.shape
        if group < 2 or n % group:
            raise ValueError(f"shared prefix: {n} rows do not split into groups of {group} (need group >= 2)")
        if not 0 < prefix < width:
            raise ValueError(f"shared prefix of {prefix} positions does not fit rows of {width} positions")
        valid = attention_mask.bool()
        head = valid[::group, :prefix]  # [g, S0]
        if not torch.equal(valid[:, :prefix], head.repeat_interleave(group, dim=0)):
            raise ValueError("shared prefix: rows of one group differ in their prompt's padding")
        tail = width - prefix
        lowest = torch.finfo(dtype).min
        causal = torch.ones(width, width, dtype=torch.bool, device=valid.device).tril()
        prefix_allowed = causal[:prefix, :prefix] & head[:, None, :]  # [g, S0, S0]
        tail_allowed = causal[prefix:, :] & valid[:, None, :]  # [n, T, S0+T]
        tail_valid = valid[:, prefix:].reshape(head.shape[0], group * tail)
        return cls(
            prefix=prefix,
            tail=tail,
            group=group,
            prefix_mask=_additive(prefix_allowed, dtype, lowest),
            tail_mask=_additive(tail_allowed, dtype, lowest),
            token_weights=torch.cat([head.float() * group, tail_valid.float()], dim=1),
        )

    def pack(self, rows: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """`[..., n, S0+T, ...]` (rows at `dim`, positions at `dim + 1`) -> `[..., g, S0+G·T, ...]`.

        The prefix is taken from each group's first row; `prefix_agrees` says whether the others match it.
        """
        head = rows.narrow(dim + 1, 0, self.prefix).unflatten(dim, (self.groups, self.group)).select(dim + 1, 0)
        tails = rows.narrow(dim + 1, self.prefix, self.tail)
        tails = tails.unflatten(dim, (self.groups, self.group)).flatten(dim + 1, dim + 2)  # [.., g, G·T, ..]
        return torch.cat([head, tails], dim=dim + 1)

    def unpack(self, packed: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """`[..., g, S0+G·T, ...]` -> `[..., n, S0+T, ...]`: every row gets its group's prefix."""
        head = packed.narrow(dim + 1, 0, self.prefix).repeat_interleave(self.group, dim=dim)
        tails = packed.narrow(dim + 1, self.prefix, self.group * self.tail)
        tails = tails.unflatten(dim + 1, (self.group, self.tail)).flatten(dim, dim + 1)  # [.., n, T, ..]
        return torch.cat([head, tails], dim=dim + 1)

    def prefix_agrees(self, rows: torch.Tensor, dim: int = 0) -> bool:
        """Whether every row of a group carries the same first S0 positions (so that `pack` loses nothing)."""
        head = rows.narrow(dim + 1, 0, self.prefix)
        first = head.unflatten(dim, (self.groups, self.group)).narrow(dim + 1, 0, 1)
        return bool((head.unflatten(dim, (self.groups, self.group)) == first).all())

    def tails(self, packed: torch.Tensor) -> torch.Tensor:
        """`[g, G·T, ...]` outputs of the tail positions -> `[n, T, ...]`."""
        return packed.reshape(self.groups * self.group, self.tail, *packed.shape[2:])


def _additive(allowed: torch.Tensor, dtype: torch.dtype, lowest: float) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, lowest).unsqueeze(1)
