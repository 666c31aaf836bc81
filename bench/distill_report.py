"""The distillation comparison's table and curves (bench/run_distill.sh): for each run and seed, the
held-out greedy accuracy at steps 0 / 5 / 10 / 20 / 30, answers generated per answer trained, wall
minutes, and the first evaluated step at 85% held-out with the answers generated up to it; then the
held-out curves of every run in one figure.

    python bench/distill_report.py bench/results    # reads distill_<run>_s<seed>_metrics.jsonl
"""
import glob
import json
import os
import re
import sys

RUNS = {"grpo": "GRPO (rewards, k3 to the reference)",
        "grpo_ds": "GRPO with DYNAMIC_SAMPLING, no teacher", "opd": "pure OPD (teacher term only)",
        "opd_wide": "pure OPD, 32 questions x 1 answer",
        "opd_wide_sum": "pure OPD, 32 x 1, LOSS_TYPE dr_grpo", "grpo_opd": "GRPO + OPD",
        "grpo_opd_matched": "GRPO + OPD, DISTILL_SCALE matched",
        "grpo_opd_none": "GRPO + OPD, SCALE_REWARDS none",
        "grpo_opd_first": "GRPO + OPD, TEACHER_FIRST_KL 0.05",
        "grpo_opd_wrong": "GRPO + OPD, DISTILL_BELOW 2",
        "grpo_opd_handoff_plain": "OPD, then GRPO: the optimizer kept, equal groups kept",
        "grpo_opd_handoff_reset": "OPD, then GRPO: AdamW cleared, equal groups kept",
        "grpo_opd_handoff": "OPD, then GRPO (TEACHER_STEPS 10, DYNAMIC_SAMPLING)"}
STEPS = (0, 5, 10, 20, 30)
TARGET = 0.85  # held-out accuracy the issue asks about


def summary(path) -> dict:
    """One run's figures from its metrics.jsonl (and the _wall_s file beside it)."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    evals = {m["step"]: m["eval_reward_correct"] for m in lines if "eval_reward_correct" in m}
    train = [m for m in lines if "completions_generated" in m]
    generated = sum(m["completions_generated"] for m in train)
    reached = next((step for step in sorted(evals) if evals[step] >= TARGET), None)
    answers_to_target = None
    if reached is not None:
        answers_to_target = sum(m["completions_generated"] for m in train if m["step"] <= reached)
    wall = path.replace("_metrics.jsonl", "_wall_s")
    kl = [m["teacher_kl"] for m in train if "teacher_kl" in m]
    return dict(evals=evals, ratio=generated / max(1, sum(m["completions_trained"] for m in train)),
                minutes=int(open(wall).read()) / 60 if os.path.exists(wall) else float("nan"),
                reached=reached, answers_to_target=answers_to_target and int(answers_to_target),
                steps=len(train),
                teacher_kl=(kl[0], kl[-1]) if kl else None)


def percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def table(runs: dict):
    head = " | ".join(f"step {s}" for s in STEPS)
    print(f"| run | seed | {head} | generated / trained | minutes | 85% at step (answers) |"
          " teacher_kl first -> last |")
    print("|---|---|" + "---|" * (len(STEPS) + 4))
    for run, seeds in runs.items():
        for seed, s in sorted(seeds.items()):
            accuracy = " | ".join(percent(s["evals"].get(step)) for step in STEPS)
            target = "not reached"
            if s["reached"] is not None:
                target = f"{s['reached']} ({s['answers_to_target']})"
            kl = "-" if s["teacher_kl"] is None else "{:.3f} -> {:.3f}".format(*s["teacher_kl"])
            print(f"| {RUNS.get(run, run)} | {seed} | {accuracy} | {s['ratio']:.2f} | "
                  f"{s['minutes']:.1f} | {target} | {kl} |")


def curves(runs: dict, image: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {"grpo": "tab:blue", "opd": "tab:orange", "grpo_opd": "tab:green"}
    for run, seeds in runs.items():
        for seed, s in sorted(seeds.items()):
            steps = sorted(s["evals"])
            ax.plot(steps, [100 * s["evals"][step] for step in steps], marker="o",
                    color=colours.get(run), linestyle="-" if seed == min(seeds) else "--",
                    label=f"{RUNS.get(run, run)}, seed {seed}")
    ax.axhline(100 * TARGET, color="grey", linewidth=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title("SmolLM2-135M: GRPO, on-policy distillation, both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(image, dpi=110)
    print(f"curves: {image}")


def main(folder):
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "distill_*_s*_metrics.jsonl"))):
        run, seed = re.match(r"distill_(.+)_s(\d+)_metrics\.jsonl", os.path.basename(path)).groups()
        runs.setdefault(run, {})[int(seed)] = summary(path)
    if not runs:
        sys.exit(f"no distill_*_s*_metrics.jsonl in {folder}: run bench/run_distill.sh first")
    runs = {run: runs[run] for run in sorted(runs, key=lambda r: list(RUNS).index(r)
                                              if r in RUNS else len(RUNS))}
    table(runs)
    curves(runs, os.path.join(folder, "distill_curves.png"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
