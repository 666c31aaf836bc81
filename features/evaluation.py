"""Held-out evaluation: greedy answers to EVAL_SIZE questions the run never trains on, scored by the trainer's
rewards, before step 1 and every EVAL_STEPS steps.

    CHECKPOINT=output/step_30 python bench/probe_heldout.py       # the same, on a saved checkpoint
"""
import torch

from features.tools import generate_with_tools
from features.vllm_engine import vllm_sample

EVAL_BATCH = 16  # questions per greedy generate call (transformers): bounds memory, not the result


def evaluate(model, questions, *, encode, decode, score, eos_ids, pad_id, max_new_tokens, llm=None, tools=(),
             max_calls=0, tokenizer=None) -> dict:
    """{"eval_<reward name>": mean} over the greedy answers to `questions` (from the vLLM engine `llm` if given);
    with tools, eval_tool_share too (answers that called a tool). Questions with a "tag" also get each mean per tag:
    eval_<name>_<tag>. encode(questions) -> the tokenized prompts; decode(completion_ids) -> texts;
    score(texts, golds, questions) -> (total, {reward name: values}): the trainer's own three; tokenizer: tools'."""
    texts, calls = greedy_answers(model, questions, encode=encode, decode=decode, eos_ids=eos_ids, pad_id=pad_id,
                                  max_new_tokens=max_new_tokens, llm=llm, tools=tools, max_calls=max_calls,
                                  tokenizer=tokenizer)
    _, each = score(texts, [q["gold"] for q in questions], [q["question"] for q in questions])
    each = each | ({"tool_share": [float(c > 0) for c in calls]} if tools else {})
    out = {}
    for tag in [None] + sorted({q["tag"] for q in questions if "tag" in q}):
        rows = [i for i, q in enumerate(questions) if tag is None or q.get("tag") == tag]
        out |= {f"eval_{name}" + (f"_{tag}" if tag else ""): sum(values[i] for i in rows) / len(rows)
                for name, values in each.items()}
    return out


@torch.no_grad()
def greedy_answers(model, questions, *, encode, decode, eos_ids, pad_id, max_new_tokens, batch_size=EVAL_BATCH,
                   llm=None, tools=(), max_calls=0, tokenizer=None) -> tuple:
    """(the greedy completion text of each question, its tool calls). Greedy decoding draws no random numbers,
    and fork_rng guards the training stream anyway: evaluating never changes training."""
    from transformers import GenerationConfig

    greedy = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                              eos_token_id=eos_ids)
    device = next(model.parameters()).device
    model.eval()
    texts, calls = [], []
    batch_size = batch_size if llm is None else len(questions)  # vLLM schedules all of them at once
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(0, len(questions), batch_size):
            enc = encode(questions[i : i + batch_size]).to(device)
            if tools:  # multi-turn, as the rollouts (features/tools.py)
                answers, _, out = generate_with_tools(model, tokenizer, enc, 1, gen_config=greedy, llm=llm, tools=tools,
                                                      temperature=0.0, max_calls=max_calls, eos_ids=eos_ids)
                calls += out["tool_calls"]
            elif llm is not None:
                answers, _ = vllm_sample(llm, enc, 1, 0.0, eos_ids, pad_id, max_new_tokens)  # (b, T)
            else:
                answers = model.generate(**enc, generation_config=greedy)[:, enc.input_ids.shape[1] :]  # (b, T)
            texts += decode(answers)
    return texts, calls or [0] * len(texts)


def log_eval(step, model, questions, log, rank, **evaluate_args):
    """Rank 0 evaluates (evaluate's arguments) and writes the result to its run log; the other ranks wait."""
    if rank == 0:
        log.eval(step, evaluate(model, questions, **evaluate_args), len(questions))
    torch.distributed.barrier()
