"""GRPO's variants, in a room of their own: every other baseline (step 4), surrogate, token
selection and teacher term (step 6) that the menu at the top of grpo_ref_split.py can switch on.

A default step never enters this file. main's set-up (choose_parts) hands a step these functions
in place of the lesson's when a variant is set: completion_advantages, varied_by_any_reward and
at_step for step 4, variant_terms for step 6; the lesson's own math (advantages_in_groups, the
clip-only grpo_loss, k3, reduce_loss) is the reference every function here is compared with. Each
function is pure, names its paper, and carries a shape comment on each tensor line. docs/loss.md
says when to pick which.

    OBJECTIVE=cispo MU=2 deepspeed --num_gpus 1 grpo_ref_split.py
    python -m pytest tests/test_surrogates.py tests/test_objectives.py   # each against its paper
"""
from dataclasses import dataclass

import torch

from features import env_overrides
from features.wire import check_teacher_topk

# ----------------------------------------------------------------------------- constants
# The menu's selectors (OBJECTIVE, ADVANTAGE, ...) are grpo_ref_split.py's; their settings are here.
SAPO_TAU_POS = 1.0  # OBJECTIVE "sapo": the soft gate's temperature where A > 0 (the paper's)
SAPO_TAU_NEG = 1.05  # ... and where A < 0: a little steeper, negative updates kept closer
CISPO_MAX_RATIO = 5.0  # OBJECTIVE "cispo": its importance weight sg(min(r, this)); ScaleRL's, TRL's
TIS_CAP = 2.0  # vLLM: each token's surrogate x min(pi_old / pi_vllm, TIS_CAP); 0 = off; else > 1
TIS_MODE = "token_truncate"  # | "token_mask" | "sequence_truncate" | "sequence_mask"
DISTILL_DISCOUNT = 0.0  # teacher terms of later tokens added at this^distance (tinker's); 0 = own
DISTILL_SCALE = "fixed"  # | "matched": the teacher term x rms(group term) / rms(its own), a batch
env_overrides.apply_env_overrides(globals(), "objectives.py")

OBJECTIVES = ("clip", "cispo", "sapo", "gmpo")  # OBJECTIVE's choices
ADVANTAGES = ("grpo", "rloo", "reinforce_pp_baseline", "passk")  # ADVANTAGE's choices
REWARD_NORMS = ("sum_then_normalize", "normalize_then_sum")  # REWARD_NORM's choices
SCALES = ("group", "batch", "none")  # SCALE_REWARDS' choices: what r - group mean is divided by
TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TIS_MODE's
DISTILL_SCALES = ("fixed", "matched")  # DISTILL_SCALE's choices


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) mean of x over each row's True positions (0 if none); selects, as inf x 0 is NaN. The
    lesson's reduce_loss writes the same mean inline: the variants below take it per completion."""
    return torch.where(mask.bool(), x, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)


# ----------------------------------------------------------------------------- step 4: baselines
@dataclass(frozen=True)
class AdvantageSettings:
    """Step 4's menu as the lesson set it (grpo_ref_split.advantage_settings)."""
    advantage: str  # ADVANTAGE
    reward_norm: str  # REWARD_NORM
    scale_rewards: str  # SCALE_REWARDS
    group_size: int  # NUM_PRE_Q
    reward_names: tuple  # REWARDS' function names, in order
    reward_weights: tuple  # and their weights
    std_eps: float  # STD_EPS


def varied_by_any_reward(scores: torch.Tensor, each: dict, s: AdvantageSettings) -> torch.Tensor:
    """(Q,) GDPO's groups with a signal: the weighted sums differ, or any one reward does (each
    reward is normalised in its group on its own). scores (N,); each: {reward name: N values}."""
    G = s.group_size
    varied = scores.view(-1, G).std(1, correction=int(G > 1)) > 0  # (Q,); G = 1: none
    table = torch.tensor([each[name] for name in s.reward_names]).T  # (N, K)
    return varied | table.view(-1, G, table.shape[1]).std(1).gt(0).any(-1)  # (Q,)


