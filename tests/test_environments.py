"""Environments (environments.py): the built-in task scored as an environment gives the trainer's
numbers, reasoning-gym's tasks score by their own score_answer, a class of one's own plugs in by
name, the weighted mix draws by weight, and a bad entry or a hostile step is refused, named.

    python -m pytest tests/test_environments.py
"""
import json
import math
import os
import random

import pytest

import environments
import grpo_ref_split as grpo
import rewards
from conftest import ROOT, metrics, train
from features.question_sampler import QuestionSampler

COMPLETIONS = os.path.join(ROOT, "bench", "results", "distill_teacher60",
                           "distill_grpo_opd_wrong_s44_completions.jsonl")


class Reverse(environments.Environment):
    """A task of one's own for the tests: write the word backwards."""
    reward_weights = {"reversed": 1.0, "short": 0.5}

    @classmethod
    def questions(cls, seed):
        rng = random.Random(seed)
        words = ["".join(rng.choice("abcdef") for _ in range(5)) for _ in range(40)]
        return [{"question": f"Write {w} backwards.", "gold": w[::-1]} for w in words]

    def reset(self, question, seed):
        self.gold = question["gold"]
        return [{"role": "user", "content": question["question"]}]

    def step(self, message):
        values = {"reversed": float(self.gold in message), "short": float(len(message) < 40)}
        return environments.Turn(observation="", rewards=values, done=True)


class Hostile(Reverse):
    """A step that misbehaves as its `how` says."""
    how = "nan"

    def step(self, message):
        turn = super().step(message)
        if Hostile.how == "nan":
            turn.rewards["reversed"] = math.nan
        elif Hostile.how == "text":
            turn.rewards["reversed"] = "1"
        elif Hostile.how == "missing":
            del turn.rewards["short"]
        elif Hostile.how == "not_done":
            turn.done = False
        elif Hostile.how == "dict":
            return {"reward": 1.0}
        return turn


@pytest.fixture
def mix(monkeypatch):
    """Sets ENVIRONMENTS for one test."""
    def set_mix(setting):
        monkeypatch.setattr(environments, "ENVIRONMENTS", setting)
        return setting
    return set_mix


def test_the_built_in_task_as_an_environment_scores_as_the_trainer_does(mix):
    """960 answers the embedded model wrote (a distillation run's completions): the arithmetic
    task as an environment gives every sum and every reward value rewards.score gives, bit for
    bit, so the demo's figures cannot move."""
    mix([["arithmetic", 1.0]])
    with open(COMPLETIONS) as f:
        records = [json.loads(line) for line in f]
    texts = [r["answer"] for r in records]
    asked = [{"question": r["question"], "gold": r["gold"], "env": "arithmetic"} for r in records]
    plain = rewards.score(grpo.REWARDS, texts, [r["gold"] for r in records],
                          [r["question"] for r in records])
    assert environments.score(texts, asked, grpo.REWARDS) == plain
    assert len(set(plain[0])) == 4  # right and wrong, with and without the format: all there
    assert grpo.score_answers(texts, asked) == plain


def test_one_environment_draws_the_questions_the_uniform_sampler_draws(mix):
    mix([["arithmetic", 1.0]])
    train_q, held_out = environments.load(seed=42, eval_size=128, arith_max=20, fit_images=None)
    plain_train, plain_held_out = rewards.split_held_out(
        rewards.load_questions("arithmetic", 42, 20), 128)
    assert [q["question"] for q in train_q] == [q["question"] for q in plain_train]
    assert [q["gold"] for q in held_out] == [q["gold"] for q in plain_held_out]
    assert {q["env"] for q in train_q + held_out} == {"arithmetic"}
    ours = environments.MixSampler(train_q, 7)
    plain = QuestionSampler(plain_train, 7)
    for n in (4, 4, 3, 8):
        assert [q["question"] for q in ours.draw(n)] == [q["question"] for q in plain.draw(n)]


