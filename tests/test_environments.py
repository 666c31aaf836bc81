"""Environments (environments.py): the built-in task scored as an environment gives the trainer's
numbers, reasoning-gym's tasks score by their own score_answer, a class of one's own plugs in by
name, the weighted mix draws by weight, and a bad entry or a hostile step is refused, named.

    python -m pytest tests/test_environments.py
"""
import json
import math
import os
import random
import re

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
    texts = [r["completion"] for r in records]
    asked = [{"question": r["question"], "gold": r["gold"], "env": "arithmetic"} for r in records]
    plain = rewards.score(grpo.REWARDS, texts, [r["gold"] for r in records],
                          [r["question"] for r in records])
    assert environments.score(texts, asked, grpo.REWARDS) == plain
    assert len(set(plain[0])) == 4  # right and wrong, with and without the format: all there
    assert grpo.choose_task().score(texts, asked) == plain


def test_the_shapes_task_with_images_as_an_environment_loads_and_scores_as_without(
        mix, monkeypatch):
    """The vision task as an environment: the lesson's load_dataset gives the same questions,
    golds and fitted image bytes with ENVIRONMENTS [["shapes", 1]] as with DATASET "shapes", and
    answers naming every colour score as rewards.score scores them (the vision demo's REWARDS)."""
    from features import evaluation, vision

    monkeypatch.setattr(evaluation, "EVAL_SIZE", 16)
    monkeypatch.setattr(vision, "MAX_PIXELS", 32 * 32)  # the 64 x 64 pictures fitted: scaled down
    monkeypatch.setattr(grpo, "DATASET", "shapes")
    monkeypatch.setattr(grpo, "REWARDS", [(rewards.reward_word, 2.0), (rewards.reward_format, 1.0)])
    mix([])
    plain = grpo.choose_task().load()
    mix([["shapes", 1.0]])
    ours = grpo.choose_task().load()
    for plain_part, our_part in zip(plain, ours):
        assert len(our_part) == len(plain_part)
        for a, b in zip(plain_part, our_part):
            assert (b["question"], b["gold"], b["images"]) == (a["question"], a["gold"],
                                                              a["images"])
            assert b["env"] == "shapes"
    assert ours[1][0]["images"] != rewards.load_questions("shapes", grpo.SEED, 20)[-16]["images"]
    held_out = ours[1]
    texts = [f"<think> it is {colour} </think><answer>{colour}</answer>"
             for _ in held_out for colour in rewards.COLOURS]
    texts += ["blue, I think"] * len(held_out)
    asked = [q for q in held_out for _ in rewards.COLOURS] + held_out
    want = rewards.score(grpo.REWARDS, texts, [q["gold"] for q in asked],
                         [q["question"] for q in asked])
    assert grpo.choose_task().score(texts, asked) == want
    assert set(want[0]) == {0.0, 1.0, 3.0}  # unformatted, formatted but wrong, right


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
        environments.check_settings(sampler="uniform", tools_on=False, eval_samples=0)


def test_settings_the_mix_cannot_serve_are_refused(mix):
    mix([["arithmetic", 1.0]])
    with pytest.raises(SystemExit, match='SAMPLER "uniform"'):
        environments.check_settings(sampler="difficulty", tools_on=False, eval_samples=0)
    with pytest.raises(SystemExit, match="leave TOOLS"):
        environments.check_settings(sampler="uniform", tools_on=True, eval_samples=0)
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
        grpo.score_completions(["<think> 1 </think><answer>2</answer>"],
                           [{"question": "q", "gold": "2"}])
    finally:
        sys.setprofile(None)
    assert calls == []


def test_a_run_on_the_arithmetic_environment_alone_trains_as_the_default(server, tiny_model_dir,
                                                                        tmp_path):
    """Two steps of the tiny model, with and without ENVIRONMENTS [["arithmetic", 1]]: every
    metric but the timings the same; the environment's own metrics (share_arithmetic,
    reward_arithmetic, ...) and its held-out mean come on top."""
    plain = train(tiny_model_dir, server.url, tmp_path / "plain", 1, EVAL_STEPS=2, SAVE_STEPS=0)
    assert plain.returncode == 0, plain.stderr[-3000:]
    envs = train(tiny_model_dir, server.url, tmp_path / "envs", 1, EVAL_STEPS=2, SAVE_STEPS=0,
                 ENVIRONMENTS='[["arithmetic", 1.0]]')
    assert envs.returncode == 0, envs.stderr[-3000:]
    timing = ("seconds", "_s")
    for a, b in zip(*(metrics(tmp_path / name)[0] for name in ("plain", "envs"))):
        assert b["share_arithmetic"] == 1.0 and b["reward_arithmetic"] == b["reward"]
        assert {k: v for k, v in a.items() if not k.endswith(timing)} == \
            {k: v for k, v in b.items() if not k.endswith((*timing, "_arithmetic"))}
    plain_eval = metrics(tmp_path / "plain")[1]
    envs_eval = metrics(tmp_path / "envs")[1]
    for a, b in zip(plain_eval, envs_eval):
        assert b["eval_reward_correct_arithmetic"] == b["eval_reward_correct"]
        assert {k: v for k, v in b.items() if not k.endswith("_arithmetic")} == a


