"""Environments (ENVIRONMENTS): a task as a plug-in, and several tasks in one run, in a room of
their own. A default step never enters this file; the lesson reaches it only when ENVIRONMENTS
names some: its questions (load_dataset), its draws (the sampler) and its scores (step 3).

An environment is OpenEnv's reset / step (and tinker-cookbook's Env) cut to what GRPO needs. The
trainer makes one Environment per completion, so an episode may keep state between its turns:

    reset(question, seed) -> the opening messages, [{"role": "user", "content": ...}]
    step(message)         -> Turn(observation, rewards {name: value}, done)

A single-turn task is one step. Its rewards are named, so REWARD_NORM "normalize_then_sum" (GDPO)
normalises each on its own; a completion's reward is their sum weighted by the environment's
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
import functools
import importlib
import math
import sys
from dataclasses import dataclass
from typing import Callable

import rewards
from features import env_overrides
from features.question_sampler import QuestionSampler, draw_by_rule
from features.run_log import tag_of
from features.turns import Reply, eos_at, play_turns, prompts_and_sampler

# ----------------------------------------------------------------------------- constants
ENVIRONMENTS = []  # [[name, weight]] or [[name, weight, {options}]]; [] = DATASET and REWARDS
RG_SIZE = 2000  # questions a reasoning-gym task makes for training (its held-out set apart)
RG_HELD_OUT_SEED = 1_000_003  # added to SEED for a reasoning-gym task's held-out questions
OPENENV_QUESTIONS = 2000  # episodes (seeds) an OpenEnv environment trains on (held-out apart)
MAX_TURNS = 8  # steps an episode may take; every turn's tokens count in MAX_NEW_TOKENS
ENV_TIMEOUT = 30.0  # s a reset or step may take; then the environment is named and the run stops
MAX_OBSERVATION_BYTES = 8192  # an environment's message (its JSON) longer than this is refused
SERVER_WAIT = 600.0  # s to wait at start for an environment's server to answer, then stop
env_overrides.apply_env_overrides(globals(), "environments.py")

RG_PREFIX = "rg:"  # "rg:leg_counting": reasoning-gym's task of that name
OPENENV_PREFIX = "openenv:"  # "openenv:http://host:port": an environment OpenEnv serves there
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
    """How an environment scores: a fresh episode per completion, and its rewards' weights."""
    make: Callable  # make() -> a fresh Environment, one per completion
    reward_weights: dict  # {reward name: weight} in a completion's summed reward
    multi_turn: bool = False  # True: its episodes may take several steps (environments.play)


# ----------------------------------------------------------------------------- the built-in ones
class QuestionEnvironment(Environment):
    """A single-turn task whose opening is its question's text; step scores the one completion."""
    question = None  # the question reset opened (a dict: its text, its gold...)

    def reset(self, question: dict, seed: int) -> list:
        self.question = question
        return [{"role": "user", "content": question["question"]}]


class RewardsEnvironment(QuestionEnvironment):
    """A single-turn task scored by reward functions f(completion, gold, question) -> float: the
    trainer's REWARDS on a built-in dataset."""

    def __init__(self, reward_fns):
        self.reward_fns = reward_fns

    def step(self, message: str) -> Turn:
        gold = self.question["gold"]
        text = self.question["question"]
        values = {fn.__name__: rewards.checked_reward(fn, message, gold, text)
                  for fn, _ in self.reward_fns}
        return Turn(observation="", rewards=values, done=True)


class ReasoningGymEnvironment(QuestionEnvironment):
    """A single-turn reasoning-gym task: the answer in <answer> tags (rewards.extract_answer),
    scored by the task's own score_answer (0 to 1, partial credit where the task gives it), beside
    the trainer's reward_format."""

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


