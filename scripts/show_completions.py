"""The best and worst answers of one training step, from the completions.jsonl the trainer writes
(LOG_COMPLETIONS_STEPS): what the model wrote, each reward, the advantage it got.

    # newest step of output/completions.jsonl
    python scripts/show_completions.py
    # step 12, the 3 best and the 3 worst
    python scripts/show_completions.py output/completions.jsonl 12 3
"""
import json
import sys


def load(path) -> list:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        sys.exit(
            f"{path} does not exist: the trainer writes it into OUTPUT_DIR when "
            "LOG_COMPLETIONS_STEPS > 0"
        )
    except json.JSONDecodeError as e:
        sys.exit(f"{path} is not a completions.jsonl file (one JSON object per line): {e}")


def best_and_worst(answers, step, n) -> tuple:
    """(best n, worst n) of a step's answers by total reward; ties keep the file's order."""
    if step not in {a["step"] for a in answers}:
        steps = sorted({a["step"] for a in answers})
        sys.exit(
            f"no answers of step {step}; the file holds steps {steps[0]}..{steps[-1]} "
            f"({len(steps)} of them)"
            if steps
            else "the file holds no answers"
        )
    ranked = sorted((a for a in answers if a["step"] == step), key=lambda a: -a["reward"])
    return ranked[:n], ranked[::-1][:n]


def show(a) -> str:
    scores = " ".join(f"{k} {v:g}" for k, v in a.items() if k.startswith("reward_"))
    cut = ", cut at the token budget" if a["truncated"] else ""
    return (
        f"reward {a['reward']:g} ({scores}) | advantage {a['advantage']:+.2f} | {a['length']} "
        f"tokens{cut}\n  Q: {a['question']}  (gold {a['gold']})\n  A: {a['completion']}"
    )


def main(argv):
    path = argv[1] if len(argv) > 1 else "output/completions.jsonl"
    answers = load(path)
    if not answers:
        sys.exit(f"{path} holds no answers yet")
    try:
        step = int(argv[2]) if len(argv) > 2 else max(a["step"] for a in answers)
        n = int(argv[3]) if len(argv) > 3 else 2
    except ValueError:
        sys.exit(__doc__)
    best, worst = best_and_worst(answers, step, n)
    count = sum(a["step"] == step for a in answers)
    print(
        f"step {step}: {count} answers\n\nbest:\n"
        + "\n".join(map(show, best))
        + "\n\nworst:\n"
        + "\n".join(map(show, worst))
    )


if __name__ == "__main__":
    main(sys.argv)