def test_three_environments_train_together_against_a_real_openenv_server(
        server, tiny_model_dir, tmp_path, guess_server):
    """The arithmetic task, a reasoning-gym task and the number-guessing game served by OpenEnv's
    own server in its own process, two steps: each training line carries each environment's share
    and mean reward, as its answers in completions.jsonl give them; each held-out line each one's
    mean (the overall mean is theirs, as each holds out EVAL_SIZE; the game's episodes played);
    TensorBoard has them as scalars and curves.png is drawn."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, url = guess_server
    game = f"openenv:{url}"
    setting = [["arithmetic", 1.0], ["rg:leg_counting", 1.0, {"min_animals": 1,
                                                             "max_animals": 2}],
               [game, 1.0, {"reward_weights": {"solved": 1.0}}]]
    out = tmp_path / "mix"
    run = train(tiny_model_dir, server.url, out, 1, EVAL_STEPS=2, SAVE_STEPS=1, TENSORBOARD=1,
                ENVIRONMENTS=json.dumps(setting), Q_BATCH_SIZE=4, OPENENV_QUESTIONS=40,
                MAX_NEW_TOKENS=48)
    assert run.returncode == 0, run.stderr[-3000:]
    steps, evals = metrics(out)
    assert [line["step"] for line in steps] == [1, 2]
    answers = [json.loads(line) for line in open(out / "completions.jsonl")]
    games = [a for a in answers if a["env"] == game]
    assert games and all(a["question"].startswith("I am thinking") for a in games)
    tags = (("arithmetic", "arithmetic"), ("rg:leg_counting", "rg_leg_counting"),
            (game, environments.tag_of(game)))
    for line in steps:
        mine = [a for a in answers if a["step"] == line["step"]]
        for env, tag in tags:
            own = [a["reward"] for a in mine if a["env"] == env]
            share = line.get(f"share_{tag}", 0.0)  # a step that drew none of it has none
            assert share == pytest.approx(len(own) / len(mine), abs=1e-6)
            if own:
                assert line[f"reward_{tag}"] == pytest.approx(sum(own) / len(own), abs=1e-6)
    for line in evals:
        arithmetic = line["eval_reward_correct_arithmetic"]
        legs = line["eval_reward_correct_rg_leg_counting"]
        assert line["eval_reward_correct"] == pytest.approx((arithmetic + legs) / 3)
        assert line[f"eval_solved_{environments.tag_of(game)}"] == pytest.approx(
            3 * line["eval_solved"])
    board = EventAccumulator(str(out / "tb"))
    board.Reload()
    assert {"share_arithmetic", "eval_reward_correct_rg_leg_counting"} <= set(
        board.Tags()["scalars"])
    assert (out / "curves.png").exists()


# ----------------------------------------------------------------------------- episodes of turns
class Countdown(environments.Environment):
    """A multi-turn task of one's own: it answers "again" until the model's turn holds "stop",
    rewarding 1 for each turn and 5 for stopping."""
    multi_turn = True
    reward_weights = {"turn": 1.0, "stopped": 1.0}

    @classmethod
    def questions(cls, seed):
        return [{"question": f"Count {k}.", "gold": ""} for k in range(20)]

    def reset(self, question, seed):
        return [{"role": "user", "content": question["question"]}]

    def step(self, message):
        stop = "stop" in message
        return environments.Turn(observation="again", done=stop,
                                 rewards={"turn": 1.0, "stopped": 5.0 * stop})


def test_the_observation_joins_the_answer_as_the_chat_template_writes_a_turn(tokenizer):
    """Prompt + the model's turn (ending in its EOS) + observation_ids reads exactly as the chat
    template writes the three turns, with THINK_PREFILL after the next assistant header."""
    first = [{"role": "user", "content": "Guess."}]
    prompt = tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    turn = "<think> 8 </think><answer>8</answer>"
    glue = tokenizer.decode(environments.observation_ids(tokenizer, "Higher.", "<think>"))
    whole = tokenizer.apply_chat_template(
        first + [{"role": "assistant", "content": turn}, {"role": "user", "content": "Higher."}],
        tokenize=False, add_generation_prompt=True)
    assert prompt + turn + tokenizer.eos_token + glue == whole + "<think>"


def scripted(turns_by_row):
    """sample() for play that writes each row's next scripted turn (token ids) whatever it is
    asked; it checks each prefix grows by what play appended."""
    calls = []

    def sample(prefixes, budgets):
        calls.append(len(prefixes))
        return [(turns_by_row[len(calls) - 1][k], None) for k in range(len(prefixes))]
    return sample


def test_play_masks_the_environments_tokens_and_sums_the_rewards_of_every_turn(mix, tokenizer):
    """Two episodes of Countdown: the first stops on its second turn, the second writes no EOS
    and is cut by the budget. The mask is True on exactly the model's tokens (EOS included), the
    rewards add up over the turns, only the first is stopped."""
    mix([["test_environments:Countdown", 1.0]])
    eos = tokenizer.eos_token_id
    go = tokenizer("go on", add_special_tokens=False).input_ids + [eos]
    stop = tokenizer("stop", add_special_tokens=False).input_ids + [eos]
    long_turn = tokenizer(" word" * 40, add_special_tokens=False).input_ids  # no EOS: cut
    question = {"question": "Count 1.", "gold": "", "env": "test_environments:Countdown"}
    out = environments.play(scripted([[go, long_turn], [stop]]), [[1, 2], [1, 2]],
                            [question, question], reward_fns=grpo.REWARDS, tokenizer=tokenizer,
                            think_prefill="<think>", max_new_tokens=30, eos_ids=[eos],
                            pad_id=eos)
    glue = environments.observation_ids(tokenizer, "again", "<think>")
    first = go + glue + stop
    assert out["completion_ids"][0, : len(first)].tolist() == first
    assert out["policy_mask"][0].tolist()[: len(first)] == \
        [True] * len(go) + [False] * len(glue) + [True] * len(stop)
    assert not out["policy_mask"][0, len(first):].any()
    assert out["policy_mask"][1].tolist() == [True] * 30  # the budget, all the model's own
    assert out["played"] == [{"turn": 2.0, "stopped": 5.0}, {"turn": 0.0, "stopped": 0.0}]
    assert out["stopped"].tolist() == [True, False] and out["turns"] == [2, 0]
    sums, each = environments.score(["a", "b"], [question, question], grpo.REWARDS,
                                    out["played"])
    assert sums == [7.0, 0.0] and each == {"turn": [2.0, 0.0], "stopped": [5.0, 0.0]}


def test_an_episode_ends_after_max_turns(mix, tokenizer, monkeypatch):
    mix([["test_environments:Countdown", 1.0]])
    monkeypatch.setattr(environments, "MAX_TURNS", 3)
    eos = tokenizer.eos_token_id
    go = tokenizer("go", add_special_tokens=False).input_ids + [eos]
    question = {"question": "Count 1.", "gold": "", "env": "test_environments:Countdown"}
    out = environments.play(scripted([[go]] * 5), [[1]], [question], reward_fns=grpo.REWARDS,
                            tokenizer=tokenizer, think_prefill="", max_new_tokens=500,
                            eos_ids=[eos], pad_id=eos)
    assert out["turns"] == [3] and out["stopped"].tolist() == [False]
    assert out["played"] == [{"turn": 3.0, "stopped": 0.0}]


# ----------------------------------------------------------------------------- OpenEnv, for real
def serve(script, port, **env):
    """A server script on `port` in its own process; waits for its /health."""
    import subprocess
    import time

    import requests

    proc = subprocess.Popen([__import__("sys").executable, script], cwd=ROOT,
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                return proc
        except requests.ConnectionError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{script} did not start")


@pytest.fixture
def hostile():
    """start(how) -> the URL of tests/openenv_hostile.py misbehaving that way."""
    from conftest import free_port, kill_group

    procs = []

    def start(how, from_session=1):
        port = free_port()
        procs.append(serve("tests/openenv_hostile.py", port, HOSTILE=how,
                           HOSTILE_PORT=str(port), HOSTILE_FROM_SESSION=str(from_session)))
        return f"http://127.0.0.1:{port}"
    yield start
    for proc in procs:
        kill_group(proc)


@pytest.mark.parametrize("how, says", [
    ("nan", "reward score = None is not a number"),  # OpenEnv's server writes NaN as null
    ("huge", "step failed"),
    ("text", "an observation needs a text field"),
    ("silent", "step failed: TimeoutError"),
])
def test_a_hostile_openenv_server_is_refused_with_the_environment_named(hostile, monkeypatch,
                                                                         how, says):
    monkeypatch.setattr(environments, "ENV_TIMEOUT", 2.0)
    url = hostile(how)
    episode = environments.OpenEnvEnvironment(url, f"openenv:{url}", {"score": 1.0})
    try:
        said = "Say anything (3)."
        episode.reset({"question": said, "seed": 3,
                       "opening": [{"role": "user", "content": said}]}, seed=0)
        with pytest.raises(environments.EnvironmentFault, match=f"openenv:{url}: {says}"):
            episode.step("hello")
    finally:
        episode.close()


@pytest.mark.parametrize("how, weights, says", [
    ("no_done", {"score": 1.0}, "a reply without done.*at start"),  # the client would read False
    ("done_text", {"score": 1.0}, "a reply without done.*at start"),
    ("nan", {"score": 1.0}, "reward score = None is not a number.*at start"),
    ("nan_raw", {"score": 1.0}, "reward score = nan is not finite.*at start"),  # NaN, not null
    ("text", {"score": 1.0}, "an observation needs a text field.*at start"),
    ("fine", {"solved": 1.0}, "rewards .* are not \\['solved'\\].*at start"),  # never sent
    ("messages", {"score": 1.0}, "reset must return the opening messages"),  # at its openings
])
def test_a_hostile_openenv_server_is_refused_at_load(hostile, mix, monkeypatch, how, weights,
                                                     says):
    """Issue 88 items 1 and 5: the run's task asks the server for one throwaway step at load
    (probe_rewards), so a reply without done, a reward that is not a finite number, an observation
    without text and a reward name the server never sends each stop the run there, named; so do
    opening messages that are not {"role", "content"} strings, at the run's first reset."""
    monkeypatch.setattr(environments, "OPENENV_QUESTIONS", 4)
    monkeypatch.setattr(grpo.evaluation, "EVAL_SIZE", 2)
    url = hostile(how)
    mix([[f"openenv:{url}", 1.0, {"reward_weights": weights}]])
    with pytest.raises(SystemExit, match=f"openenv:{url}: {says}"):
        grpo.choose_task().load()


