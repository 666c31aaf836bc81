"""Environments (ENVIRONMENTS): a task as a plug-in, and several tasks in one run, in a room of
their own. A default step never enters this file; the lesson reaches it only when ENVIRONMENTS
names some: its questions (load_dataset), its draws (the sampler) and its scores (step 3).

An environment is OpenEnv's reset / step (and tinker-cookbook's Env) cut to what GRPO needs. The
trainer makes one Environment per answer, so an episode may keep state between its turns:

    reset(question, seed) -> the opening messages, [{"role": "user", "content": ...}]
    step(message)         -> Turn(observation, rewards {name: value}, done)

A single-turn task is one step. Its rewards are named, so REWARD_NORM "normalize_then_sum" (GDPO)
normalises each on its own; an answer's reward is their sum weighted by the environment's
reward_weights. Each question carries its environment's name ("env", and "tag" for the held-out
evaluation's per-environment means), so a group is always one environment's. What ENVIRONMENTS
may name:
  - a built-in task: "arithmetic", "arithmetic_mixed", "shapes", a GSM8K-style .jsonl: DATASET's
    questions scored by the trainer's REWARDS, the same numbers as without ENVIRONMENTS;
  - "rg:<task>": one of reasoning-gym's procedural tasks, scored by its own score_answer, with a
    seeded held-out set of its own;
  - "module:attribute": a class of one's own, with `questions(seed)` and reset / step
    (docs/environments.md has one in 30 lines).

    ENVIRONMENTS='[["arithmetic", 1.0], ["rg:leg_counting", 1.0]]' bash scripts/run_demo.sh
    python -m pytest tests/test_environments.py
"""
import importlib
import math
import sys
from dataclasses import dataclass
from typing import Callable

import rewards
from features import env_overrides
from features.question_sampler import QuestionSampler

# ----------------------------------------------------------------------------- constants
ENVIRONMENTS = []  # [[name, weight]] or [[name, weight, {options}]]; [] = DATASET and REWARDS
RG_SIZE = 2000  # questions a reasoning-gym task makes for training (its held-out set apart)
RG_HELD_OUT_SEED = 1_000_003  # added to SEED for a reasoning-gym task's held-out questions
env_overrides.apply_env_overrides(globals(), "environments.py")

RG_PREFIX = "rg:"  # "rg:leg_counting": reasoning-gym's task of that name
BUILT_IN = ("arithmetic", "arithmetic_mixed", "shapes")  # besides a .jsonl and geometry3k


# ----------------------------------------------------------------------------- the interface
@dataclass
class Turn:
    """What one step of an episode gives back."""
    observation: str  # the environment's next message to the model; "" when done
    rewards: dict  # {reward name: value} for the message just taken
    done: bool  # True: the episode is over (a single-turn task: after its one step)


class Environment:
    """One episode of a task; a subclass writes reset and step (and a class method questions)."""

    def reset(self, question: dict, seed: int) -> list:
        """The opening messages for `question` (a dict with "question", "gold", ...)."""
        raise NotImplementedError

    def step(self, message: str) -> Turn:
        """The model's message taken: the next observation, its rewards, and whether it is over."""
        raise NotImplementedError


@dataclass(frozen=True)
class Scorer:
    """How an environment scores: a fresh episode per answer, and its rewards' weights."""
    make: Callable  # make() -> a fresh Environment, one per answer
    reward_weights: dict  # {reward name: weight} in an answer's summed reward


def tag_of(name: str) -> str:
    """An environment's name in metric names (eval_reward_correct_<tag>): no ":", "/" or "."."""
    return name.replace(":", "_").replace("/", "_").replace(".", "_")


