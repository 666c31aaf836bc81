"""How often a group has different rewards (so it trains), by whether its question is new to the
rank or drawn again, and by the accuracy of that question's group before: what any sampler that
redraws questions (SAMPLER=difficulty, features/question_sampler.py) can gain: the run's answers
generated per answer trained, and what that would have been had every question drawn again varied.
Reads a run's completions.jsonl (every answer).

    python bench/replay_outcomes.py /tmp/objectives/difficulty_s42/completions.jsonl 8 10
    # the arguments: completions.jsonl, the group size (8), the step that splits the run (10)
"""
import json
import sys
from collections import defaultdict


def outcomes(path, group_size=8, split=10):
    """{(phase, kind): [varied, ...]}: phase "steps <= split" or "later"; kind "new", "again after
    varied k/G right" or "again after uniform". One entry per group of `group_size` consecutive
    answers."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) % group_size:
        raise ValueError(f"{path}: {len(rows)} answers do not split into groups of {group_size}")
    before = {}  # (rank, question) -> (varied, right) of its latest group
    out = defaultdict(list)  # (phase, kind) -> whether each such group varied
    for i in range(0, len(rows), group_size):
        group = rows[i : i + group_size]
        key = (group[0]["rank"], group[0]["question"])
        if any((a["rank"], a["question"]) != key for a in group):
            raise ValueError(
                f"{path}: answers {i}-{i + group_size - 1} are not one group (group size "
                f"{group_size}?)"
            )
        varied = len({a["reward"] for a in group}) > 1
        right = sum(a["reward_correct"] > 0 for a in group)
        kind = (
            "new"
            if key not in before
            else (
                f"again after varied {before[key][1]}/{group_size} right"
                if before[key][0]
                else "again after uniform"
            )
        )
        phase = f"steps <= {split}" if group[0]["step"] <= split else "later"
        out[(phase, kind)].append(varied)
        before[key] = (varied, right)
    return out


def main():
    path = sys.argv[1]
    group_size = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    split = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    out = outcomes(path, group_size, split)
    print("| phase | question | groups | varied |\n|---|---|---|---|")
    for (phase, kind), varied in sorted(out.items()):
        print(f"| {phase} | {kind} | {len(varied)} | {sum(varied) / len(varied):.2f} |")
    # Only groups with different rewards train, so answers generated per answer trained = groups /
    # varied groups.
    groups = sum(len(varied) for varied in out.values())
    again = sum(len(varied) for (_, kind), varied in out.items() if kind != "new")
    new_varied = sum(sum(varied) for (_, kind), varied in out.items() if kind == "new")
    print(
        f"answers generated per trained: {groups / sum(map(sum, out.values())):.2f}; had every "
        "question drawn again "
        f"varied: {groups / (again + new_varied):.2f} ({again} of {groups} groups were drawn again)"
    )


if __name__ == "__main__":
    main()
