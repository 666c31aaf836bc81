"""Rewards for R1-style GRPO: one for the <think>/<answer> format, one for the right answer.

Both take the text the model wrote (with the trainer's `<think>` prefill put back in front) and
return a float, so a reader can check any completion by hand:

    python -c "import rewards; print(rewards.reward_correct('<answer>42</answer>', '42'))"

The trainer combines them as CORRECT_WEIGHT * reward_correct + FORMAT_WEIGHT * reward_format.
"""
import re
import threading

from math_verify import parse, verify

# One <think> block, then one <answer> block, nothing else around them (the EOS is stripped by
# decoding). Tags may not nest or repeat: a model that learns to emit "<answer>" twice gets 0.
FORMAT_RE = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def reward_format(completion: str) -> float:
    """1.0 when the text is exactly <think>...</think> <answer>...</answer>, else 0.0."""
    text = completion.strip()
    if FORMAT_RE.fullmatch(text) is None or any(text.count(tag) != 1 for tag in TAGS):
        return 0.0
    return 1.0


def extract_answer(completion: str) -> str | None:
    """The content of the last <answer>...</answer>, else the last number in the text, else None."""
    answers = ANSWER_RE.findall(completion)
    if answers:
        return answers[-1].strip()
    numbers = NUMBER_RE.findall(completion)
    return numbers[-1] if numbers else None


def reward_correct(completion: str, gold: str) -> float:
    """1.0 when the extracted answer equals `gold` mathematically (math-verify), else 0.0."""
    answer = extract_answer(completion)
    if answer is None or not answer:
        return 0.0
    # math-verify bounds its sympy work with signal.alarm, which only the main thread may set;
    # elsewhere (a server worker, say) we run without its timeout rather than crash.
    on_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if on_main else None
    try:
        gold_parsed = parse(gold, parsing_timeout=timeout)
        answer_parsed = parse(answer, parsing_timeout=timeout)
        return 1.0 if verify(gold_parsed, answer_parsed, timeout_seconds=timeout) else 0.0
    except Exception:  # sympy can raise on adversarial strings; a wrong answer, not a crash
        return 0.0


def extract_gsm8k_answer(solution: str) -> str:
    """GSM8K's gold answer: the text after '####', commas removed ('1,000' -> '1000')."""
    if "####" not in solution:
        raise ValueError(f"not a GSM8K solution (no '####'): {solution[:80]!r}")
    return solution.split("####")[-1].strip().replace(",", "")
