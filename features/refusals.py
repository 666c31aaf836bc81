"""Settings that cannot work, refused before any model loads, with what to set instead; settings
that work but are likely a mistake, warned. The trainer's check_settings calls them first thing in
main().

    DISTILL_COEF=0.5 deepspeed --num_gpus 1 grpo_ref_split.py    # stops at once: BETA > 0 too
"""
import sys

from features import checkpoints, fast_paths, lora, run_log, vllm_engine


def refuse_impossible(*, gspo, clip_eps, clip_eps_high, loss_type, output_dir):
    """Stop on settings that cannot work together or an OUTPUT_DIR that holds another run; warn on
    GSPO settings it was not made for. The keywords are the trainer's constants of those names;
    each feature's own constants are read from its module."""
    checkpoints.refuse_to_overwrite(output_dir, checkpoints.RESUME)  # would delete another run's
    per_answer_tis = vllm_engine.TIS_MODE.startswith("sequence_")  # a whole answer's ratio
    if fast_paths.USE_TRITON and (gspo or per_answer_tis):
        sys.exit("USE_TRITON has no per-answer ratio (GSPO, TIS_MODE sequence_*): set those off, "
                 "or USE_TRITON=0")
    run_log.check_tensorboard(run_log.TENSORBOARD)
    if gspo and max(clip_eps, clip_eps_high) > 0.01:  # an answer's mean drift is far smaller
        print(
            f"warning: GSPO with CLIP_EPS {clip_eps} will hardly ever clip (the paper: 3e-4 / "
            "4e-4)",
            file=sys.stderr,
        )
    if gspo and loss_type != "grpo":  # each answer's one ratio would count once per token (TRL too)
        print(
            f"warning: GSPO with LOSS_TYPE {loss_type!r} weighs each answer's sequence loss by "
            'its length; GSPO is defined with LOSS_TYPE "grpo"',
            file=sys.stderr,
        )


def refuse_distillation(
    *, distill_coef, discount, off_policy_delta, beta, kl_bias_correction, rewards, num_pre_q,
    scale_rewards, dynamic_sampling
):
    """Stop on a teacher setting that cannot work (docs/distillation.md): a k3 penalty towards the
    teacher (its gradient is the forward KL's), the fused Triton loss (one advantage per answer, no
    DeepSeek-V3.2 corrections), groups of one answer with rewards still weighed. Say so when
    DYNAMIC_SAMPLING has nothing to do. The keywords are the trainer's constants of those names."""
    coef = distill_coef
    delta = off_policy_delta
    if coef < 0 or delta < 0:
        sys.exit(f"DISTILL_COEF = {coef}, OFF_POLICY_DELTA = {delta}: each is 0 (off) or above")
    if not 0 <= discount <= 1 or (discount and not coef):
        sys.exit(f"DISTILL_DISCOUNT = {discount}: a discount in [0, 1] of the teacher's terms, "
                 "with DISTILL_COEF > 0")
    if coef and beta and not lora.own_reference():
        sys.exit(
            f"DISTILL_COEF > 0 with BETA = {beta}: the server holds the teacher, and "
            "a k3 penalty towards it pulls along the forward KL's gradient (biased); set BETA=0, "
            "or with LoRA take the reference from the base (REF_FROM_BASE=1)"
        )
    if fast_paths.USE_TRITON and (coef or delta or kl_bias_correction):
        sys.exit(
            "USE_TRITON takes one advantage per answer and neither DeepSeek-V3.2 correction: "
            "set DISTILL_COEF, OFF_POLICY_DELTA and KL_BIAS_CORRECTION off, or USE_TRITON=0"
        )
    pure = coef > 0 and all(weight == 0 for _, weight in rewards)
    if num_pre_q < 1 or (num_pre_q == 1 and not pure):
        sys.exit(
            f"NUM_PRE_Q = {num_pre_q}: a group needs 2 answers or more to compare "
            "rewards; 1 only for pure distillation (DISTILL_COEF > 0, every REWARDS weight 0)"
        )
    if coef and dynamic_sampling:
        print("DYNAMIC_SAMPLING with DISTILL_COEF: every group trains (the teacher's term differs "
              "within any group, equal rewards or not), so each step draws its questions once",
              flush=True)
    if num_pre_q == 1 and scale_rewards != "group":
        sys.exit('NUM_PRE_Q = 1 takes SCALE_REWARDS = "group" (its advantages are 0 then)')
