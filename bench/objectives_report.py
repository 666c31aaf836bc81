"""The objectives comparison's table (bench/run_objectives.sh): for each setting and seed, held-out
greedy accuracy and pass@4 at steps 0/10/20/30, answers generated per answer trained over the run,
seconds per training step and wall time; then each setting's mean over its seeds, and each one's
last held-out accuracy against the default's on the same seed (a default changes only for a setting
ahead on every seed). It also draws objectives_curves.png in the folder: issue 59's settings'
held-out accuracy beside the default's, on the seeds they share.

    # reads objectives_<setting>_s<seed>_metrics.jsonl
    python bench/objectives_report.py bench/results
"""
import glob
import json
import os
import re
import sys

SETTINGS = {
    "default": "default (LR cosine to 0.1x)",
    "flat": "flat LR (the default until 2026-11-25)",
    "dynamic": "DYNAMIC_SAMPLING=1, flat LR",
    "difficulty": "SAMPLER=difficulty, flat LR",
    "dr_grpo": "LOSS_TYPE=dr_grpo SCALE_REWARDS=none, flat LR",
    "learnability": "SAMPLER=learnability, pass of 256",
    "learn_dynamic": "learnability + DYNAMIC",
    "mu2": "MU=2 (PPO's clip)",
    "cispo": "OBJECTIVE=cispo MU=2 (before issue 79: answer means, cap 1.2)",
    "cispo_paper": "OBJECTIVE=cispo LOSS_TYPE=dapo MU=2 (cap 5)",
    "sapo": "OBJECTIVE=sapo MU=2",
    "gmpo": "OBJECTIVE=gmpo MU=2",
    "rloo": "ADVANTAGE=rloo",
    "reinforce_pp": "ADVANTAGE=reinforce_pp_baseline",
    "passk": "ADVANTAGE=passk",
    "gdpo": "REWARD_NORM=normalize_then_sum",
    "top_entropy": "TOP_ENTROPY_QUANTILE=0.2",
}
STEPS = (0, 10, 20, 30)
# The curves' two panels: the surrogates, which compare at MU = 2 beside PPO's clip there, and the
# advantages and token choices, which compare beside the default as it is.
PANELS = {
    "surrogates (MU=2)": ("default", "mu2", "cispo", "cispo_paper", "sapo", "gmpo"),
    "advantages and tokens (MU=1)": ("default", "rloo", "reinforce_pp", "passk", "gdpo",
                                     "top_entropy"),
}


