"""Settings that cannot work, refused before any model loads, with what to set instead; settings that work
but are likely a mistake, warned. The trainer's check_settings calls refuse_impossible first thing in main().

    TIS_CAP=1 deepspeed --num_gpus 1 grpo_ref_split.py      # stops at once: the cap must be above 1
"""
import sys

from features import checkpoints, env_overrides
from features.run_log import check_tensorboard


def refuse_impossible(constants: dict, **choices):
    """Stop on settings that cannot work together or an OUTPUT_DIR that holds another run; warn on
    GSPO settings it was not made for. constants: the trainer's (its globals()), read by name;
    choices: {constant: its options}."""
    gspo = constants["GSPO"]
    tis_cap = constants["TIS_CAP"]
    clip_eps = constants["CLIP_EPS"]
    loss_type = constants["LOSS_TYPE"]
    checkpoints.refuse_to_overwrite(constants["OUTPUT_DIR"], constants["RESUME"])  # would delete another run's
    env_overrides.check_choices(constants, **choices)
    if constants["USE_TRITON"] and (gspo or constants["TIS_MODE"].startswith("sequence_")):  # a whole answer's
        sys.exit("USE_TRITON has no per-answer ratio (GSPO, TIS_MODE sequence_*): set those off, or USE_TRITON=0")
    if tis_cap < 0 or 0 < tis_cap <= 1:  # at <= 1 the mask modes drop every token, truncation shrinks all
        sys.exit(f"TIS_CAP = {tis_cap}: the importance weights' cap must be above 1 (2.0 is common), or 0 = off")
    refuse_distillation(constants)
    check_tensorboard(constants["TENSORBOARD"])
    if gspo and max(clip_eps, constants["CLIP_EPS_HIGH"]) > 0.01:  # an answer's mean drift is far smaller
        print(f"warning: GSPO with CLIP_EPS {clip_eps} will hardly ever clip (the paper: 3e-4 / 4e-4)",
              file=sys.stderr)
    if gspo and loss_type != "grpo":  # each answer's one ratio would count once per token (TRL warns too)
        print(f"warning: GSPO with LOSS_TYPE {loss_type!r} weighs each answer's sequence loss by its length; "
              'GSPO is defined with LOSS_TYPE "grpo"', file=sys.stderr)


def refuse_distillation(constants: dict):
    """Stop on a teacher setting that cannot work (docs/distillation.md): a k3 penalty towards the
    teacher (its gradient is the forward KL's), the fused Triton loss (one advantage per answer, no
    DeepSeek-V3.2 corrections), groups of one answer with rewards still weighed."""
    coef = constants["DISTILL_COEF"]
    delta = constants["OFF_POLICY_DELTA"]
    own_reference = constants["LORA_RANK"] > 0 and constants["REF_FROM_BASE"]
    if coef < 0 or delta < 0:
        sys.exit(f"DISTILL_COEF = {coef}, OFF_POLICY_DELTA = {delta}: each is 0 (off) or above")
    if coef and constants["BETA"] and not own_reference:
        sys.exit(f"DISTILL_COEF > 0 with BETA = {constants['BETA']}: the server holds the teacher, and "
                 "a k3 penalty towards it pulls along the forward KL's gradient (biased); set BETA=0, "
                 "or with LoRA take the reference from the base (REF_FROM_BASE=1)")
    if constants["USE_TRITON"] and (coef or delta or constants["KL_BIAS_CORRECTION"]):
        sys.exit("USE_TRITON takes one advantage per answer and neither DeepSeek-V3.2 correction: "
                 "set DISTILL_COEF, OFF_POLICY_DELTA and KL_BIAS_CORRECTION off, or USE_TRITON=0")
    pure = coef > 0 and all(weight == 0 for _, weight in constants["REWARDS"])
    if constants["NUM_PRE_Q"] < 1 or (constants["NUM_PRE_Q"] == 1 and not pure):
        sys.exit(f"NUM_PRE_Q = {constants['NUM_PRE_Q']}: a group needs 2 answers or more to compare "
                 "rewards; 1 only for pure distillation (DISTILL_COEF > 0, every REWARDS weight 0)")
    if constants["NUM_PRE_Q"] == 1 and constants["SCALE_REWARDS"] != "group":
        sys.exit('NUM_PRE_Q = 1 takes SCALE_REWARDS = "group" (its advantages are 0 then)')