# ----------------------------------------------------------------------------- the built-in ones
class RewardsEnvironment(Environment):
    """A single-turn task scored by reward functions f(completion, gold, question) -> float: the
    trainer's REWARDS on a built-in dataset."""

    def __init__(self, reward_fns):
        self.reward_fns = reward_fns
        self.question = None

    def reset(self, question: dict, seed: int) -> list:
        self.question = question
        return [{"role": "user", "content": question["question"]}]

    def step(self, message: str) -> Turn:
        gold = self.question["gold"]
        text = self.question["question"]
        values = {fn.__name__: rewards.checked_reward(fn, message, gold, text)
                  for fn, _ in self.reward_fns}
        return Turn(observation="", rewards=values, done=True)


class ReasoningGymEnvironment(Environment):
    """A single-turn reasoning-gym task: the answer in <answer> tags (rewards.extract_answer),
    scored by the task's own score_answer (0 to 1, partial credit where the task gives it), beside
    the trainer's reward_format."""

    def __init__(self):
        self.question = None

    def reset(self, question: dict, seed: int) -> list:
        self.question = question
        return [{"role": "user", "content": question["question"]}]

    def step(self, message: str) -> Turn:
        import reasoning_gym

        entry = self.question["entry"]
        score_answer = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
        answer = rewards.extract_answer(message)
        right = float(score_answer(answer=answer, entry=entry))
        values = {"reward_correct": right, "reward_format": rewards.reward_format(message)}
        return Turn(observation="", rewards=values, done=True)


def reasoning_gym_questions(name, options, *, seed, eval_size) -> tuple:
    """"rg:<task>": (RG_SIZE training questions from the task's generator at `seed`, eval_size
    held-out ones at seed + RG_HELD_OUT_SEED); a held-out text leaves training."""
    import reasoning_gym

    task = name[len(RG_PREFIX):]
    try:
        train = reasoning_gym.create_dataset(task, size=RG_SIZE, seed=seed, **options)
        tested = reasoning_gym.create_dataset(task, size=eval_size, seed=seed + RG_HELD_OUT_SEED,
                                              **options)
    except Exception as e:  # an unknown task or option: reasoning-gym's own message
        raise ValueError(f"ENVIRONMENTS: {name}: reasoning-gym refused it: {e}") from e
    rows = [rg_question(entry, "train") for entry in train]
    rows += [rg_question(entry, "test") for entry in tested]
    return rewards.split_held_out(rows, eval_size)


def rg_question(entry: dict, split: str) -> dict:
    """A reasoning-gym entry as a question: its text, its answer as the gold, the entry itself
    (score_answer reads its metadata)."""
    return {"question": entry["question"], "gold": str(entry["answer"]), "entry": entry,
            "split": split}


def own_class(name: str):
    """"module:Class": the class of one's own that the name points at, checked for the four
    things an environment class needs."""
    module_name, _, attribute = name.partition(":")
    try:
        env_class = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"ENVIRONMENTS: {name}: no such class ({e})") from e
    for needed in ("questions", "reward_weights", "reset", "step"):
        if not hasattr(env_class, needed):
            raise ValueError(f"ENVIRONMENTS: {name} has no {needed}: an environment class needs "
                             "questions(seed), reward_weights, reset and step")
    return env_class


def kind_of(name: str) -> str:
    """"rg" (reasoning-gym), "own" (module:Class) or "built_in" (a DATASET name)."""
    if name.startswith(RG_PREFIX):
        return "rg"
    if ":" in name and not name.endswith(".jsonl"):
        return "own"
    return "built_in"


def scorer(name, options, reward_fns) -> Scorer:
    """How the environment `name` scores. A built-in task weighs REWARDS as the trainer does; a
    reasoning-gym one gives its score the weight of REWARDS' correctness reward and reward_format
    its weight there (0 without it); a class of one's own brings its reward_weights."""
    weights = {fn.__name__: w for fn, w in reward_fns}
    if kind_of(name) == "built_in":
        return Scorer(make=lambda: RewardsEnvironment(reward_fns), reward_weights=weights)
    if kind_of(name) == "rg":
        correct = rewards.correctness_reward(list(weights))
        rg_weights = dict(reward_correct=weights.get(correct, 1.0),
                          reward_format=weights.get("reward_format", 0.0))
        return Scorer(make=ReasoningGymEnvironment, reward_weights=rg_weights)
    env_class = own_class(name)
    return Scorer(make=lambda: env_class(**options), reward_weights=dict(env_class.reward_weights))


