"""Where a training step's time goes: generation, pi_old_logps, scoring, waiting for the reference
server, policy forward+backward, optimizer, and the overhead ratio step / (generation + fwd+bwd),
for two settings side by side (COMPARE): by default today's step against the step it replaced (full
rows, SHARED_PREFIX = False, and a pi_old_logps forward every step, SKIP_PI_OLD = False); with
COMPARE=shared_prefix only the shared prefix on and off; with COMPARE=vllm, vLLM generation
(USE_VLLM = True) against transformers' generate.

Without an argument it runs the real thing: `python ref_server.py` and `deepspeed --num_gpus 1
grpo_ref_split.py` on the embedded model with the default constants (evaluation off), STEPS steps
per run, the two sides alternating for ROUNDS rounds, and reads the per-step timings the trainer
writes to metrics.jsonl. With a metrics.jsonl (e.g. the demo's) it only reads that file.

    python bench/bench_step_anatomy.py                          # ~15 minutes on 2 CPU cores
    # SHARED_PREFIX on and off, ~15 minutes
    COMPARE=shared_prefix python bench/bench_step_anatomy.py
    COMPARE=vllm python bench/bench_step_anatomy.py             # USE_VLLM on and off, ~12 minutes
    python bench/bench_step_anatomy.py output/metrics.jsonl     # any finished run
Writes bench/results/step_anatomy.json (step_anatomy_<COMPARE>.json for the others; the new side's
last run goes to step_anatomy_metrics.jsonl). """
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3  # training steps per run; the first is left out of the averages (warm-up)
ROUNDS = 2  # runs per path, alternating: new, old, new, old
# what the two sides differ in: old_path | shared_prefix | vllm
COMPARE = os.environ.get("COMPARE", "old_path")
PATHS = {
    "old_path": {"new path": {}, "old path": {"SHARED_PREFIX": "0", "SKIP_PI_OLD": "0"}},
    "shared_prefix": {"shared prefix": {"SHARED_PREFIX": "1"}, "full rows": {"SHARED_PREFIX": "0"}},
    # new side first
    "vllm": {"vLLM": {"USE_VLLM": "1"}, "transformers": {"USE_VLLM": "0"}},
}[COMPARE]
# the step-time ratio its issue asks for
TARGET = {"old_path": 0.5, "shared_prefix": None, "vllm": None}[COMPARE]
PHASES = [  # (name, how it is computed from one metrics line)
    ("generation", lambda m: m["generate_s"]),
    ("pi_old_logps (a forward of the sampling weights)", lambda m: m["pi_old_s"]),
    ("scoring", lambda m: m["score_s"]),
    ("server: upload, reference forward, download", lambda m: m["wait_s"]),
    ("policy forward + backward", lambda m: m["fwd_bwd_s"]),
    ("optimizer step", lambda m: m["optim_s"]),
    ("vLLM weight push", lambda m: m.get("push_s", 0.0)),
    (
        "everything else (prompts, collate, metrics)",
        lambda m: (
            m["seconds"]
            - m["generate_s"]
            - m["pi_old_s"]
            - m["score_s"]
            - m["wait_s"]
            - m["train_s"]
            - m.get("push_s", 0.0)
        ),
    ),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_steps(out_dir, **extra):
    """The real server and trainer for STEPS steps; returns the metrics.jsonl path."""
    port = free_port()
    env = {
        **os.environ,
        **extra,
        "PORT": str(port),
        "REF_SERVER": f"http://127.0.0.1:{port}",
        "OUTPUT_DIR": out_dir,
        "ALL_STEPS": str(STEPS),
        "EVAL_STEPS": "0",
        "SAVE_STEPS": "1000",
        "KEEP_CHECKPOINTS": "1",
    }
    with open(os.path.join(out_dir, "server.log"), "w") as log:
        server = subprocess.Popen(
            [sys.executable, "ref_server.py"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
            cmd = [
                deepspeed,
                "--num_gpus",
                "1",
                "--master_port",
                str(free_port()),
                "grpo_ref_split.py",
            ]
            subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
    return os.path.join(out_dir, "metrics.jsonl")


def anatomy(metrics_paths, label=""):
    """Mean phases over the training steps of these metrics files, each run's first step left
    out."""
    steps = []
    for path in metrics_paths:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        run = [m for m in lines if not any(k.startswith("eval_") for k in m)]
        if len(run) < 2 or any("score_s" not in m for m in run):
            sys.exit(
                f"{path}: need 2+ training steps logged with generate_s/pi_old_s/score_s "
                "(written by this version of grpo_ref_split.py)"
            )
        steps += run[1:]  # step 1 pays one-time costs (allocator, first compile of kernels)
    mean = lambda f: sum(f(m) for m in steps) / len(steps)  # noqa: E731
    step_s = mean(lambda m: m["seconds"])
    phases = {name: mean(f) for name, f in PHASES}
    overhead = step_s / (phases["generation"] + phases["policy forward + backward"])
    print(
        f"{label or metrics_paths[0]}: {len(steps)} steps from {len(metrics_paths)} run(s), mean "
        f"step {step_s:.1f} s"
    )
    for name, s in phases.items():
        print(f"  {name:45s} {s:7.2f} s  {s / step_s:6.1%}")
    print(
        f"  overhead ratio = step / (generation + forward+backward) = {overhead:.2f}  (target <= "
        "1.15)"
    )
    return dict(
        steps=len(steps),
        step_s=round(step_s, 2),
        phases_s={k: round(v, 3) for k, v in phases.items()},
        overhead_ratio=round(overhead, 3),
    )


def main():
    if len(sys.argv) > 1:
        result = dict(
            metrics=os.path.relpath(os.path.abspath(sys.argv[1]), ROOT), **anatomy(sys.argv[1:2])
        )
    else:
        runs = {name: [] for name in PATHS}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(ROUNDS):
                # alternating, so a slow spell of the machine hits both
                for name, env in PATHS.items():
                    out_dir = os.path.join(tmp, f"{name.replace(' ', '_')}{r}")
                    os.makedirs(out_dir)
                    runs[name].append(run_steps(out_dir, **env))
            if COMPARE != "vllm":
                kept = os.path.join(ROOT, "bench", "results", "step_anatomy_metrics.jsonl")
                # the default constants' last run, to read
                shutil.copy(runs[next(iter(PATHS))][-1], kept)
            result = {name: anatomy(paths, name) for name, paths in runs.items()}
        new, old = PATHS
        ratio = result[new]["step_s"] / result[old]["step_s"]
        print(
            f"step time, {new} / {old} = {ratio:.2f}"
            + (f"  (target <= {TARGET})" if TARGET else "")
        )
        result = {
            f"step_ratio_{new}_over_{old}".replace(" ", "_"): round(ratio, 3),
            "rounds": ROUNDS,
            "steps_per_run": STEPS,
            **result,
        }
    name = "step_anatomy.json" if COMPARE == "old_path" else f"step_anatomy_{COMPARE}.json"
    out = os.path.join(ROOT, "bench", "results", name)
    with open(out, "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
                "command": " ".join(
                    [f"COMPARE={COMPARE} python bench/bench_step_anatomy.py", *sys.argv[1:]]
                ),
                **result,
            },
            f,
            indent=1,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
