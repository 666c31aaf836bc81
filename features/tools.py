"""Tool use (TOOLS): multi-turn rollouts. The model writes <tool>expression</tool>; generation stops
there, the toolkit runs the tool on what the model wrote, appends <result>its answer</result> and
the model goes on, up to max_calls calls and max_new_tokens tokens per completion in all. The
result's tokens are not the policy's: the mask this module returns marks them, and the trainer
leaves them out of the loss, the KL and every ratio metric.

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
from features.turns import Reply, eos_at, play_turns, prompts_and_sampler

TOOLS = []  # names of this module's tools, f(text in <tool></tool>) -> <result>; [] = one turn
MAX_TOOL_CALLS = 3  # calls a completion may make; results count in MAX_NEW_TOKENS, not in the loss
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
    closed a call before any EOS; else None (the completion ended, or was cut)."""
    eos = [k for k, t in enumerate(segment) if t in eos_ids]
    head = segment[: eos[0]] if eos else segment
    if TOOL_CLOSE not in tokenizer.decode(head, skip_special_tokens=True):
        return None
    return next(
        k
        for k in range(1, len(head) + 1)
        if TOOL_CLOSE in tokenizer.decode(head[:k], skip_special_tokens=True)
    )


class CallEpisode:
    """A completion with the calculator (features/turns.py plays it): its turn ends where the model
    closes a call (TOOL_CLOSE) inside its own turn, and the reply is the tool's <result>; an EOS
    ends it, done. A call past max_calls ends it there, as the token budget does: cut, not
    stopped. It counts its calls and the ones whose result was an error."""
    stop = (TOOL_CLOSE,)  # the sampler's stop text besides the EOS

    def __init__(self, tools, max_calls: int):
        self.tools = tools
        self.max_calls = max_calls
        self.calls = 0
        self.errors = 0

    def turn_of(self, tokenizer, segment, eos_ids) -> tuple:
        """(the segment up to its turn's end, "call" | "eos" | None: cut by the budget)."""
        end = call_end(tokenizer, segment, eos_ids)
        if end is not None:  # up to the call's close; HF pads a stopped row: drop that padding
            return segment[:end], "call"
        eos = eos_at(segment, eos_ids)
        if eos is not None:  # up to and including the EOS; the rest is padding
            return segment[: eos + 1], "eos"
        return segment, None

    def reply(self, tokenizer, ids, segment, *, ended, budget_left) -> Reply:
        """The call's <result>, from the completion so far (ids); done at an EOS; over past
        max_calls or with no room left for a result."""
        if ended == "eos":
            return Reply(done=True)
        if self.calls >= self.max_calls or budget_left <= 0:
            return Reply(over=True)  # one call too many, or the budget spent
        text = tokenizer.decode(ids, skip_special_tokens=True)
        # past: what the closing token wrote after the tag ("<")
        call, _, past = text.rpartition(TOOL_CLOSE)
        answer = run_tool(self.tools, call.rpartition(TOOL_OPEN)[2])
        # "</tool><result>"
        opening = RESULT_OPEN[len(past) :] if RESULT_OPEN.startswith(past) else RESULT_OPEN
        result = tokenizer(opening + answer + RESULT_CLOSE, add_special_tokens=False,
                           split_special_tokens=True).input_ids  # text, never EOS
        self.calls += 1
        self.errors += answer.startswith("error:")
        return Reply(ids=result)


def tool_rollout(
    sample, prompts, *, tokenizer, tools, max_calls, max_new_tokens, eos_ids, pad_id
) -> dict:
    """Multi-turn completions to `prompts` (token id lists, one per completion), each a CallEpisode
    played by features/turns.play_turns: sample(prefixes, budgets) -> one (token ids, log-probs or
    None) continuation per prefix, stopping after an EOS or after TOOL_CLOSE. Returns play_turns'
    completion_ids, vllm_logps, policy_mask and stopped, its reply_mask as tool_mask (B, T) True
    on the toolkit's tokens, and each completion's tool_calls and tool_errors."""
    episodes = [CallEpisode(tools, max_calls) for _ in prompts]
    out = play_turns(sample, prompts, episodes, tokenizer=tokenizer,
                     max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
    out["tool_mask"] = out.pop("reply_mask")  # (B, T) the results' tokens
    return out | dict(tool_calls=[e.calls for e in episodes],
                      tool_errors=[e.errors for e in episodes])


def rollout(model, tokenizer, prompts, *, gen_config, llm, eos_ids, num_pre_q, temperature):
    """Step 2 with the calculator (TOOLS; the lesson's Rollout seam): generate_with_tools on
    prompts.encoded with the chosen tools and MAX_TOOL_CALLS."""
    return generate_with_tools(model, tokenizer, prompts.encoded, num_pre_q, gen_config=gen_config,
                               llm=llm, temperature=temperature, tools=chosen(),
                               max_calls=MAX_TOOL_CALLS, eos_ids=eos_ids)


def generate_with_tools(
    model, tokenizer, enc, n, *, gen_config, llm, temperature, tools, max_calls, eos_ids
):
    """tool_rollout for n completions to each prompt of `enc` (left-padded input_ids,
    attention_mask; a prompt's n rows consecutive), from vLLM (`llm`) or transformers' generate
    with gen_config (do_sample=False: greedy): (completion_ids, vllm_logps, {policy_mask, stopped,
    tool_calls, tool_errors}): the loss needs only the policy's own tokens (policy_mask), not
    tool_rollout's tool_mask."""
    prompts, sample = prompts_and_sampler(model, tokenizer, enc, n, gen_config=gen_config,
                                          llm=llm, temperature=temperature, eos_ids=eos_ids,
                                          stop=CallEpisode.stop)
    out = tool_rollout(
        sample,
        prompts,
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