# ----------------------------------------------------------------------------- the run's mix
def entries(setting=None) -> list:
    """ENVIRONMENTS as (name, weight, options) triples, each checked: a name of a kind this file
    knows, a finite weight > 0, options a dict, no name twice. ValueError names the entry."""
    setting = ENVIRONMENTS if setting is None else setting
    out = []
    for entry in setting:
        if not isinstance(entry, (list, tuple)) or len(entry) not in (2, 3):
            raise ValueError(f"ENVIRONMENTS: {entry!r} is not [name, weight] or "
                             "[name, weight, {options}]")
        name, weight, *rest = entry
        options = rest[0] if rest else {}
        if not isinstance(name, str) or not known_kind(name):
            raise ValueError(f"ENVIRONMENTS: unknown environment {name!r}: one of "
                             f"{', '.join(BUILT_IN)}, a .jsonl, a hub id with '/', "
                             f"'{RG_PREFIX}<task>' or 'module:Class'")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"ENVIRONMENTS: {name}: weight {weight!r} is not a number")
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"ENVIRONMENTS: {name}: weight {weight} must be finite and > 0")
        if not isinstance(options, dict):
            raise ValueError(f"ENVIRONMENTS: {name}: options {options!r} are not a dict")
        if kind_of(name) == "built_in" and options:
            raise ValueError(f"ENVIRONMENTS: {name}: a built-in task takes no options (its "
                             "settings are the trainer's: ARITH_MAX...)")
        if name in [e[0] for e in out]:
            raise ValueError(f"ENVIRONMENTS: {name} is named twice")
        out.append((name, float(weight), options))
    return out


def known_kind(name: str) -> bool:
    """Whether `name` is of a kind ENVIRONMENTS can load (whether it exists is checked on load)."""
    if kind_of(name) == "rg":
        return len(name) > len(RG_PREFIX)
    if kind_of(name) == "own":
        module_name, _, attribute = name.partition(":")
        return bool(module_name and attribute)
    return name in BUILT_IN or name.endswith(".jsonl") or "/" in name


def check_settings(*, sampler: str, tools_on: bool) -> None:
    """Stop, before any model loads, on ENVIRONMENTS that cannot serve this run: a bad entry (an
    unknown environment, a weight <= 0, a class of one's own that is not there), or a setting the
    mix does not serve (SAMPLER other than "uniform", TOOLS)."""
    if not ENVIRONMENTS:
        return
    try:
        for name, _, options in entries():
            if kind_of(name) == "own":
                own_class(name)
    except ValueError as e:
        sys.exit(str(e))
    if sampler != "uniform":
        sys.exit(f"ENVIRONMENTS draws each question's environment by its weight; SAMPLER "
                 f"{sampler!r} would draw by pass rates instead: use SAMPLER \"uniform\"")
    if tools_on:
        sys.exit("ENVIRONMENTS with TOOLS: the calculator is a task of its own; leave TOOLS [] "
                 "with ENVIRONMENTS")


def load(*, seed: int, eval_size: int, arith_max: int, fit_images) -> tuple:
    """(training questions, held-out questions) of every environment, in ENVIRONMENTS' order, each
    carrying its environment's name ("env") and tag ("tag": the held-out means per environment).
    Every environment holds out eval_size questions of its own; fit_images(questions) fits those
    with images to the pixel budget (features/vision.fit_questions). The questions carry their
    environment, so two environments may ask the same text."""
    train = []
    held_out = []
    for name, _, options in entries():
        if kind_of(name) == "rg":
            part = reasoning_gym_questions(name, options, seed=seed, eval_size=eval_size)
        elif kind_of(name) == "own":
            part = rewards.split_held_out(list(own_class(name).questions(seed)), eval_size)
        else:
            dataset = rewards.load_questions(name, seed, arith_max)
            if any(q.get("images") for q in dataset):
                dataset = fit_images(dataset)
            part = rewards.split_held_out(dataset, eval_size)
        for q in part[0] + part[1]:
            q["env"] = name
            q["tag"] = tag_of(name)
        train += part[0]
        held_out += part[1]
    return train, held_out


