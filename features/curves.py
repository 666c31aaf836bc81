"""Log: the run's curves, reward, each reward function's mean and the KL against step, from any
metrics.jsonl (features/run_log.py writes it), as a PNG beside it; the trainer draws them at each
checkpoint.

    python -m features.curves output/metrics.jsonl reward_correct reward_format   # curves.png
"""
import json
import os
import sys


def is_eval(line: dict) -> bool:
    """A held-out evaluation's line of metrics.jsonl (its metrics are eval_<reward name>)."""
    return any(k.startswith("eval_") for k in line)


def environment_tags(rows) -> list:
    """The environments a run's training lines report on (their share_<tag> metrics), sorted."""
    return sorted({k[len("share_"):] for r in rows for k in r if k.startswith("share_")})


def plot_on_rank_0(rank, log, reward_names):
    """Rank 0 redraws curves.png beside its log's metrics.jsonl (log: features/run_log.RunLog)."""
    if rank == 0:
        plot_curves(log.metrics.name, reward_names)


def plot_curves(metrics_path, reward_names, png_path=None):
    """Reward, each reward function's mean and KL against step from any metrics.jsonl, as a PNG;
    returns (its path, the figure's panels as {title: (steps, values)} of the training line) for a
    reader to check."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in lines if not is_eval(r)]  # training steps
    evals = [r for r in lines if is_eval(r)]  # held-out evaluations, drawn dashed
    rewards = [name for name in reward_names if rows and name in rows[0]]  # one panel per function
    keys = ("reward", *rewards, "kl")  # kl is absent with BETA = 0: its panel stays empty
    needed = ("step", "reward", *rewards)
    if not rows or not rewards or any(k not in r for r in rows for k in needed):
        raise ValueError(f"{metrics_path}: need JSON lines with step, reward and each "
                         "reward_<name> (and kl)")
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, key in zip(axes, keys):
        drawn = [r for r in rows if key in r]
        ax.plot([r["step"] for r in drawn], [r[key] for r in drawn], marker=".",
                label="training samples")
        if evals and key in rewards:
            ax.plot([r["step"] for r in evals], [r[f"eval_{key}"] for r in evals], "--o",
                    label="held-out, greedy")
            ax.legend(fontsize=7)
        for tag in environment_tags(rows):  # ENVIRONMENTS: each one's own, thinner
            own = [r for r in rows if f"{key}_{tag}" in r]
            ax.plot([r["step"] for r in own], [r[f"{key}_{tag}"] for r in own], lw=0.8,
                    label=tag)
            held = [r for r in evals if f"eval_{key}_{tag}" in r]
            ax.plot([r["step"] for r in held], [r[f"eval_{key}_{tag}"] for r in held], ":",
                    lw=0.8, label=f"{tag}, held-out")
            ax.legend(fontsize=6)
        ax.set(title=key, xlabel="step")
        ax.grid(alpha=0.3)
    panels = {ax.get_title(): tuple(map(list, ax.get_lines()[0].get_data())) for ax in axes}
    fig.tight_layout()
    png_path = png_path or os.path.join(os.path.dirname(metrics_path), "curves.png")
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path, panels


def main():
    """`python -m features.curves METRICS REWARD_NAME...`: draw them, and say where."""
    if len(sys.argv) < 3:
        sys.exit("usage: python -m features.curves output/metrics.jsonl reward_correct ...")
    png_path, _ = plot_curves(sys.argv[1], sys.argv[2:])
    print(png_path)


if __name__ == "__main__":
    main()
