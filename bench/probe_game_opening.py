"""How the untrained embedded model opens the number-guessing game (scripts/guess_number_env.py)
under each opening a run can give it: the game's own (GUESS_EXAMPLE, a system turn and a worked
first guess of another game), the game's earlier one-message rules, and the trainer's prompt
(its system prompt and arithmetic worked example, what the game was asked before environments
owned their prompts). It samples PROBE_SAMPLES first turns of each at the trainer's TEMPERATURE
and MAX_NEW_TOKENS, THINK_PREFILL after the chat template as a run does, and prints how many
write a guess in <answer> tags the game reads, how many of those lie in 1..GUESS_MAX, and what
greedy decoding writes (a held-out evaluation plays greedily).

    python bench/probe_game_opening.py                 # 1 to 8 (the game's GUESS_MAX); ~2 minutes
    GUESS_MAX=4 python bench/probe_game_opening.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_ref_split as grpo  # noqa: E402
import scripts.guess_number_env as game  # noqa: E402  (its GUESS_ constants from the environment)
from features.embedded_model import resolve_model_path  # noqa: E402

PROBE_SAMPLES = int(os.environ.get("PROBE_SAMPLES", "64"))  # first turns sampled per opening
PROBE_SEED = int(os.environ.get("PROBE_SEED", "0"))  # torch's seed before each opening's samples


def openings() -> dict:
    """{name: the opening messages} of each way a run can open the game."""
    top, turns = game.GUESS_MAX, game.GUESS_TURNS
    [rules_alone] = game.opening(top, turns, example=False)
    trainers = [{"role": "system", "content": grpo.SYSTEM_PROMPT},
                {"role": "user", "content": grpo.EXAMPLE[0]},
                {"role": "assistant", "content": grpo.EXAMPLE[1]},
                rules_alone]
    return {"the game's own (GUESS_EXAMPLE)": game.opening(top, turns),
            "the rules alone (GUESS_EXAMPLE=0)": [rules_alone],
            "the trainer's prompt around the rules": trainers}


def guesses(texts) -> list:
    """The guess the game reads in each text (its last <answer> number), or None."""
    found = [game.ANSWER_RE.findall(text) for text in texts]
    return [int(each[-1]) if each else None for each in found]


def main():
    model, tokenizer, eos_ids, gen_config = grpo.load_policy(
        resolve_model_path(grpo.MODEL_PATH), torch.device("cpu"))
    model.eval()
    for name, messages in openings().items():
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text + grpo.THINK_PREFILL, return_tensors="pt").input_ids  # (1, P)
        rows = ids.repeat(PROBE_SAMPLES, 1)  # (N, P)
        torch.manual_seed(PROBE_SEED)
        with torch.no_grad():
            sampled = model.generate(input_ids=rows, attention_mask=torch.ones_like(rows),
                                     generation_config=gen_config)  # (N, P + T)
            greedy = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    generation_config=gen_config, do_sample=False)  # (1, P + T)
        texts = grpo.decode(tokenizer, sampled[:, ids.shape[1]:])
        read = guesses(texts)
        tagged = [g for g in read if g is not None]
        in_range = [g for g in tagged if 1 <= g <= game.GUESS_MAX]
        print(f"{name}: {len(tagged)}/{PROBE_SAMPLES} write a guess the game reads, "
              f"{len(in_range)} of them in 1..{game.GUESS_MAX}; guesses {sorted(tagged)}")
        print(f"  greedy: {grpo.decode(tokenizer, greedy[:, ids.shape[1]:])[0][:160]!r}")


if __name__ == "__main__":
    main()
