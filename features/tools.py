"""Tool use (TOOLS): multi-turn rollouts. The model writes <tool>expression</tool>; generation stops
there, the toolkit runs the tool on what the model wrote, appends <result>its answer</result> and
the model goes on, up to max_calls calls and max_new_tokens tokens per answer in all. The result's
tokens are not the policy's: the mask this module returns marks them, and the trainer leaves them
out of the loss, the KL and every ratio metric.

    # the demo: with the calculator and without
    bash bench/run_tool_demo.sh
    python -c "from features.tools import calculator; print(calculator('(348 + 517) * 2'))"
A tool is a plain function from the text between the tags to the text the model gets back; a text
starting "error:" counts as a tool error. With several tools the model writes <tool>name:
text</tool>. """
import ast
import copy
import math
import operator
import sys
from fractions import Fraction

import torch

from features import env_overrides
from features.vllm_engine import sampled_logps, sampling_params

TOOLS = []  # names of this module's tools, f(text in <tool></tool>) -> <result>; [] = one turn
MAX_TOOL_CALLS = 3  # calls an answer may make; results count in MAX_NEW_TOKENS, not in the loss
env_overrides.apply_env_overrides(globals(), "features/tools.py")  # TOOLS='["calculator"]'


# what the model writes around a call; generation stops at the close
TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
# what the toolkit writes around the tool's answer
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
MAX_EXPRESSION_CHARS = 200  # a longer call is refused before it is parsed: bounds time and memory
# parentheses or operations nested deeper are refused: bounds the parser's and our recursion
MAX_DEPTH = 64
# any number, written or computed, beyond this is refused: no huge integers, no float overflow
MAX_NUMBER = 10**15
MAX_RESULT_CHARS = 200  # a tool's answer is cut to this: a tool cannot flood the context
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
SIGNS = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """A calculation the calculator refuses; its message is what the model reads."""


def calculator(expression: str) -> str:
    """The value of an expression of numbers, + - * /, unary signs and parentheses, exactly
    (fractions), as text: "865", "2.5", "0.333333". Anything else (names, calls, **, attributes,
    strings, lambdas...) returns an error text, never raises and never runs code: the text is parsed
    by Python's ast and only the allowed nodes are read."""
    if not isinstance(expression, str):
        return "error: the expression must be text"
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: the expression is longer than {MAX_EXPRESSION_CHARS} characters"
    depth = 0
    # before ast.parse, whose own recursion a deep enough nesting would exhaust
    for c in expression:
        depth += (c == "(") - (c == ")")
        if depth > MAX_DEPTH:
            return f"error: parentheses nested deeper than {MAX_DEPTH}"
    try:
        value = _value(ast.parse(expression.strip(), mode="eval").body, 0)
    except CalculatorError as e:
        return f"error: {e}"
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return "error: not an expression of numbers, + - * / and parentheses"
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def _value(node, depth) -> Fraction:
    """The exact value of an allowed ast node; CalculatorError for anything else."""
    if depth > MAX_DEPTH:
        raise CalculatorError(f"operations nested deeper than {MAX_DEPTH}")
    # not bool, complex or str
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value) or abs(node.value) > MAX_NUMBER:
            raise CalculatorError(f"a number larger than {MAX_NUMBER}")
        value = (
            Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
        )
    elif isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
        value = SIGNS[type(node.op)](_value(node.operand, depth + 1))
    elif isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left, depth + 1), _value(node.right, depth + 1)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        value = OPERATORS[type(node.op)](left, right)
    else:  # name the operator itself where there is one: "Pow", "FloorDiv"
        what = type(getattr(node, "op", node)).__name__
        raise CalculatorError(f"{what} is not allowed: only numbers, + - * / and parentheses")
    if abs(value) > MAX_NUMBER or value.denominator > MAX_NUMBER:
        raise CalculatorError(f"a result larger than {MAX_NUMBER}")
    return value


def run_tool(tools, call: str) -> str:
    """The text the model gets back for `call` (what it wrote between the tags), cut to
    MAX_RESULT_CHARS. One tool gets the whole call; with several, the call is "name: text". A tool
    that raises gives an error text."""
    if len(tools) == 1:
        fn = tools[0]
        argument = call
    else:
        name, _, argument = call.partition(":")
        fn = {f.__name__: f for f in tools}.get(name.strip())
        if fn is None:
            return (
                f"error: no tool {name.strip()[:40]!r}; write <tool>name: text</tool> with one of "
                + ", ".join(f.__name__ for f in tools)
            )
    try:
        out = str(fn(argument.strip()))
    except Exception as e:  # a tool's bug is the model's error text, never a crash of the trainer
        out = f"error: {type(e).__name__}: {e}"
    return out[:MAX_RESULT_CHARS]


