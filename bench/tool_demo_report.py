"""The tool-use demo's table and curve from its runs (bench/run_tool_demo.sh): held-out greedy
accuracy on small and large operands and the share of answers that called the calculator, at each
evaluation, with the calculator and without, and each run's wall time. Copies each run's
metrics.jsonl into bench/results/.

    python bench/tool_demo_report.py /tmp/tool_demo        # the folder holding tools/ and plain/
    python bench/tool_demo_report.py /tmp/tool_s43 _s43    # copies named tool_demo_<run>_s43_*
"""
import json
import os
import pathlib
import shutil
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LABELS = {
    "tools": "calculator, call cost 0.25",
    "tools_group": "calculator, call cost 0.25, group-scaled",
    "tools_free": "calculator, free calls, group-scaled",
    "plain": "no calculator",
}
COLORS = ("C0", "C1", "C2", "C3")  # one per run in LABELS


def evals(folder):
    """The held-out evaluation lines of a run's metrics.jsonl, by step."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return {m["step"]: m for m in lines if any(k.startswith("eval_") for k in m)}


def main(root, suffix=""):
    runs = {
        name: evals(os.path.join(root, name))
        for name in LABELS
        if os.path.exists(os.path.join(root, name))
    }
    walls = {name: os.path.join(root, name, "wall_s") for name in runs}
    wall = {
        name: int(pathlib.Path(path).read_text())
        for name, path in walls.items()
        if os.path.exists(path)
    }
    # held-out, greedy
    print("| run | step | right, small | right, large | called, small | called, large |")
    print("|---|---|---|---|---|---|")
    for name, by_step in runs.items():
        for step, m in sorted(by_step.items()):
            share = [
                f"{m[f'eval_tool_share_{t}']:.1%}" if f"eval_tool_share_{t}" in m else "-"
                for t in ("small", "large")
            ]
            right = [f"{m[f'eval_reward_correct_{t}']:.1%}" for t in ("small", "large")]
            print(
                f"| {LABELS[name]} | {step} | {right[0]} | {right[1]} | {share[0]} | {share[1]} |"
            )
    print("wall time: " + ", ".join(f"{LABELS[name]} {s / 60:.1f} min" for name, s in wall.items()))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, tag in zip(axes, ("small", "large")):
        for (name, by_step), color in zip(runs.items(), COLORS):
            steps = sorted(by_step)
            ax.plot(
                steps,
                [100 * by_step[s][f"eval_reward_correct_{tag}"] for s in steps],
                "-o",
                color=color,
                label=f"right: {LABELS[name]}",
            )
            if f"eval_tool_share_{tag}" in by_step[steps[0]]:
                ax.plot(
                    steps,
                    [100 * by_step[s][f"eval_tool_share_{tag}"] for s in steps],
                    ":^",
                    color=color,
                    label=f"called: {LABELS[name]}",
                )
        ax.set(title=f"held-out, {tag} operands", xlabel="step", ylabel="%", ylim=(0, 102))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    os.makedirs(RESULTS, exist_ok=True)
    curve = os.path.join(RESULTS, f"tool_demo_curves{suffix}.png")
    fig.savefig(curve, dpi=100)
    for name in runs:
        shutil.copy(
            os.path.join(root, name, "metrics.jsonl"),
            os.path.join(RESULTS, f"tool_demo_{name}{suffix}_metrics.jsonl"),
        )
    print(f"curve: {curve}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tool_demo", *sys.argv[2:3])
