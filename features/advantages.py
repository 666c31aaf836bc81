"""Group-relative advantages, GRPO's replacement for a value model: each answer's reward against its group's.

Here, not in grpo_ref_split.py, because ref_server.py needs them too (REGROUP makes new groups, a
REWARD_MODEL changes rewards) and the server never imports the trainer. docs/loss.md: when to use each scale.
    python -c "import torch; from features.advantages import group_advantages as a; print(a(torch.tensor([1., 0.]), 2))"
"""
import torch

STD_EPS = 1e-4  # keeps a group of near-equal rewards from blowing up its advantages
SCALES = ("group", "batch", "none")  # SCALE_REWARDS: what r - group mean is divided by


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", batch_std=None) -> torch.Tensor:
    """(N,) advantages r - its group's mean, divided by (+ STD_EPS): "group" its group's std (GRPO), "batch" the std
    of all N rewards (or batch_std, when a regrouped group needs its rollout's), "none" nothing (Dr. GRPO). Stds are
    unbiased."""
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} (need >= 2)")
    if scale not in SCALES:
        raise ValueError(f"SCALE_REWARDS = {scale!r}: one of {', '.join(SCALES)}")
    if rewards.numel() == 0:  # no groups: no advantages (and no std of nothing to warn about)
        return rewards.float()
    r = rewards.float().view(-1, group_size)  # (Q, G)
    centred = r - r.mean(1, keepdim=True)  # (Q, G)
    if scale == "none":
        return centred.view(-1)  # (N,)
    std = r.std(1, keepdim=True) if scale == "group" else torch.tensor(batch_std if batch_std is not None
                                                                       else r.std().item())  # (Q, 1) or ()
    return (centred / (std + STD_EPS)).view(-1)  # (N,)