class OpenEnvEnvironment(Environment):
    """An environment OpenEnv serves at `url` (its own server: FastAPI under uvicorn), reached with
    OpenEnv's client, one WebSocket session per completion. What the server sends is checked before
    it is used: a message over MAX_OBSERVATION_BYTES, an answer later than ENV_TIMEOUT, an
    observation without its text, a reward that is not a finite number, rewards that are not the
    ones reward_weights names: each raises EnvironmentFault naming the environment."""

    def __init__(self, url: str, name: str, reward_weights: dict):
        self.name = name
        self.reward_weights = reward_weights
        self.client = strict_client(url, name)

    def call(self, what: str, *args, **kwargs):
        """client.reset or client.step, its failures as EnvironmentFault naming the environment."""
        try:
            return getattr(self.client, what)(*args, **kwargs)
        except EnvironmentFault:  # already named (a reply without done)
            raise
        except Exception as e:  # refused, cut, timed out, too large, or the server's own error
            said = str(e)[:300] or f"no answer within ENV_TIMEOUT {ENV_TIMEOUT:g} s"
            raise EnvironmentFault(f"environment {self.name}: {what} failed: "
                                   f"{type(e).__name__}: {said}") from e

    def open(self, seed: int) -> list:
        """The opening messages of the episode `seed`: the observation's `messages` where the
        server sends them (a system turn, a worked example: checked_opening), else its text as
        the user's one message."""
        result = self.call("reset", seed=seed)
        text, _ = self.read(result, first=True)
        messages = result.observation.get("messages")
        if messages is None:
            return [{"role": "user", "content": text}]
        return checked_opening(messages, self.name)

    def reset(self, question: dict, seed: int) -> list:
        opening = self.open(question["seed"])
        if opening != question["opening"]:  # the episode would not be the one its group was asked
            raise EnvironmentFault(f"environment {self.name}: reset(seed={question['seed']}) "
                                   "opened otherwise than when the run started: its episodes "
                                   "must depend on the seed alone")
        return opening

    def step(self, message: str) -> Turn:
        result = self.call("step", {"message": message})
        text, values = self.read(result)
        return Turn(observation=text, rewards=values, done=result.done)

    def read(self, result, first=False) -> tuple:
        """(the observation's text, its rewards by name) of a StepResult, checked."""
        observation = result.observation
        if not isinstance(observation, dict) or not isinstance(observation.get("text"), str):
            raise EnvironmentFault(f"environment {self.name}: an observation needs a text field "
                                   f"(got {str(observation)[:200]})")
        if not isinstance(result.done, bool):
            raise EnvironmentFault(f"environment {self.name}: done is {result.done!r}, not a bool")
        if first:
            return observation["text"], {}
        values = observation.get("rewards") or {}
        if set(self.reward_weights) == {"reward"}:  # one number: OpenEnv's own reward field
            values = {"reward": result.reward}
        if not isinstance(values, dict) or set(values) != set(self.reward_weights):
            raise EnvironmentFault(f"environment {self.name}: rewards {str(values)[:200]} are not "
                                   f"{sorted(self.reward_weights)}")
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise EnvironmentFault(f"environment {self.name}: reward {name} = {value!r} is "
                                       "not a number")
            if not math.isfinite(value):
                raise EnvironmentFault(f"environment {self.name}: reward {name} = {value} is not "
                                       "finite")
        return observation["text"], {name: float(value) for name, value in values.items()}

    def close(self):
        """The session's end; a failure to say goodbye loses nothing."""
        try:
            self.client.close()
        except Exception:  # the server may be gone already: the episode is over either way
            pass


class EnvironmentFault(RuntimeError):
    """An environment that failed or misbehaved: the step stops, nothing of it trains."""


def strict_client(url: str, name: str):
    """OpenEnv's GenericEnvClient for the server at `url`, bounded (ENV_TIMEOUT,
    MAX_OBSERVATION_BYTES), whose replies must say whether the episode is over: OpenEnv's client
    reads a reply without `done` as False, and the episode would run on to MAX_TURNS, cut, its
    turns' rewards added up. A reply without a bool `done` raises EnvironmentFault naming it."""
    from openenv.core.generic_client import GenericEnvClient

    class StrictClient(GenericEnvClient):
        def _parse_result(self, payload):
            done = payload.get("done") if isinstance(payload, dict) else None
            if not isinstance(done, bool):
                raise EnvironmentFault(f"environment {name}: a reply without done (true or false) "
                                       f"({str(payload)[:200]})")
            return super()._parse_result(payload)

    return StrictClient(base_url=url, connect_timeout_s=ENV_TIMEOUT, message_timeout_s=ENV_TIMEOUT,
                        max_message_size_mb=MAX_OBSERVATION_BYTES / 2**20).sync()


