"""The environments demo's tables and curves (bench/run_envs.sh): for each environment, its
held-out greedy score every 5 steps in the run that mixes three environments and in the run on it
alone, seed by seed; then each environment mixed against alone at equal questions (the alone
run's evaluation nearest the questions the mix gave it); then the task no run trains on, asked of
the base model and of each run's last checkpoint; then one figure with a panel per environment.

    python bench/envs_report.py bench/results/envs   # reads envs_<run>_s<seed>_metrics.jsonl
    python bench/envs_report.py A B                  # runs from both folders (B's over A's)

An environment's score is its held-out success reward: reward_correct for a task the trainer's
REWARDS score and for reasoning-gym's, the reward named in SUCCESS for another (the game's
"solved"). Its metric is eval_<reward>_<tag> (features/evaluation.py). A reward an environment
does not give reads 0 in its means (environments.score fills every name), so a success metric that
is 0 at every evaluation of every run is left out where its tag has another.
"""
import glob
import json
import os
import re
import sys

SUCCESS = ("reward_correct", "solved")  # the rewards that say an episode succeeded
STEPS = (0, 5, 10, 15, 20, 25, 30)  # the evaluated steps the tables show (EVAL_STEPS 5)


def held_out(path) -> dict:
    """{metric: {step: value}} of a run's per-environment success metrics (eval_<reward>_<tag>)."""
    scores = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            for key, value in record.items():
                if any(key.startswith(f"eval_{reward}_") for reward in SUCCESS):
                    scores.setdefault(key, {})[record["step"]] = value
    return scores


def run_files(folders: list, pattern: str) -> list:
    """The files matching `pattern` in each folder, a later folder's after an earlier one's."""
    return [path for folder in folders for path in sorted(glob.glob(os.path.join(folder, pattern)))]


def runs_in(folders: list) -> dict:
    """{(run, seed): held_out(...)} of every envs_<run>_s<seed>_metrics.jsonl in the folders; a run
    in a later folder replaces the same run and seed in an earlier one."""
    runs = {}
    for path in run_files(folders, "envs_*_s*_metrics.jsonl"):
        named = re.match(r"envs_(.+)_s(\d+)_metrics\.jsonl", os.path.basename(path))
        run, seed = named.groups()
        runs[(run, int(seed))] = held_out(path)
    return runs


def success_metrics(runs: dict) -> list:
    """The metrics to report: every success metric, but one that is 0 throughout where its
    environment's tag has another (the game's eval_reward_correct_<tag>, which it never gives)."""
    metrics = sorted({metric for scores in runs.values() for metric in scores})
    never = {m for m in metrics
             if all(v == 0 for scores in runs.values() for v in scores.get(m, {}).values())}

    def tag(metric):
        return next(metric[len(f"eval_{r}_"):] for r in SUCCESS if metric.startswith(f"eval_{r}_"))

    return [m for m in metrics
            if m not in never or not any(tag(o) == tag(m) for o in metrics if o != m)]


def percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def mean_of(values: list):
    """The mean of the values that are there, or None when any is missing (a run not finished)."""
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)


def tables(runs: dict, metrics: list):
    """One table per environment metric: each run that logged it, seed by seed, then the mean over
    its seeds where it ran on more than one."""
    for metric in metrics:
        print(f"\n{metric} (held-out, greedy, %)\n")
        print("| run | seed | " + " | ".join(f"step {s}" for s in STEPS) + " |")
        print("|---|---|" + "---|" * len(STEPS))
        for (run, seed), scores in sorted(runs.items()):
            if metric in scores:
                row = " | ".join(percent(scores[metric].get(step)) for step in STEPS)
                print(f"| {run} | {seed} | {row} |")
        for run in sorted({run for run, _ in runs}):
            seeded = [scores[metric] for (name, _), scores in runs.items()
                      if name == run and metric in scores]
            if len(seeded) > 1:
                row = " | ".join(percent(mean_of([s.get(step) for s in seeded])) for step in STEPS)
                print(f"| {run} | mean of {len(seeded)} | {row} |")


