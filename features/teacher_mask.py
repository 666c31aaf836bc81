"""GRPO + OPD with the teacher's term on the wrong answers only (DISTILL_BELOW,
docs/distillation.md): an answer whose summed reward is DISTILL_BELOW or more trains on the
rewards' advantage alone; the others take the teacher's per-token term beside it. This is KDRL's
reward-guided mask (arXiv 2506.02208). A correct answer already has the rewards' push; the reverse
KL towards a confident teacher would only narrow its distribution further, and with every answer
in a group alike the group loses its reward signal too. The teacher's word then goes where the
rewards say the student is wrong. The trainer reads the mask in policy_loss (distill_advantages'
answers, the top-k term's rows); this module holds the setting, its check and the mask.

    DISTILL_BELOW=2 DISTILL_COEF=1 BETA=0 deepspeed grpo_ref_split.py  # a TEACHER=1 server
"""
import math
import sys

import torch

from features import env_overrides

DISTILL_BELOW = 0.0  # > 0 = the teacher's term only on answers rewarded under this; 0 = all
env_overrides.apply_env_overrides(globals(), "features/teacher_mask.py")


def check_settings(*, distill_coef, rewards):
    """Stop, before any model loads, on a mask with nothing to read: no teacher, or no reward
    weighed above 0 (every answer's reward would be 0). rewards: the trainer's (function, weight)
    pairs."""
    if not math.isfinite(DISTILL_BELOW) or DISTILL_BELOW < 0:
        sys.exit(f"DISTILL_BELOW = {DISTILL_BELOW}: a summed reward (2 = the demo's correct "
                 "answers), or 0 = the teacher's term on every answer")
    if DISTILL_BELOW and (distill_coef <= 0 or all(weight == 0 for _, weight in rewards)):
        sys.exit(f"DISTILL_BELOW = {DISTILL_BELOW} keeps the teacher's term to answers rewarded "
                 "under it: it needs DISTILL_COEF > 0 (a TEACHER=1 server) and a REWARDS weight "
                 "above 0 (pure distillation has no reward to read)")


def answers(rewards: torch.Tensor) -> torch.Tensor | None:
    """(B,) bool, the answers that take the teacher's term: those whose summed reward (B,) is
    under DISTILL_BELOW; None = every answer (DISTILL_BELOW 0)."""
    if not DISTILL_BELOW:
        return None
    return rewards < DISTILL_BELOW  # (B,)
