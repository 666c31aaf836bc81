"""LoRA against full fine-tuning on the embedded model: trainable parameters, the checkpoint a step
writes, and the peak memory and time of one training step.

Each run is its own process on one DeepSpeed rank (CPU, fp32, default constants, LORA_RANK 16 for
LoRA): 2 synthetic groups of NUM_PRE_Q answers of MAX_NEW_TOKENS tokens to the demo's prompts, then
steps 6 and 7 of the training loop (micro_batches, backward, engine.step) and a checkpoint as
save_checkpoint writes it. Peak RSS of the step from /proc (VmHWM reset just before it, so it counts
the weights, DeepSpeed's buffers and the optimizer state, not the model's loading). The settings
alternate: full, LoRA, full, LoRA.

    python bench/bench_lora.py        # ~5 minutes on 2 CPU cores

Writes bench/results/lora.json.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from bench_step_memory import demo_groups, hwm_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
LORA_RANK = 16  # the rank measured
ROUNDS = 2  # runs per setting, the lowest peak kept


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def child():
    """One step and one checkpoint; prints {"peak_bytes", "seconds", "trainable", "total",
    "checkpoint_bytes"}."""
    import ctypes

    import grpo_ref_split as grpo
    from features.checkpoints import save_checkpoint

    engine, tokenizer, *_ = grpo.setup_deepspeed()
    parts = grpo.choose_parts()  # as main hands them to the steps
    groups = demo_groups(engine, tokenizer, 2)
    # freed memory back to the system: else the start varies by ~0.5 GiB
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the RSS now
    start = time.perf_counter()
    batches = parts.batches(engine, groups, tokenizer.pad_token_id)
    grpo.train_step(engine, batches, loss_of=parts.loss)  # steps 6-7
    seconds = time.perf_counter() - start
    peak = hwm_bytes()
    with tempfile.TemporaryDirectory() as out:  # what save_checkpoint writes per step
        save_checkpoint(
            engine,
            tokenizer,
            1,
            __import__("random").Random(0),
            0,
            output_dir=out,
            keep=1,
            lora=grpo.lora.LORA_RANK > 0,
        )
        checkpoint = folder_bytes(os.path.join(out, "step_1"))
    params = list(engine.module.parameters())
    print(
        json.dumps(
            {
                "peak_bytes": peak,
                "seconds": seconds,
                "checkpoint_bytes": checkpoint,
                "trainable": sum(p.numel() for p in params if p.requires_grad),
                "total": sum(p.numel() for p in params),
            }
        )
    )


def measure(lora_rank):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": str(2**20),
        "LORA_RANK": str(lora_rank),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    out = subprocess.run(
        [sys.executable, __file__, "child"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    runs = {"full": [], "lora": []}
    for _ in range(ROUNDS):
        runs["full"].append(measure(0))
        runs["lora"].append(measure(LORA_RANK))
    best = {k: min(r, key=lambda x: x["peak_bytes"]) for k, r in runs.items()}
    gib = 2**30
    mib = 2**20
    for k, r in best.items():
        print(
            f"{k:4s}: {r['trainable']:>11,} trainable of {r['total']:,} | "
            f"checkpoint {r['checkpoint_bytes'] / mib:7.1f} MiB | step peak RSS "
            f"{r['peak_bytes'] / gib:.2f} GiB | step {r['seconds']:.1f} s "
            f"(peaks {[round(x['peak_bytes'] / gib, 2) for x in runs[k]]})"
        )
    full = best["full"]
    adapters = best["lora"]
    ratios = {
        "trainable": full["trainable"] / adapters["trainable"],
        "peak": full["peak_bytes"] / adapters["peak_bytes"],
        "checkpoint": full["checkpoint_bytes"] / adapters["checkpoint_bytes"],
        "seconds": adapters["seconds"] / full["seconds"],
    }
    print(
        f"full / LoRA rank {LORA_RANK}: trainable {ratios['trainable']:.0f}x, "
        f"checkpoint {ratios['checkpoint']:.0f}x, step peak memory {ratios['peak']:.2f}x; "
        f"LoRA step time / full {ratios['seconds']:.2f}x"
    )
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "lora.json"), "w") as fh:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{os.cpu_count()} CPU cores",
                "lora_rank": LORA_RANK,
                "best": best,
                "runs": runs,
                "ratios": ratios,
            },
            fh,
            indent=1,
        )


if __name__ == "__main__":
    child() if sys.argv[1:2] == ["child"] else main()
