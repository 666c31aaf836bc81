"""GRPO + OPD with the teacher first (TEACHER_FIRST_KL, docs/distillation.md): with a teacher
(DISTILL_COEF) and rewards, every step trains on the teacher's term alone, the rewards' advantages
set to 0, until a step's teacher_kl (the ranks' mean) is TEACHER_FIRST_KL or less; from the next
step on, for the rest of the run, the rewards join. Pure distillation reaches the teacher's level
in fewer answers than GRPO does, and the rewards can then keep teaching past a teacher no better
than the student's own GRPO would become. The trainer holds the state (rewards_joined in main's
loop) and applies it in train_step; this module holds the setting and its check.

    TEACHER_FIRST_KL=0.05 DISTILL_COEF=1 BETA=0 deepspeed grpo_ref_split.py  # a TEACHER=1 server
"""
import math
import sys

from features import env_overrides

TEACHER_FIRST_KL = 0.0  # > 0 = rewards wait until a step's teacher_kl <= this (nats a token)
env_overrides.apply_env_overrides(globals(), "features/teacher_first.py")


def check_settings(*, distill_coef, rewards):
    """Stop, before any model loads, on a schedule with nothing to schedule: no teacher to start
    with, or no reward weighed above 0 to join. rewards: the trainer's (function, weight) pairs."""
    if not math.isfinite(TEACHER_FIRST_KL) or TEACHER_FIRST_KL < 0:
        sys.exit(f"TEACHER_FIRST_KL = {TEACHER_FIRST_KL}: a teacher_kl in nats a token (0.05 is "
                 "where the demo's pure distillation had come most of the way), or 0 = off")
    if TEACHER_FIRST_KL and (distill_coef <= 0 or all(weight == 0 for _, weight in rewards)):
        sys.exit(f"TEACHER_FIRST_KL = {TEACHER_FIRST_KL} trains on the teacher alone until its KL "
                 "is that low, then the rewards join: it needs DISTILL_COEF > 0 (a TEACHER=1 "
                 "server) and a REWARDS weight above 0")
