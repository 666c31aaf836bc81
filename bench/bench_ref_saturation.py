"""When does one reference server saturate? The reference forward's seconds per step against a
trainer rank's, measured side by side in one process on the embedded model at the demo's shapes (4
groups of 8 answers, 64 new tokens; CPU fp32 here, bf16 on a GPU):

  - ref: the server's forward for one rank's step (no gradient; SHARED_PREFIX and chunked log-probs,
    as ref_server.py computes it);
  - train: steps 6-7 of a trainer rank (train_step: forward, backward, optimizer step);
  - generate: step 2 of a trainer rank (transformers' generate, as the demo without vLLM).

One server keeps up with (train + generate) / ref trainer ranks that each send it one step's groups
per step; past that the ranks wait on it. The three alternate, ROUNDS times; medians are kept.

    python bench/bench_ref_saturation.py        # ~5 minutes on 2 CPU cores

Writes bench/results/ref_saturation.json.
"""
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
ROUNDS = 3


def main():
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import torch

    import grpo_ref_split as grpo
    from bench_step_memory import demo_groups
    from features.fast_paths import completion_logps
    from rewards import load_questions

    engine, tokenizer, eos_ids, gen_config, *_ = grpo.setup_deepspeed()
    parts = grpo.choose_parts()  # as main hands them to the steps
    groups = demo_groups(engine, tokenizer, grpo.Q_BATCH_SIZE)
    questions = load_questions("arithmetic", 0, grpo.ARITH_MAX)[: grpo.Q_BATCH_SIZE]
    tokens = sum(t["input_ids"].numel() for t, _ in groups)
    times = {"ref": [], "train": [], "generate": []}
    for _ in range(ROUNDS):
        start = time.perf_counter()
        with torch.no_grad():
            for tensors, meta in groups:  # the server: one group at a time
                ids = tensors["input_ids"]
                completion_logps(engine.module.eval(), ids, torch.ones_like(ids),
                                 ids.shape[1] - meta["plen"], grpo.TEMPERATURE, shared_prefix=True,
                                 chunk=grpo.fast_paths.LOGP_CHUNK,
                                 from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN)
        times["ref"].append(time.perf_counter() - start)
        start = time.perf_counter()
        batches = parts.batches(engine, groups, tokenizer.pad_token_id)
        grpo.train_step(engine, batches, loss_of=parts.loss)
        times["train"].append(time.perf_counter() - start)
        start = time.perf_counter()
        grpo.generate(engine.module.eval(), tokenizer, questions,
                      rollout=parts.rollout, gen_config=gen_config, eos_ids=eos_ids)
        times["generate"].append(time.perf_counter() - start)
        print({k: round(v[-1], 2) for k, v in times.items()}, flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    with_generation = (median["train"] + median["generate"]) / median["ref"]
    training_only = median["train"] / median["ref"]
    print(
        f"per step of {tokens:,} tokens: ref {median['ref']:.2f} s "
        f"({median['ref'] / tokens * 1e3:.3f} "
        f"ms/token), train {median['train']:.2f} s, generate {median['generate']:.2f} s"
    )
    print(
        f"one server keeps up with {with_generation:.1f} trainer ranks that generate their own "
        f"answers, {training_only:.1f} that only train (answers from workers)"
    )
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "ref_saturation.json"), "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "tokens_per_step": tokens,
                "times": times,
                "median": median,
                "ranks_per_server_generating": with_generation,
                "ranks_per_server_training_only": training_only,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
