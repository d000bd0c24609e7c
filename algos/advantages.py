"""Group-relative advantages (GRPO's Â_i = (r_i − mean_G r) / std_G r, Dr. GRPO's without the std) and what the
step logs of the groups' rewards: the share whose rewards are all equal (zero advantage) and their spread.
"""

from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages `[N]` of rewards `[N]` laid out in contiguous groups of `group_size` (N = prompts · G)."""
    groups = _grouped(rewards, group_size)
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps a zero-std group at 0 instead of 0/0), got {eps}")
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (groups.std(dim=1, unbiased=True, keepdim=True) + eps)
    return centred.reshape(-1)


def zero_std_group_frac(rewards: Tensor, group_size: int) -> float:
    """Share of groups whose `group_size` rewards are all equal (no learning signal), rewards `[N]`."""
    groups = _grouped(rewards, group_size)
    constant = groups.amax(dim=1) == groups.amin(dim=1)
    return constant.float().mean().item()


def within_group_std(rewards: Tensor, group_size: int) -> float:
    """The reward's spread within a group (the std the advantage divides by, unbiased), averaged over the groups of
    rewards `[N]`: how much a group has to tell apart, where the overall std also counts easy against hard prompts."""
    return _grouped(rewards, group_size).std(dim=1, unbiased=True).mean().item()


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Rewards `[N]` as `[N / group_size, group_size]` in fp32, after checking the layout."""
    if not isinstance(rewards, Tensor) or rewards.dim() != 1 or rewards.numel() == 0:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a non-empty 1-D tensor [N], got {shape}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size must be an int >= 2 (a group-relative baseline needs 2 samples), got {group_size!r}"
        )
    if rewards.numel() % group_size:
        raise ValueError(f"the number of rewards N = {rewards.numel()} is not divisible by group_size = {group_size}")
    return rewards.detach().float().reshape(-1, group_size)