def questions_mixed(path) -> dict:
    """{tag: steps' worth of questions} the mixed run trained on per environment: the sum over its
    steps of share_<tag>, so that many steps of a run on the environment alone saw as many."""
    steps_worth = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                for key, value in json.loads(line).items():
                    if key.startswith("share_"):
                        tag = key[len("share_"):]
                        steps_worth[tag] = steps_worth.get(tag, 0.0) + value
    return steps_worth


def equal_questions(folders: list, runs: dict, metrics: list):
    """Mixed against alone at equal questions per environment: the mixed run's last evaluation
    against the alone run's evaluation nearest the steps' worth of questions the mix gave it."""
    print("\nMixed at its last step against alone at equal questions (held-out, greedy, %)\n")
    print("| environment | seed | mixed: steps' worth | mixed: score | alone: step | "
          "alone: score |")
    print("|---|---|---|---|---|---|")
    for (run, seed), mixed in sorted(runs.items()):
        if run != "mix":
            continue
        path = run_files(folders, f"envs_{run}_s{seed}_metrics.jsonl")[-1]
        for tag, worth in sorted(questions_mixed(path).items()):
            metric = next((m for m in metrics if m.endswith(f"_{tag}") and m in mixed), None)
            alone = next((scores[metric] for (other, other_seed), scores in runs.items()
                          if other != "mix" and other_seed == seed and metric in scores), None)
            if metric is None or alone is None:
                continue
            last = max(mixed[metric])
            near = min(alone, key=lambda step: abs(step - worth))  # an evaluated step
            print(f"| {tag} | {seed} | {worth:.1f} | {percent(mixed[metric][last])} | {near} | "
                  f"{percent(alone[near])} |")


def unseen(folders: list):
    """The task no run trained on: the base model's score and each run's last checkpoint's."""
    print("\nThe task no run trains on (held-out, greedy, %)\n")
    print("| model | seed | score |")
    print("|---|---|---|")
    rows = {}  # {(model, seed): score}, a later folder's over an earlier one's
    for path in run_files(folders, "*_unseen.json") + run_files(folders, "unseen_base_s*.json"):
        try:
            with open(path) as f:
                probed = json.load(f)
            score = float(probed["eval_reward_correct"])
        except (ValueError, KeyError, TypeError) as err:
            sys.exit(f"{path} holds no probe's score ({type(err).__name__}: {err}): delete it "
                     "(a run's: its _wall_s too, so the run trains again), then run "
                     "bench/run_envs.sh again")
        name = os.path.basename(path)
        seed = re.search(r"_s(\d+)", name).group(1)
        model = "base" if name.startswith("unseen_base") else name.split("_s")[0][len("envs_"):]
        rows[(model, seed)] = score
    for (model, seed), score in rows.items():
        print(f"| {model} | {seed} | {percent(score)} |")


def curves(runs: dict, metrics: list, image: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for (run, seed), scores in sorted(runs.items()):
            if metric in scores:
                steps = sorted(scores[metric])
                ax.plot(steps, [100 * scores[metric][s] for s in steps], marker="o",
                        color="tab:green" if run == "mix" else "tab:blue",
                        label=f"{run}, seed {seed}")
        ax.set_title(metric, fontsize=8)
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out greedy score (%)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(image, dpi=110)
    print(f"\ncurves: {image}")


def main(folders: list):
    runs = runs_in(folders)
    if not runs:
        sys.exit(f"no envs_*_s*_metrics.jsonl in {folders}: run bench/run_envs.sh first")
    metrics = success_metrics(runs)
    tables(runs, metrics)
    equal_questions(folders, runs, metrics)
    unseen(folders)
    curves(runs, metrics, os.path.join(folders[-1], "envs_curves.png"))


if __name__ == "__main__":
    main(sys.argv[1:] or ["bench/results/envs"])