def openenv_questions(name, options, *, seed, eval_size) -> tuple:
    """An OpenEnv environment's questions: an episode per seed, its question the opening the
    server gives for it (asked once here, so a group's prompt is known before its episodes open,
    and checked again at each reset). OPENENV_QUESTIONS training seeds from `seed` on, eval_size
    held-out ones from seed + RG_HELD_OUT_SEED. The server must answer within SERVER_WAIT: else
    the run stops here, before any model loads, naming it."""
    from features.retry import request_with_retry

    url = name[len(OPENENV_PREFIX):]
    health = url.replace("ws://", "http://").replace("wss://", "https://").rstrip("/")
    try:
        request_with_retry("GET", f"{health}/health", give_up_after=SERVER_WAIT,
                           what=f"environment {name}", read_timeout=ENV_TIMEOUT,
                           hint="is the environment's server running there?")
    except Exception as e:
        raise EnvironmentFault(f"ENVIRONMENTS: {name} is not reachable: {e}") from e
    episode = OpenEnvEnvironment(url, name, options.get("reward_weights", {"reward": 1.0}))
    try:
        def opening_of(k: int) -> dict:
            opening = episode.open(k)
            return {"question": opening[-1]["content"], "gold": "", "seed": k, "opening": opening}
        train = [opening_of(seed + k) for k in range(OPENENV_QUESTIONS)]
        held_out = [opening_of(seed + RG_HELD_OUT_SEED + k) for k in range(eval_size)]
        probe_rewards(episode, seed=seed - 1)  # before any model loads: its rewards' names
    finally:
        episode.close()
    return train, held_out


def probe_rewards(episode, *, seed: int) -> None:
    """One throwaway episode (seed, not a training one), one empty message: the reply must carry
    done and the rewards reward_weights names, each a finite number (OpenEnvEnvironment.read), so
    a name the server never sends stops the run at load, not at step 1 after the model loads."""
    episode.call("reset", seed=seed)
    try:
        episode.read(episode.call("step", {"message": ""}))
    except EnvironmentFault as e:
        raise EnvironmentFault(f"{e} (asked at start, with an empty message)") from e


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
    """"rg" (reasoning-gym), "openenv" (served by OpenEnv), "own" (module:Class) or "built_in" (a
    DATASET name)."""
    if name.startswith(RG_PREFIX):
        return "rg"
    if name.startswith(OPENENV_PREFIX):
        return "openenv"
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
    if kind_of(name) == "openenv":
        served = options.get("reward_weights", {"reward": 1.0})
        url = name[len(OPENENV_PREFIX):]
        return Scorer(make=lambda: OpenEnvEnvironment(url, name, served),
                      reward_weights=dict(served), multi_turn=True)
    env_class = own_class(name)
    return Scorer(make=lambda: env_class(**options), reward_weights=dict(env_class.reward_weights),
                  multi_turn=bool(getattr(env_class, "multi_turn", False)))


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
        if isinstance(name, str) and kind_of(name) == "openenv" and not known_kind(name):
            raise ValueError(f"ENVIRONMENTS: {name!r}: an OpenEnv server is named by its URL, "
                             f"'{OPENENV_PREFIX}http://host:port' (or ws://)")
        if not isinstance(name, str) or not known_kind(name):
            raise ValueError(f"ENVIRONMENTS: unknown environment {name!r}: one of "
                             f"{', '.join(BUILT_IN)}, a .jsonl, a hub id with '/', "
                             f"'{RG_PREFIX}<task>', '{OPENENV_PREFIX}http://host:port' or "
                             "'module:Class'")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"ENVIRONMENTS: {name}: weight {weight!r} is not a number")
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"ENVIRONMENTS: {name}: weight {weight} must be finite and > 0")
        if not isinstance(options, dict):
            raise ValueError(f"ENVIRONMENTS: {name}: options {options!r} are not a dict")
        served = options.get("reward_weights", {"reward": 1.0})
        if not isinstance(served, dict) or not served or not all(
                isinstance(k, str) and isinstance(w, (int, float)) and not isinstance(w, bool)
                and math.isfinite(w) for k, w in served.items()):
            raise ValueError(f"ENVIRONMENTS: {name}: reward_weights {served!r} must map names to "
                             "finite numbers")
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
    if kind_of(name) == "openenv":
        return name[len(OPENENV_PREFIX):].startswith(("http://", "https://", "ws://", "wss://"))
    if kind_of(name) == "own":
        module_name, _, attribute = name.partition(":")
        return bool(module_name and attribute)
    return name in BUILT_IN or name.endswith(".jsonl") or "/" in name


