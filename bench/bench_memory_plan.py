"""The memory plan (features/memory_plan.py) against the measured peak of one training step.

Each setting runs one demo-sized step on one DeepSpeed rank on this CPU (fp32, the embedded model),
as bench/bench_step_memory.py does: synthetic groups, then steps 6 and 7 (train_step). Measured: the
peak RSS during the second step (VmHWM, reset just before it; the first creates AdamW's state) less
the RSS the process had before the model loaded, so what it counts is what the plan counts: weights,
gradients, AdamW's state (created by the first step), the gradient bucket, activations and logits.
The plan for the same setting is computed from the model's config alone, beside it.

    python bench/bench_memory_plan.py          # 5 settings, ~5 minutes on 2 CPU cores

Writes bench/results/memory_plan.json and prints one row per setting: plan, measured, plan /
measured. """
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
# name: the constants it changes (the demo's otherwise: 4 groups of 8 answers, 64 tokens)
SETTINGS = {
    "default": {},
    "micro-batches of 1 group": {"TRAIN_MICRO_BATCH": "1"},
    "gradient checkpointing": {"GRADIENT_CHECKPOINTING": "1"},
    "LoRA rank 16": {"LORA_RANK": "16"},
    "256-token answers": {"MAX_NEW_TOKENS": "256"},
}


def rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def child():
    """One step; prints {"before_model", "peak", "prompt_tokens"} in bytes and tokens."""
    import ctypes

    import deepspeed  # noqa: F401  (imported before the baseline, as the step needs it)
    import transformers  # noqa: F401

    import grpo_ref_split as grpo
    from bench_step_memory import demo_groups, hwm_bytes

    before_model = rss_bytes()
    engine, tokenizer, *_ = grpo.setup_deepspeed()
    parts = grpo.choose_parts()  # as main hands them to the steps
    groups = demo_groups(engine, tokenizer, grpo.Q_BATCH_SIZE)
    batches = parts.batches(engine, groups, tokenizer.pad_token_id)
    grpo.train_step(engine, batches, loss_of=parts.loss)  # the first creates AdamW's state
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the RSS now
    before_step = rss_bytes()
    grpo.train_step(engine, batches, loss_of=parts.loss)  # as every later step: measured
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(json.dumps({"before_model": before_model, "before_step": before_step, "peak": hwm_bytes(),
                      "after_step": rss_bytes(),
                      "prompt_tokens": groups[0][1]["plen"]}))


def measure(changes: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A fixed mmap threshold: freed big buffers go back to the system, so RSS follows what is alive.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **changes}
    out = subprocess.run(
        [sys.executable, __file__, "child"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def planned(changes: dict, prompt_tokens: int) -> int:
    """The plan's trainer total for the demo's constants with `changes`, in fp32 on one CPU rank."""
    import grpo_ref_split as grpo
    from features import memory_plan
    from features.embedded_model import resolve_model_path

    def value(name):
        return int(changes.get(name, getattr(grpo, name)))

    setting = memory_plan.Setting(
        ranks=1,
        ranks_per_node=1,
        bf16=False,
        offload_optimizer=False,
        lora_rank=value("LORA_RANK"),
        gradient_checkpointing=bool(value("GRADIENT_CHECKPOINTING")),
        q_batch_size=grpo.Q_BATCH_SIZE,
        train_micro_batch=value("TRAIN_MICRO_BATCH"),
        num_pre_q=grpo.NUM_PRE_Q,
        prompt_tokens=prompt_tokens,
        max_new_tokens=value("MAX_NEW_TOKENS"),
        logp_chunk=grpo.fast_paths.LOGP_CHUNK,
        logp_from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
        shared_prefix=grpo.fast_paths.SHARED_PREFIX,
    )
    shape = memory_plan.model_shape(
        resolve_model_path(grpo.MODEL_PATH),
        lora_rank=setting.lora_rank,
        lora_targets=grpo.lora.LORA_TARGETS,
    )
    rows = memory_plan.plan(shape, setting, device_bytes=24 * 2**30)
    held = rows[0].trainer + rows[0].cpu + rows[1].trainer  # on a CPU the two sides are one RAM
    return held + rows[2].trainer + rows[3].trainer  # the step: no generation in this bench


def main():
    gib = 2**30
    rows = []
    print(f"{'setting':<28}{'plan GiB':>10}{'measured GiB':>14}{'plan / measured':>17}", flush=True)
    for name, changes in SETTINGS.items():
        got = measure(changes)
        used = got["peak"] - got["before_model"]
        plan = planned(changes, got["prompt_tokens"])
        rows.append(
            {
                "setting": name,
                "changes": changes,
                "plan_bytes": plan,
                "measured_bytes": used,
                "ratio": plan / used,
                **got,
            }
        )
        print(f"{name:<28}{plan / gib:>10.2f}{used / gib:>14.2f}{plan / used:>17.2f}", flush=True)
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"largest error of the plan: {worst:.0%}")
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "memory_plan.json"), "w") as f:
        json.dump(
            {"date": time.strftime("%Y-%m-%d"), "rows": rows, "largest_error": worst}, f, indent=1
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child()
    else:
        main()