def summary(path):
    """{greedy: {step: acc}, pass4: {step: pass@4}, ratio: generated / trained answers, minutes} of
    one run."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    evals = {m["step"]: m for m in lines if "eval_reward_correct" in m}
    train = [m for m in lines if "completions_generated" in m]
    wall = path.replace("_metrics.jsonl", "_wall_s")
    # PASS_RATE_QUESTIONS x NUM_PRE_Q more
    passes = path.replace("_metrics.jsonl", "_pass_rates.json")
    before = 0
    if os.path.exists(passes):
        with open(passes) as f:
            before = 8 * len(json.load(f)["rates"])  # the demo's NUM_PRE_Q answers to each
    return dict(
        greedy={s: evals[s]["eval_reward_correct"] for s in STEPS if s in evals},
        pass4={s: evals[s].get("eval_pass@4") for s in STEPS if s in evals},
        ratio=(before + sum(m["completions_generated"] for m in train))
        / max(1, sum(m["completions_trained"] for m in train)),
        step_s=sum(m["seconds"] for m in train) / max(1, len(train)),
        minutes=int(open(wall).read()) / 60 if os.path.exists(wall) else float("nan"),
        steps=len(train),
    )


def cell(v):
    return "-" if v is None else f"{100 * v:.1f}"


def main(folder):
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "objectives_*_s*_metrics.jsonl"))):
        setting, seed = re.match(
            r"objectives_(.+)_s(\d+)_metrics\.jsonl", os.path.basename(path)
        ).groups()
        runs.setdefault(setting, {})[int(seed)] = summary(path)
    head = (
        " | ".join(f"greedy {s}" for s in STEPS) + " | " + " | ".join(f"pass@4 {s}" for s in STEPS)
    )
    print(f"| setting | seed | {head} | generated / trained | s / step | minutes |")
    print("|---|---|" + "---|" * (2 * len(STEPS) + 3))
    for setting in [s for s in SETTINGS if s in runs] + [s for s in runs if s not in SETTINGS]:
        seeds = runs[setting]
        rows = [(str(seed), r) for seed, r in sorted(seeds.items())]
        if len(seeds) > 1:  # the mean over seeds, where every seed has the value
            mean = lambda key, s: (
                sum(r[key][s] for r in seeds.values()) / len(seeds)  # noqa: E731
                if all(r[key].get(s) is not None for r in seeds.values())
                else None
            )
            rows.append(
                (
                    "mean",
                    dict(
                        greedy={s: mean("greedy", s) for s in STEPS},
                        pass4={s: mean("pass4", s) for s in STEPS},
                        ratio=sum(r["ratio"] for r in seeds.values()) / len(seeds),
                        step_s=sum(r["step_s"] for r in seeds.values()) / len(seeds),
                        minutes=sum(r["minutes"] for r in seeds.values()) / len(seeds),
                    ),
                )
            )
        for seed, r in rows:
            cells = [cell(r["greedy"].get(s)) for s in STEPS] + [
                cell(r["pass4"].get(s)) for s in STEPS
            ]
            print(
                f"| {SETTINGS.get(setting, setting)} | {seed} | {' | '.join(cells)} | "
                f"{r['ratio']:.2f} | {r['step_s']:.1f} | {r['minutes']:.1f} |"
            )
    against_default(runs)
    curves(runs, os.path.join(folder, "objectives_curves.png"))


def against_default(runs: dict):
    """The issue's rule for changing a default: each setting's held-out greedy accuracy at the last
    step minus the default's on the same seed, and on how many of those seeds it is ahead."""
    last = STEPS[-1]
    default = runs.get("default", {})
    print(f"\n| setting | greedy {last} minus the default's, by seed | seeds ahead |")
    print("|---|---|---|")
    for setting in [s for s in SETTINGS if s in runs and s != "default"]:
        seeds = [
            seed
            for seed in sorted(runs[setting])
            if seed in default
            and last in default[seed]["greedy"]
            and last in runs[setting][seed]["greedy"]
        ]
        gaps = [
            runs[setting][seed]["greedy"][last] - default[seed]["greedy"][last] for seed in seeds
        ]
        by_seed = ", ".join(f"{seed}: {100 * gap:+.1f}" for seed, gap in zip(seeds, gaps))
        ahead = sum(gap > 0 for gap in gaps)
        print(f"| {SETTINGS[setting]} | {by_seed or '-'} | {ahead} of {len(gaps)} |")


def curves(runs: dict, image: str):
    """Each panel's settings on the seeds all of them have (so the default is never a mean of more
    seeds than the others): the mean held-out greedy accuracy at STEPS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 4.5), sharey=True)
    for ax, (title, settings) in zip(axes, PANELS.items()):
        drawn = [s for s in settings if s in runs]
        if not drawn:
            continue
        common = sorted(set.intersection(*(set(runs[s]) for s in drawn)))
        if not common:  # no seed that every setting of the panel has run yet
            continue
        for setting in drawn:
            seeds = [runs[setting][seed] for seed in common]
            steps = [s for s in STEPS if all(s in r["greedy"] for r in seeds)]
            accuracy = [100 * sum(r["greedy"][s] for r in seeds) / len(seeds) for s in steps]
            ax.plot(steps, accuracy, marker="o", label=SETTINGS.get(setting, setting))
        seed_word = "seeds" if len(common) > 1 else "seed"
        ax.set_title(f"{title}, {seed_word} {', '.join(map(str, common))}")
        ax.set_xlabel("training step")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out greedy accuracy (%), mean of seeds")
    fig.tight_layout()
    fig.savefig(image, dpi=110)
    print(f"curves: {image}")


if __name__ == "__main__":
    main(
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
