"""Log: held-out evaluation, greedy completions to EVAL_SIZE questions the run never trains on,
scored by the trainer's rewards, before step 1 and every EVAL_STEPS steps; with EVAL_SAMPLES = k,
also k sampled completions per question at the training temperature, for mean@k and the unbiased
pass@k.

    CHECKPOINT=output/step_30 python bench/probe_heldout.py       # the same, on a saved checkpoint
"""
import math
import sys

import torch

from features import env_overrides, tools
from features.tools import generate_with_tools
from features.vision import pixel_rows
from features.vllm_engine import vllm_sample

EVAL_STEPS = 10  # held-out greedy accuracy before step 1 and every this many steps; 0 = never
EVAL_SIZE = 128  # held-out questions: the dataset's last EVAL_SIZE, never trained on
EVAL_SAMPLES = 0  # k > 0: also k sampled completions per held-out question, for pass@k (k x time)
env_overrides.apply_env_overrides(globals(), "features/evaluation.py")


def due(step: int, *, last_step: int) -> bool:
    """Whether the held-out evaluation runs after `step`: every EVAL_STEPS and at the last step."""
    return EVAL_STEPS > 0 and (step % EVAL_STEPS == 0 or step == last_step)


EVAL_BATCH = 16  # questions per generate call (transformers): bounds memory, not the result


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c are right (Chen et al. 2021, arXiv
    2107.03374): 1 - C(n - c, k) / C(n, k), the chance that k of the n, drawn without replacement,
    hold a right one."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n {n}, c {c}, k {k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(model, questions, *, encode, decode, score, eos_ids, max_new_tokens, pad_id=None,
             llm=None, tools=(), max_calls=0, tokenizer=None, samples=0,
             sample_config=None, correct=None, answer=None) -> dict:
    """{"eval_<reward name>": mean} over the greedy completions to `questions` (from the vLLM engine
    `llm` if given); with tools, eval_tool_share too (completions that called a tool). samples = k >
    0: also eval_<name>_mean@k over k completions per question sampled with sample_config (its
    temperature), and eval_pass@j for j = 2, 4, ... and k (by the reward named `correct`, the
    task's correctness reward; None: no pass@k, refused at start with EVAL_SAMPLES). Questions
    with a "tag" also get each mean per tag: eval_<name>_<tag>. encode(tokenizer, questions) ->
    the tokenized prompts; decode(tokenizer, completion_ids) -> texts; score(texts, asked) ->
    (total, {reward name: values}), asked: each completion's question (a dict): the trainer's own
    three; tokenizer: for them, for tools and for the pad id (or pad_id). answer: how the task
    answers its held-out questions, (model, questions, **args) -> (texts, tool calls, rewards
    played over episodes or None): greedy_answers unless the task plays episodes."""
    pad_id = tokenizer.pad_token_id if pad_id is None else pad_id
    args = dict(encode=encode, decode=decode, eos_ids=eos_ids, pad_id=pad_id,
                max_new_tokens=max_new_tokens, llm=llm, tools=tools, max_calls=max_calls,
                tokenizer=tokenizer)
    texts, calls, played = (answer or greedy_answers)(model, questions, **args)
    _, each = score(texts, questions, played)
    each = each | ({"tool_share": [float(c > 0) for c in calls]} if tools else {})
    if samples > 0:
        each |= sampled_scores(model, questions, samples, sample_config, score, args, correct)
    out = {}
    for tag in [None] + sorted({q["tag"] for q in questions if "tag" in q}):
        rows = [i for i, q in enumerate(questions) if tag is None or q.get("tag") == tag]
        suffix = f"_{tag}" if tag else ""
        out |= {f"eval_{name}{suffix}": sum(values[i] for i in rows) / len(rows)
                for name, values in each.items()}
    return out


