"""Would overlapping the reference forward with the policy forward+backward pay on this machine?
(The step-speed issue's item 3: upload, run the policy's forward+backward while the server computes
the reference log-probs, then pull them for the loss.) With the reference model on its own GPU that
hides the reference forward; here the server and the trainer share the same CPU cores.

At the demo's shapes (Q_BATCH_SIZE groups of NUM_PRE_Q answers of ANSWER_TOKENS tokens to the demo's
prompts, the embedded model, fp32, SHARED_PREFIX on), a second process does the reference forward as
ref_server.py does (no grad) while this one does the policy's forward+backward, either one after the
other (as the trainer runs them today) or at the same time (the overlap), alternating for ROUNDS
rounds. Each process keeps torch's default threads, as the real server and trainer do.

    python bench/bench_overlap.py          # ~6 minutes on 2 CPU cores
Writes bench/results/overlap.json.
"""
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# rounds of (one after the other, at the same time); the first round is left out (warm-up)
ROUNDS = 4
# answer length: the demo's answers are ~22 tokens on average, its groups as long as the longest
ANSWER_TOKENS = 32

import torch  # noqa: E402

import grpo_ref_split as grpo  # noqa: E402
from features.embedded_model import resolve_model_path  # noqa: E402
from features.fast_paths import completion_logps  # noqa: E402


def demo_batch(tokenizer):
    """(input_ids, attention_mask): the demo's prompts, left-padded, each repeated NUM_PRE_Q times,
    then random answers; the same in both processes."""
    from rewards import load_questions

    questions = load_questions(grpo.DATASET, grpo.SEED, grpo.ARITH_MAX)[: grpo.Q_BATCH_SIZE]
    enc = grpo.encode_prompts(tokenizer, questions)
    G = grpo.NUM_PRE_Q
    g = torch.Generator().manual_seed(0)
    answers = torch.randint(100, 5000, (len(questions) * G, ANSWER_TOKENS), generator=g)  # (B, T)
    ids = torch.cat([enc.input_ids.repeat_interleave(G, 0), answers], 1)  # (B, P+T)
    # (B, P+T)
    attn = torch.cat([enc.attention_mask.repeat_interleave(G, 0), torch.ones_like(answers)], 1)
    return ids, attn


def load():
    """(model, tokenizer) as the trainer loads them, on the CPU."""
    return grpo.load_policy(resolve_model_path(grpo.MODEL_PATH), torch.device("cpu"))[:2]


def reference(conn):
    """The server's side: on each "go", one no-grad reference forward; answers with its end time."""
    model, tokenizer = load()
    model.eval()
    ids, attn = demo_batch(tokenizer)
    conn.send("ready")
    while conn.recv() == "go":
        with torch.no_grad():
            completion_logps(model, ids, attn, ANSWER_TOKENS, grpo.TEMPERATURE, shared_prefix=True,
                             chunk=grpo.fast_paths.LOGP_CHUNK,
                             from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN)  # (B, T)
        conn.send(time.perf_counter())


def main():
    parent, child = mp.get_context("spawn").Pipe()
    server = mp.get_context("spawn").Process(target=reference, args=(child,), daemon=True)
    server.start()
    model, tokenizer = load()
    model.train()
    ids, attn = demo_batch(tokenizer)
    assert parent.recv() == "ready"

    def policy_step():
        model.zero_grad(set_to_none=True)
        logps = completion_logps(
            model,
            ids,
            attn,
            ANSWER_TOKENS,
            grpo.TEMPERATURE,
            shared_prefix=True,
            chunk=grpo.fast_paths.LOGP_CHUNK,
            from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
        )  # (B, T)
        logps.mean().backward()  # the loss's own cost is nothing beside the model's

    seconds = {"one after the other": [], "at the same time": []}
    for r in range(ROUNDS):
        for way in seconds:  # alternating, so a slow spell of the machine hits both
            start = time.perf_counter()
            parent.send("go")
            if way == "one after the other":
                parent.recv()  # the trainer waits for the reference log-probs, then trains
                policy_step()
                end = time.perf_counter()
            else:
                policy_step()
                end = max(time.perf_counter(), parent.recv())
            print(f"round {r}: {way:20s} {end - start:6.2f} s", flush=True)
            if r > 0:
                seconds[way].append(end - start)
    parent.send("stop")
    server.join(timeout=60)
    med = {way: statistics.median(s) for way, s in seconds.items()}
    ratio = med["at the same time"] / med["one after the other"]
    print(
        f"median: one after the other {med['one after the other']:.2f} s, at the same time "
        f"{med['at the same time']:.2f} s: overlap / sequential = {ratio:.2f}"
    )
    out = os.path.join(ROOT, "bench", "results", "overlap.json")
    with open(out, "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
                "command": "python bench/bench_overlap.py",
                "groups": grpo.Q_BATCH_SIZE,
                "completions_each": grpo.NUM_PRE_Q,
                "completion_tokens": ANSWER_TOKENS,
                "rounds": ROUNDS,
                "median_s": {k: round(v, 2) for k, v in med.items()},
                "overlap_over_sequential": round(ratio, 3),
            },
            f,
            indent=1,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
