"""Guard: settings that cannot work, refused before any model loads, with what to set instead;
settings that work but are likely a mistake, warned. The trainer's check_settings calls them first
thing in main().

    DISTILL_COEF=0.5 deepspeed --num_gpus 1 grpo_ref_split.py    # stops at once: BETA > 0 too
"""
import math
import sys

from features import checkpoints, fast_paths, lora, run_log, wire


def refuse_tis(*, tis_cap):
    """Stop on an importance weights' cap that cannot work (objectives.TIS_CAP): at or below 1
    the mask modes drop every token and truncation all."""
    if tis_cap < 0 or 0 < tis_cap <= 1:
        sys.exit(f"TIS_CAP = {tis_cap}: the importance weights' cap must be above 1 "
                 "(2.0 is common), or 0 = off")


def refuse_impossible(*, gspo, clip_eps, clip_eps_high, loss_type, output_dir, tis_mode):
    """Stop on settings that cannot work together or an OUTPUT_DIR that holds another run; warn on
    GSPO settings it was not made for. The keywords are the trainer's constants of those names
    (tis_mode: objectives.TIS_MODE); each feature's own constants are read from its module."""
    checkpoints.refuse_to_overwrite(output_dir, checkpoints.RESUME)  # would delete another run's
    for name, eps in (("CLIP_EPS", clip_eps), ("CLIP_EPS_HIGH", clip_eps_high)):
        if not math.isfinite(eps) or eps < 0:  # the ratio's range would be empty or inverted
            sys.exit(f"{name} = {eps}: the clip's half-width, a finite number >= 0 (0.2 is "
                     "GRPO's; DAPO's CLIP_EPS_HIGH 0.28)")
    per_completion_tis = tis_mode.startswith("sequence_")  # a whole completion's ratio
    if fast_paths.USE_TRITON and (gspo or per_completion_tis):
        sys.exit("USE_TRITON has no per-completion ratio (GSPO, TIS_MODE sequence_*): set those "
                 "off, or USE_TRITON=0")
    run_log.check_tensorboard(run_log.TENSORBOARD)
    if gspo and max(clip_eps, clip_eps_high) > 0.01:  # a completion's mean drift is far smaller
        print(
            f"warning: GSPO with CLIP_EPS {clip_eps} will hardly ever clip (the paper: 3e-4 / "
            "4e-4)",
            file=sys.stderr,
        )
    if gspo and loss_type != "grpo":  # each completion's one ratio counts once per token (TRL too)
        print(
            f"warning: GSPO with LOSS_TYPE {loss_type!r} weighs each completion's sequence loss by "
            'its length; GSPO is defined with LOSS_TYPE "grpo"',
            file=sys.stderr,
        )


def refuse_objectives(*, objective, advantage, reward_norm, top_entropy_quantile, sapo_taus,
                      gspo, loss_type, scale_rewards, distill_coef, num_pre_q, cispo_max_ratio=5.0,
                      tis_mode="token_truncate", tis_cap=0.0):
    """Stop on a variant of the surrogate, the baseline or the rewards' normalisation that cannot
    work with the rest (docs/loss.md says why each). The keywords are the trainer's constants of
    those names (sapo_taus: SAPO_TAU_POS, SAPO_TAU_NEG; cispo_max_ratio, tis_mode, tis_cap:
    objectives.py's CISPO_MAX_RATIO, TIS_MODE, TIS_CAP)."""
    if not 0 < top_entropy_quantile <= 1:
        sys.exit(f"TOP_ENTROPY_QUANTILE = {top_entropy_quantile}: the share of completion tokens "
                 "that train, in (0, 1]; 1 = all")
    if not all(math.isfinite(tau) and tau > 0 for tau in sapo_taus):
        sys.exit(f"SAPO_TAU_POS, SAPO_TAU_NEG = {sapo_taus}: temperatures above 0 and finite "
                 "(nan or inf makes SAPO's gate, and so the loss, NaN)")
    if objective == "cispo" and loss_type != "dapo":
        sys.exit(f'OBJECTIVE cispo with LOSS_TYPE {loss_type!r}: CISPO is defined with one token '
                 'mean over the whole batch (the paper, TRL, verl); set LOSS_TYPE="dapo"')
    if objective == "cispo" and not (math.isfinite(cispo_max_ratio) and cispo_max_ratio >= 1):
        sys.exit(f"CISPO_MAX_RATIO = {cispo_max_ratio}: the cap on CISPO's importance weight, at "
                 "least 1 (below it every on-policy token is weighed down; 5.0 is TRL's advice)")
    if objective == "gmpo" and top_entropy_quantile < 1:
        sys.exit(f"OBJECTIVE gmpo with TOP_ENTROPY_QUANTILE {top_entropy_quantile}: GMPO's one "
                 "value per completion is a geometric mean over all its tokens, so the tokens the "
                 "entropy share leaves out would train through it; use clip, cispo or sapo")
    if objective == "gmpo" and tis_mode == "token_mask" and tis_cap:
        sys.exit('OBJECTIVE gmpo with TIS_MODE "token_mask": GMPO\'s one value per completion '
                 'would train the tokens the mask drops; use TIS_MODE "token_truncate" or a '
                 'sequence mode')
    if fast_paths.USE_TRITON and (objective != "clip" or top_entropy_quantile < 1):
        sys.exit(f"USE_TRITON fuses PPO's clip over every token: OBJECTIVE {objective!r} and "
                 "TOP_ENTROPY_QUANTILE < 1 run on the PyTorch path (USE_TRITON=0)")
    if gspo and objective != "clip":
        sys.exit(f"GSPO with OBJECTIVE {objective!r}: GSPO is a ratio for PPO's clip; the other "
                 "surrogates define their own (gmpo: a geometric mean already)")
    if objective == "gmpo" and distill_coef:
        sys.exit("OBJECTIVE gmpo with DISTILL_COEF: GMPO takes one advantage per completion, a "
                 "teacher's term is per token (clip, cispo or sapo keep it)")
    if objective == "gmpo" and loss_type != "grpo":
        sys.exit(f'OBJECTIVE gmpo with LOSS_TYPE {loss_type!r}: its one value per completion would '
                 'count once per token; GMPO is defined with LOSS_TYPE "grpo"')
    if (advantage != "grpo" or reward_norm != "sum_then_normalize") and scale_rewards != "group":
        sys.exit(f"ADVANTAGE {advantage!r}, REWARD_NORM {reward_norm!r} with SCALE_REWARDS "
                 f"{scale_rewards!r}: SCALE_REWARDS scales GRPO's advantages; the others bring "
                 "their own scale (leave it \"group\")")
    if reward_norm != "sum_then_normalize" and advantage != "grpo":
        sys.exit(f"REWARD_NORM {reward_norm!r} with ADVANTAGE {advantage!r}: GDPO normalises "
                 "each reward in its group as GRPO does; choose one of the two")
    if (advantage != "grpo" or reward_norm != "sum_then_normalize") and num_pre_q < 2:
        sys.exit(f"ADVANTAGE {advantage!r}, REWARD_NORM {reward_norm!r}: each needs groups of "
                 f"2 completions or more (NUM_PRE_Q = {num_pre_q})")


