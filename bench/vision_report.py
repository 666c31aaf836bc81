"""The vision demo's table and curves (bench/run_vision_demo.sh): for each run and seed, the
held-out greedy accuracy on "What colour is the larger shape?" at steps 0 / 10 / 20 / 30 against
chance, answers generated per answer trained, and wall minutes (the model's making and caption pass
apart); the controls of each run's step 30 (bench/vision_controls.py: colour-swapped and
position-swapped twins, shuffled and blank images); then bench/results/vision_curves.png, every
run's held-out curve with the two chance levels.

    python bench/vision_report.py bench/results    # reads vision_<run>_s<seed>_metrics.jsonl
"""
import glob
import json
import os
import re
import sys

STEPS = (0, 10, 20, 30)
CHANCE = ("25.0% for one of the 4 colours at random", "50.0% for one of the 2 colours shown")
CONTROLS = {"original": "as they are", "twins": "colour-swapped twins",
            "both_twins": "right on both colour twins", "positions": "position-swapped twins",
            "both_positions": "right on both position twins", "shuffled": "shuffled",
            "blank": "blank"}  # vision_controls.py's keys, in the table's order
RUNS = {"aligned": "caption pass, then GRPO", "aligned_vllm": "the same, vLLM sampling",
        "unaligned": "GRPO from the random vision side"}


def summary(path) -> dict:
    """One run's figures from its metrics.jsonl and the _wall_s file beside it."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    evals = {m["step"]: m["eval_reward_word"] for m in lines if "eval_reward_word" in m}
    train = [m for m in lines if "completions_generated" in m]
    generated = sum(m["completions_generated"] for m in train)
    trained = sum(m["completions_trained"] for m in train)
    wall = path.replace("_metrics.jsonl", "_wall_s")
    minutes = int(open(wall).read()) / 60 if os.path.exists(wall) else float("nan")
    stopped = path.replace("_metrics.jsonl", "_stopped")  # the trainer gave up (MAX_ROLLOUTS)
    reason = open(stopped).read().strip() if os.path.exists(stopped) else ""
    return dict(evals=evals, ratio=generated / max(1, trained), minutes=minutes, steps=len(train),
                stopped=reason)


def controls_table(folder: str, runs: dict):
    """Each run's controls (its _controls.json) as a row per seed, in %."""
    rows = []
    for run in runs:
        for seed in sorted(runs[run]):
            path = os.path.join(folder, f"vision_{run}_s{seed}_controls.json")
            if os.path.exists(path):
                rows.append((f"{RUNS.get(run, run)}, seed {seed}", json.load(open(path))))
    if not rows:
        return
    print("\ncontrols of step 30, held-out greedy accuracy (%):")
    print("| held-out images | " + " | ".join(name for name, _ in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for key, text in CONTROLS.items():
        cells = " | ".join("-" if key not in values else f"{100 * values[key]:.1f}"
                           for _, values in rows)
        print(f"| {text} | {cells} |")


def curves(runs: dict, image: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, seeds in runs.items():
        for seed, s in sorted(seeds.items()):
            steps = sorted(s["evals"])
            ax.plot(steps, [100 * s["evals"][step] for step in steps], marker="o",
                    label=f"{RUNS.get(run, run)}, seed {seed}")
    for level, text in ((25, "a colour at random"), (50, "one of the two shown")):
        ax.axhline(level, color="grey", linewidth=0.8, linestyle=":")
        ax.text(0.5, level + 1, f"chance: {text}", fontsize=7, color="grey")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_ylim(-2, 100)
    ax.set_title("SmolVLM-shaped model from SmolLM2-135M: the colour of the larger shape")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(image, dpi=110)
    print(f"curves: {image}")


def main(folder):
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "vision_*_s*_metrics.jsonl"))):
        run, seed = re.match(r"vision_(.+)_s(\d+)_metrics\.jsonl", os.path.basename(path)).groups()
        runs.setdefault(run, {})[int(seed)] = summary(path)
    if not runs:
        sys.exit(f"no vision_*_s*_metrics.jsonl in {folder}: run bench/run_vision_demo.sh first")
    print(f"chance: {CHANCE[0]}; {CHANCE[1]}")
    head = " | ".join(f"step {s}" for s in STEPS)
    print(f"| run | seed | {head} | generated / trained | minutes |")
    print("|---|---|" + "---|" * (len(STEPS) + 2))
    for run in sorted(runs, key=lambda r: list(RUNS).index(r) if r in RUNS else len(RUNS)):
        for seed, s in sorted(runs[run].items()):
            accuracy = " | ".join("-" if s["evals"].get(step) is None
                                  else f"{100 * s['evals'][step]:.1f}" for step in STEPS)
            ratio = f"{s['ratio']:.2f}" if s["steps"] else "no answer trained"
            print(f"| {RUNS.get(run, run)} | {seed} | {accuracy} | {ratio} | {s['minutes']:.1f} |")
            if s["stopped"]:
                print(f"  {run} seed {seed} stopped after {s['steps']} steps: {s['stopped']}")
    controls_table(folder, runs)
    curves(runs, os.path.join(folder, "vision_curves.png"))
    losses = os.path.join(folder, "vision_caption_losses.json")
    if os.path.exists(losses):
        values = json.load(open(losses))
        print(f"caption pass: {len(values)} steps, loss {values[0]:.3f} -> "
              f"{sum(values[-10:]) / len(values[-10:]):.3f} (mean of the last 10)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
