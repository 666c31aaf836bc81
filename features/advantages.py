"""Group-relative advantages, GRPO's replacement for a value model: each answer's reward against its group's.

Here, not in grpo_ref_split.py, because ref_server.py needs them too (REGROUP makes new groups, a
REWARD_MODEL changes rewards) and the server never imports the trainer.
    python -c "import torch; from features.advantages import group_advantages as a; print(a(torch.tensor([1., 0.]), 2))"
"""
import torch

STD_EPS = 1e-4  # keeps a group of near-equal rewards from blowing up its advantages


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) advantages (r - mean) / (std + STD_EPS) within consecutive groups of `group_size` (unbiased std)."""
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} (need >= 2)")
    if rewards.numel() == 0:  # no groups: no advantages (and no std of nothing to warn about)
        return rewards.float()
    r = rewards.float().view(-1, group_size)  # (Q, G)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + STD_EPS)  # (Q, G)
    return adv.view(-1)  # (N,)