def check_settings(*, sampler: str, tools_on: bool, eval_samples: int, gdpo: bool = False,
                   reward_fns=()) -> None:
    """Stop, before any model loads, on ENVIRONMENTS that cannot serve this run: a bad entry (an
    unknown environment, a weight <= 0, a class of one's own that is not there), or a setting the
    mix does not serve (SAMPLER other than "uniform", TOOLS; EVAL_SAMPLES with an environment of
    several turns; GDPO with one reward weighed two ways). An OpenEnv server is asked at load (the
    task's, load_or_stop), still before any model."""
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
    if gdpo and weight_conflict(reward_fns):
        sys.exit(weight_conflict(reward_fns))
    several = [name for name, _, options in entries() if scorer(name, options, ()).multi_turn]
    if several and eval_samples > 0:
        sys.exit(f"ENVIRONMENTS: {several[0]} plays episodes of several turns, which the held-out "
                 "evaluation plays greedily only: set EVAL_SAMPLES=0")


def mix_task(*, reward_fns, seed, eval_size, arith_max, fit_images, default_prompt,
             think_prefill) -> rewards.Task:
    """ENVIRONMENTS as the run's task (the lesson's choose_task): every environment's questions
    (load), an environment drawn by its weight for each (MixSampler), each question prompted as
    its environment opens it (opening_prompt; default_prompt, the trainer's, for a question-and-
    answer task) and each completion scored by its environment's own rewards."""
    return rewards.Task(
        load=functools.partial(load_or_stop, seed=seed, eval_size=eval_size, arith_max=arith_max,
                               fit_images=fit_images),
        sampler=MixSampler, draw=draw_by_rule,
        prompt=functools.partial(opening_prompt, default=default_prompt,
                                 think_prefill=think_prefill),
        score=scorer_for_run(reward_fns), rewards=tuple(run_rewards(reward_fns)),
        answer_held_out=played_completions)


def opening_prompt(tokenizer, question: dict, *, default, think_prefill: str) -> str:
    """A question's prompt: its environment's opening messages (what reset gave at load, kept as
    "opening") in the model's chat template, then THINK_PREFILL; a question-and-answer task (a
    built-in dataset, reasoning-gym) opens no messages of its own and takes the trainer's prompt,
    default(tokenizer, question): its system prompt asks for the tags its rewards read."""
    if "opening" not in question:
        return default(tokenizer, question)
    text = tokenizer.apply_chat_template(question["opening"], tokenize=False,
                                         add_generation_prompt=True)
    return text + think_prefill


def checked_opening(messages, name: str) -> list:
    """reset's opening messages, checked: a non-empty list of {"role", "content"} dicts with string
    values, the last one the user's. EnvironmentFault names the environment."""
    well_formed = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and set(m) == {"role", "content"}
        and isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages)
    if not well_formed or messages[-1]["role"] != "user":
        raise EnvironmentFault(f"environment {name}: reset must return the opening messages, "
                               "[{\"role\": ..., \"content\": ...}, ...] ending in the user's "
                               f"(got {str(messages)[:200]})")
    return messages


def own_questions(name, options, *, seed, eval_size) -> tuple:
    """A class of one's own: its questions(seed), each with its position as its episode's seed
    (unless it has one) and its opening messages (reset at load, so the prompt is known before its
    episodes open, and checked again at each reset); the last eval_size held out by position, so a
    game whose every question opens with the same text still trains."""
    env_class = own_class(name)
    questions = [dict(q) for q in env_class.questions(seed)]
    if not 0 < eval_size < len(questions):
        raise ValueError(f"ENVIRONMENTS: {name}: its questions(seed) gave {len(questions)} "
                         f"questions, and EVAL_SIZE {eval_size} of them are held out: it needs "
                         "1 <= EVAL_SIZE < its questions")
    for k, question in enumerate(questions):
        question.setdefault("seed", k)
        opening = env_class(**options).reset(question, question["seed"])
        question["opening"] = checked_opening(opening, name)
    cut = len(questions) - eval_size  # the first held-out question's position
    return questions[:cut], questions[cut:]


def load_or_stop(**load_args) -> tuple:
    """load, as the run calls it at start: a refusal (a task reasoning-gym does not know, too few
    questions, a server that misbehaves at its first reset or step) stops the run with its message,
    the environment named, not a traceback."""
    try:
        return load(**load_args)
    except (ValueError, EnvironmentFault) as e:
        sys.exit(str(e))


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
            part = own_questions(name, options, seed=seed, eval_size=eval_size)
        elif kind_of(name) == "openenv":
            part = openenv_questions(name, options, seed=seed, eval_size=eval_size)
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

    def record(self, records, group_size: int) -> None:
        """The mix keeps no outcomes (SAMPLER other than "uniform" is refused with it)."""


