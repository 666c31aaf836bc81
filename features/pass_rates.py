"""The pass-rate pass: before step 1, k completions to each training question from the starting
policy, and each question's share of right completions, stored beside the run
(OUTPUT_DIR/pass_rates.json) for SAMPLER = "learnability" (features/question_sampler.py). A resumed
run, or one whose OUTPUT_DIR already holds the file, reads it instead of measuring again. Held-out
questions are never passed in.

    SAMPLER=learnability PASS_RATE_QUESTIONS=256 bash scripts/run_demo.sh
"""
import json
import os
import sys
import time

import torch
from tqdm import tqdm

from features import env_overrides, question_sampler

PASS_RATE_QUESTIONS = 0  # > 0: before step 1, NUM_PRE_Q completions to this many (learnability)
env_overrides.apply_env_overrides(globals(), "features/pass_rates.py")


FILE = "pass_rates.json"


def check_settings(*, correct):
    """Stop, before any model loads, on PASS_RATE_QUESTIONS without a reward that says whether a
    completion is right (correct: its name, or None): there would be no pass rate to measure."""
    if PASS_RATE_QUESTIONS > 0 and correct is None:
        sys.exit(f"PASS_RATE_QUESTIONS = {PASS_RATE_QUESTIONS} measures pass rates, which need a "
                 "reward that says whether a completion is right (reward_correct, reward_boxed or "
                 "reward_word) among REWARDS")


def pass_rate_pass(sampler, generate_completions, score, *, count, group, output_dir, batch,
                   rank):
    """Measure (or read back) the pass rates of the sampler's first `count` questions and keep the
    sampler to those, weighted by them. generate_completions(questions) -> the trainer's Rollout of
    `group` completions to each; score(texts, asked) -> (totals, {reward name: values}), asked:
    each completion's question (a dict); a completion passes when the sampler's pass_key reward is
    above 0."""
    def completion_passes(part):  # for each question, its completions' right (True) or wrong
        out = generate_completions(part)
        _, each = score(out.texts, [q for q in part for _ in range(group)])
        right = [value > 0 for value in each[sampler.pass_key]]
        return [right[i : i + group] for i in range(0, len(right), group)]
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rates = measure(sampler.questions[:count], completion_passes, output_dir=output_dir,
                    batch=batch, rank=rank, world=world)
    sampler.questions = [q for q in sampler.questions if question_sampler.id_of(q) in rates]
    sampler.set_pass_rates(rates)


def measure(questions, completion_passes, *, output_dir, batch, rank, world):
    """{question_id: pass rate} for `questions`; completion_passes(some questions) -> for each, the
    list of its k completions' right/wrong. Rank r measures questions r, r + world, ...; every rank
    returns all."""
    path = os.path.join(output_dir, FILE)
    if os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
        print(
            f"[rank {rank}] pass rates of {len(stored['rates'])} questions read from {path}",
            flush=True,
        )
        return stored["rates"]
    mine = questions[rank::world]
    rates = {}
    start = time.time()
    for i in tqdm(
        range(0, len(mine), batch), disable=rank != 0, desc="pass rates", dynamic_ncols=True
    ):
        part = mine[i : i + batch]
        for q, passes in zip(part, completion_passes(part)):
            rates[question_sampler.id_of(q)] = sum(passes) / len(passes)
    rates = gather(rates, world)
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"rates": rates, "seconds": round(time.time() - start, 1)}, f)
        os.replace(path + ".tmp", path)  # whole or absent
    return rates


def gather(rates: dict, world: int) -> dict:
    """Every rank's {question: rate} merged, on every rank."""
    if world == 1 or not torch.distributed.is_initialized():
        return rates
    parts = [None] * world
    torch.distributed.all_gather_object(parts, rates)
    merged = {}
    for part in parts:
        merged.update(part)
    return merged
