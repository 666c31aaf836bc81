"""A model's greedy held-out scores on the environments ENVIRONMENTS names, as the trainer's own
evaluation computes them (features/evaluation.py, transformers): a task a run never trained on,
asked of its last checkpoint and of the base model, tells whether anything transferred.

    ENVIRONMENTS='[["rg:basic_arithmetic", 1.0]]' python bench/probe_environment.py     # the base
    CHECKPOINT=output/step_30 ENVIRONMENTS='[["rg:basic_arithmetic", 1.0]]' \
      python bench/probe_environment.py

It loads each environment's EVAL_SIZE held-out questions for the trainer's SEED (environments.load)
and prints one JSON line: the checkpoint, the number of questions and every eval_ metric.
"""
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import environments  # noqa: E402
import grpo_ref_split as grpo  # noqa: E402
from features import evaluation  # noqa: E402
from features.embedded_model import resolve_model_path  # noqa: E402

CHECKPOINT = os.environ.get("CHECKPOINT", "")  # a run's step_N folder or a model; "" = MODEL_PATH


def main():
    if not environments.ENVIRONMENTS:
        sys.exit("ENVIRONMENTS names none: set the environments to probe, "
                 "ENVIRONMENTS='[[\"rg:basic_arithmetic\", 1.0]]'")
    environments.check_settings(sampler="uniform", tools_on=False, eval_samples=0)
    path = CHECKPOINT or resolve_model_path(grpo.MODEL_PATH)
    if not os.path.isdir(path):
        sys.exit(f"CHECKPOINT={path!r} is not a folder: a run's step_N, or a model folder")
    task = grpo.choose_task()  # the environment as the trainer takes it
    _, held_out = task.load()
    model, tokenizer, eos_ids, _ = grpo.load_policy(path, torch.device("cpu"))
    encode = functools.partial(grpo.encode_prompts, prompt=task.prompt)  # the task's prompts
    scores = evaluation.evaluate(model, held_out, encode=encode, decode=grpo.decode,
                                 score=task.score, eos_ids=eos_ids, answer=task.answer_held_out,
                                 max_new_tokens=grpo.MAX_NEW_TOKENS, tokenizer=tokenizer)
    print(json.dumps({"checkpoint": path, "questions": len(held_out), **scores}))


if __name__ == "__main__":
    main()
