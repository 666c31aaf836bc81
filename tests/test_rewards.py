"""Rewards on hand-written strings and on real GSM8K data from ../shared/gsm8k when present."""
import json
import os
import re

import pytest

from conftest import SHARED_GSM8K
from rewards import extract_answer, extract_gsm8k_answer, reward_correct, reward_format


@pytest.mark.parametrize("text, expected", [
    ("<think>3 + 4 = 7</think><answer>7</answer>", 1.0),
    ("<think>\nadd them\n</think>\n<answer> 7 </answer>\n", 1.0),  # newlines and spaces allowed
    ("<think></think><answer></answer>", 1.0),  # format only: correctness is the other reward
    ("<think>3 + 4</think>", 0.0),  # no answer block
    ("<answer>7</answer>", 0.0),  # no think block
    ("<answer>7</answer><think>x</think>", 0.0),  # wrong order
    ("<think>x</think><answer>7</answer> and more", 0.0),  # trailing text
    ("Sure! <think>x</think><answer>7</answer>", 0.0),  # leading text
    ("<think>x</think><answer>7</answer><answer>8</answer>", 0.0),  # repeated tag
    ("<think>a<think>b</think><answer>7</answer>", 0.0),  # nested think
    ("<think>x</think><answer>7", 0.0),  # cut before closing
    ("", 0.0),
])
def test_reward_format(text, expected):
    assert reward_format(text) == expected


@pytest.mark.parametrize("text, gold, expected", [
    ("<think>3+4</think><answer>7</answer>", "7", 1.0),
    ("<think>3+4</think><answer>8</answer>", "7", 0.0),
    ("<think>..</think><answer>The answer is 7.</answer>", "7", 1.0),
    ("<think>..</think><answer>$7$</answer>", "7", 1.0),
    ("<think>..</think><answer>7.0</answer>", "7", 1.0),
    ("<think>..</think><answer>1,000</answer>", "1000", 1.0),  # thousands separator
    ("<think>..</think><answer>0.75</answer>", "3/4", 1.0),
    ("<answer>5</answer> then <answer>7</answer>", "7", 1.0),  # the last answer block counts
    ("<answer>7</answer> then <answer>5</answer>", "7", 0.0),
    ("<think>3 + 4 = 7 so the total is 7", "7", 1.0),  # no tags: the last number
    ("<think>3 + 4 = 7, minus 2 is 5", "7", 0.0),
    ("<think>I do not know", "7", 0.0),  # no number at all
    ("<answer>answer here</answer>", "7", 0.0),  # the reward-hacking string seen on this model
    ("<answer></answer>", "7", 0.0),
    ("<answer>-3</answer>", "-3", 1.0),
])
def test_reward_correct(text, gold, expected):
    assert reward_correct(text, gold) == expected


def test_extract_answer_prefers_tags_over_numbers():
    assert extract_answer("12 and 13 <answer>14</answer> 15") == "14"
    assert extract_answer("12 and 13") == "13"
    assert extract_answer("nothing") is None


def test_extract_gsm8k_answer():
    assert extract_gsm8k_answer("so 5 + 5 = 10\n#### 10") == "10"
    assert extract_gsm8k_answer("big\n#### 1,234,567") == "1234567"
    assert extract_gsm8k_answer("neg\n####   -4 ") == "-4"
    with pytest.raises(ValueError, match="no '####'"):
        extract_gsm8k_answer("The answer is 4")


needs_gsm8k = pytest.mark.skipif(
    not os.path.isdir(SHARED_GSM8K), reason="../shared/gsm8k not present"
)


@needs_gsm8k
def test_every_gsm8k_gold_answer_is_a_number_and_verifies_itself():
    with open(os.path.join(SHARED_GSM8K, "train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 7473
    golds = [extract_gsm8k_answer(r["answer"]) for r in rows]
    odd = [g for g in golds if not g.lstrip("-").replace(".", "", 1).isdigit()]
    assert not odd, odd[:5]
    for g in golds[:300]:  # a model that writes the gold answer in tags earns the reward
        assert reward_correct(f"<think>work</think><answer>{g}</answer>", g) == 1.0


@needs_gsm8k
def test_reward_correct_agrees_with_labelled_model_solutions():
    """Real GSM8K model solutions (ending in 'A: N'), labelled correct or not by their authors."""
    with open(os.path.join(SHARED_GSM8K, "example_model_solutions.jsonl")) as f:
        rows = [json.loads(line) for line in f][:250]
    checked = agree = 0
    for row in rows:
        gold = row["ground_truth"].split("A:")[-1].strip()
        for key, value in row.items():
            if isinstance(value, dict) and "solution" in value:
                # no tags: the last number is the answer
                got = reward_correct(value["solution"], gold)
                agree += got == float(value["is_correct"])
                checked += 1
    assert checked == 1000
    assert agree == checked, f"{checked - agree} of {checked} disagree with the labels"


def test_reworded_questions_keep_each_sum_in_wordings_the_task_never_uses():
    """rewards.reworded (issue 79's unseen wordings): every held-out sum asked in one of a dozen
    templates that are not the task's, its gold and numbers kept; a question that is not a sum of
    its last two numbers is refused."""
    import rewards

    asked = [{"question": q["question"], "gold": rewards.extract_gsm8k_answer(q["answer"])}
             for q in rewards.make_arithmetic(200, 20, seed=5)]
    again = rewards.reworded(asked, seed=1)
    assert len(rewards.UNSEEN_TEMPLATES) == 12
    assert not set(rewards.UNSEEN_TEMPLATES) & set(rewards.TEMPLATES)
    assert {q["wording"] for q in again} == set(range(12))  # 200 draws reach every template
    for before, after in zip(asked, again):
        numbers = [int(n) for n in re.findall(r"\d+", after["question"])]
        assert after["gold"] == before["gold"] and sum(numbers[-2:]) == int(before["gold"])
        assert after["question"] != before["question"]
    with pytest.raises(ValueError, match="not a sum"):
        rewards.reworded([{"question": "What is 2 + 3?", "gold": "6"}], seed=0)
