"""Does the base model call the calculator? Samples answers to small- and large-operand questions of
the "arithmetic_mixed" task with TOOLS on, under two prompts (a worked example turn that shows one
call, and the project's own example, which shows none), and prints per prompt and question kind: the
share of answers that call the tool, the share whose call is exactly the question's sum, and the
share that are right.

    # vLLM if installed, else transformers; ~2 min with vLLM on 2 cores
    python bench/probe_tools.py
    SAMPLES=64 USE_VLLM=0 python bench/probe_tools.py
GRPO can only reinforce what is sampled: a prompt under which no answer calls the tool teaches
nothing about it. """
import importlib.util
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOOLS", '["calculator"]')
import grpo_ref_split as grpo
from features import vllm_engine  # noqa: E402
from features import tools  # noqa: E402
from features.embedded_model import resolve_model_path  # noqa: E402
from rewards import load_questions, reward_correct  # noqa: E402

SAMPLES = int(os.environ.get("SAMPLES", 64))  # answers per prompt and question kind
PER_QUESTION = 8  # answers to each question (a group)
TOOL_PROMPT = json.loads(open(os.path.join(os.path.dirname(__file__), "tool_prompt.json")).read())
PROMPTS = {"worked call": (TOOL_PROMPT["SYSTEM_PROMPT"], tuple(TOOL_PROMPT["EXAMPLE"])),
           "no call (the default example)": (TOOL_PROMPT["SYSTEM_PROMPT"], grpo.EXAMPLE)}


def main():
    torch.manual_seed(0)
    path = resolve_model_path(grpo.MODEL_PATH)
    model, tokenizer, eos_ids, gen_config = grpo.load_policy(path, torch.device("cpu"))
    llm = None
    if os.environ.get("USE_VLLM", "1") == "1" and importlib.util.find_spec("vllm"):
        llm = vllm_engine.start_engine(resolve_model_path(grpo.MODEL_PATH), 0, model.dtype,
                                       eager=vllm_engine.VLLM_EAGER,
                                       gpu_memory=vllm_engine.VLLM_GPU_MEMORY,
                                       cpu_kv_gb=vllm_engine.VLLM_CPU_KV_GB)
    else:
        print("without vLLM: transformers' generate (slower)")
    questions = load_questions("arithmetic_mixed", grpo.SEED)[: -grpo.evaluation.EVAL_SIZE]
    print(
        f"{'prompt':32s} {'kind':6s} {'answers':>7s} {'call':>6s} {'exact call':>10s} {'right':>6s}"
    )
    for name, (system, example) in PROMPTS.items():
        grpo.SYSTEM_PROMPT, grpo.EXAMPLE = system, example
        for kind in ("small", "large"):
            qs = [q for q in questions if q["tag"] == kind][: SAMPLES // PER_QUESTION]
            enc = grpo.encode_prompts(tokenizer, qs)
            ids, _, out = tools.generate_with_tools(
                model,
                tokenizer,
                enc,
                PER_QUESTION,
                gen_config=gen_config,
                llm=llm,
                temperature=grpo.TEMPERATURE,
                tools=grpo.tools.chosen(),
                max_calls=grpo.tools.MAX_TOOL_CALLS,
                eos_ids=eos_ids,
            )
            texts = grpo.decode(tokenizer, ids)
            golds = [q["gold"] for q in qs for _ in range(PER_QUESTION)]
            called = [c > 0 for c in out["tool_calls"]]
            exact = [
                any(
                    tools.calculator(c) == g
                    for c in re.findall(r"<tool>(.*?)</tool>", t, re.DOTALL)
                )
                for t, g in zip(texts, golds)
            ]
            right = [reward_correct(t, g) for t, g in zip(texts, golds)]
            n = len(texts)
            print(
                f"{name:32s} {kind:6s} {n:7d} {sum(called) / n:6.1%} {sum(exact) / n:10.1%} "
                f"{sum(right) / n:6.1%}"
            )


if __name__ == "__main__":
    main()
