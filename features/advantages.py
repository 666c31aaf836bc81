"""Group-relative advantages, GRPO's replacement for a value model: each answer's reward against its
group's.

Here, not in grpo_ref_split.py, because ref_server.py needs them too (REGROUP makes new groups, a
REWARD_MODEL changes rewards) and the server never imports the trainer. docs/loss.md: when to use
each scale.

    python -m pytest tests/test_grpo_math.py -k advantages    # each scale against its definition
"""
import torch

STD_EPS = 1e-4  # keeps a group of near-equal rewards from blowing up its advantages
SCALES = ("group", "batch", "none")  # SCALE_REWARDS: what r - group mean is divided by


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", batch_std=None
) -> torch.Tensor:
    """(N,) advantages r - its group's mean, divided by (+ STD_EPS): "group" its group's std (GRPO),
    "batch" batch_std, the std of the step's rewards over all ranks (step_std), "none" nothing (Dr.
    GRPO). Stds are unbiased."""
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size} (need >= 2)"
        )
    if scale not in SCALES:
        raise ValueError(f"SCALE_REWARDS = {scale!r}: one of {', '.join(SCALES)}")
    if scale == "batch" and batch_std is None:
        raise ValueError(
            'SCALE_REWARDS = "batch" needs batch_std, the std of the step\'s rewards on all ranks: '
            "only the trainer knows it (step_std); before that, centre with upload_scale()"
        )
    if rewards.numel() == 0:  # no groups: no advantages (and no std of nothing to warn about)
        return rewards.float()
    r = rewards.float().view(-1, group_size)  # (Q, G)
    centred = r - r.mean(1, keepdim=True)  # (Q, G)
    if scale == "none":
        return centred.view(-1)  # (N,)
    # (Q, 1) or ()
    std = r.std(1, keepdim=True) if scale == "group" else torch.tensor(float(batch_std))
    return (centred / (std + STD_EPS)).view(-1)  # (N,)


def upload_scale(scale: str) -> str:
    """The scaling a group's advantages get before the trainer holds the step's groups: "batch" only
    centres ("none"), since the std of the step's rewards over all ranks is not known yet to the
    rollout or to the server (a regrouped group or a reward model's scores would otherwise be
    divided by another batch's std)."""
    return "none" if scale == "batch" else scale


def step_std(rewards: torch.Tensor, device) -> float:
    """The unbiased std of the rewards every rank holds for this step: an all-reduce of their count,
    sum and sum of squares. Every rank must call it once per step. rewards (N,) this rank's."""
    r = rewards.double().to(device)  # (N,)
    stats = torch.stack(
        [torch.tensor(float(r.numel()), dtype=torch.float64, device=device), r.sum(), (r * r).sum()]
    )  # (3,) count, sum, sum of squares
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(stats)
    count, total, squares = stats.tolist()
    if count < 2:
        return 0.0
    variance = (squares - total * total / count) / (count - 1)
    return max(variance, 0.0) ** 0.5  # rounding can take a zero variance a hair below 0


def scale_to_step(groups, dropped_rewards: torch.Tensor, device) -> list:
    """SCALE_REWARDS = "batch": every group the step trains on, its advantages redone from its
    rewards (as they came back: a reward model's scores included) over the std of all the step's
    rewards on all ranks, the trained groups' and the groups this rank dropped for equal rewards (as
    TRL's std over every generated reward). groups: (tensors, meta) pairs; dropped_rewards (D,)."""
    trained = [tensors["rewards"].float() for tensors, _ in groups]  # (G,) each
    std = step_std(torch.cat([*trained, dropped_rewards.float()]), device)
    return [
        (
            {
                **tensors,
                "advantages": group_advantages(
                    tensors["rewards"], len(tensors["rewards"]), "batch", std
                ),
            },
            meta,
        )
        for tensors, meta in groups
    ]


def whiten_to_step(groups, n_dropped: int, device) -> list:
    """ADVANTAGE "reinforce_pp" and REWARD_NORM "normalize_then_sum": every group the step trains
    on, its advantages divided by their std over all the step's answers on all ranks: the trained
    groups' and the n_dropped answers of groups dropped for equal rewards (their advantages are 0).
    Each group's advantages sum to 0, so their mean over the step is 0 and this is the whitening
    REINFORCE++ and GDPO apply, per answer (theirs weighs each answer by its tokens). groups:
    (tensors, meta) pairs."""
    trained = [tensors["advantages"].float() for tensors, _ in groups]  # (G,) each
    std = step_std(torch.cat([*trained, torch.zeros(n_dropped)]), device)
    return [({**tensors, "advantages": tensors["advantages"] / (std + STD_EPS)}, meta)
            for tensors, meta in groups]
