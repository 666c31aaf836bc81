"""Does a checkpoint add, or has it learned the task's phrasing? Its greedy held-out accuracy on the
built-in task's own wordings beside the same sums in a dozen wordings training never uses
(rewards.UNSEEN_TEMPLATES): a policy that learned addition scores the same on both.

    CHECKPOINT=output/step_30 python bench/probe_wordings.py      # the demo's last step
    CHECKPOINT=model_folder WORDING_SEEDS="0 1" python bench/probe_wordings.py

It answers the trainer's EVAL_SIZE held-out questions (DATASET "arithmetic", the trainer's SEED)
greedily with the trainer's own prompt and evaluation (features/evaluation.py, transformers), then
the same questions reworded with each seed of WORDING_SEEDS, and prints each accuracy, the gap, and
the unseen wordings' accuracy per template.
"""
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_ref_split as grpo  # noqa: E402
import rewards  # noqa: E402
from features.evaluation import held_out_answers  # noqa: E402

CHECKPOINT = os.environ.get("CHECKPOINT", "output/step_30")  # a run's step_N folder, or a model
WORDING_SEEDS = [int(s) for s in os.environ.get("WORDING_SEEDS", "0").split()]  # one each
BATCH = 32  # questions per generate call


def accuracy(model, tokenizer, eos_ids, questions) -> list:
    """Each question's greedy answer scored right (1.0) or not, by the trainer's reward_correct."""
    texts, _ = held_out_answers(model, questions, encode=grpo.encode_prompts, tokenizer=tokenizer,
                                decode=grpo.decode, eos_ids=eos_ids,
                                pad_id=tokenizer.pad_token_id,
                                max_new_tokens=grpo.MAX_NEW_TOKENS, batch_size=BATCH)
    golds = [q["gold"] for q in questions]
    return [rewards.reward_correct(text, gold) for text, gold in zip(texts, golds)]


def main():
    if not os.path.isdir(CHECKPOINT):
        sys.exit(f"CHECKPOINT={CHECKPOINT!r} is not a folder: a run's step_N, or a model folder")
    if grpo.DATASET != "arithmetic":
        sys.exit(f"DATASET={grpo.DATASET!r}: the rewording knows the built-in arithmetic task only")
    model, tokenizer, eos_ids, _ = grpo.load_policy(CHECKPOINT, torch.device("cpu"))
    model.eval()
    dataset = rewards.load_questions(grpo.DATASET, grpo.SEED, grpo.ARITH_MAX)
    _, held_out = rewards.split_held_out(dataset, grpo.evaluation.EVAL_SIZE)
    own = accuracy(model, tokenizer, eos_ids, held_out)
    print(f"{CHECKPOINT}: {len(held_out)} held-out questions, greedy; the task's wordings "
          f"{sum(own) / len(own):.1%}")
    per_template = defaultdict(list)
    for seed in WORDING_SEEDS:
        asked = rewards.reworded(held_out, seed)
        right = accuracy(model, tokenizer, eos_ids, asked)
        for question, score in zip(asked, right):
            per_template[rewards.UNSEEN_TEMPLATES[question["wording"]]].append(score)
        unseen = sum(right) / len(right)
        print(f"  unseen wordings (seed {seed}) {unseen:.1%}: {unseen - sum(own) / len(own):+.1%}")
    for template, scores in sorted(per_template.items()):
        print(f"    {sum(scores) / len(scores):6.1%} of {len(scores):3d}  {template}")


if __name__ == "__main__":
    main()