def test_a_reply_without_done_stops_a_real_run_before_any_model_loads(hostile, tiny_model_dir,
                                                                      tmp_path):
    """The same through the trainer itself: a server whose step replies lack done stops the run
    at load, named, before the memory plan or any weight loads (OpenEnv's client would have read
    done as False, and every episode would have run on to MAX_TURNS)."""
    url = hostile("no_done")
    setting = json.dumps([[f"openenv:{url}", 1.0, {"reward_weights": {"score": 1.0}}]])
    run = train(tiny_model_dir, "http://127.0.0.1:9", tmp_path, 1, ENVIRONMENTS=setting,
                OPENENV_QUESTIONS=4, EVAL_SIZE=2, ENV_TIMEOUT=5)
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert f"openenv:{url}: a reply without done" in output, output[-2000:]
    assert "asked at start" in output and "memory plan" not in output


@pytest.mark.parametrize("how, says", [
    ("no_done", "a reply without done"),  # the client's check (strict_client)
    ("die", "step failed"),  # the server exits in the middle of the episode
])
def test_a_server_that_turns_hostile_mid_run_stops_it_named_and_its_step_never_trains(
        hostile, server, tiny_model_dir, tmp_path, how, says):
    """Issue 88 item 5: hostile replies through a real two-step run: a reply without done, and the
    server gone mid-episode (its reset answered). The reply checks (a NaN reward, an observation
    without text, 16 MB, no answer) are the same calls: test_a_hostile_openenv_server_is_refused_*
    send each through them, at load and in an episode. The server plays fine
    for the load (its openings and the probe: session 1) and step 1's 2 x 4 episodes, then turns:
    step 2's episodes meet it (step 1's, should a group need a second rollout). The run stops
    naming the environment and the fault, and the step that met it neither logs nor saves."""
    url = hostile(how, from_session=10)
    setting = json.dumps([[f"openenv:{url}", 1.0, {"reward_weights": {"score": 1.0}}]])
    run = train(tiny_model_dir, server.url, tmp_path, 1, ENVIRONMENTS=setting,
                OPENENV_QUESTIONS=4, EVAL_SIZE=2, EVAL_STEPS=0, ENV_TIMEOUT=3)
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert f"environment openenv:{url}: {says}" in output, output[-2000:]
    steps, _ = metrics(tmp_path)
    assert [line["step"] for line in steps] in ([], [1])  # the step that met it never logs
    assert not (tmp_path / "step_2").exists()