def call_end(tokenizer, segment, eos_ids):
    """The number of tokens of `segment` up to the one that completes TOOL_CLOSE, if the model
    closed a call before any EOS; else None (the answer ended, or was cut)."""
    eos = [k for k, t in enumerate(segment) if t in eos_ids]
    head = segment[: eos[0]] if eos else segment
    if TOOL_CLOSE not in tokenizer.decode(head, skip_special_tokens=True):
        return None
    return next(
        k
        for k in range(1, len(head) + 1)
        if TOOL_CLOSE in tokenizer.decode(head[:k], skip_special_tokens=True)
    )


def tool_rollout(
    sample, prompts, *, tokenizer, tools, max_calls, max_new_tokens, eos_ids, pad_id
) -> dict:
    """Multi-turn answers to `prompts` (token id lists, one per answer). sample(prefixes, budgets)
    -> one (token ids, log-probs or None) continuation per prefix, stopping after an EOS or after
    TOOL_CLOSE. A call past max_calls ends the answer there, as the token budget does: it is cut,
    not stopped. Returns completion_ids (B, T) padded with pad_id, vllm_logps (B, T) or None,
    tool_mask (B, T) True on the toolkit's tokens, policy_mask (B, T) True on the policy's own
    tokens (up to and including a sampled EOS; never the tool's or the padding), stopped (B,) True
    where the policy sampled an EOS, calls and errors (B lists).

    The mask comes from each answer's real length, not from the first pad: the pad id is the EOS for
    SmolLM2 and Qwen, and an answer cut after a call has none, so a first-pad rule would train on a
    token never sampled."""
    B = len(prompts)
    ids = [[] for _ in range(B)]
    tool = [[] for _ in range(B)]
    logps = [[] for _ in range(B)]
    calls = [0] * B
    errors = [0] * B
    active = list(range(B))
    sampled = False
    stopped = [False] * B
    while active:
        outs = sample(
            [prompts[i] + ids[i] for i in active], [max_new_tokens - len(ids[i]) for i in active]
        )
        still = []
        for i, (segment, segment_logps) in zip(active, outs):
            segment = list(segment)[: max_new_tokens - len(ids[i])]
            end = call_end(tokenizer, segment, eos_ids)
            eos = next((k for k, t in enumerate(segment) if t in eos_ids), None)
            if end is not None:
                # up to the call's close; HF pads a stopped row: drop that padding
                segment = segment[:end]
            elif eos is not None:
                segment = segment[: eos + 1]  # up to and including the EOS; the rest is padding
                stopped[i] = True
            sampled |= segment_logps is not None
            ids[i] += segment
            tool[i] += [False] * len(segment)
            logps[i] += list(segment_logps or [0.0] * len(segment))[: len(segment)]
            if end is None or calls[i] >= max_calls or len(ids[i]) >= max_new_tokens:
                continue  # finished: an EOS, the budget, or one call too many
            text = tokenizer.decode(ids[i], skip_special_tokens=True)
            # past: what the closing token wrote after the tag ("<")
            call, _, past = text.rpartition(TOOL_CLOSE)
            answer = run_tool(tools, call.rpartition(TOOL_OPEN)[2])
            # "</tool><result>"
            opening = RESULT_OPEN[len(past) :] if RESULT_OPEN.startswith(past) else RESULT_OPEN
            result = tokenizer(
                opening + answer + RESULT_CLOSE,
                add_special_tokens=False,
                # text, never EOS
                split_special_tokens=True,
            ).input_ids[: max_new_tokens - len(ids[i])]
            ids[i] += result
            tool[i] += [True] * len(result)
            logps[i] += [0.0] * len(result)
            calls[i] += 1
            errors[i] += answer.startswith("error:")
            if len(ids[i]) < max_new_tokens:
                still.append(i)
        active = still
    completion_ids = padded_rows(ids, pad_id, torch.long)  # (B, T)
    tool_mask = padded_rows(tool, False, torch.bool)  # (B, T)
    policy_mask = padded_rows([[not t for t in row] for row in tool], False, torch.bool)  # (B, T)
    vllm_logps = padded_rows(logps, 0.0, torch.float32)  # (B, T)
    return dict(
        completion_ids=completion_ids,
        vllm_logps=vllm_logps if sampled else None,
        tool_mask=tool_mask,
        policy_mask=policy_mask,
        stopped=torch.tensor(stopped),
        tool_calls=calls,
        tool_errors=errors,
    )