def completion_advantages(scores: torch.Tensor, each: dict, s: AdvantageSettings) -> torch.Tensor:
    """Step 4 of a variant: (N,) each completion's advantage. scores (N,) the weighted sums; each:
    {reward name: N values}. "batch" scale, REINFORCE++ and GDPO are divided by a std over the
    whole step later (at_step), once every rank's groups are known."""
    G = s.group_size
    if s.reward_norm == "normalize_then_sum":  # GDPO: each reward in its group; / the step's std
        values = [each[name] for name in s.reward_names]  # K lists of N
        table = torch.tensor(values, dtype=torch.float32).T  # (N, K)
        weights = torch.tensor(s.reward_weights)  # (K,)
        return gdpo_advantages(table, weights, G, std_eps=s.std_eps)  # (N,)
    if s.advantage == "rloo":
        return rloo_advantages(scores, G)  # (N,)
    if s.advantage == "passk":
        return passk_advantages(scores, G, std_eps=s.std_eps)  # (N,)
    # REINFORCE++-baseline, "batch" and "none": centred here; the first two / a step's std later
    return centred_in_groups(scores, G)  # (N,)


def centred_in_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) r - its group's mean, no scale (Dr. GRPO's SCALE_REWARDS "none"; "batch" and
    REINFORCE++-baseline divide it by a std over the step later)."""
    grouped = scores.float().view(-1, group_size)  # (Q, G)
    return (grouped - grouped.mean(1, keepdim=True)).view(-1)  # (N,)


def rloo_advantages(scores: torch.Tensor, num_pre_q: int) -> torch.Tensor:
    """(N,) RLOO (Ahmadian et al. 2024, arXiv 2402.14740): r minus the mean of the group's other
    completions, G / (G - 1) (r - the group's mean); no std, so a reward's scale stays in the
    step."""
    grouped = scores.float().view(-1, num_pre_q)  # (Q, G)
    others = (grouped.sum(1, keepdim=True) - grouped) / (num_pre_q - 1)  # (Q, G)
    return (grouped - others).view(-1)  # (N,)


def passk_advantages(scores: torch.Tensor, num_pre_q: int, *, std_eps: float) -> torch.Tensor:
    """(N,) the pass@k advantage (arXiv 2503.19595, verl's grpo_passk): only each group's best
    completion gets one, (r_best - r_second) / (the group's std + std_eps); the others 0. It trains
    for the best of k samples, not for each one."""
    grouped = scores.float().view(-1, num_pre_q)  # (Q, G)
    top2 = grouped.topk(2, dim=1).values  # (Q, 2)
    gap = (top2[:, 0] - top2[:, 1]) / (grouped.std(1) + std_eps)  # (Q,)
    best = grouped.argmax(1)  # (Q,) the first of equal bests
    advantages = torch.zeros_like(grouped)  # (Q, G)
    advantages[torch.arange(len(best)), best] = gap
    return advantages.view(-1)  # (N,)


def gdpo_advantages(each: torch.Tensor, weights: torch.Tensor, num_pre_q: int, *,
                    std_eps: float) -> torch.Tensor:
    """(N,) GDPO's (arXiv 2601.05242) normalize-then-sum: each reward of `each` (N, K) normalised
    in its group, (r_k - mean) / (std + std_eps), then their sum with `weights` (K,). Summing first
    lets the reward of largest variance drown the others; here each counts by its weight. The step
    then divides by the std over all its completions (whiten_to_step)."""
    grouped = each.float().view(-1, num_pre_q, each.shape[1])  # (Q, G, K)
    centred = grouped - grouped.mean(1, keepdim=True)  # (Q, G, K)
    normalised = centred / (grouped.std(1, keepdim=True) + std_eps)  # (Q, G, K)
    return (normalised * weights.float()).sum(-1).view(-1)  # (N,)


def at_step(groups, dropped_scores: torch.Tensor, device, s: AdvantageSettings) -> list:
    """The step's groups, their advantages divided by a std over the step on all ranks (every
    rank calls it): the std of every reward the step sampled for SCALE_REWARDS "batch"
    (scale_to_step; dropped_scores (D,), the rewards of the groups dropped for equal rewards,
    count in it, as in TRL), that of the trained completions' advantages for REINFORCE++-baseline
    and GDPO (whiten_to_step)."""
    if s.scale_rewards == "batch":
        return scale_to_step(groups, dropped_scores, device, std_eps=s.std_eps)
    return whiten_to_step(groups, device, std_eps=s.std_eps)


def step_std(rewards: torch.Tensor, device) -> float:
    """The unbiased std of the rewards every rank holds for this step: an all-reduce of their count,
    sum and sum of squares. Every rank must call it once per step. rewards (N,) this rank's."""
    r = rewards.double().to(device)  # (N,)
    count = torch.tensor(float(r.numel()), dtype=torch.float64, device=device)  # ()
    stats = torch.stack([count, r.sum(), (r * r).sum()])  # (3,) count, sum, sum of squares
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(stats)
    count, total, squares = stats.tolist()
    if count < 2:
        return 0.0
    variance = (squares - total * total / count) / (count - 1)
    return max(variance, 0.0) ** 0.5  # rounding can take a zero variance a hair below 0


def scale_to_step(groups, dropped_scores: torch.Tensor, device, *, std_eps: float) -> list:
    """SCALE_REWARDS = "batch": every group the step trains on, its advantages redone from its
    rewards (as they came back: a reward model's scores included), r - the group's mean over the
    std of all the step's rewards on all ranks, the trained groups' and the groups this rank
    dropped for equal rewards (as TRL's std over every generated reward). groups: (tensors, meta)
    pairs; dropped_scores (D,)."""
    trained = [tensors["scores"].float() for tensors, _ in groups]  # (G,) each
    std = step_std(torch.cat([*trained, dropped_scores.float()]), device)
    def scaled(tensors):  # the group's rewards centred, over the step's std
        centred = centred_in_groups(tensors["scores"], len(tensors["scores"]))  # (G,)
        return {**tensors, "advantages": centred / (torch.tensor(float(std)) + std_eps)}
    return [(scaled(tensors), meta) for tensors, meta in groups]


def whiten_to_step(groups, device, *, std_eps: float) -> list:
    """ADVANTAGE "reinforce_pp_baseline" (REINFORCE++-baseline: verl's
    reinforce_plus_plus_baseline, OpenRLHF's reinforce_baseline; arXiv 2501.03262) and REWARD_NORM
    "normalize_then_sum" (GDPO): every group the step trains on, its advantages divided by their
    std over the completions the step trains, on all ranks. Each group's advantages sum to 0, so
    their mean over the step is 0 and this is the whitening REINFORCE++-baseline and GDPO apply,
    per completion (theirs weighs each completion by its tokens). The groups dropped for equal
    rewards do not count: their zeros would shrink the std by how many were dropped (re-rollouts
    included), and scale the same trained completions differently from step to step. groups:
    (tensors, meta) pairs."""
    trained = [tensors["advantages"].float() for tensors, _ in groups] or [torch.zeros(0)]
    std = step_std(torch.cat(trained), device)  # every rank, groups or none
    return [({**tensors, "advantages": tensors["advantages"] / (std + std_eps)}, meta)
            for tensors, meta in groups]


# ----------------------------------------------------------------------------- step 6: the loss
@dataclass(frozen=True)
class LossSettings:
    """Step 6's menu as the lesson set it (grpo_ref_split.loss_settings)."""
    objective: str  # OBJECTIVE
    gspo: bool  # GSPO
    kl_bias_correction: bool  # KL_BIAS_CORRECTION
    off_policy_delta: float  # OFF_POLICY_DELTA
    top_entropy_quantile: float  # TOP_ENTROPY_QUANTILE
    distill_coef: float  # DISTILL_COEF
    distill_top_k: int  # DISTILL_TOP_K
    beta: float  # BETA
    clip_eps: float  # CLIP_EPS
    clip_eps_high: float  # CLIP_EPS_HIGH
    temperature: float  # TEMPERATURE: the teacher's top-k log-probs are taken at it
    use_vllm: bool  # features/vllm_engine.USE_VLLM: its mismatch is corrected and logged


@dataclass
class VariantLoss:
    """What step 6 of a variant gives the lesson back: the loss per token and what its metrics
    read."""
    per_token: torch.Tensor  # (B, T) the loss before reduce_loss
    token_advantages: torch.Tensor  # (B, T) each token's advantage (a teacher's term included)
    # (B, T) pi / pi_old as the surrogate saw it (GSPO: the completion's), detached
    ratio: torch.Tensor
    metrics: dict  # the variant's own: vLLM's gap, the teacher's distance


def variant_terms(engine, b, *, logps, pi_old_logps, entropy, s: LossSettings,
                  reference_kl) -> VariantLoss:
    """Step 6 of a variant on batch b (grpo_ref_split.Batch), in place of the lesson's grpo_terms:
    logps, pi_old_logps, entropy (B, T) from the lesson's forward; reference_kl(ref_logps, logps,
    mask) -> (B, T) its k3 towards the reference (None: no reference), the lesson's."""
    kl = reference_kl(b.ref_logps, logps, b.mask)  # (B, T) or None
    mask = b.mask.bool()  # (B, T)
    # (B, T) each completion's advantage on its tokens
    token_advantages = b.advantages[:, None].expand_as(mask)
    teacher_rows = None  # (B,) the completions that take the teacher's term; None = all
    if s.distill_coef:
        teacher_rows = teacher_mix_rows(b)
    if s.distill_coef and not s.distill_top_k:  # + the teacher's term on each token
        token_advantages = distill_advantages(
            b.advantages, teacher_logps=b.extra.teacher_logps, pi_old_logps=pi_old_logps, mask=mask,
            coef=s.distill_coef, discount=DISTILL_DISCOUNT, matched=DISTILL_SCALE == "matched",
            teacher_rows=teacher_rows)  # (B, T)
    weights = None  # (B, T) vLLM's mismatch pi_old / pi_vllm, truncated or masked (TIS_MODE)
    if b.extra.vllm_logps is not None and TIS_CAP:
        weights = mismatch_weights(pi_old_logps, b.extra.vllm_logps, b.extra.vllm_rows, mask,
                                   mode=TIS_MODE, cap=TIS_CAP)  # (B, T)
    if s.off_policy_delta:  # DeepSeek-V3.2: far off-policy tokens with A < 0 leave the surrogate
        pi_old_as_sampled = pi_old_logps  # (B, T) pi_old, vLLM's own on the rows it sampled
        if b.extra.vllm_logps is not None:
            rows = mask & b.extra.vllm_rows[:, None]  # (B, T)
            pi_old_as_sampled = torch.where(rows, b.extra.vllm_logps, pi_old_logps)  # (B, T)
        keep = off_policy_mask(advantages=token_advantages, pi_old_logps=pi_old_as_sampled,
                               logps=logps, mask=mask, delta=s.off_policy_delta)  # (B, T)
        weights = keep if weights is None else weights * keep  # (B, T)
    trained = weights  # (B, T) or None: which tokens' surrogates train, and by how much
    if s.top_entropy_quantile < 1:  # "Beyond the 80/20 rule": the forking tokens alone
        keep = high_entropy_mask(entropy=entropy, mask=mask, quantile=s.top_entropy_quantile)
        trained = keep if weights is None else weights * keep  # (B, T)
    per_token = variant_token_loss(
        logps=logps, pi_old_logps=pi_old_logps, kl=kl, advantages=token_advantages, mask=mask,
        beta=s.beta, clip_eps=s.clip_eps, clip_eps_high=s.clip_eps_high, weights=trained,
        gspo=s.gspo, bias_corrected_kl=s.kl_bias_correction, objective=s.objective,
        sapo_taus=(SAPO_TAU_POS, SAPO_TAU_NEG), cispo_max_ratio=CISPO_MAX_RATIO)  # (B, T)
    if s.distill_coef and s.distill_top_k:  # + the reverse KL over the teacher's likeliest tokens
        student = student_topk_logps(engine, b, temperature=s.temperature)  # (B, T, k)
        rkl = topk_reverse_kl(student_logps=student,
                              teacher_logps=b.extra.teacher_topk_logps)  # (B, T)
        if teacher_rows is not None:
            rkl = rkl * teacher_rows[:, None]  # (B, T)
        per_token = per_token + s.distill_coef * rkl  # (B, T)
    with torch.no_grad():
        log_ratio = policy_log_ratio(logps=logps, pi_old_logps=pi_old_logps, mask=mask, gspo=s.gspo)
        metrics = variant_metrics(b, s, pi_old_logps=pi_old_logps, weights=weights,
                                  token_advantages=token_advantages)
    return VariantLoss(per_token=per_token, token_advantages=token_advantages,
                       ratio=torch.exp(log_ratio), metrics=metrics)


def teacher_mix_rows(b):
    """(B,) bool or None: the completions that take the teacher's term (features/teacher_mix.py's
    DISTILL_BELOW and TEACHER_STEPS; None = every completion)."""
    from features import teacher_mix  # here: the mix is the teacher's, and only its runs need it

    return teacher_mix.teacher_rows(b.extra.scores, teacher_on=b.extra.teacher_on)


def variant_metrics(b, s: LossSettings, *, pi_old_logps, weights, token_advantages) -> dict:
    """The metrics only a variant has (features/run_log.py): vLLM's gap and masked share, the
    teacher's distance and share."""
    from features import run_log

    metrics = {}
    if s.use_vllm:  # how far vLLM's log-probs are from pi_old
        metrics |= run_log.vllm_metrics(b, pi_old_logps=pi_old_logps, weights=weights)
    if b.extra.teacher_logps is not None:  # how far the student is from its teacher
        sampled_term = None if s.distill_top_k else token_advantages  # (B, T) A + the teacher's
        metrics |= run_log.teacher_metrics(b, pi_old_logps=pi_old_logps,
                                           token_advantages=sampled_term)
    return metrics


def variant_token_loss(*, logps, pi_old_logps, kl, advantages, mask, beta, clip_eps,
                       clip_eps_high, weights=None, gspo=False, bias_corrected_kl=False,
                       objective="clip", sapo_taus=(1.0, 1.05),
                       cispo_max_ratio=5.0) -> torch.Tensor:
    """(B, T) the lesson's grpo_loss with the variants: -(surrogate x weights - beta x k3), the
    surrogate PPO's clip or one of OBJECTIVES (objective; sapo_taus SAPO's temperatures,
    cispo_max_ratio CISPO's cap), GSPO's ratio per
    completion, weights (B, T) on each token's surrogate (None: 1), and with bias_corrected_kl
    DeepSeek-V3.2's k3 x r (the reverse KL's gradient). logps, pi_old_logps, mask (B, T); kl (B, T)
    the lesson's k3 towards the reference (None: none); advantages (B,) or (B, T)."""
    if kl is None and beta:
        raise ValueError(f"variant_token_loss: kl=None needs beta=0 (beta {beta})")
    mask = mask.bool()  # (B, T)
    log_ratio = policy_log_ratio(logps=logps, pi_old_logps=pi_old_logps, mask=mask,
                                 gspo=gspo)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    if objective == "clip":
        clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)  # (B, T)
        surrogate = torch.min(ratio * adv, clipped * adv)  # (B, T)
    elif objective == "cispo":
        surrogate = cispo_surrogate(ratio=ratio, logps=logps, advantages=adv,
                                    max_ratio=cispo_max_ratio)  # (B, T)
    elif objective == "sapo":
        surrogate = sapo_surrogate(ratio=ratio, advantages=adv, taus=sapo_taus)  # (B, T)
    elif objective == "gmpo":
        surrogate = gmpo_surrogate(log_ratio=log_ratio, advantages=adv, mask=mask,
                                   clip_eps=clip_eps, clip_eps_high=clip_eps_high)  # (B, T)
    else:
        raise ValueError(f"objective {objective!r}: one of {OBJECTIVES}")
    if weights is not None:
        surrogate = surrogate * weights  # (B, T) importance weights, detached
    if kl is not None:
        kl_weight = ratio if bias_corrected_kl else 1.0  # DeepSeek-V3.2: reverse KL's gradient
        surrogate = surrogate - beta * kl_weight * kl  # (B, T)
    return -surrogate  # (B, T)


def policy_log_ratio(*, logps, pi_old_logps, mask, gspo=False) -> torch.Tensor:
    """(B, T) log(pi / pi_old) of each completion token, the ratio the loss clips and the metrics
    show; GSPO (arXiv 2507.18071): each completion's mean log-ratio on its every token (one ratio,
    clipped whole)."""
    log_ratio = logps - pi_old_logps  # (B, T)
    if not gspo:
        return log_ratio
    completion_mean = masked_mean(log_ratio, mask)[:, None]  # (B, 1)
    # GSPO-token (the GSPO paper's per-token form): the completion's ratio as the value, each
    # token's own log-prob as the gradient. With one advantage per completion its gradient is
    # GSPO's; with a teacher's per-token advantages each token moves by its own, not by the
    # completion's mean.
    return completion_mean.detach() + log_ratio - log_ratio.detach()  # (B, T)


# The surrogates of OBJECTIVE, PPO's clip's rivals; each (B, T), its gradient that of sum A_t log pi
# at r = 1, as the clip's is.
def cispo_surrogate(*, ratio, logps, advantages, max_ratio) -> torch.Tensor:
    """CISPO (MiniMax-M1, arXiv 2506.13585): sg(min(r, max_ratio)) A log pi. The cap bounds the
    importance weight and is detached, so every token keeps its gradient: PPO's clip zeroes it for
    a token past the range, often a rare "fork" token that matters. No lower bound, as in the
    paper (its eps_low is set high); the cap is ScaleRL's eps_max (arXiv 2510.13786), 5 by TRL's
    advice (CISPO_MAX_RATIO). Its loss is a token mean over the batch (LOSS_TYPE "dapo")."""
    weight = ratio.clamp(max=max_ratio).detach()  # (B, T)
    return weight * advantages * logps  # (B, T)


def sapo_surrogate(*, ratio, advantages, taus) -> torch.Tensor:
    """SAPO (Qwen, arXiv 2511.20347): a soft gate (4 / tau) sigmoid(tau (r - 1)) A instead of the
    hard clip, tau = taus[0] where A > 0, taus[1] where A < 0. Its gradient on log pi is
    4 s(1 - s) r A with s the sigmoid: A at r = 1, fading smoothly as r leaves 1."""
    tau = torch.where(advantages > 0, taus[0], taus[1])  # (B, T) or (B, 1)
    return 4 / tau * torch.sigmoid(tau * (ratio - 1)) * advantages  # (B, T)


def gmpo_surrogate(*, log_ratio, advantages, mask, clip_eps, clip_eps_high) -> torch.Tensor:
    """GMPO (arXiv 2507.20673, verl's "geo_mean"): the geometric mean of the completion's token
    ratios, each clipped in log space to [-clip_eps, clip_eps_high] on the side its advantage's
    sign limits, times A; one value per completion, on each of its tokens (reduce_loss's "grpo"
    means it back). An outlier token moves a geometric mean far less than an arithmetic one. A is
    per completion (refused with a teacher's per-token term)."""
    sign = torch.sign(advantages)  # (B, 1) or (B, T)
    clamped = log_ratio.clamp(-clip_eps, clip_eps_high)  # (B, T)
    kept = sign * torch.min(sign * log_ratio, sign * clamped)  # (B, T) the pessimistic one
    completion_ratio = torch.exp(masked_mean(kept, mask))[:, None]  # (B, 1)
    completion_advantage = masked_mean(advantages.expand_as(log_ratio), mask)[:, None]  # (B, 1)
    return (completion_ratio * completion_advantage).expand_as(log_ratio)  # (B, T)


# Token selection: which tokens' surrogates train, and by how much; each (B, T), detached.
def mismatch_weights(pi_old_logps, vllm_logps, vllm_rows, mask, *, mode, cap) -> torch.Tensor:
    """(B, T) truncated importance sampling (TIS, Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"): rho = pi_old / pi_vllm on vLLM's tokens (mask;
    vllm_rows (B,) or all), else 1; per token or per completion (its product), truncated at cap or 0
    outside [1 / cap, cap]. vLLM samples with other kernels than the trainer's."""
    sampled = mask if vllm_rows is None else mask & vllm_rows[:, None]  # (B, T)
    log_rho = torch.where(sampled, pi_old_logps - vllm_logps, 0.0)  # (B, T)
    if mode.startswith("sequence_"):
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)  # (B, T) the completion's ratio
    rho = torch.exp(log_rho)  # (B, T)
    if mode.endswith("_truncate"):
        return rho.clamp(max=cap)  # (B, T)
    return torch.where((rho >= 1 / cap) & (rho <= cap), rho, 0.0)  # (B, T)