def test_an_unreachable_openenv_server_stops_the_run_at_load(mix, monkeypatch):
    from conftest import free_port

    monkeypatch.setattr(environments, "SERVER_WAIT", 1.0)
    url = f"http://127.0.0.1:{free_port()}"
    mix([[f"openenv:{url}", 1.0]])
    with pytest.raises(environments.EnvironmentFault, match=f"openenv:{url} is not reachable"):
        environments.load(seed=1, eval_size=4, arith_max=20, fit_images=None)


@pytest.fixture
def guess_server():
    from conftest import free_port, kill_group

    port = free_port()
    proc = serve("scripts/guess_number_env.py", port, GUESS_PORT=str(port))
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:  # a test may have killed it already
        kill_group(proc)


def test_the_games_opening_shows_a_worked_guess_of_another_game():
    """GUESS_EXAMPLE: the opening shows where a guess goes, as the trainer's own prompt shows one
    sum: a system turn, then a guess the game's judge reads for a game of another range (so it
    gives no number of this one away), then the rules; without it, the earlier runs' opening."""
    from scripts import guess_number_env as game

    system, example, worked, rules = game.opening(8, 2)
    assert [m["role"] for m in (system, example, worked, rules)] == [
        "system", "user", "assistant", "user"]
    assert "1 to 8" in rules["content"] and "2 guesses" in rules["content"]
    assert "1 to 100" in example["content"]
    assert [game.judge(worked["content"], secret) for secret in (1, 50, 99)] == [
        ("Lower.", False), ("Right!", True), ("Higher.", False)]
    assert int(game.ANSWER_RE.findall(worked["content"])[-1]) > 8  # none of this game's range
    [alone] = game.opening(8, 2, example=False)
    assert alone["content"].startswith("I am thinking of a whole number from 1 to 8. Guess it:")
    assert game.judge("The answer is 8.", 8) == (
        "No guess found: write a number in <answer></answer>.", False)


