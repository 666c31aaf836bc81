"""Where a distilled student's groups were wrong as one, does its teacher know the answer?

Reads a run's completions.jsonl (COMPLETIONS), takes every group from FIRST_STEP to LAST_STEP whose
answers all missed (reward_correct 0: a group that gives GRPO nothing, so only the teacher's term
moves it), and asks the TEACHER checkpoint each of those questions: one greedy answer and SAMPLES
sampled at the training temperature (transformers, the trainer's own prompt). Prints, per question,
the student's commonest answer, the teacher's greedy answer and how many of its samples are right;
then the teacher's share right over all of them. A teacher that misses the same questions pulls the
student towards its own mistakes there (docs/distillation.md, DISTILL_BELOW).

    # about a minute here for 9 questions x 9 answers
    COMPLETIONS=bench/results/distill_teacher60/distill_grpo_opd_wrong_s44_completions.jsonl \
      TEACHER=output/distill_teacher60/step_60 python bench/probe_teacher_misses.py
"""
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_ref_split as grpo  # noqa: E402
from rewards import reward_correct  # noqa: E402

COMPLETIONS = os.environ.get("COMPLETIONS", "")  # a run's completions.jsonl
TEACHER = os.environ.get("TEACHER", "output/distill_teacher60/step_60")  # its step_N folder
FIRST_STEP = int(os.environ.get("FIRST_STEP", "11"))  # the steps whose groups are read
LAST_STEP = int(os.environ.get("LAST_STEP", "30"))  # inclusive
SAMPLES = int(os.environ.get("SAMPLES", "8"))  # the teacher's sampled answers per question
SEED = int(os.environ.get("SEED", "0"))  # torch's seed for those samples


def wrong_groups(path: str, first: int, last: int) -> list:
    """[(step, question, gold, the student's answers)] for each group in steps first..last whose
    answers all have reward_correct 0, in step order."""
    groups = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            answer = json.loads(line)
            groups[answer["step"], answer["question"], answer["gold"]].append(answer)
    return [
        (step, question, gold, [a["completion"] for a in answers])
        for (step, question, gold), answers in sorted(groups.items(), key=lambda item: item[0][0])
        if first <= step <= last and all(a["reward_correct"] == 0 for a in answers)
    ]


def short(text: str) -> str:
    """An answer on one line, its end: where the sum and the <answer> tag are."""
    return text.strip().replace("\n", " ")[-44:]


def main():
    if not os.path.isfile(COMPLETIONS):
        sys.exit(f"COMPLETIONS={COMPLETIONS!r} is not a file: a run's completions.jsonl")
    if not os.path.isdir(TEACHER):
        sys.exit(f"TEACHER={TEACHER!r} is not a folder: the teacher's step_N checkpoint")
    groups = wrong_groups(COMPLETIONS, FIRST_STEP, LAST_STEP)
    if not groups:
        sys.exit(f"no group of steps {FIRST_STEP}..{LAST_STEP} in {COMPLETIONS} was wrong as one")
    model, tokenizer, _, gen_config = grpo.load_policy(TEACHER, torch.device("cpu"))
    model.eval()
    torch.manual_seed(SEED)
    right_samples = 0
    right_greedy = 0
    for step, question, gold, student in groups:
        enc = grpo.encode_prompts(tokenizer, [{"question": question}])
        with torch.no_grad():
            sampled = model.generate(
                input_ids=enc.input_ids.repeat(SAMPLES, 1),  # (SAMPLES, P)
                attention_mask=enc.attention_mask.repeat(SAMPLES, 1),  # (SAMPLES, P)
                generation_config=gen_config,
            )  # (SAMPLES, P + T)
            greedy = model.generate(
                **enc, do_sample=False, max_new_tokens=gen_config.max_new_tokens
            )  # (1, P + T)
        prompt_length = enc.input_ids.shape[1]
        samples = grpo.decode(tokenizer, sampled[:, prompt_length:])
        greedy_text = grpo.decode(tokenizer, greedy[:, prompt_length:])[0]
        right = sum(int(reward_correct(text, gold)) for text in samples)
        right_samples += right
        right_greedy += int(reward_correct(greedy_text, gold))
        commonest = collections.Counter(short(text) for text in student).most_common(1)[0][0]
        print(f"step {step:2d} | gold {gold:>4} | student: {commonest!r} | teacher greedy: "
              f"{short(greedy_text)!r} | teacher samples right {right}/{SAMPLES}")
    print(f"{len(groups)} groups wrong as one; the teacher: greedy right on {right_greedy}, "
          f"samples right {right_samples}/{len(groups) * SAMPLES} "
          f"({100 * right_samples / (len(groups) * SAMPLES):.0f}%)")


if __name__ == "__main__":
    main()
