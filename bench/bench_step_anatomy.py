"""Where a training step's time goes: generation, gen_logps, scoring, waiting for the reference
server, policy forward+backward, optimizer, and the overhead ratio step / (generation + fwd+bwd).

Without an argument it runs the real thing for a few steps: `python ref_server.py` and
`deepspeed --num_gpus 1 grpo_ref_split.py` on the embedded model with the default constants
(evaluation off), and reads the per-step timings the trainer writes to metrics.jsonl. With a
metrics.jsonl (e.g. the demo's) it only reads that file.

    python bench/bench_step_anatomy.py                          # ~6 minutes on 2 CPU cores
    python bench/bench_step_anatomy.py output/metrics.jsonl     # any finished run
Writes bench/results/step_anatomy.json (and the run's metrics to step_anatomy_metrics.jsonl).
"""
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
STEPS = 5  # training steps to run; the first is left out of the averages (warm-up)
PHASES = [  # (name, how it is computed from one metrics line)
    ("generation", lambda m: m["generate_s"]),
    ("gen_logps (a forward of the sampling weights)", lambda m: m["gen_logps_s"]),
    ("scoring", lambda m: m["score_s"]),
    ("server: upload, reference forward, download", lambda m: m["wait_s"]),
    ("policy forward + backward", lambda m: m["fwd_bwd_s"]),
    ("optimizer step", lambda m: m["optim_s"]),
    ("everything else (prompts, collate, metrics)",
     lambda m: m["seconds"] - m["generate_s"] - m["gen_logps_s"] - m["score_s"] - m["wait_s"] - m["train_s"]),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_steps(out_dir):
    """The real server and trainer for STEPS steps; returns the metrics.jsonl path."""
    port = free_port()
    env = {**os.environ, "PORT": str(port), "REF_SERVER": f"http://127.0.0.1:{port}", "OUTPUT_DIR": out_dir,
           "ALL_STEPS": str(STEPS), "EVAL_STEPS": "0", "SAVE_STEPS": "1000", "KEEP_CHECKPOINTS": "1"}
    with open(os.path.join(out_dir, "server.log"), "w") as log:
        server = subprocess.Popen([sys.executable, "ref_server.py"], cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
        try:
            deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
            cmd = [deepspeed, "--num_gpus", "1", "--master_port", str(free_port()), "grpo_ref_split.py"]
            subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
    return os.path.join(out_dir, "metrics.jsonl")


def anatomy(metrics_path):
    with open(metrics_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    steps = [m for m in lines if not any(k.startswith("eval_") for k in m)]
    if len(steps) < 2 or any("score_s" not in m for m in steps):
        sys.exit(f"{metrics_path}: need 2+ training steps logged with generate_s/gen_logps_s/score_s "
                 "(written by this version of grpo_ref_split.py)")
    steps = steps[1:]  # step 1 pays one-time costs (allocator, first compile of kernels)
    mean = lambda f: sum(f(m) for m in steps) / len(steps)  # noqa: E731
    step_s = mean(lambda m: m["seconds"])
    phases = {name: mean(f) for name, f in PHASES}
    overhead = step_s / (phases["generation"] + phases["policy forward + backward"])
    print(f"{metrics_path}: steps {steps[0]['step']}..{steps[-1]['step']}, mean step {step_s:.1f} s")
    for name, s in phases.items():
        print(f"  {name:45s} {s:7.2f} s  {s / step_s:6.1%}")
    print(f"overhead ratio = step / (generation + forward+backward) = {overhead:.2f}  (target <= 1.10)")
    return dict(metrics=os.path.relpath(os.path.abspath(metrics_path), ROOT), steps=len(steps), step_s=round(step_s, 2),
                phases_s={k: round(v, 3) for k, v in phases.items()}, overhead_ratio=round(overhead, 3))


def main():
    if len(sys.argv) > 1:
        result = anatomy(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as out_dir:
            kept = os.path.join(ROOT, "bench", "results", "step_anatomy_metrics.jsonl")
            shutil.copy(run_steps(out_dir), kept)  # bench_vs_trl.py can reuse this run
            result = anatomy(kept)
    out = os.path.join(ROOT, "bench", "results", "step_anatomy.json")
    with open(out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
                   "command": "python bench/bench_step_anatomy.py " + " ".join(sys.argv[1:]), **result}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