def test_an_openenv_servers_opening_messages_are_the_prompt(guess_server, tokenizer, monkeypatch):
    """Issue 88 item 2 for OpenEnv: the messages a server's reset sends (the game's system turn and
    worked example) are each episode's opening, checked again at each reset, and the prompt is
    them in the chat template; its text alone is the question's."""
    monkeypatch.setattr(environments, "OPENENV_QUESTIONS", 3)
    _, url = guess_server
    name = f"openenv:{url}"
    train, held_out = environments.openenv_questions(
        name, {"reward_weights": {"solved": 1.0}}, seed=5, eval_size=2)
    from scripts.guess_number_env import opening

    want = opening(8, 2)
    assert [q["opening"] for q in train + held_out] == [want] * 5
    assert {q["question"] for q in train} == {want[-1]["content"]}
    episode = environments.OpenEnvEnvironment(url, name, {"solved": 1.0})
    try:
        assert episode.reset(train[1], seed=0) == want
        changed = dict(train[1], opening=want[-1:])  # what the run started with differs
        with pytest.raises(environments.EnvironmentFault, match="opened otherwise"):
            episode.reset(changed, seed=0)
    finally:
        episode.close()
    prompt = environments.opening_prompt(tokenizer, train[0], default=None, think_prefill="<t>")
    assert want[0]["content"] in prompt and want[2]["content"] in prompt
    assert prompt.endswith("<t>") and prompt.index(want[2]["content"]) < prompt.index("1 to 8")


class Reweighed(Reverse):
    """A class that weighs reward_format otherwise than the trainer's REWARDS do (1.0)."""
    reward_weights = {"reversed": 1.0, "reward_format": 0.5}

    def step(self, message):
        values = {"reversed": float(self.gold in message), "reward_format": 1.0}
        return environments.Turn(observation="", rewards=values, done=True)