class MixSampler(QuestionSampler):
    """draw(n): each of the n questions from an environment drawn by its weight, then uniformly
    among its questions not drawn yet; one environment draws exactly as the uniform sampler."""

    def __init__(self, questions, seed):
        super().__init__(questions, seed)
        self.mode = "environments"  # the lesson's draw_questions then calls draw()
        mix = entries()
        self.weights = [weight for _, weight, _ in mix]
        self.pools = [[q for q in questions if q["env"] == name] for name, _, _ in mix]

    def draw(self, n: int) -> list:
        if len(self.pools) == 1:  # exactly random.Random(seed).sample, as without ENVIRONMENTS
            return self.rng.sample(self.pools[0], n)
        drawn = []
        taken = set()  # (environment, index) already drawn
        while len(drawn) < n:
            k = self.rng.choices(range(len(self.pools)), weights=self.weights)[0]
            i = self.rng.randrange(len(self.pools[k]))
            if (k, i) not in taken:
                taken.add((k, i))
                drawn.append(self.pools[k][i])
        return drawn

    def record(self, answers, group_size: int) -> None:
        """The mix keeps no outcomes (SAMPLER other than "uniform" is refused with it)."""


def score(texts, asked, reward_fns) -> tuple:
    """Step 3 by environment: (each answer's weighted sum of its rewards, {reward name: each
    answer's value}); asked: each answer's question (a dict with its "env"). The table holds every
    name of every environment; an answer gets 0 for a reward its environment does not give. Each
    answer is an episode of its own: reset, then its one step (a single-turn environment)."""
    if len(texts) != len(asked):
        raise ValueError(f"{len(texts)} answers for {len(asked)} questions")
    scorers = {name: scorer(name, options, reward_fns) for name, _, options in entries()}
    names = list(dict.fromkeys(n for s in scorers.values() for n in s.reward_weights))
    each = {name: [0.0] * len(texts) for name in names}
    sums = []
    for i, (text, question) in enumerate(zip(texts, asked)):
        env = question["env"]
        episode = scorers[env].make()
        episode.reset(question, seed=i)
        values = checked_rewards(episode.step(text), env, scorers[env].reward_weights)
        for name, value in values.items():
            each[name][i] = value
        weights = scorers[env].reward_weights
        sums.append(sum(weights[name] * values[name] for name in weights))
    return sums, each


def checked_rewards(turn, env: str, reward_weights: dict) -> dict:
    """The turn's rewards, checked: a Turn, done (a single-turn step), exactly the names of the
    environment's reward_weights, each a finite number. ValueError names the environment."""
    if not isinstance(turn, Turn):
        raise ValueError(f"environment {env}: step gave {type(turn).__name__}, not a Turn")
    if not turn.done:
        raise ValueError(f"environment {env}: a single-turn step must be done")
    if not isinstance(turn.rewards, dict) or set(turn.rewards) != set(reward_weights):
        raise ValueError(f"environment {env}: step's rewards {turn.rewards!r} are not "
                         f"{sorted(reward_weights)}")
    out = {}
    for name in reward_weights:  # the weights' order: the sum adds up as rewards.score does
        value = turn.rewards[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"environment {env}: reward {name} = {value!r} is not a number")
        if not math.isfinite(value):
            raise ValueError(f"environment {env}: reward {name} = {value} is not finite")
        out[name] = float(value)
    return out
