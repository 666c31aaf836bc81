"""How GRPO + OPD mixes the teacher's term with the rewards (docs/distillation.md), three settings
beside DISTILL_COEF, each off by default:

- TEACHER_FIRST_KL, the teacher first: every step trains on the teacher's term alone, the rewards'
  advantages set to 0, until a step's teacher_kl (the ranks' mean) is TEACHER_FIRST_KL or less;
  from the next step on, for the rest of the run, the rewards join. Pure distillation reaches the
  teacher's level in fewer completions than GRPO does, and the rewards can then keep teaching past a
  teacher no better than the student's own GRPO would become. The trainer holds the state
  (Phases, which main's loop advances after each step and applies before step 6).
- DISTILL_BELOW, the teacher on the wrong completions only: a completion whose summed reward is
  DISTILL_BELOW or more trains on the rewards' advantage alone; the others take the teacher's
  per-token term beside it (KDRL's reward-guided mask, arXiv 2506.02208). A correct completion
  already has the rewards' push; the reverse KL towards a confident teacher would only narrow it
  further, and a group whose completions are all alike has no reward signal left. The trainer
  reads the mask in step 6 (objectives.py: distill_advantages' teacher_rows, the top-k term's
  rows).
- TEACHER_STEPS, distillation then RL: the first TEACHER_STEPS steps train on the teacher's term
  alone (the rewards' advantages 0), every later step on the rewards alone (the teacher's term
  0), the order of a distill-then-RL pipeline. Pure distillation comes most of the way to the
  teacher in a few steps and then stops rising; from the hand-off on the rewards alone decide.
  The hand-off also clears AdamW's moments, so that the rewards' stage starts as a run of its
  own would, not carried along by the moments the teacher's gradients built. After it, as in
  GRPO, groups whose rewards are all equal teach nothing and are dropped, so DYNAMIC_SAMPLING
  refills the step: a distilled student samples narrowly, and many of its groups are alike.
  The server still sends the teacher's log-probs after it, for the teacher_kl metric. The
  trainer's loop holds the Phases; they apply each step's Phase to its batches.

This module holds the three settings, their check, the mask, each step's phase and the hand-off.

    TEACHER_FIRST_KL=0.05 DISTILL_COEF=1 BETA=0 deepspeed grpo_ref_split.py  # a TEACHER=1 server
    DISTILL_BELOW=2 DISTILL_COEF=1 BETA=0 deepspeed grpo_ref_split.py
    TEACHER_STEPS=10 DISTILL_COEF=1 BETA=0 deepspeed grpo_ref_split.py
"""
import math
import sys
from dataclasses import dataclass, replace

import torch

from features import env_overrides

TEACHER_FIRST_KL = 0.0  # > 0 = rewards wait until a step's teacher_kl <= this (nats a token)
DISTILL_BELOW = 0.0  # > 0 = the teacher's term only on completions rewarded under this; 0 = all
TEACHER_STEPS = 0  # > 0 = the teacher alone for this many steps, then the rewards alone; 0 = off
env_overrides.apply_env_overrides(globals(), "features/teacher_mix.py")


def check_resumed(saved, folder: str) -> None:
    """Stop a resume whose TEACHER_STEPS is not the one the checkpoint in `folder` saved (saved:
    its settings, the trainer saves TEACHER_STEPS with every checkpoint; None: no checkpoint): the
    phase of every later step would change without a word. A checkpoint from before it was saved
    is accepted only with TEACHER_STEPS 0."""
    if saved is None:
        return
    then = saved.get("TEACHER_STEPS")
    if then is None and TEACHER_STEPS:
        sys.exit(f"RESUME from {folder} with TEACHER_STEPS = {TEACHER_STEPS}: the checkpoint does "
                 "not say its TEACHER_STEPS (saved before it was recorded); start a new run, or "
                 "resume with 0")
    if then is not None and then != TEACHER_STEPS:
        sys.exit(f"RESUME from {folder} with TEACHER_STEPS = {TEACHER_STEPS}, but the run was "
                 f"started with {then}: the phase of every later step would change; resume with "
                 f"{then}")


def check_settings(*, distill_coef, rewards, all_steps):
    """Stop, before any model loads, on a mix with nothing to mix: a value out of range, no
    teacher, or no reward weighed above 0 (every completion's reward would be 0). rewards: the
    trainer's (function, weight) pairs; all_steps: the run's last step."""
    if not math.isfinite(TEACHER_FIRST_KL) or TEACHER_FIRST_KL < 0:
        sys.exit(f"TEACHER_FIRST_KL = {TEACHER_FIRST_KL}: a teacher_kl in nats a token (0.05 is "
                 "where the demo's pure distillation had come most of the way), or 0 = off")
    if not math.isfinite(DISTILL_BELOW) or DISTILL_BELOW < 0:
        sys.exit(f"DISTILL_BELOW = {DISTILL_BELOW}: a summed reward (2 = the demo's correct "
                 "completions), or 0 = the teacher's term on every completion")
    if not isinstance(TEACHER_STEPS, int) or TEACHER_STEPS < 0:
        sys.exit(f"TEACHER_STEPS = {TEACHER_STEPS!r}: a whole number of steps the teacher trains "
                 "alone before the rewards take over, or 0 = off")
    if TEACHER_STEPS and TEACHER_STEPS >= all_steps:
        sys.exit(f"TEACHER_STEPS = {TEACHER_STEPS} with ALL_STEPS = {all_steps}: the rewards would "
                 "never train. That is pure distillation: REWARDS weighed 0 and TEACHER_STEPS 0")
    for name, value in (("TEACHER_FIRST_KL", TEACHER_FIRST_KL), ("DISTILL_BELOW", DISTILL_BELOW)):
        if TEACHER_STEPS and value:  # both rules shape steps that train the two terms together
            sys.exit(f"TEACHER_STEPS = {TEACHER_STEPS} with {name} = {value}: after the hand-off "
                     f"no step trains the teacher and the rewards together, so {name} has "
                     "nothing to act on. Set one of them to 0")
    no_rewards = all(weight == 0 for _, weight in rewards)
    mixes = (("TEACHER_FIRST_KL", TEACHER_FIRST_KL), ("DISTILL_BELOW", DISTILL_BELOW),
             ("TEACHER_STEPS", TEACHER_STEPS))
    for name, value in mixes:
        if value and (distill_coef <= 0 or no_rewards):
            sys.exit(f"{name} = {value} mixes a teacher's term with the rewards: it needs "
                     "DISTILL_COEF > 0 (a TEACHER=1 server) and a REWARDS weight above 0")