def test_the_mix_draws_each_environment_by_its_weight(mix):
    """Weights 3 : 1 over 4,000 questions drawn 4 at a time: the first's share is 0.75 within
    0.03 (its standard error is 0.007), and a draw never repeats a question."""
    mix([["arithmetic", 3.0], ["test_environments:Reverse", 1.0]])
    train_q, _ = environments.load(seed=1, eval_size=8, arith_max=20, fit_images=None)
    sampler = environments.MixSampler(train_q, 3)
    drawn = [sampler.draw(4) for _ in range(1000)]
    share = sum(q["env"] == "arithmetic" for d in drawn for q in d) / 4000
    assert abs(share - 0.75) < 0.03
    assert all(len({id(q) for q in d}) == 4 for d in drawn)


def test_reasoning_gym_tasks_score_by_their_own_score_answer(mix):
    """rg:leg_counting: the gold in <answer> tags scores 1 on reward_correct, another number 0;
    the held-out set is its own (no training question among them) and the same for one seed."""
    mix([["rg:leg_counting", 1.0, {"min_animals": 1, "max_animals": 2}]])
    train_q, held_out = environments.load(seed=5, eval_size=16, arith_max=20, fit_images=None)
    again, held_again = environments.load(seed=5, eval_size=16, arith_max=20, fit_images=None)
    assert [q["question"] for q in held_out] == [q["question"] for q in held_again]
    assert not {q["question"] for q in held_out} & {q["question"] for q in train_q}
    q = held_out[0]
    right = f"<think> counting </think><answer>{q['gold']}</answer>"
    wrong = f"<think> counting </think><answer>{int(q['gold']) + 1}</answer>"
    sums, each = environments.score([right, wrong, "no tags 0"], [q, q, q], grpo.REWARDS)
    assert each == {"reward_correct": [1.0, 0.0, 0.0], "reward_format": [1.0, 1.0, 0.0]}
    assert sums == [3.0, 1.0, 0.0]  # REWARDS' weights: 2 for the correct one, 1 for the format
    assert q["tag"] == "rg_leg_counting"


def test_a_class_of_ones_own_plugs_in_by_name_and_the_mix_scores_each_by_its_own(mix):
    mix([["arithmetic", 1.0], ["test_environments:Reverse", 2.0]])
    train_q, _ = environments.load(seed=1, eval_size=8, arith_max=20, fit_images=None)
    word = next(q for q in train_q if q["env"] == "test_environments:Reverse")
    sum_q = next(q for q in train_q if q["env"] == "arithmetic")
    texts = [word["gold"], "x" * 50, f"<think> a </think><answer>{sum_q['gold']}</answer>"]
    sums, each = environments.score(texts, [word, word, sum_q], grpo.REWARDS)
    assert sums == [1.5, 0.0, 3.0]
    assert each["reversed"] == [1.0, 0.0, 0.0] and each["reward_correct"] == [0.0, 0.0, 1.0]


@pytest.mark.parametrize("how, says", [
    ("nan", "reward reversed = nan is not finite"),
    ("text", "reward reversed = '1' is not a number"),
    ("missing", "step's rewards .* are not \\['reversed', 'short'\\]"),
    ("not_done", "a single-turn step must be done"),
    ("dict", "step gave dict, not a Turn"),
])
def test_a_hostile_step_is_refused_with_the_environment_named(mix, monkeypatch, how, says):
    mix([["test_environments:Hostile", 1.0]])
    monkeypatch.setattr(Hostile, "how", how)
    question = {"question": "Write ab backwards.", "gold": "ba", "env": "test_environments:Hostile"}
    with pytest.raises(ValueError, match=f"environment test_environments:Hostile: {says}"):
        environments.score(["ba"], [question], grpo.REWARDS)


