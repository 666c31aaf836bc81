"""How often the untrained embedded model follows the tag format, with and without the worked
EXAMPLE.

Samples 6 training questions x 8 answers at the trainer's TEMPERATURE and MAX_NEW_TOKENS with
the trainer's own prompt, and prints the format rate, the accuracy and how many answers close
the <think> tag. This is what chose EXAMPLE (README, "What the demo does").

    python bench/probe_format.py                 # with EXAMPLE (the default prompt); ~1 minute here
    EXAMPLE=null python bench/probe_format.py    # zero-shot
"""
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_ref_split as grpo  # noqa: E402
import rewards  # noqa: E402
from features.embedded_model import resolve_model_path  # noqa: E402
from rewards import load_questions  # noqa: E402


def main():
    model, tokenizer, eos_ids, gen_config = grpo.load_policy(
        resolve_model_path(grpo.MODEL_PATH), torch.device("cpu")
    )
    model.eval()
    torch.manual_seed(0)
    questions = random.Random(1).sample(load_questions(grpo.DATASET, grpo.SEED, grpo.ARITH_MAX), 6)
    G = 8
    enc = grpo.encode_prompts(tokenizer, questions)
    with torch.no_grad():
        out = model.generate(
            input_ids=enc.input_ids.repeat_interleave(G, 0),
            attention_mask=enc.attention_mask.repeat_interleave(G, 0),
            generation_config=gen_config,
        )
    texts = grpo.decode(tokenizer, out[:, enc.input_ids.shape[1] :])
    _, each = rewards.score(
        grpo.REWARDS,
        texts,
        [q["gold"] for q in questions for _ in range(G)],
        [q["question"] for q in questions for _ in range(G)],
    )
    m = {name: sum(values) / len(values) for name, values in each.items()}
    closed = sum("</think>" in t for t in texts)
    print(
        f"EXAMPLE={grpo.EXAMPLE!r}: {len(texts)} answers | format {m['reward_format']:.0%} "
        f"| correct {m['reward_correct']:.0%} | {closed} contain </think>"
    )


if __name__ == "__main__":
    main()