def test_gdpo_normalises_each_environments_own_rewards(mix, monkeypatch):
    """REWARD_NORM "normalize_then_sum" on a mix: an environment whose rewards are not REWARDS'
    gets GDPO's advantages from its own rewards and weights (checked against the definition
    written out here), and the arithmetic group from REWARDS'."""
    import torch

    mix([["arithmetic", 1.0], ["test_environments:Reverse", 1.0]])
    monkeypatch.setattr(grpo, "REWARD_NORM", "normalize_then_sum")
    monkeypatch.setattr(grpo, "NUM_PRE_Q", 4)
    assert grpo.choose_task().rewards == (("reward_correct", 2.0), ("reward_format", 1.0),
                                       ("reversed", 1.0), ("short", 0.5))
    word = {"question": "Write abc backwards.", "gold": "cba", "env": "test_environments:Reverse"}
    sum_q = {"question": "What is 2 + 3?", "gold": "5", "env": "arithmetic"}
    texts = ["cba", "abc", "cba" + "!" * 50, "no"]
    texts += ["<think> 5 </think><answer>5</answer>", "<think> 5 </think><answer>4</answer>",
              "5", "<think> 5 </think><answer>5</answer>"]
    sums, each = grpo.choose_task().score(texts, [word] * 4 + [sum_q] * 4)
    advantages = grpo.choose_parts().advantages(torch.tensor(sums), each)

    def normalised(values):  # (r - group mean) / (unbiased std + STD_EPS)
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        return [(v - mean) / (std + grpo.STD_EPS) for v in values]

    reversed_ = normalised([1.0, 0.0, 1.0, 0.0])
    short = normalised([1.0, 1.0, 0.0, 1.0])
    want = [1.0 * r + 0.5 * s for r, s in zip(reversed_, short)]
    correct = normalised([1.0, 0.0, 1.0, 1.0])
    formatted = normalised([1.0, 1.0, 0.0, 1.0])
    want += [2.0 * c + 1.0 * f for c, f in zip(correct, formatted)]
    assert advantages.tolist() == pytest.approx(want, rel=1e-6)


def test_gdpo_refuses_a_reward_two_environments_weigh_differently(mix):
    mix([["arithmetic", 1.0], ["test_environments:Reweighed", 1.0]])
    with pytest.raises(SystemExit, match="weighs reward reward_format 1.0 and .*Reweighed 0.5"):
        environments.check_settings(sampler="uniform", tools_on=False, eval_samples=0,
                                    gdpo=True, reward_fns=grpo.REWARDS)
    environments.check_settings(sampler="uniform", tools_on=False, eval_samples=0,
                                gdpo=False, reward_fns=grpo.REWARDS)  # a plain sum weighs each


PARITY = '''
import environments


class Parity(environments.Environment):
    """Rewards a random tiny model's answers still differ on: their length's parity."""
    reward_weights = {"odd": 1.0, "long": 0.5}

    @classmethod
    def questions(cls, seed):
        return [{"question": f"Say something {i}.", "gold": ""} for i in range(40)]

    def reset(self, question, seed):
        return [{"role": "user", "content": question["question"]}]

    def step(self, message):
        values = {"odd": float(len(message) % 2), "long": float(len(message) > 30)}
        return environments.Turn(observation="", rewards=values, done=True)
'''


