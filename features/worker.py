"""Extra generation workers (GENONLY): a process on any spare GPU or machine that only generates,
scores and uploads groups tagged with its policy version, and loads each newer OUTPUT_DIR/step_N the
trainer saves, so it is at most SAVE_STEPS steps stale. Trainers take its groups as extras. Stop it
with Ctrl-C.

    GENONLY=1 python grpo_ref_split.py          # or: python grpo_ref_split.py genonly
"""
import os
import random
import socket
import sys
import time
from collections import Counter

import torch

from features import env_overrides
from features.checkpoints import checkpoints
from features.vllm_engine import push_weights
from features.weight_sync import WeightFetcher, check_weights, swap_in, weights_budget

GENONLY = False  # True = this process only generates, scores and uploads (as `genonly`)
WORKER_MAX_QUEUED = 8  # a worker waits while the server holds this many groups: bounds staleness
EXTRA_GROUPS = 0  # > 0 with genonly workers: each rank also takes this many of their groups
env_overrides.apply_env_overrides(globals(), "features/worker.py")


WAIT_S = 1.0  # a worker whose groups nobody takes yet looks again after this long


def run_worker(
    load,
    rollout,
    client,
    *,
    questions,
    q_batch_size,
    first,
    seed,
    start_llm,
    output_dir,
    max_queued,
    allow_mismatch,
    trainers_read_server=True,
    weights_from="",
    token="",
):
    """Forever: pick up the newest checkpoint, wait while the server holds max_queued groups
    (trainers are behind: the pile would only grow stale), else draw q_batch_size of `questions`,
    make groups and upload them. The trainer's own functions come in: load(path, device) -> policy,
    rollout(model, tokenizer, drawn, eos_ids=, gen_config=, llm=, keep_all=, seconds=) -> the
    trainer's ScoredGroups (groups, records), and start_llm(seed, dtype) -> a vLLM engine (None:
    transformers generates). trainers_read_server False (BETA = 0, or LoRA's reference from the
    base) stops it at once: it would feed nobody. weights_from (WEIGHTS_FROM): the trainer's weight
    server (features/weight_sync.py, with `token`), instead of OUTPUT_DIR's checkpoints."""
    # BETA = 0, or LoRA with REF_FROM_BASE (REF_FROM_BASE=0 on both sends LoRA groups)
    if not trainers_read_server:
        sys.exit(
            "GENONLY: with BETA = 0, or LoRA with REF_FROM_BASE, trainers never read from the "
            "server: a worker would feed nobody"
        )
    name = f"worker-{socket.gethostname()}-{os.getpid()}"
    torch.manual_seed(seed + os.getpid())  # workers must not repeat each other's samples
    rng = random.Random(seed + os.getpid())
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    policy = load(first, device)
    version = 0
    # either role: it only samples
    health = client.health(policy[0], policy[1], allow_mismatch, teacher=None)
    # the server may still tell equal groups apart
    keep_all = bool(health["regroup"] or health["reward_model"])
    keep_all = keep_all or health.get("role") == "teacher"  # the teacher's term trains every group
    llm = start_llm(seed + os.getpid(), policy[0].dtype) if start_llm else None
    waiting = False
    fetcher = None
    if weights_from:  # it refuses a file larger than this model's weights, or not theirs
        fetcher = WeightFetcher(
            weights_from,
            token,
            version,
            max_bytes=weights_budget(policy[0]),
            check=lambda tensors: check_weights(policy[0], tensors),
        )
    while True:
        fetched = fetcher.take() if fetcher else None
        if fetched:  # checked whole (size, sha256, every name, shape, dtype) before it got here
            swap_in(policy[0], fetched[1])
            if llm is not None:
                push_weights(llm, policy[0])  # a push that fails is fatal: vLLM may hold a mix
            version = fetched[0]
            print(
                f"[{name}] swapped in the trainer's weights: policy version {version}", flush=True
            )
        newest = None if fetcher else (checkpoints(output_dir) or [None])[-1]
        step = int(newest.rsplit("_", 1)[1]) if newest else 0
        if step > version:
            try:
                policy = load(newest, device)
                if llm is not None:
                    push_weights(llm, policy[0])
                version = step
                print(f"[{name}] loaded {newest}: policy version {version}", flush=True)
            # deleted by the trainer's keep limit while we read it: the next one will do
            except OSError as e:
                print(
                    f"[{name}] could not load {newest} ({e}); keeping version {version}", flush=True
                )
        health = client.health()
        if health["pending"] + health["ready_workers"] >= max_queued:
            if not waiting:  # once per pause: a person watching sees why nothing is uploaded
                print(
                    f"[{name}] waiting: the server holds {max_queued} groups nobody has taken yet",
                    flush=True,
                )
            waiting = True
            time.sleep(WAIT_S)
            continue
        waiting = False
        model, tokenizer, eos_ids, gen_config = policy
        scored = rollout(
            model,
            tokenizer,
            rng.sample(questions, q_batch_size),
            eos_ids=eos_ids,
            gen_config=gen_config,
            llm=llm,
            keep_all=keep_all,
            seconds=Counter(),
        )
        client.upload(scored.groups, version=version, worker=name)
        records = scored.records
        reward = sum(r["reward"] for r in records) / len(records)
        refused = f" | refused versions {fetcher.counts['refused']}" if fetcher else ""
        print(
            f"[{name}] version {version} | uploaded {len(scored.groups)} groups | reward "
            f"{reward:.3f}{refused}",
            flush=True,
        )
