"""Peak memory of one demo-sized training step against groups per rank, with micro-batches of one
group (TRAIN_MICRO_BATCH = 1) and without (0: the whole batch in one forward+backward).

Each run is its own process on one DeepSpeed rank (CPU, fp32, the embedded model, default
constants): synthetic groups of NUM_PRE_Q answers of MAX_NEW_TOKENS tokens to the demo's prompts,
reference log-probs near the policy's, then steps 6 and 7 of the training loop (micro_batches,
policy_loss, engine.backward, engine.step). The peak RSS of the step alone is read from /proc
(VmHWM, reset just before the step), so loading the model does not count. The settings alternate:
off, on, off, on, ...

    # groups per rank 1, 2, 4, 8; ~10 minutes on 2 CPU cores
    python bench/bench_step_memory.py

Writes bench/results/step_memory.json.
"""
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GROUPS = (1, 2, 4, 8)
ROUNDS = 2  # runs per setting, the lowest peak kept


def hwm_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def demo_groups(engine, tokenizer, n_groups) -> list:
    """n_groups synthetic groups at the demo's shapes: NUM_PRE_Q answers of MAX_NEW_TOKENS random
    tokens to the demo's prompts, with reference log-probs near the policy's."""
    import torch

    import grpo_ref_split as grpo
    from features.fast_paths import completion_logps
    from rewards import load_questions

    G, T = grpo.NUM_PRE_Q, grpo.MAX_NEW_TOKENS
    groups = []
    for i, q in enumerate(load_questions("arithmetic", 0, grpo.ARITH_MAX)[:n_groups]):
        prompt = tokenizer(
            grpo.build_prompt(tokenizer, q["question"]), add_special_tokens=False
        ).input_ids
        g = torch.Generator().manual_seed(i)
        ids = torch.cat(
            [torch.tensor(prompt).expand(G, -1), torch.randint(100, 5000, (G, T), generator=g)], 1
        )
        with torch.no_grad():
            ref = completion_logps(
                engine,
                ids,
                torch.ones_like(ids),
                T,
                grpo.TEMPERATURE,
                shared_prefix=True,
                chunk=grpo.fast_paths.LOGP_CHUNK,
                from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
            )
        groups.append(
            (
                dict(
                    input_ids=ids,
                    completion_mask=torch.ones(G, T, dtype=torch.bool),
                    advantages=torch.randn(G, generator=g),
                    scores=torch.zeros(G),  # on the wire with every group; unread here
                    ref_logps=ref + 0.1,
                ),
                {"plen": len(prompt)},
            )
        )
    return groups


def child(n_groups):
    """One step on n_groups groups; prints {"peak_bytes", "seconds"}."""
    import grpo_ref_split as grpo

    engine, tokenizer, *_ = grpo.setup_deepspeed()
    parts = grpo.choose_parts()  # as main hands them to the steps
    groups = demo_groups(engine, tokenizer, n_groups)
    import ctypes

    # freed memory back to the system: else the start varies by ~0.5 GiB
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the RSS now
    start = time.perf_counter()
    batches = parts.batches(engine, groups, tokenizer.pad_token_id)
    grpo.train_step(engine, batches, loss_of=parts.loss)  # steps 6-7
    print(json.dumps({"peak_bytes": hwm_bytes(), "seconds": time.perf_counter() - start}))


def measure(n_groups, micro):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A fixed mmap threshold: big buffers go back to the system when freed, so RSS follows what is
    # alive (with glibc's moving threshold, identical runs' peaks differed by 0.5 GiB; with this by
    # < 0.1).
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": str(2**20),
        "TRAIN_MICRO_BATCH": str(micro),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    out = subprocess.run(
        [sys.executable, __file__, "child", str(n_groups)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    gib = 2**30
    rows = []
    print(
        "groups per rank | peak RSS of the step: all at once | micro-batches of 1 group", flush=True
    )
    for n in GROUPS:
        runs = {"off": [], "one_group": []}
        for _ in range(ROUNDS):
            runs["off"].append(measure(n, 0))
            runs["one_group"].append(measure(n, 1))
        row = {
            "groups": n,
            **{k: min(r, key=lambda x: x["peak_bytes"]) for k, r in runs.items()},
            "all_peaks": {k: [x["peak_bytes"] for x in r] for k, r in runs.items()},
        }
        rows.append(row)
        print(
            f"  {n:2d} | {row['off']['peak_bytes'] / gib:5.2f} GiB, {row['off']['seconds']:5.1f} s "
            "| "
            f"{row['one_group']['peak_bytes'] / gib:5.2f} GiB, {row['one_group']['seconds']:5.1f} "
            "s",
            flush=True,
        )
    growth = {k: rows[-1][k]["peak_bytes"] / rows[0][k]["peak_bytes"] for k in ("off", "one_group")}
    print(
        f"peak at {GROUPS[-1]} groups / at {GROUPS[0]}: all at once {growth['off']:.2f}x, "
        f"micro-batches of 1 group {growth['one_group']:.2f}x (target <= 1.15x)"
    )
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "step_memory.json"), "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{os.cpu_count()} CPU cores",
                "rows": rows,
                "growth": growth,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    child(int(sys.argv[2])) if sys.argv[1:2] == ["child"] else main()
