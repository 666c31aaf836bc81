"""What a trained checkpoint still gets wrong on the held-out questions, greedy and sampled.

Loads CHECKPOINT (a step_N folder of a run), answers the trainer's EVAL_SIZE held-out questions
greedily (the trainer's own `held_out_answers`, transformers) and SAMPLES times each at TEMPERATURE,
then prints both accuracies, how often the samples get the greedy misses right (0 = the model does
not know those sums; GRPO only learns from questions whose samples disagree), and the first misses.

    # ~7 minutes here for 128 questions x 4
    CHECKPOINT=output/step_30 python bench/probe_heldout.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_ref_split as grpo  # noqa: E402
import rewards  # noqa: E402
from features.evaluation import held_out_answers  # noqa: E402
from rewards import load_questions, split_held_out  # noqa: E402

# a run's step_N folder (weights + tokenizer)
CHECKPOINT = os.environ.get("CHECKPOINT", "output/step_30")
SAMPLES = int(os.environ.get("SAMPLES", "4"))  # sampled answers per held-out question
BATCH = 32  # questions per generate call


def main():
    if not os.path.isdir(CHECKPOINT):
        sys.exit(
            f"CHECKPOINT={CHECKPOINT!r} is not a folder: point it at a run's step_N checkpoint"
        )
    model, tokenizer, eos_ids, gen_config = grpo.load_policy(CHECKPOINT, torch.device("cpu"))
    model.eval()
    dataset = load_questions(grpo.DATASET, grpo.SEED, grpo.ARITH_MAX)
    _, held_out = split_held_out(dataset, grpo.evaluation.EVAL_SIZE)
    golds = [q["gold"] for q in held_out]
    greedy_texts = held_out_answers(
        model,
        held_out,
        encode=grpo.encode_prompts,
        tokenizer=tokenizer,
        decode=grpo.decode,
        eos_ids=eos_ids,
        pad_id=tokenizer.pad_token_id,
        max_new_tokens=grpo.MAX_NEW_TOKENS,
        batch_size=BATCH,
    )[0]  # (texts, tool calls)
    torch.manual_seed(0)
    sampled_texts = []
    for i in range(0, len(held_out), BATCH):
        enc = grpo.encode_prompts(tokenizer, held_out[i : i + BATCH])
        with torch.no_grad():
            out = model.generate(
                input_ids=enc.input_ids.repeat_interleave(SAMPLES, 0),
                attention_mask=enc.attention_mask.repeat_interleave(SAMPLES, 0),
                # plain sampling at TEMPERATURE, as in training
                generation_config=gen_config,
            )
        sampled_texts += grpo.decode(tokenizer, out[:, enc.input_ids.shape[1] :])
    _, greedy = rewards.score(grpo.REWARDS, greedy_texts, golds, [q["question"] for q in held_out])
    _, sampled = rewards.score(
        grpo.REWARDS,
        sampled_texts,
        [g for g in golds for _ in range(SAMPLES)],
        [q["question"] for q in held_out for _ in range(SAMPLES)],
    )
    right = greedy["reward_correct"]  # (N,) 1.0 / 0.0
    per_question = [
        sum(sampled["reward_correct"][i * SAMPLES : (i + 1) * SAMPLES]) / SAMPLES
        for i in range(len(held_out))
    ]
    misses = [i for i, r in enumerate(right) if r == 0]
    print(
        f"{CHECKPOINT}: {len(held_out)} held-out questions | greedy accuracy "
        f"{sum(right) / len(right):.1%} | sampled (T={grpo.TEMPERATURE}, {SAMPLES} each) "
        f"{sum(per_question) / len(per_question):.1%} "
        f"| format greedy {sum(greedy['reward_format']) / len(right):.1%}"
    )
    if misses:
        print(
            f"{len(misses)} greedy misses; their samples are right "
            f"{sum(per_question[i] for i in misses) / len(misses):.1%} of the time"
        )
    for i in misses[:12]:
        print(
            f"  gold {golds[i]:>3} | {greedy_texts[i].strip()!r} | samples right "
            f"{per_question[i]:.0%} | {held_out[i]['question']!r}"
        )


if __name__ == "__main__":
    main()
