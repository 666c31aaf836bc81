"""Seconds per GRPO step and per generated token: this project against TRL's GRPOTrainer, same CPU,
same model and workload, the two alternating in one invocation (ours, TRL, ours, TRL).

Both train the embedded SmolLM2-135M-Instruct on the built-in arithmetic task with the very same
prompts (system prompt, worked example, `<think>` prefill), 4 questions x 8 answers per step,
64 new tokens at temperature 0.7 with no top-k/top-p, beta 0.04, clip 0.2, lr 1e-5, fp32, one
process, the same rewards (2 x correct + 1 x format). Ours: `python ref_server.py` plus
`deepspeed --num_gpus 1 grpo_ref_split.py` (bench_step_anatomy.run_steps, default constants);
TRL: GRPOTrainer in this process with its reference model in memory. The first step of each run
is left out (warm-up).

TRL is not a dependency of the project; install it for this script only, without touching the
project's pins:
    pip install --no-deps --target /tmp/trl_pkg trl==1.16.0
    PYTHONPATH=/tmp/trl_pkg python bench/bench_vs_trl.py     # ~20 minutes on 2 CPU cores
    USE_VLLM=1 PYTHONPATH=/tmp/trl_pkg python bench/bench_vs_trl.py   # ours generating with vLLM
Writes bench/results/vs_trl.json (vs_trl_vllm.json with USE_VLLM=1; TRL runs without vLLM either
way). """
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step_anatomy import STEPS, run_steps  # noqa: E402

ROUNDS = 2  # runs of each, alternating


def trl_steps(out_dir):
    """TRL's GRPOTrainer for STEPS steps: [(seconds, tokens generated)] per step."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import grpo_ref_split as g
    import rewards
    from features.embedded_model import resolve_model_path

    path = resolve_model_path("")
    tokenizer = AutoTokenizer.from_pretrained(path)
    questions, _ = rewards.split_held_out(
        rewards.load_questions(g.DATASET, g.SEED, g.ARITH_MAX), g.EVAL_SIZE
    )
    data = Dataset.from_list(
        [
            {"prompt": g.build_prompt(tokenizer, q["question"]), "gold": q["gold"]}
            # already chat-templated and prefilled
            for q in questions[: 4 * STEPS * 4]
        ]
    )

    # TRL calls reward_funcs with lists; ours take one completion, its gold and question
    def trl_reward(fn):
        def call(prompts, completions, gold, **_):
            return [fn(g.THINK_PREFILL + c, a, p) for p, c, a in zip(prompts, completions, gold)]

        call.__name__ = fn.__name__
        return call

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)
            print(f"TRL step {len(self.times)}: {self.times[-1]:.1f} s", flush=True)

    config = GRPOConfig(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=g.Q_BATCH_SIZE * g.NUM_PRE_Q,
        num_generations=g.NUM_PRE_Q,
        max_completion_length=g.MAX_NEW_TOKENS,
        temperature=g.TEMPERATURE,
        top_k=0,
        top_p=1.0,
        beta=g.BETA,
        epsilon=g.CLIP_EPS,
        learning_rate=g.LR,
        loss_type="grpo",
        num_iterations=1,
        reward_weights=[w for _, w in g.REWARDS],
        logging_steps=1,
        save_strategy="no",
        # ours runs without it too
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=g.SEED,
        model_init_kwargs={"dtype": torch.float32},
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=[trl_reward(fn) for fn, _ in g.REWARDS],
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    lengths = [
        h["completions/mean_length"]
        for h in trainer.state.log_history
        if "completions/mean_length" in h
    ]
    return [(t, n * config.per_device_train_batch_size) for t, n in zip(timer.times, lengths)]


def our_steps(out_dir):
    """Our trainer and server for STEPS steps: [(seconds, tokens generated)] per step."""
    with open(run_steps(out_dir)) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    import grpo_ref_split as g

    return [
        (m["seconds"], m["length"] * g.Q_BATCH_SIZE * g.NUM_PRE_Q) for m in lines if "seconds" in m
    ]


def summary(runs):
    """Means over every run's steps but the first: seconds per step, seconds per generated token."""
    steps = [s for run in runs for s in run[1:]]
    return dict(
        s_per_step=round(sum(t for t, _ in steps) / len(steps), 2),
        s_per_token=round(sum(t for t, _ in steps) / sum(n for _, n in steps), 4),
        steps=[[round(t, 2), round(n)] for run in runs for t, n in run],
    )


def main():
    try:
        import trl
    except ImportError:
        sys.exit(
            "TRL is not installed (it is not a project dependency). For this benchmark only:\n"
            "  pip install --no-deps --target /tmp/trl_pkg trl==1.16.0\n"
            "  PYTHONPATH=/tmp/trl_pkg python bench/bench_vs_trl.py"
        )
    runs = {"ours": [], "trl": []}
    for _ in range(ROUNDS):
        for name, fn in (("ours", our_steps), ("trl", trl_steps)):
            with tempfile.TemporaryDirectory() as out_dir:
                runs[name].append(fn(out_dir))
    ours, theirs = summary(runs["ours"]), summary(runs["trl"])
    ratio = ours["s_per_step"] / theirs["s_per_step"]
    print(
        f"ours: {ours['s_per_step']:.1f} s/step, {ours['s_per_token'] * 1000:.1f} ms per generated "
        "token"
    )
    print(
        f"TRL {trl.__version__}: {theirs['s_per_step']:.1f} s/step, "
        f"{theirs['s_per_token'] * 1000:.1f} ms per generated token"
    )
    import grpo_ref_split as g

    print(f"ratio ours / TRL (s per step) = {ratio:.2f}  (target <= {0.3 if g.USE_VLLM else 0.45})")
    out = os.path.join(
        ROOT, "bench", "results", "vs_trl_vllm.json" if g.USE_VLLM else "vs_trl.json"
    )
    with open(out, "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
                "command": f"USE_VLLM={int(g.USE_VLLM)} PYTHONPATH=/tmp/trl_pkg "
                "python bench/bench_vs_trl.py",
                "trl_version": trl.__version__,
                "rounds": ROUNDS,
                "steps_per_run": STEPS,
                "ours": ours,
                "trl": theirs,
                "ratio_s_per_step": round(ratio, 3),
            },
            f,
            indent=1,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