def padded_rows(rows, pad, dtype) -> torch.Tensor:
    """(B, T) of B lists of different lengths, each padded on the right with `pad` to the longest
    (T at least 1)."""
    width = max(1, max(map(len, rows)))
    out = torch.full((len(rows), width), pad, dtype=dtype)  # (B, T)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def transformers_turns(model, tokenizer, gen_config, stop=(TOOL_CLOSE,)):
    """sample() for tool_rollout from transformers' generate: the prefixes left-padded into one
    batch, each row stopping at an EOS or at a text of `stop` (generate's stop_strings; () = at an
    EOS only, an environment's turn)."""

    def sample(prefixes, budgets):
        width = max(map(len, prefixes))
        device = next(model.parameters()).device
        ids = torch.tensor(
            [[gen_config.pad_token_id] * (width - len(p)) + p for p in prefixes], device=device
        )
        # (b, width)
        attn = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prefixes], device=device
        )
        config = copy.deepcopy(gen_config)  # the trainer's sampling, stopping at a call too
        config.max_new_tokens = max(budgets)
        config.stop_strings = list(stop) or None
        out = model.generate(
            input_ids=ids, attention_mask=attn, generation_config=config, tokenizer=tokenizer
        )
        return [(row.tolist(), None) for row in out[:, width:].cpu()]

    return sample


def vllm_turns(llm, temperature, eos_ids, stop=(TOOL_CLOSE,)):
    """sample() for tool_rollout from a vLLM engine: one request per prefix, stopping at an EOS or
    TOOL_CLOSE, with the sampled tokens' log-probs; a continuation's prefix is in the engine's
    prefix cache already."""
    from vllm.inputs import TokensPrompt

    def sample(prefixes, budgets):
        seeds = (
            torch.randint(2**31, (len(prefixes),)).tolist()
            if temperature > 0
            else [None] * len(prefixes)
        )
        params = [
            sampling_params(
                temperature,
                budget,
                eos_ids,
                seed,
                stop=list(stop),
                include_stop_str_in_output=True,
            )
            for budget, seed in zip(budgets, seeds)
        ]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prefixes], params, use_tqdm=False
        )
        answers = [out.outputs[0] for out in outs]
        return [(list(a.token_ids), sampled_logps(a) if a.logprobs else None) for a in answers]

    return sample


def rollout(model, tokenizer, prompts, *, gen_config, llm, eos_ids, num_pre_q, temperature):
    """Step 2 with the calculator (TOOLS; the lesson's Rollout seam): generate_with_tools on
    prompts.encoded with the chosen tools and MAX_TOOL_CALLS."""
    return generate_with_tools(model, tokenizer, prompts.encoded, num_pre_q, gen_config=gen_config,
                               llm=llm, temperature=temperature, tools=chosen(),
                               max_calls=MAX_TOOL_CALLS, eos_ids=eos_ids)


def generate_with_tools(
    model, tokenizer, enc, n, *, gen_config, llm, temperature, tools, max_calls, eos_ids
):
    """tool_rollout for n answers to each prompt of `enc` (left-padded input_ids, attention_mask; a
    prompt's n rows consecutive), from vLLM (`llm`) or transformers' generate with gen_config
    (do_sample=False: greedy): (completion_ids, vllm_logps, {policy_mask, stopped, tool_calls,
    tool_errors}): the loss needs only the policy's own tokens (policy_mask), not tool_rollout's
    tool_mask."""
    prompts = [
        ids[keep.bool()].tolist()
        for ids, keep in zip(enc.input_ids.cpu(), enc.attention_mask.cpu())
    ]
    sample = (
        vllm_turns(llm, temperature, eos_ids)
        if llm is not None
        else transformers_turns(model, tokenizer, gen_config)
    )
    out = tool_rollout(
        sample,
        [p for p in prompts for _ in range(n)],
        tokenizer=tokenizer,
        tools=tools,
        max_calls=max_calls,
        max_new_tokens=gen_config.max_new_tokens,
        eos_ids=list(eos_ids),
        pad_id=gen_config.pad_token_id,
    )
    del out["tool_mask"]
    return out.pop("completion_ids"), out.pop("vllm_logps"), out


tool_functions = {"calculator": calculator}  # the tools TOOLS may name: a registry, not a setting


def chosen() -> list:
    """The tool functions TOOLS names, in its order (check_settings refused any other name)."""
    return [tool_functions[name] for name in TOOLS]


def check_settings():
    """Stop, before any model loads, on a TOOLS name that is not in tool_functions."""
    for name in TOOLS:
        if name not in tool_functions:
            sys.exit(
                f"TOOLS names {name!r}, which is not a tool of features/tools.py "
                f"(tool_functions: {', '.join(sorted(tool_functions))})"
            )