def scorers_of_run(reward_fns) -> dict:
    """{environment name: Scorer} for every environment of ENVIRONMENTS."""
    return {name: scorer(name, options, reward_fns) for name, _, options in entries()}


def run_rewards(reward_fns) -> list:
    """(name, weight) of every reward the run's environments give, each name once, in the order
    ENVIRONMENTS names them: score's table, the step's log and GDPO's columns. A name two
    environments give keeps the first one's weight (weight_conflict refuses that under GDPO)."""
    weights = {}
    for one in scorers_of_run(reward_fns).values():
        for name, weight in one.reward_weights.items():
            weights.setdefault(name, weight)
    return list(weights.items())


def weight_conflict(reward_fns) -> str:
    """Why GDPO cannot serve this mix, or "": it sums each reward name with one weight, so two
    environments that weigh one name differently would have one of them summed wrongly."""
    first = {}  # name: (environment, weight)
    for env, one in scorers_of_run(reward_fns).items():
        for name, weight in one.reward_weights.items():
            seen = first.setdefault(name, (env, weight))
            if seen[1] != weight:
                return (f"ENVIRONMENTS: {seen[0]} weighs reward {name} {seen[1]} and {env} "
                        f"{weight}; REWARD_NORM \"normalize_then_sum\" sums a reward with one "
                        "weight: give them one weight or use \"sum_then_normalize\"")
    return ""


def scorer_for_run(reward_fns):
    """Step 3 as the lesson's steps call it, (texts, asked, played=None) -> score's (scores, each),
    with the run's REWARDS for the built-in tasks."""
    def score_by_environment(texts, asked, played=None) -> tuple:
        return score(texts, asked, reward_fns, played)
    return score_by_environment


def score(texts, asked, reward_fns, played=None) -> tuple:
    """Step 3 by environment: (each completion's weighted sum of its rewards, {reward name: each
    completion's value}); asked: each completion's question (a dict with its "env"). The table
    holds every name of every environment; a completion gets 0 for a reward its environment does
    not give. played: each completion's rewards, summed over its episode's turns, where play() ran
    the episodes; None (or a None in it): a single-turn episode, reset and stepped here."""
    if len(texts) != len(asked):
        raise ValueError(f"{len(texts)} completions for {len(asked)} questions")
    scorers = scorers_of_run(reward_fns)
    each = {name: [0.0] * len(texts) for name, _ in run_rewards(reward_fns)}
    scores = []
    for i, (text, question) in enumerate(zip(texts, asked)):
        env = question["env"]
        if played is not None and played[i] is not None:
            values = played[i]
        else:
            episode = scorers[env].make()
            episode.reset(question, seed=question.get("seed", 0))
            values = checked_rewards(episode.step(text), env, scorers[env].reward_weights)
        for name, value in values.items():
            each[name][i] = value
        weights = scorers[env].reward_weights
        scores.append(sum(weights[name] * values[name] for name in weights))
    return scores, each


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


# ----------------------------------------------------------------------------- multi-turn episodes
def multi_turn(questions) -> bool:
    """Whether any of `questions` belongs to an environment whose episodes take several turns:
    then the step's completions are played turn by turn (play), every one of them."""
    several = {name: scorer(name, options, ()).multi_turn for name, _, options in entries()}
    return any(several[q["env"]] for q in questions)


def rollout(model, tokenizer, prompts, *, gen_config, llm, eos_ids, single_turn, num_pre_q,
            temperature, think_prefill, reward_fns) -> tuple:
    """Step 2 under ENVIRONMENTS (the lesson's Rollout seam): episodes played turn by turn when any
    of the step's questions comes from an environment of several turns (play_rollout), else the
    run's single-turn rollout (single_turn: the lesson's sample_completions or its faster equal)."""
    if not multi_turn(prompts.asked):
        return single_turn(model, tokenizer, prompts, gen_config=gen_config, llm=llm,
                           eos_ids=eos_ids)
    return play_rollout(model, tokenizer, prompts.encoded, num_pre_q, prompts.asked,
                        gen_config=gen_config, llm=llm, temperature=temperature, eos_ids=eos_ids,
                        think_prefill=think_prefill, reward_fns=reward_fns)


