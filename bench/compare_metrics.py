"""Compare two runs' metrics.jsonl line by line: every value but the timings (names ending in _s,
seconds) is either identical or listed with its largest difference. A change that must leave the
demo unchanged is checked this way against bench/results/demo_metrics.jsonl.

    python bench/compare_metrics.py bench/results/demo_metrics.jsonl output/metrics.jsonl
"""
import json
import sys


def is_timing(name: str) -> bool:
    """Wall-clock figures, which differ from run to run by design."""
    return name.endswith("_s") or name == "seconds"


def main(first: str, second: str):
    with open(first) as f:
        a = [json.loads(line) for line in f if line.strip()]
    with open(second) as f:
        b = [json.loads(line) for line in f if line.strip()]
    if [m["step"] for m in a] != [m["step"] for m in b]:
        sys.exit(f"the runs logged other steps: {len(a)} and {len(b)} lines")
    identical = 0
    gaps = {}  # name -> the largest difference seen
    for x, y in zip(a, b):
        for name in sorted(set(x) & set(y)):
            if is_timing(name):
                continue
            if x[name] == y[name]:
                identical += 1
            else:
                gaps[name] = max(gaps.get(name, 0.0), abs(x[name] - y[name]))
    print(f"{len(a)} lines, {identical} values identical")
    for name, gap in sorted(gaps.items()):
        print(f"  {name}: differs, by at most {gap:.3g}")
    evals = [(m["step"], m["eval_reward_correct"]) for m in b if "eval_reward_correct" in m]
    if evals:
        print("held-out:", " / ".join(f"{100 * value:.1f}% (step {step})" for step, value in evals))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
