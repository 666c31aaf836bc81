"""One one-step run of the tiny test model, started through DeepSpeed's launcher and without it,
alternated side by side: what the launcher adds to each of the suite's one-rank runs.

    python bench/bench_launch.py MODEL_DIR [ROUNDS]   # MODEL_DIR: e.g. the tests' tiny_model folder
"""
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A port no one listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_seconds(command: list, model_dir: str) -> float:
    """Seconds for one step of 2 questions x 4 answers, BETA 0 (no server), to the process exit."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "MODEL_PATH": model_dir, "OUTPUT_DIR": out, "ALL_STEPS": "1",
               "BETA": "0", "EVAL_STEPS": "0", "Q_BATCH_SIZE": "2", "NUM_PRE_Q": "4",
               "MAX_NEW_TOKENS": "16", "OMP_NUM_THREADS": "1"}
        start = time.time()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.time() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return seconds


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    model_dir = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    for _ in range(rounds):
        launcher = [deepspeed, "--num_gpus", "1", "--master_port", str(free_port()),
                    "grpo_ref_split.py"]
        with_launcher = run_seconds(launcher, model_dir)
        without = run_seconds([sys.executable, "grpo_ref_split.py"], model_dir)
        print(f"launcher {with_launcher:.1f} s, python {without:.1f} s, "
              f"ratio {with_launcher / without:.2f}", flush=True)


if __name__ == "__main__":
    main()
