"""SAMPLER = "learnability" and the pass-rate pass: weights p (1 - p) against hand values, draw
frequencies over many draws, the record from trained groups, the stored pass rates, and a run that
draws only measured training questions (never a held-out one)."""
import json
from collections import Counter

import pytest

import grpo_ref_split as grpo
from conftest import free_port, metrics, train
from features import pass_rates
from features.question_sampler import QuestionSampler


def questions(n):
    return [{"question": f"q{i}", "answer": str(i)} for i in range(n)]


def test_weights_are_p_times_one_minus_p_and_follow_the_latest_group():
    sampler = QuestionSampler(questions(3), seed=0, mode="learnability",
                              pass_key="reward_correct")
    sampler.set_pass_rates({"q0": 0.25, "q1": 1.0})
    # q2 unknown: p = 0.5
    assert [sampler.weight(q) for q in questions(3)] == [0.25 * 0.75, 0.0, 0.25]
    group = [{"question": "q1", "reward_correct": float(i < 3), "reward": 0.0} for i in range(8)]
    sampler.record(group, 8)
    assert sampler.pass_rates["q1"] == 3 / 8
    assert sampler.weight(questions(3)[1]) == pytest.approx(3 / 8 * 5 / 8)


def test_draw_frequencies_follow_the_weights_and_weight_zero_only_fills_up():
    """20,000 single draws: each question's share within 0.015 of w / sum(w); mastered (p = 1) and
    out-of-reach (p = 0) questions are never drawn while others are left, and fill a larger draw."""
    rates = {"q0": 0.5, "q1": 0.25, "q2": 0.9, "q3": 1.0, "q4": 0.0}
    sampler = QuestionSampler(questions(5), seed=1, mode="learnability",
                              pass_key="reward_correct")
    sampler.set_pass_rates(rates)
    weights = {q: p * (1 - p) for q, p in rates.items()}
    total = sum(weights.values())
    draws = Counter(sampler.draw(1)[0]["question"] for _ in range(20000))
    for name, w in weights.items():
        assert draws[name] / 20000 == pytest.approx(w / total, abs=0.015), (name, draws)
    assert draws["q3"] == 0 and draws["q4"] == 0
    for _ in range(200):
        drawn = [q["question"] for q in sampler.draw(4)]
        assert len(set(drawn)) == 4 and {"q0", "q1", "q2"} <= set(drawn)


@pytest.mark.parametrize("setting, name", [
    (("features.question_sampler", "SAMPLER", "learnability"), "SAMPLER"),
    (("features.pass_rates", "PASS_RATE_QUESTIONS", 16), "PASS_RATE_QUESTIONS"),
    (("features.evaluation", "EVAL_SAMPLES", 4), "EVAL_SAMPLES"),
])
def test_a_count_of_right_answers_is_keyed_by_the_tasks_correctness_reward(setting, name,
                                                                          monkeypatch, tmp_path):
    """Issue 79: SAMPLER learnability and PASS_RATE_QUESTIONS read reward_correct and crashed at
    step 1 (KeyError) on a reward_boxed task, after the model loaded; EVAL_SAMPLES' pass@k
    silently vanished. Each now reads the task's correctness reward, and a task without one is
    refused at start, naming the setting."""
    import importlib

    import rewards

    module, constant, value = setting
    monkeypatch.setattr(importlib.import_module(module), constant, value)
    monkeypatch.setattr(grpo, "OUTPUT_DIR", str(tmp_path))
    monkeypatch.setattr(grpo, "REWARDS", [(rewards.reward_format, 1.0)])
    with pytest.raises(SystemExit, match=name):
        grpo.check_settings()
    monkeypatch.setattr(grpo, "REWARDS", [(rewards.reward_boxed, 1.0),
                                          (rewards.reward_think_boxed, 0.5)])
    grpo.check_settings()
    assert rewards.correctness_reward(["reward_think_boxed", "reward_boxed"]) == "reward_boxed"
    sampler = QuestionSampler(questions(2), seed=0, mode="learnability", pass_key="reward_boxed")
    group = [{"question": "q0", "reward": 1.0, "reward_boxed": float(i < 1)} for i in range(4)]
    sampler.record(group, 4)  # a record without reward_correct: keyed by reward_boxed
    assert sampler.pass_rates["q0"] == 0.25


def test_pass_at_k_counts_the_correctness_reward_it_is_given():
    """evaluation.sampled_scores with correct="reward_boxed": pass@2 of 4 samples of which 1 is
    right, 1 - C(3, 2) / C(4, 2) = 0.5, from reward_boxed (no reward_correct in the scores)."""
    from features import evaluation

    class Config:
        do_sample = True

    def score(texts, asked, played=None):
        return [0.0] * 4, {"reward_boxed": [1.0, 0.0, 0.0, 0.0]}

    def answers(model, questions, per_question, gen_config, **args):
        return ["x"] * (len(questions) * per_question), []

    original = evaluation.held_out_answers
    evaluation.held_out_answers = answers
    try:
        got = evaluation.sampled_scores(None, [{"question": "q", "gold": "1"}], 4, Config(), score,
                                        {}, correct="reward_boxed")
    finally:
        evaluation.held_out_answers = original
    assert got["pass@2"] == [pytest.approx(0.5)] and got["pass@4"] == [1.0]


def test_the_pass_is_stored_and_read_back_instead_of_measured_again(tmp_path):
    calls = []

    def completion_passes(part):
        calls.append([q["question"] for q in part])
        return [[True, False, False, False] for _ in part]

    asked = questions(5)
    rates = pass_rates.measure(
        asked, completion_passes, output_dir=str(tmp_path), batch=2, rank=0, world=1
    )
    assert rates == {f"q{i}": 0.25 for i in range(5)}
    assert calls == [["q0", "q1"], ["q2", "q3"], ["q4"]]
    again = pass_rates.measure(
        asked, completion_passes, output_dir=str(tmp_path), batch=2, rank=0, world=1
    )
    assert again == rates and len(calls) == 3  # read from OUTPUT_DIR/pass_rates.json
    assert json.loads((tmp_path / "pass_rates.json").read_text())["rates"] == rates


def test_a_learnability_run_measures_then_draws_only_measured_training_questions(
    tiny_model_dir, tmp_path
):
    """PASS_RATE_QUESTIONS=4 before step 1: pass_rates.json holds 4 training questions, none held
    out, each a share of NUM_PRE_Q; every question the run trains on is one of them."""
    dead = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    run = train(
        tiny_model_dir,
        dead,
        out,
        1,
        BETA=0,
        ALL_STEPS=2,
        EVAL_STEPS=0,
        SAMPLER="learnability",
        PASS_RATE_QUESTIONS=4,
        Q_BATCH_SIZE=2,
        MAX_ROLLOUTS=40,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rates = json.loads((out / "pass_rates.json").read_text())["rates"]
    assert len(rates) == 4 and all(r in (0, 0.25, 0.5, 0.75, 1.0) for r in rates.values())
    held_out = {
        q["question"]
        for q in grpo.rewards.split_held_out(
            grpo.rewards.load_questions(grpo.DATASET, grpo.SEED, grpo.ARITH_MAX), 8
        )[1]
    }
    assert not set(rates) & held_out
    trained = {
        json.loads(line)["question"]
        for line in (out / "completions.jsonl").read_text().splitlines()
    }
    assert trained and trained <= set(rates)
    assert len(metrics(out)[0]) == 2