@pytest.mark.parametrize("setting, says", [
    ([["chess", 1.0]], "unknown environment 'chess'"),
    ([["arithmetic", 0.0]], "arithmetic: weight 0.0 must be finite and > 0"),
    ([["arithmetic", -1]], "arithmetic: weight -1 must be finite and > 0"),
    ([["arithmetic", float("nan")]], "arithmetic: weight nan must be finite"),
    ([["arithmetic", True]], "arithmetic: weight True is not a number"),
    ([["arithmetic", 1.0], ["arithmetic", 2.0]], "arithmetic is named twice"),
    ([["rg:leg_counting", 1.0, [2]]], "options \\[2\\] are not a dict"),
    ([["arithmetic", 1.0, {"size": 3}]], "a built-in task takes no options"),
    ([["arithmetic"]], "is not \\[name, weight\\]"),
    ([["test_environments:Nothing", 1.0]], "test_environments:Nothing: no such class"),
    ([["json:dumps", 1.0]], "json:dumps has no questions"),
])
def test_a_bad_entry_stops_the_run_before_any_model_loads(mix, setting, says):
    mix(setting)
    with pytest.raises(SystemExit, match=f"ENVIRONMENTS: .*{says}"):
        environments.check_settings(sampler="uniform", tools_on=False)


def test_settings_the_mix_cannot_serve_are_refused(mix):
    mix([["arithmetic", 1.0]])
    with pytest.raises(SystemExit, match='SAMPLER "uniform"'):
        environments.check_settings(sampler="difficulty", tools_on=False)
    with pytest.raises(SystemExit, match="leave TOOLS"):
        environments.check_settings(sampler="uniform", tools_on=True)
    with pytest.raises(ValueError, match="rg:no_such_task: reasoning-gym refused it"):
        mix([["rg:no_such_task", 1.0]])
        environments.load(seed=1, eval_size=4, arith_max=20, fit_images=None)


def test_a_default_step_never_enters_environments_py():
    """The lesson reaches environments.py only behind `if environments.ENVIRONMENTS`: with it
    empty, scoring a step calls nothing of the module."""
    import sys

    calls = []

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == environments.__file__:
            calls.append(frame.f_code.co_name)
        return None

    sys.setprofile(tracer)
    try:
        grpo.score_answers(["<think> 1 </think><answer>2</answer>"],
                           [{"question": "q", "gold": "2"}])
    finally:
        sys.setprofile(None)
    assert calls == []


def test_a_run_on_the_arithmetic_environment_alone_trains_as_the_default(server, tiny_model_dir,
                                                                        tmp_path):
    """Two steps of the tiny model, with and without ENVIRONMENTS [["arithmetic", 1]]: every
    metric but the timings the same; the held-out evaluation adds its per-environment mean."""
    plain = train(tiny_model_dir, server.url, tmp_path / "plain", 1, EVAL_STEPS=2, SAVE_STEPS=0)
    assert plain.returncode == 0, plain.stderr[-3000:]
    envs = train(tiny_model_dir, server.url, tmp_path / "envs", 1, EVAL_STEPS=2, SAVE_STEPS=0,
                 ENVIRONMENTS='[["arithmetic", 1.0]]')
    assert envs.returncode == 0, envs.stderr[-3000:]
    timing = ("seconds", "_s")
    for a, b in zip(*(metrics(tmp_path / name)[0] for name in ("plain", "envs"))):
        assert {k: v for k, v in a.items() if not k.endswith(timing)} == \
            {k: v for k, v in b.items() if not k.endswith(timing)}
    plain_eval = metrics(tmp_path / "plain")[1]
    envs_eval = metrics(tmp_path / "envs")[1]
    for a, b in zip(plain_eval, envs_eval):
        assert b["eval_reward_correct_arithmetic"] == b["eval_reward_correct"]
        assert {k: v for k, v in b.items() if not k.endswith("_arithmetic")} == a


def test_a_mixed_run_evaluates_each_environment_on_its_own(server, tiny_model_dir, tmp_path):
    setting = [["arithmetic", 1.0], ["rg:leg_counting", 1.0, {"min_animals": 1,
                                                             "max_animals": 2}]]
    run = train(tiny_model_dir, server.url, tmp_path / "mix", 1, EVAL_STEPS=2, SAVE_STEPS=0,
                ENVIRONMENTS=json.dumps(setting))
    assert run.returncode == 0, run.stderr[-3000:]
    for line in metrics(tmp_path / "mix")[1]:
        arithmetic = line["eval_reward_correct_arithmetic"]
        legs = line["eval_reward_correct_rg_leg_counting"]
        assert line["eval_reward_correct"] == pytest.approx((arithmetic + legs) / 2)