def play_rollout(model, tokenizer, enc, n, asked, *, gen_config, llm, temperature, eos_ids,
                 think_prefill, reward_fns) -> tuple:
    """play() for n completions to each prompt of `enc` (left-padded input_ids, attention_mask; a
    prompt's n rows consecutive; asked: each completion's question), sampled by vLLM (`llm`) or by
    transformers' generate with gen_config (do_sample False: greedy), each turn ending at an EOS:
    (completion_ids, vllm_logps, {policy_mask, stopped, played, turns})."""
    prompts, sample = prompts_and_sampler(model, tokenizer, enc, n, gen_config=gen_config,
                                          llm=llm, temperature=temperature, eos_ids=eos_ids,
                                          stop=ChatEpisode.stop)
    out = play(sample, prompts, asked, reward_fns=reward_fns,
               tokenizer=tokenizer, think_prefill=think_prefill,
               max_new_tokens=gen_config.max_new_tokens, eos_ids=list(eos_ids),
               pad_id=gen_config.pad_token_id)
    return out.pop("completion_ids"), out.pop("vllm_logps"), out


def played_completions(model, questions, *, encode, decode, eos_ids, pad_id, max_new_tokens,
                       llm=None, tokenizer=None, **unused) -> tuple:
    """The held-out evaluation's completions under ENVIRONMENTS (features/evaluation.evaluate's
    `answer`): (each question's greedy completion as text, no tool calls, its rewards over its
    episode's turns or None where its environment is single-turn). The multi-turn questions are
    played as the rollouts play them (play_rollout), the others answered by held_out_answers and
    scored by the trainer's step 3. fork_rng guards the training stream."""
    import torch
    from transformers import GenerationConfig

    from features.evaluation import EVAL_BATCH, held_out_answers

    several = [multi_turn([q]) for q in questions]
    plain = [q for q, multi in zip(questions, several) if not multi]
    plain_texts = []
    if plain:
        plain_texts, _ = held_out_answers(model, plain, encode=encode, decode=decode,
                                          eos_ids=eos_ids, pad_id=pad_id,
                                          max_new_tokens=max_new_tokens, llm=llm,
                                          tokenizer=tokenizer)
    episodic = [q for q, multi in zip(questions, several) if multi]
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                              eos_token_id=eos_ids)
    prefill = decode(tokenizer, torch.zeros(1, 0, dtype=torch.long))[0]  # decode's THINK_PREFILL
    device = next(model.parameters()).device
    model.eval()
    played_texts = []
    played = []
    batch_size = EVAL_BATCH if llm is None else max(1, len(episodic))  # vLLM: all at once
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(0, len(episodic), batch_size):
            part = episodic[i : i + batch_size]
            enc = encode(tokenizer, part).to(device)
            completions, _, out = play_rollout(
                model, tokenizer, enc, 1, part, gen_config=config, llm=llm, temperature=0.0,
                eos_ids=eos_ids, think_prefill=prefill, reward_fns=())
            played_texts += decode(tokenizer, completions)
            played += out["played"]
    plain_texts = iter(plain_texts)
    episodes = iter(zip(played_texts, played))
    texts = []
    rewards_played = []
    for multi in several:
        text, values = next(episodes) if multi else (next(plain_texts), None)
        texts.append(text)
        rewards_played.append(values)
    return texts, [0] * len(texts), rewards_played