def teacher_rows(rewards: torch.Tensor, *, teacher_on=True) -> torch.Tensor | None:
    """(B,) bool, the completions that take the teacher's term: those whose summed reward (B,) is
    under DISTILL_BELOW, none once the teacher has left (teacher_on False); None = every
    completion."""
    if not teacher_on:
        return torch.zeros_like(rewards, dtype=torch.bool)  # (B,)
    if not DISTILL_BELOW:
        return None
    return rewards < DISTILL_BELOW  # (B,)


def teacher_trains(step: int) -> bool:
    """Whether step (1, 2, ...) trains on the teacher's term: all, or TEACHER_STEPS' first."""
    return not TEACHER_STEPS or step <= TEACHER_STEPS


def rewards_train(step: int) -> bool:
    """Whether step trains on the rewards as far as TEACHER_STEPS goes: after the teacher's steps
    (TEACHER_FIRST_KL's wait is the trainer's, from each step's teacher_kl)."""
    return step > TEACHER_STEPS


@dataclass(frozen=True)
class Phase:
    """Which terms one step trains on (the trainer's loop holds it; train_step applies it)."""
    step: int
    joined: bool  # the rewards may train: TEACHER_FIRST_KL's wait is over (or it is off)
    teacher: bool  # the teacher's term trains: every step, or TEACHER_STEPS' first
    rewards: bool  # the rewards' advantages train: joined, and past TEACHER_STEPS
    hand_off: bool  # the first step after TEACHER_STEPS: AdamW's state is cleared first


def phase(step: int, *, joined: bool) -> Phase:
    """Step's Phase. joined: False while TEACHER_FIRST_KL waits."""
    return Phase(step=step, joined=joined, teacher=teacher_trains(step),
                 rewards=joined and rewards_train(step),
                 hand_off=bool(TEACHER_STEPS) and step == TEACHER_STEPS + 1)


def next_phase(current: Phase, *, teacher_kl: float) -> Phase:
    """The next step's Phase, given this step's teacher_kl (the ranks' mean): the rewards join for
    good once it is TEACHER_FIRST_KL or less."""
    joined = current.joined or teacher_kl <= TEACHER_FIRST_KL
    return phase(current.step + 1, joined=joined)


class Phases:
    """The run's stages, one Phase a step: main's loop applies it to the step's batches before
    step 6 and advances it after the step is logged."""

    def __init__(self, first_step: int):
        self.now = phase(first_step, joined=not TEACHER_FIRST_KL)  # this step's Phase

    def apply(self, engine, batches, metrics) -> list:
        """The step's batches as its Phase trains them: the rewards' advantages 0 while the teacher
        trains alone, the teacher's term off after TEACHER_STEPS; at the hand-off AdamW's state is
        cleared first. metrics gets rewards_joined (1 once the rewards train)."""
        if self.now.hand_off:  # TEACHER_STEPS: the rewards' stage, a fresh AdamW
            hand_off(engine, self.now.step)
        if TEACHER_FIRST_KL or TEACHER_STEPS:
            metrics["rewards_joined"] = float(self.now.rewards)
        if not self.now.rewards:
            batches = [replace(b, advantages=torch.zeros_like(b.advantages)) for b in batches]
        if not self.now.teacher:
            batches = [replace(b, extra=replace(b.extra, teacher_on=False)) for b in batches]
        return batches

    def advance(self, *, teacher_kl: float) -> None:
        """On to the next step's Phase, given this step's teacher_kl (the ranks' mean)."""
        self.now = next_phase(self.now, teacher_kl=teacher_kl)


def hand_off(engine, step: int) -> None:
    """Clear the optimizer's state (AdamW's two moments and its step count, which restarts the
    bias correction), so that the next optimizer step is a fresh AdamW's first; the learning
    rate schedule goes on. engine: DeepSpeed's, whose optimizer is ZeRO's wrapper holding the
    torch optimizer it steps as .optimizer (ZeRO-2, ZeRO-Offload's CPU Adam), or that optimizer
    itself (a ZeRO stage 0 config hands back the bare AdamW); its global_rank 0 says so."""
    stepped = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer
    stepped.state.clear()  # refilled with zeros by the next step
    if engine.global_rank == 0:
        print(f"step {step}: the teacher's {TEACHER_STEPS} steps are over; the rewards train "
              "alone from here, AdamW's moments cleared", flush=True)
