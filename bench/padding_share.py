"""The share of computed tokens that are padding, per forward, from a run's completions.jsonl
(issue 89's first measurement, before any packing).

    python bench/padding_share.py output/completions.jsonl           # the demo's run
    DATASET=../shared/gsm8k/train.jsonl MAX_NEW_TOKENS=256 ALL_STEPS=2 EVAL_STEPS=0 SAVE_STEPS=0 \
      OUTPUT_DIR=/tmp/gsm256 bash scripts/run_demo.sh && python bench/padding_share.py \
      /tmp/gsm256/completions.jsonl

Each step's groups are rebuilt from the records (NUM_PRE_Q consecutive answers to one question; a
group trains when its rewards differ), each prompt measured with the trainer's own build_prompt and
tokenizer. Then, for each forward, the tokens it computes against the tokens that are real:
  - policy: step 6's batch as collate lays it out, every trained row left-padded to the longest
    prompt and right-padded to the longest answer of the step; with SHARED_PREFIX (the default) the
    prompts run once per group (groups x the longest prompt) and the answers once per row;
  - pi_old: the same rectangle, where it runs (MU > 1, a regrouping server, SKIP_PI_OLD off);
  - reference and teacher: the server's forward of one group, its prompt once (no padding) and its
    answers right-padded to the group's longest; without the shared prefix, every row whole.
The answers' lengths are the tokens each model wrote (its EOS included), as the records say.
"""
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpo_ref_split as grpo  # noqa: E402
from features.embedded_model import resolve_model_path  # noqa: E402


def step_groups(records: list, group_size: int) -> dict:
    """{step: [(question, [answer lengths], trains)]}, each group's rows consecutive per rank."""
    steps = defaultdict(list)
    by_rank = defaultdict(list)
    for record in records:
        by_rank[(record["step"], record["rank"])].append(record)
    for (step, _), rows in sorted(by_rank.items()):
        for i in range(0, len(rows), group_size):
            group = rows[i : i + group_size]
            trains = len({r["reward"] for r in group}) > 1
            steps[step].append((group[0]["question"], [r["length"] for r in group], trains))
    return steps


def shares(steps: dict, prompt_tokens) -> dict:
    """{forward: (computed tokens, real tokens)} summed over the steps, for the trained groups."""
    out = defaultdict(lambda: [0, 0])
    for groups in steps.values():
        trained = [(prompt_tokens(q), lengths) for q, lengths, trains in groups if trains]
        if not trained:
            continue
        longest_prompt = max(plen for plen, _ in trained)
        longest_completion = max(max(lengths) for _, lengths in trained)
        rows = sum(len(lengths) for _, lengths in trained)
        real_prompts = sum(plen * len(lengths) for plen, lengths in trained)
        real_answers = sum(sum(lengths) for _, lengths in trained)
        rectangle = rows * (longest_prompt + longest_completion)
        out["policy, full rows"][0] += rectangle
        out["policy, full rows"][1] += real_prompts + real_answers
        shared = len(trained) * longest_prompt + rows * longest_completion  # prompts once per group
        out["policy, shared prefix"][0] += shared
        out["policy, shared prefix"][1] += sum(plen for plen, _ in trained) + real_answers
        for plen, lengths in trained:  # the server: one group a forward
            group_answers = len(lengths) * max(lengths)
            out["reference, shared prefix"][0] += plen + group_answers
            out["reference, shared prefix"][1] += plen + sum(lengths)
            out["reference, full rows"][0] += len(lengths) * (plen + max(lengths))
            out["reference, full rows"][1] += len(lengths) * plen + sum(lengths)
    return out


def main(path: str):
    from transformers import AutoTokenizer

    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(grpo.MODEL_PATH))
    cache = {}

    def prompt_tokens(question: str) -> int:  # the trainer's prompt, as step 2 encodes it
        if question not in cache:
            text = grpo.build_prompt(tokenizer, question)
            cache[question] = len(tokenizer(text, add_special_tokens=False).input_ids)
        return cache[question]

    steps = step_groups(records, grpo.NUM_PRE_Q)
    answers = [r["length"] for r in records]
    print(f"{path}: {len(steps)} steps, {len(records)} answers, length mean "
          f"{sum(answers) / len(answers):.1f}, longest {max(answers)}")
    for name, (computed, real) in sorted(shares(steps, prompt_tokens).items()):
        print(f"{name:<26} computed {computed:>9,}  real {real:>9,}  padding "
              f"{1 - real / computed:6.1%}")


if __name__ == "__main__":
    main(sys.argv[1])