def test_a_run_on_an_environment_without_the_trainers_rewards_logs_its_own(server, tiny_model_dir,
                                                                           tmp_path):
    """Two tiny steps on a class of one's own alone, under GDPO: the step's log holds the
    environment's rewards (odd, long), not REWARDS' (reward_correct was looked for in its answers,
    and in GDPO's table, and the run stopped with a KeyError)."""
    (tmp_path / "parity_env.py").write_text(PARITY)
    out = tmp_path / "out"
    run = train(tiny_model_dir, server.url, out, 1, SAVE_STEPS=0, EVAL_STEPS=2,
                ENVIRONMENTS='[["parity_env:Parity", 1.0]]', REWARD_NORM="normalize_then_sum",
                PYTHONPATH=str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps, evals = metrics(out)
    assert len(steps) == 2 and all("odd" in m and "long" in m for m in steps)
    assert not any("reward_correct" in m for m in steps)
    assert "eval_odd_parity_env_Parity" in evals[-1]


def test_the_example_in_docs_environments_md_runs_as_written(mix, tmp_path, monkeypatch):
    """docs/environments.md's class of one's own, as written there, named in ENVIRONMENTS beside
    the arithmetic task: its questions load, and it scores its answers by its own weights."""
    import re
    import sys

    page = open(os.path.join(ROOT, "docs", "environments.md")).read()
    code = re.search(r"```python\n(.*?)```", page, re.DOTALL).group(1)
    (tmp_path / "my_env.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_env", raising=False)
    mix([["arithmetic", 1.0], ["my_env:Reverse", 1.0]])
    environments.check_settings(sampler="uniform", tools_on=False, eval_samples=0)
    train_q, held_out = environments.load(seed=3, eval_size=8, arith_max=20, fit_images=None)
    word = next(q for q in held_out if q["env"] == "my_env:Reverse")
    sums, each = environments.score([word["gold"], "no"], [word, word], grpo.REWARDS)
    assert sums == [1.5, 0.5] and each["reversed"] == [1.0, 0.0]
    assert word["tag"] == "my_env_Reverse"


def test_each_environment_gets_its_share_and_means_in_the_step_metrics():
    from features.run_log import environment_stats

    answers = [dict(env="arithmetic", reward=3.0, reward_correct=1.0, length=9, step=1),
               dict(env="arithmetic", reward=1.0, reward_correct=0.0, length=5, step=1),
               dict(env="rg:leg_counting", reward=2.0, reward_correct=1.0, length=7, step=1)]
    assert environment_stats(answers) == {
        "share_arithmetic": 2 / 3, "reward_arithmetic": 2.0, "reward_correct_arithmetic": 0.5,
        "share_rg_leg_counting": 1 / 3, "reward_rg_leg_counting": 2.0,
        "reward_correct_rg_leg_counting": 1.0}


# ----------------------------------------------------------------------------- a task's own prompt
class Riddle(Reverse):
    """A class that opens with its own system turn and question, and remembers its seed."""
    seeds = []  # the seed each reset got

    def reset(self, question, seed):
        Riddle.seeds.append(seed)
        super().reset(question, seed)
        return [{"role": "system", "content": "Answer with the reversed word only."},
                {"role": "user", "content": f"Riddle: {question['question']}"}]


class SameOpening(Reverse):
    """A game whose every question opens with the same text (only the seed tells them apart)."""

    @classmethod
    def questions(cls, seed):
        return [{"question": "Guess my word.", "gold": w} for w in ("abc", "bca", "cab") * 10]


class Drifting(Reverse):
    """A class whose reset opens otherwise each time: its episodes depend on more than the seed."""
    resets = 0

    def reset(self, question, seed):
        Drifting.resets += 1
        return [{"role": "user", "content": f"{question['question']} ({Drifting.resets})"}]


def test_an_environment_is_prompted_with_what_its_reset_opens(mix, tokenizer, monkeypatch):
    """Issue 88 item 2 (and 87's task seam): the prompt of a class of one's own is its reset's
    messages in the chat template, then THINK_PREFILL; no trainer system prompt, no arithmetic
    worked example. A built-in task's prompt stays the trainer's (build_prompt)."""
    monkeypatch.setattr(grpo.evaluation, "EVAL_SIZE", 8)
    mix([["arithmetic", 1.0], ["test_environments:Riddle", 1.0]])
    task = grpo.choose_task()
    train, held_out = task.load()
    riddle = next(q for q in train if q["env"] == "test_environments:Riddle")
    opened = Riddle().reset(riddle, riddle["seed"])
    want = tokenizer.apply_chat_template(opened, tokenize=False, add_generation_prompt=True)
    prompt = task.prompt(tokenizer, riddle)
    assert prompt == want + grpo.THINK_PREFILL
    assert grpo.EXAMPLE[0] not in prompt and grpo.SYSTEM_PROMPT not in prompt
    assert "Answer with the reversed word only." in prompt and "Riddle: Write" in prompt
    sum_q = next(q for q in train if q["env"] == "arithmetic")
    assert task.prompt(tokenizer, sum_q) == grpo.build_prompt(tokenizer, sum_q["question"])
    assert grpo.EXAMPLE[0] in task.prompt(tokenizer, sum_q)
    ids = grpo.encode_prompts(tokenizer, [riddle], task.prompt).input_ids[0]  # as step 2 encodes
    assert tokenizer.decode(ids) == prompt


def test_reset_gets_the_questions_own_seed_not_the_answers_place_in_the_step(mix, monkeypatch):
    """Issue 88 item 2: the seed reset receives is the question's (its position in questions(seed),
    or the one it carries), the same at load, in scoring and in play, whatever the answer's place
    in the step."""
    monkeypatch.setattr(grpo.evaluation, "EVAL_SIZE", 8)
    mix([["test_environments:Riddle", 1.0]])
    train, _ = grpo.choose_task().load()
    assert [q["seed"] for q in train[:3]] == [0, 1, 2]
    Riddle.seeds.clear()
    asked = [train[2], train[2], train[1]]
    environments.score(["cba", "no", "x"], asked, grpo.REWARDS)
    assert Riddle.seeds == [2, 2, 1]


def test_a_game_whose_questions_share_one_opening_still_trains(mix, monkeypatch):
    """Issue 88 item 3: held-out questions are split off by position, so a game that opens every
    episode with the same text keeps its training questions (equal texts used to drop them all,
    and the run stopped in the memory plan with an empty max())."""
    monkeypatch.setattr(grpo.evaluation, "EVAL_SIZE", 8)
    mix([["test_environments:SameOpening", 1.0]])
    train, held_out = grpo.choose_task().load()
    assert (len(train), len(held_out)) == (22, 8)
    assert train and {q["question"] for q in train} == {"Guess my word."}


def test_an_environment_that_opens_otherwise_than_at_load_stops_the_episode(mix, tokenizer):
    """The prompt was taken from reset at load; an episode whose reset opens otherwise would be
    trained on a prompt it was never asked: EnvironmentFault names the environment."""
    mix([["test_environments:Drifting", 1.0]])
    monkey_questions = Drifting.questions(0)[:2]
    for k, q in enumerate(monkey_questions):
        q.update(env="test_environments:Drifting", seed=k,
                 opening=[{"role": "user", "content": q["question"]}])
    with pytest.raises(environments.EnvironmentFault, match="Drifting.*opened otherwise"):
        environments.play(scripted([[[tokenizer.eos_token_id]] * 2]), [[1], [1]],
                          monkey_questions, reward_fns=grpo.REWARDS, tokenizer=tokenizer,
                          think_prefill="", max_new_tokens=4, eos_ids=[tokenizer.eos_token_id],
                          pad_id=tokenizer.eos_token_id)


def test_reset_must_open_with_messages(mix, monkeypatch):
    """A reset that gives a string (or no user turn last) is refused at load, named."""
    monkeypatch.setattr(grpo.evaluation, "EVAL_SIZE", 8)
    class Stringy(Reverse):
        def reset(self, question, seed):
            return question["question"]
    environments.Stringy = Stringy
    try:
        mix([["environments:Stringy", 1.0]])
        with pytest.raises(SystemExit, match="Stringy.*opening messages"):
            grpo.choose_task().load()
    finally:
        del environments.Stringy


def test_no_feature_module_imports_environments_py():
    """Issue 87: the arrows run one way; features/ never reaches up into the environments' room
    (the evaluation's episodes and the metric tags now live where they belong)."""
    import ast
    import glob

    importing = []
    for path in glob.glob(os.path.join(ROOT, "features", "*.py")):
        for node in ast.walk(ast.parse(open(path).read())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if "environments" in names:
                importing.append(os.path.basename(path))
    assert importing == []


@pytest.mark.parametrize("setting, says", [
    ([["openenv:127.0.0.1:8021", 1.0]], "an OpenEnv server is named by its URL"),
    ([["nonsense", 1.0]], "'openenv:http://host:port'"),  # the list of kinds names OpenEnv's
])
def test_an_openenv_name_without_a_scheme_says_how_to_write_it(mix, setting, says):
    """Issue 88 item 4: `openenv:127.0.0.1:8021` was "unknown environment" with a list of kinds
    that left OpenEnv out."""
    with pytest.raises(ValueError, match=says):
        environments.entries(setting)


def test_a_task_reasoning_gym_does_not_know_stops_the_run_with_its_name(mix, monkeypatch):
    """Issue 88 item 4: `rg:no_such_task` gave a traceback; the run's load stops with it named."""
    monkeypatch.setattr(grpo.evaluation, "EVAL_SIZE", 4)
    mix([["rg:no_such_task", 1.0]])
    with pytest.raises(SystemExit, match="rg:no_such_task: reasoning-gym refused it"):
        grpo.choose_task().load()


def test_a_step_that_times_out_says_so(mix, monkeypatch):
    """Issue 88 item 4: a step timeout read `TimeoutError: ` with nothing after it."""
    episode = environments.OpenEnvEnvironment.__new__(environments.OpenEnvEnvironment)
    episode.name = "openenv:http://slow"

    class Silent:
        def step(self, *args, **kwargs):
            raise TimeoutError()
    episode.client = Silent()
    with pytest.raises(environments.EnvironmentFault,
                       match="openenv:http://slow: step failed: TimeoutError: no answer within"):
        episode.call("step", {"message": "hi"})
