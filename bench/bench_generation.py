"""Rollout generation: transformers' generate (the trainer's USE_VLLM = False path, shared prompt
prefill) against the in-process vLLM engine (USE_VLLM = True), at the demo's settings (embedded
model, Q_BATCH_SIZE questions x NUM_PRE_Q answers x up to MAX_NEW_TOKENS tokens, TEMPERATURE), the
two alternating in one process on the same questions: seconds per rollout batch and generated tokens
per second (medians). Both go through grpo_ref_split.generate, so this times exactly what a training
step runs.

    # eager engine (VLLM_EAGER = True), ~3 minutes
    python bench/bench_generation.py
    VLLM_EAGER=0 python bench/bench_generation.py       # compiled engine (its start is printed too)
Writes bench/results/generation_eager.json (or generation_compiled.json).
"""
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ROUNDS = 6  # rollout batches per engine, alternating; the first of each is left out (warm-up)

import torch  # noqa: E402

import grpo_ref_split as grpo
from features import vllm_engine  # noqa: E402
from features.embedded_model import resolve_model_path  # noqa: E402
from rewards import load_questions  # noqa: E402


def main():
    torch.manual_seed(grpo.SEED)
    path = resolve_model_path(grpo.MODEL_PATH)
    model, tokenizer, eos_ids, gen_config = grpo.load_policy(path, torch.device("cpu"))
    start = time.perf_counter()
    llm = vllm_engine.start_engine(resolve_model_path(grpo.MODEL_PATH), grpo.SEED, model.dtype,
                                   eager=vllm_engine.VLLM_EAGER,
                                   gpu_memory=vllm_engine.VLLM_GPU_MEMORY,
                                   cpu_kv_gb=vllm_engine.VLLM_CPU_KV_GB)
    start_s = time.perf_counter() - start
    questions = load_questions(grpo.DATASET, grpo.SEED, grpo.ARITH_MAX)
    seconds, tokens = defaultdict(list), defaultdict(list)
    for r in range(ROUNDS):
        batch = questions[r * grpo.Q_BATCH_SIZE : (r + 1) * grpo.Q_BATCH_SIZE]
        vllm_rollout = functools.partial(vllm_engine.rollout, num_pre_q=grpo.NUM_PRE_Q,
                                         temperature=grpo.TEMPERATURE,
                                         max_new_tokens=grpo.MAX_NEW_TOKENS)
        order = (("transformers", grpo.sample_completions), ("vLLM", vllm_rollout))  # alternating
        for name, sampler in order if r % 2 == 0 else order[::-1]:
            m = defaultdict(float)
            with grpo.timed(m, "generate_s"):
                rollout = grpo.generate(model, tokenizer, batch, rollout=sampler,
                                        gen_config=gen_config, eos_ids=eos_ids, llm=llm)
            n = int(rollout.mask.sum())  # generated tokens, EOS included
            seconds[name].append(m["generate_s"])
            tokens[name].append(n / m["generate_s"])
            print(
                f"round {r} {name:12s} {m['generate_s']:6.2f} s  {n:5d} tokens  "
                f"{n / m['generate_s']:6.1f} tok/s",
                flush=True,
            )
    result = {
        name: dict(
            s_per_batch=round(statistics.median(seconds[name][1:]), 2),
            tokens_per_s=round(statistics.median(tokens[name][1:]), 1),
        )
        for name in seconds
    }
    ratio = result["vLLM"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    eager = vllm_engine.VLLM_EAGER
    print(
        f"vLLM ({'eager' if eager else 'compiled'}) engine start {start_s:.1f} s; median of rounds "
        f"1-{ROUNDS - 1}:"
    )
    for name, v in result.items():
        print(f"  {name:12s} {v['s_per_batch']:6.2f} s per batch  {v['tokens_per_s']:6.1f} tok/s")
    print(f"tokens per second, vLLM / transformers = {ratio:.2f}  (target >= 2)")
    out = os.path.join(
        ROOT, "bench", "results", f"generation_{'eager' if eager else 'compiled'}.json"
    )
    with open(out, "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
                "command": f"VLLM_EAGER={int(eager)} python bench/bench_generation.py",
                "settings": dict(
                    questions=grpo.Q_BATCH_SIZE,
                    completions_each=grpo.NUM_PRE_Q,
                    max_new_tokens=grpo.MAX_NEW_TOKENS,
                    temperature=grpo.TEMPERATURE,
                ),
                "engine_start_s": round(start_s, 1),
                "rounds": ROUNDS,
                **result,
                "tokens_per_s_ratio_vllm_over_transformers": round(ratio, 2),
            },
            f,
            indent=1,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