def observation_ids(tokenizer, observation: str, think_prefill: str) -> list:
    """The tokens between the model's end of turn (its EOS, already sampled) and its next turn: the
    chat template's close of the assistant's turn, the observation as the user's turn, the
    assistant's header and THINK_PREFILL. Taken from the template itself, so any chat model's
    turns read as its own."""
    mark = "\x00TURN\x00"  # stands for the assistant's turn; nothing a template writes
    messages = [{"role": "user", "content": "."}, {"role": "assistant", "content": mark},
                {"role": "user", "content": observation}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    after = text[text.index(mark) + len(mark):]
    eos = tokenizer.eos_token or ""
    if eos and after.startswith(eos):  # the model sampled its EOS: it is in the completion already
        after = after[len(eos):]
    return tokenizer(after + think_prefill, add_special_tokens=False).input_ids


class ChatEpisode:
    """An environment's episode as features/turns.py plays it: a turn ends at the model's EOS, the
    environment steps on that turn's text, and while it is not done its observation joins the
    completion as the user's next turn (observation_ids). It sums each turn's rewards (played) and
    counts its turns; MAX_TURNS steps end it, cut."""
    stop = ()  # a turn ends at the EOS alone

    def __init__(self, episode, env: str, reward_weights: dict, think_prefill: str):
        self.episode = episode
        self.env = env
        self.reward_weights = reward_weights
        self.think_prefill = think_prefill
        self.played = dict.fromkeys(reward_weights, 0.0)
        self.turns = 0

    def turn_of(self, tokenizer, segment, eos_ids) -> tuple:
        """(the segment up to and including its EOS, "eos"), or (all of it, None): cut."""
        eos = eos_at(segment, eos_ids)
        if eos is None:
            return segment, None
        return segment[: eos + 1], "eos"

    def reply(self, tokenizer, ids, segment, *, ended, budget_left) -> Reply:
        """The environment's step on this turn's text (with THINK_PREFILL, as scored): done, out of
        turns, or its observation's tokens."""
        text = self.think_prefill + tokenizer.decode(segment, skip_special_tokens=True)
        turn = checked_turn(self.episode.step(text), self.env, self.reward_weights)
        self.turns += 1
        for name, value in turn.rewards.items():
            self.played[name] += value
        if turn.done:
            return Reply(done=True)
        if self.turns >= MAX_TURNS:
            return Reply(over=True)  # out of turns: cut, as the budget cuts
        return Reply(ids=observation_ids(tokenizer, turn.observation, self.think_prefill))


def play(sample, prompts, asked, *, reward_fns, tokenizer, think_prefill, max_new_tokens,
         eos_ids, pad_id) -> dict:
    """Every completion an episode of its question's environment (ChatEpisode), played turn by
    turn by features/turns.play_turns (sample(prefixes, budgets) -> one (token ids, log-probs or
    None) per prefix). An episode ends when done, after MAX_TURNS steps, or when max_new_tokens
    run out (cut: not stopped). A fault ends the step with EnvironmentFault: nothing of it trains,
    and the next rollout opens fresh episodes. Returns completion_ids (B, T) padded with pad_id,
    vllm_logps (B, T) or None, policy_mask (B, T), stopped (B,), played (B dicts: each
    completion's rewards summed over its turns), turns (B ints)."""
    scorers = scorers_of_run(reward_fns)
    episodes = [scorers[q["env"]].make() for q in asked]
    try:
        for episode, question in zip(episodes, asked):
            opened = episode.reset(question, seed=question.get("seed", 0))
            if "opening" in question and opened != question["opening"]:  # not the prompt it had
                raise EnvironmentFault(f"environment {question['env']}: reset(seed="
                                       f"{question.get('seed', 0)}) opened otherwise than at "
                                       "load: its episodes must depend on the question and its "
                                       "seed alone")
        chats = [ChatEpisode(episode, q["env"], scorers[q["env"]].reward_weights, think_prefill)
                 for episode, q in zip(episodes, asked)]
        out = play_turns(sample, prompts, chats, tokenizer=tokenizer,
                         max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
    finally:
        for episode in episodes:
            getattr(episode, "close", lambda: None)()
    del out["reply_mask"]  # the policy_mask says it
    return out | dict(played=[chat.played for chat in chats],
                      turns=[chat.turns for chat in chats])


def checked_turn(turn, env: str, reward_weights: dict) -> Turn:
    """A step's Turn, checked: its rewards (checked_rewards), done a bool, the observation text."""
    if not isinstance(turn, Turn):
        raise EnvironmentFault(f"environment {env}: step gave {type(turn).__name__}, not a Turn")
    if not isinstance(turn.done, bool) or not isinstance(turn.observation, str):
        raise EnvironmentFault(f"environment {env}: a Turn needs done (bool) and observation (str)")
    if len(turn.observation.encode()) > MAX_OBSERVATION_BYTES:
        raise EnvironmentFault(f"environment {env}: an observation of "
                               f"{len(turn.observation.encode())} bytes, over "
                               f"MAX_OBSERVATION_BYTES {MAX_OBSERVATION_BYTES}")
    done = Turn(observation="", rewards=turn.rewards, done=True)  # checked_rewards wants done
    try:
        values = checked_rewards(done, env, reward_weights)
    except ValueError as e:
        raise EnvironmentFault(str(e)) from e
    return Turn(observation=turn.observation, rewards=values, done=turn.done)