def refuse_distillation(
    *, distill_coef, discount, top_k, matched, off_policy_delta, beta, kl_bias_correction,
    rewards, num_pre_q, scale_rewards, dynamic_sampling, teacher_steps=0
):
    """Stop on a teacher setting that cannot work (docs/distillation.md): a k3 penalty towards the
    teacher (its gradient is the forward KL's), the fused Triton loss (one advantage per
    completion, no DeepSeek-V3.2 corrections), groups of one completion with rewards still
    weighed. Say so when DYNAMIC_SAMPLING has nothing to do. The keywords are the trainer's
    constants of those names (teacher_steps: features/teacher_mix.TEACHER_STEPS)."""
    coef = distill_coef
    delta = off_policy_delta
    if coef < 0 or delta < 0:
        sys.exit(f"DISTILL_COEF = {coef}, OFF_POLICY_DELTA = {delta}: each is 0 (off) or above")
    if not 0 <= top_k <= wire.MAX_TOP_K or (top_k and not coef):
        sys.exit(f"DISTILL_TOP_K = {top_k}: 0 (off) or 1..{wire.MAX_TOP_K} of the teacher's "
                 "likeliest tokens, with DISTILL_COEF > 0")
    if top_k and (discount or fast_paths.USE_TRITON):
        sys.exit("DISTILL_TOP_K's term is each token's exact reverse KL over the teacher's top "
                 "tokens: DISTILL_DISCOUNT (a sampled return) and USE_TRITON do not apply")
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
            "USE_TRITON takes one advantage per completion and neither DeepSeek-V3.2 correction: "
            "set DISTILL_COEF, OFF_POLICY_DELTA and KL_BIAS_CORRECTION off, or USE_TRITON=0"
        )
    pure = coef > 0 and all(weight == 0 for _, weight in rewards)
    if matched and (pure or not coef or top_k):
        sys.exit('DISTILL_SCALE "matched" sizes the sampled teacher term to the rewards\' group '
                 "term: it needs DISTILL_COEF > 0, a REWARDS weight above 0 and no DISTILL_TOP_K")
    if num_pre_q < 1 or (num_pre_q == 1 and not pure):
        sys.exit(
            f"NUM_PRE_Q = {num_pre_q}: a group needs 2 completions or more to compare "
            "rewards; 1 only for pure distillation (DISTILL_COEF > 0, every REWARDS weight 0)"
        )
    if kl_bias_correction and not beta:
        sys.exit("KL_BIAS_CORRECTION corrects the k3 penalty's gradient off-policy; with BETA = 0 "
                 "there is no penalty to correct: set BETA > 0 or KL_BIAS_CORRECTION = False")
    if coef and dynamic_sampling:
        until = f" until the hand-off after step {teacher_steps}" if teacher_steps else ""
        print("DYNAMIC_SAMPLING with DISTILL_COEF: every group trains (the teacher's term differs "
              f"within any group, equal rewards or not), so each step{until} draws its questions "
              "once", flush=True)
    if num_pre_q == 1 and scale_rewards != "group":
        sys.exit('NUM_PRE_Q = 1 takes SCALE_REWARDS = "group" (its advantages are 0 then)')