def off_policy_mask(*, advantages, pi_old_logps, logps, mask, delta) -> torch.Tensor:
    """(B, T) DeepSeek-V3.2's off-policy mask (OFF_POLICY_DELTA): 0 on a token with a negative
    advantage in a completion whose mean log(pi_old / pi) exceeds delta, else 1 (the paper's
    pi_behaviour is pi_old, the sampling policy: vLLM's own log-probs where it sampled). One
    advantage per completion keeps or drops the completion whole, as the paper; with a teacher's
    per-token advantages each token's own sign decides (docs/distillation.md). All (B, T); it
    multiplies the surrogate."""
    drift = masked_mean(pi_old_logps - logps.detach(), mask)  # (B,) how far pi moved away
    far = (drift > delta)[:, None]  # (B, 1)
    return (~(far & (advantages < 0))).float()  # (B, T)


def high_entropy_mask(*, entropy, mask, quantile) -> torch.Tensor:
    """(B, T) 1 on the completion tokens whose entropy is in the top `quantile` share of this
    micro-batch's completion tokens on all ranks (TRL's threshold is global too), 0 elsewhere
    ("Beyond the 80/20 rule", arXiv 2506.01939: the few high-entropy "forking" tokens carry the
    learning; TRL's top_entropy_quantile). entropy, mask (B, T); entropy detached. Every rank calls
    it once per micro-batch (they run as many)."""
    mask = mask.bool()  # (B, T)
    every = gathered_over_ranks(entropy[mask].float())  # (n,) the completion tokens of all ranks
    if not every.numel():
        return mask.float()  # (B, T)
    threshold = quantile_of(every, 1 - quantile)  # () the share's lowest
    return (mask & (entropy >= threshold)).float()  # (B, T)