def sampled_scores(model, questions, k, sample_config, score, args, correct=None) -> dict:
    """Per question: each reward's mean over k sampled completions ("<name>_mean@k") and, with a
    correctness reward `correct` (its name; rewards.correctness_reward), the unbiased pass@j for
    j = 2, 4, ... < k and k ("pass@j"; pass@1 would equal its mean@k)."""
    if sample_config is None or not sample_config.do_sample:
        raise ValueError("EVAL_SAMPLES needs the sampling generation config (temperature > 0)")
    texts, _ = held_out_answers(model, questions, per_question=k, gen_config=sample_config, **args)
    _, each = score(texts, [q for q in questions for _ in range(k)])
    out = {f"{name}_mean@{k}": [sum(v[i * k : (i + 1) * k]) / k for i in range(len(questions))]
           for name, v in each.items()}
    if correct is not None:
        right = [sum(v > 0 for v in each[correct][i * k : (i + 1) * k])
                 for i in range(len(questions))]
        for j in sorted({2**e for e in range(1, k.bit_length()) if 2**e < k} | {k} - {1}):  # not 1
            out[f"pass@{j}"] = [pass_at_k(k, c, j) for c in right]
    return out


@torch.no_grad()
def greedy_answers(model, questions, **args) -> tuple:
    """(each question's greedy completion as text, its tool calls, None: no episodes played), by
    held_out_answers."""
    texts, calls = held_out_answers(model, questions, **args)
    return texts, calls, None


def held_out_answers(model, questions, *, encode, decode, eos_ids, pad_id, max_new_tokens,
                     batch_size=EVAL_BATCH, llm=None, tools=(), max_calls=0, tokenizer=None,
                     per_question=1, gen_config=None) -> tuple:
    """(the completion text of each question, its tool calls): greedy, or with gen_config (a
    sampling one) `per_question` completions each, a question's completions consecutive. fork_rng
    guards the training stream (sampling draws from it, and vLLM's seeds come from it): evaluating
    never changes training."""
    from transformers import GenerationConfig

    greedy = gen_config is None
    gen_config = gen_config or GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                                pad_token_id=pad_id, eos_token_id=eos_ids)
    temperature = 0.0 if greedy else gen_config.temperature
    device = next(model.parameters()).device
    model.eval()
    texts = []
    calls = []
    batch_size = batch_size if llm is None else len(questions)  # vLLM schedules all of them at once
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(0, len(questions), batch_size):
            enc = encode(tokenizer, questions[i : i + batch_size]).to(device)
            if tools:  # multi-turn, as the rollouts (features/tools.py)
                completions, _, out = generate_with_tools(model, tokenizer, enc, per_question,
                                                          gen_config=gen_config, llm=llm,
                                                          tools=tools, temperature=temperature,
                                                          max_calls=max_calls, eos_ids=eos_ids)
                calls += out["tool_calls"]
            elif llm is not None:
                completions, _ = vllm_sample(llm, enc, per_question, temperature, eos_ids, pad_id,
                                             max_new_tokens, seeded=False)  # (b * per_question, T)
            else:
                ids = enc.input_ids.repeat_interleave(per_question, 0)  # (b x per_question, P)
                attn = enc.attention_mask.repeat_interleave(per_question, 0)  # (b x ..., P)
                pixels = pixel_rows(enc, per_question)  # a vision model's, row by row; {} text
                generated = model.generate(input_ids=ids, attention_mask=attn, **pixels,
                                           generation_config=gen_config)  # (b x ..., P + T)
                completions = generated[:, ids.shape[1] :]  # (b x per_question, T)
            texts += decode(tokenizer, completions)
    return texts, calls or [0] * len(texts)


def check_settings(*, correct):
    """Stop, before any model loads, on EVAL_SAMPLES without a reward that says whether a
    completion is right (correct: its name, or None): its pass@k would silently be missing."""
    if EVAL_SAMPLES > 0 and correct is None:
        sys.exit(f"EVAL_SAMPLES = {EVAL_SAMPLES} reports pass@k, which needs a reward that says "
                 "whether a completion is right (reward_correct, reward_boxed or reward_word) "
                 "among REWARDS; set EVAL_SAMPLES=0")


def log_eval(step, model, questions, log, rank, *, gen_config, **evaluate_args):
    """Rank 0 evaluates (evaluate's arguments; gen_config, the trainer's sampling, for EVAL_SAMPLES)
    with the run's TOOLS and EVAL_SAMPLES, and writes the result to its run log; the other ranks
    wait."""
    if rank == 0:
        result = evaluate(model, questions, tools=tools.chosen(), max_calls=tools.MAX_TOOL_CALLS,
                          samples=EVAL_SAMPLES, sample_config=gen_config, **evaluate_args)
        log.eval(step, result, len(questions))
    torch.distributed.barrier()
