"""Group-relative advantages (GRPO, DeepSeekMath arXiv 2402.03300; GSPO eq. 6) and a group-health statistic.

Rewards come group-contiguous: prompt j's G completions sit at positions j·G .. j·G + G − 1.

    Â_i = (R_i − mean_group R) / (std_group R + eps)      (scale_by_std=True, GRPO / GSPO / DAPO)
    Â_i =  R_i − mean_group R                             (scale_by_std=False, Dr. GRPO arXiv 2503.20783)

std is Bessel-corrected (unbiased), as verl's `torch.std`, with eps = 1e-6. A group whose rewards are all equal
gets zero advantages either way: it carries no learning signal (DAPO's dynamic sampling drops such groups;
`zero_std_group_frac` measures how many there are).
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
        raise ValueError(
            f"the number of rewards N = {rewards.numel()} is not divisible by group_size = {group_size}"
        )
    return rewards.detach().float().reshape(-1, group_size)