def quantile_of(values: torch.Tensor, q: float) -> torch.Tensor:
    """() the q-quantile of values (n,), linear between its two nearest ranks, as torch.quantile
    computes it; torch.quantile refuses more than 2^24 values (long chains of thought give more),
    kthvalue selects the two without that bound or a sort."""
    rank = torch.tensor(q, dtype=values.dtype) * (values.numel() - 1)  # () between 0 and n - 1
    below = int(rank.floor())
    above = int(rank.ceil())
    low = values.kthvalue(below + 1).values  # () kthvalue counts from 1
    high = values.kthvalue(above + 1).values  # ()
    return torch.lerp(low, high, (rank - below).to(values.device))  # ()


def gathered_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """(sum of n,) every rank's values (n,) one after another (this rank's alone without a process
    group); ranks may hold different counts."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    world = torch.distributed.get_world_size()
    count = torch.tensor([values.numel()], device=values.device)  # (1,)
    counts = [torch.zeros_like(count) for _ in range(world)]
    torch.distributed.all_gather(counts, count)
    most = max(int(c) for c in counts)
    padded = torch.zeros(most, dtype=values.dtype, device=values.device)  # (most,)
    padded[: values.numel()] = values
    parts = [torch.zeros_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([part[: int(c)] for part, c in zip(parts, counts)])  # (sum of n,)


# ----------------------------------------------------------------------------- the teacher's terms
def distill_advantages(advantages, *, teacher_logps, pi_old_logps, mask, coef,
                       discount=0.0, matched=False, teacher_rows=None) -> torch.Tensor:
    """(B, T) on-policy distillation (Agarwal et al. 2024, arXiv 2306.13649; Thinking Machines'
    "On-Policy Distillation"): A_t = A + coef (log teacher(y_t) - log pi_old(y_t)), each token's
    own term; its expected gradient is -coef grad KL(pi || teacher). discount g > 0 adds the later
    tokens' terms too, g^(t' - t) each (tinker's KL discount: a token is also credited with where
    it led), the reverse KL's return rather than its one step. matched: the term scaled by
    rms(A) / rms(term) over the completion tokens, so it keeps the group term's size as the KL falls
    (DISTILL_SCALE "matched"; GRPO's A stays near 1 per token whatever the rewards). teacher_rows
    (B,) bool: the completions that take the term, the others keep A alone (features/teacher_mix:
    KDRL's reward-guided mask spares the correct ones); None = every completion. advantages
    (B,)."""
    mask = mask.bool()  # (B, T)
    taking = mask if teacher_rows is None else mask & teacher_rows[:, None]  # (B, T) with the term
    term = torch.where(taking, teacher_logps - pi_old_logps.detach(), 0.0)  # (B, T)
    if discount:
        T = term.shape[1]
        distance = torch.arange(T)[None, :] - torch.arange(T)[:, None]  # (T, T) t' - t
        weight = torch.where(distance >= 0, discount ** distance.clamp(min=0).double(), 0.0)
        term = term @ weight.T.to(term)  # (B, T) sum over t' >= t of g^(t' - t) term_t'
    if matched and taking.any():  # the two terms' root mean squares over their tokens, equal
        group = advantages[:, None].expand_as(term)  # (B, T)
        group_rms = masked_mean(group.square(), mask)[mask.any(1)].mean().sqrt()  # ()
        term_rms = masked_mean(term.square(), taking)[taking.any(1)].mean().sqrt()  # ()
        term = term * (group_rms / term_rms.clamp(min=1e-8))  # (B, T)
    return advantages[:, None] + coef * term  # (B, T)


def teacher_topk_of(groups, T: int, top_k: int, vocab_size) -> tuple:
    """((B, T, k) ids, (B, T, k) log-probs): each group's teacher top-k (DISTILL_TOP_K), checked
    (features/wire.check_teacher_topk) and laid on its completion columns as the lesson's collate
    lays the rest; T the batch's completion columns."""
    B = sum(g["completion_mask"].shape[0] for g, _ in groups)
    ids = torch.zeros(B, T, top_k, dtype=torch.long)  # (B, T, k)
    logps = torch.zeros(B, T, top_k)  # (B, T, k)
    row = 0
    for g, _ in groups:
        n, tlen = g["completion_mask"].shape
        check_teacher_topk(g, top_k=top_k, completion_tokens=tlen, vocab_size=vocab_size)
        ids[row : row + n, :tlen] = g["teacher_topk_ids"]
        logps[row : row + n, :tlen] = g["teacher_topk_logps"]
        row += n
    return ids, logps


def student_topk_logps(engine, b, *, temperature) -> torch.Tensor:
    """(B, T, k) the student's log-probs at TEMPERATURE of the teacher's k likeliest tokens
    (b.extra.teacher_topk_ids) at each completion position, with their gradient. Its own forward of
    whole (B, T, V) logits: the lesson's forward keeps only the sampled tokens' log-probs, so
    DISTILL_TOP_K costs one more forward and backward a step."""
    from features.fast_paths import completion_logits

    T = b.mask.shape[1]
    logits = completion_logits(engine, b.input_ids, b.attention_mask, T,
                               vision_inputs=b.extra.vision_inputs)  # (B, T, V)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    return logp_all.gather(-1, b.extra.teacher_topk_ids)  # (B, T, k)


def topk_reverse_kl(*, student_logps, teacher_logps) -> torch.Tensor:
    """(B, T) KL(pi || teacher) over k + 1 bins: each of the teacher's k likeliest tokens v a bin
    of its own, pi(v) (log pi(v) - log teacher(v)), and one bin for the rest of the vocabulary,
    whose mass is 1 minus the k's on each side. Its minimum is pi = teacher on the k tokens (the
    tail's mass then equal too). The sum over the k alone is no divergence: its minimum is pi =
    teacher / e on them, the rest of pi's mass pushed outside, away from the teacher. Exact and
    differentiable, the full reverse KL at k = V (the tail empty). (verl's top-k distillation is
    a forward KL, tinker's the sampled token's reverse KL: DISTILL_TOP_K = 0 here.)
    student_logps, teacher_logps (B, T, k) at the same token ids."""
    head = (student_logps.exp() * (student_logps - teacher_logps)).sum(-1)  # (B, T)
    student_tail = tail_mass(student_logps)  # (B, T) float64
    teacher_tail = tail_mass(teacher_logps).clamp(min=TAIL_EPS)  # (B, T) never log(0)
    present = student_tail > TAIL_EPS  # (B, T) an empty tail adds 0 (and no 0 x log 0)
    p = torch.where(present, student_tail, 1.0)  # (B, T) 1 where empty: a finite log
    tail = torch.where(present, p * (p.log() - teacher_tail.log()), 0.0)  # (B, T)
    return head + tail.to(head.dtype)  # (B, T)


TAIL_EPS = 1e-12  # a tail mass below this is empty: float64 rounding of 1 - the k's sum


def tail_mass(logps: torch.Tensor) -> torch.Tensor:
    """(B, T) 1 - the mass of the k tokens (B, T, k), in float64: the difference of two numbers
    near 1 keeps about 1e-16 of them, where float32 would keep 1e-7."""
    return (1 - logps.double().exp().sum(-1)).clamp(min=0)  # (B, T)
