"""Which training questions a rollout draws (SAMPLER): "uniform", or "difficulty", which draws again
the questions whose latest group had different rewards and draws less often the ones whose group did
not.

A group whose completions all got the same reward has advantages 0 and trains nothing: a question
the policy always gets right (mastered) or always wrong (out of reach) costs a rollout and teaches
nothing. prime-rl keeps easy, normal and hard pools by pass rate; verl and OpenRLHF filter a dataset
by pass rate beforehand. Here each question keeps one record, its latest group's outcome, which
needs no pass over the dataset:
  - varied (different rewards): it joins the replay pool; up to REPLAY_SHARE of each draw comes
    from the pool, oldest first, and a question is replayed at most MAX_REPLAYS times in a row (else
    a few questions the policy never settles would take over the run);
  - uniform (all the same): fresh draws weigh it UNIFORM_KEEP, against 1 for a question not seen or
  varied.
"learnability" draws each question with weight p (1 - p), p its pass rate: measured before step 1 by
features/pass_rates.py (k completions each from the starting policy), then the share of right
completions (the task's correctness reward, rewards.correctness_reward) in its latest group. A
mastered (p = 1) or out-of-reach (p = 0) question weighs 0 and is drawn only when too few others are
left; p (1 - p) is the variance of a right/wrong reward, so it is the expected spread of a group's
rewards, which is what the advantage needs.
A step that rolls out the lesson's MAX_ROLLOUTS times without the groups it wants calls
out_of_rollouts.
Held-out questions are never in `questions`, so evaluation is untouched. The sampler is the run's
random.Random too (getstate/setstate), so a checkpoint keeps the records with the data position.

    SAMPLER=difficulty bash scripts/run_demo.sh
"""
import hashlib
import math
import random
import sys

from tqdm import tqdm

from features import env_overrides

SAMPLER = "uniform"  # | "difficulty": redraw varied ones | "learnability": weight p (1 - p)
REPLAY_SHARE = 0.75  # SAMPLER "difficulty": at most this share of a draw replays varied questions
env_overrides.apply_env_overrides(globals(), "features/question_sampler.py")

SAMPLERS = ("uniform", "difficulty", "learnability")  # SAMPLER's choices
UNKNOWN_PASS_RATE = 0.5  # "learnability": a question without a measured pass rate counts as this
MAX_REPLAYS = 2  # a question trained this many times in a row goes back among the fresh ones
# a question whose latest group was uniform weighs this in fresh draws (the others 1)
UNIFORM_KEEP = 0.1


def question_id(text: str, images=None) -> str:
    """What the sampler knows a question by: its text, with a digest of its images where it has
    any (geometry3k repeats texts such as "Find x." over different figures; the shapes task asks
    one text of every picture)."""
    if not images:
        return text
    digest = hashlib.sha256()
    for data in images:  # each image's length too: the same bytes cut another way differ
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return f"{text} [images {digest.hexdigest()[:16]}]"


def id_of(question: dict) -> str:
    """question_id of a dataset question ({"question", "images"...})."""
    return question_id(question["question"], question.get("images"))


def completion_id(record: dict) -> str:
    """question_id of a completion record (features/run_log.completion_records): its question_id
    when its question had images, else its question's text."""
    return record.get("question_id", record["question"])


def check_settings(*, correct):
    """Stop, before any model loads, on a SAMPLER that is none of SAMPLERS, or "learnability"
    without a reward that says whether a completion is right (correct: its name, or None)."""
    env_overrides.check_choice("SAMPLER", SAMPLER, SAMPLERS)
    if SAMPLER == "learnability" and correct is None:
        sys.exit('SAMPLER "learnability" weighs questions by their pass rates, which need a '
                 "reward that says whether a completion is right (reward_correct, reward_boxed or "
                 "reward_word) among REWARDS")


class QuestionSampler:
    """draw(n) -> n distinct questions; record(completion records, group size) after each
    rollout."""

    def __init__(self, questions, seed, mode="uniform", replay_share=0.75,
                 pass_key=None):
        """replay_share: of each draw at most this share (rounded up) comes from the replay pool
        (REPLAY_SHARE); the rest are new questions. pass_key: the name of the completion records'
        reward that is above 0 when a completion is right (rewards.correctness_reward;
        "learnability" needs it)."""
        if mode not in SAMPLERS:
            raise ValueError(f"SAMPLER = {mode!r}: one of {', '.join(SAMPLERS)}")
        if mode == "learnability" and pass_key is None:
            raise ValueError('SAMPLER "learnability" needs pass_key, the reward that says whether '
                             "a completion is right")
        self.questions = questions
        self.mode = mode
        self.rng = random.Random(seed)
        self.replay_share = replay_share
        self.pool = {}  # question_id -> replays so far; insertion order = oldest first
        self.uniform = set()  # question_ids whose latest group had equal rewards
        self.pass_rates = {}  # "learnability": question_id -> its latest pass rate
        self.pass_key = pass_key

    def draw(self, n: int) -> list:
        # exactly random.Random(seed).sample: the draws of runs before this module
        if self.mode == "uniform":
            return self.rng.sample(self.questions, n)
        if not 0 <= n <= len(self.questions):
            raise ValueError(f"cannot draw {n} questions out of {len(self.questions)}")
        if self.mode == "learnability":
            return self.learnable(n)
        by_id = {id_of(q): q for q in self.questions}
        oldest = list(self.pool)[: math.ceil(n * self.replay_share)]
        replays = [by_id[key] for key in oldest if key in by_id]
        rest = [q for q in self.questions if id_of(q) not in self.pool]
        # a dataset smaller than its pool: fresh draws may be pooled ones too
        if len(rest) < n - len(replays):
            rest = [q for q in self.questions if q not in replays]
        # Weighted draws without replacement (Efraimidis-Spirakis): the largest u ** (1 / weight)
        # win.
        weights = [UNIFORM_KEEP if id_of(q) in self.uniform else 1.0 for q in rest]
        keys = [self.rng.random() ** (1 / weight) for weight in weights]
        best = sorted(range(len(rest)), key=keys.__getitem__, reverse=True)[: n - len(replays)]
        return replays + [rest[i] for i in best]

    def weight(self, question) -> float:
        """"learnability": p (1 - p) of the question's pass rate p."""
        p = self.pass_rates.get(id_of(question), UNKNOWN_PASS_RATE)
        return p * (1 - p)

    def learnable(self, n: int) -> list:
        """n distinct questions drawn with weights p (1 - p), without replacement
        (Efraimidis-Spirakis: the largest u ** (1 / weight) win); weight-0 questions only fill up
        when too few others are left."""
        keys = []
        for q in self.questions:
            u = self.rng.random()
            w = self.weight(q)
            keys.append(u ** (1 / w) if w > 0 else u - 1)  # weight 0: below every positive key
        best = sorted(range(len(self.questions)), key=keys.__getitem__, reverse=True)[:n]
        return [self.questions[i] for i in best]

    def set_pass_rates(self, rates: dict) -> None:
        """Measured pass rates {question text: p} (features/pass_rates.py), before step 1."""
        self.pass_rates.update(rates)

    def record(self, records, group_size: int) -> None:
        """Each group's outcome, from the rollout's completion records (consecutive groups of
        `group_size`)."""
        if self.mode == "uniform":
            return
        if self.mode == "learnability":
            for i in range(0, len(records), group_size):
                group = records[i : i + group_size]
                right = sum(a[self.pass_key] > 0 for a in group)
                self.pass_rates[completion_id(group[0])] = right / len(group)
            return
        for i in range(0, len(records), group_size):
            text = completion_id(records[i])
            varied = len({a["reward"] for a in records[i : i + group_size]}) > 1
            replays = self.pool.pop(text, -1) + 1  # -1: it was a fresh draw
            if varied and replays < MAX_REPLAYS:
                self.pool[text] = replays  # re-inserted last: the others are replayed first
                self.uniform.discard(text)
            elif not varied:
                self.uniform.add(text)

    def getstate(self):
        return {"rng": self.rng.getstate(), "pool": list(self.pool.items()),
                "uniform": sorted(self.uniform), "pass_rates": dict(self.pass_rates)}

    def setstate(self, state):
        """A checkpoint's state; one saved before this module holds the random.Random state
        alone."""
        if not isinstance(state, dict):
            return self.rng.setstate(state)
        self.rng.setstate(state["rng"])
        self.pool = dict(state["pool"])
        self.uniform = set(state["uniform"])
        self.pass_rates = dict(state.get("pass_rates", {}))


def draw_by_rule(sampler, n: int) -> list:
    """Step 1 by the sampler's own rule (SAMPLER's, or the environments' mix): n questions."""
    return sampler.draw(n)


def record_outcomes(sampler, records, group_size: int) -> None:
    """Step 1's memory under SAMPLER's rules: each group's outcome, for the next draws."""
    sampler.record(records, group_size)


def out_of_rollouts(found: int, rollouts: int, wanted: int) -> None:
    """A step's `rollouts` gave `found` of the `wanted` groups with different rewards: none stops
    the run (nothing to train on, and more tries would not help); some (DYNAMIC_SAMPLING) get a
    warning, and the step trains on them."""
    got = f"only {found} of the {wanted} groups" if found else "no group"
    say = (f"{rollouts} rollouts in a row gave {got} with different rewards: the task is too hard "
           "or too easy for this model (try THINK_PREFILL, EXAMPLE, ARITH_MAX, MAX_NEW_TOKENS, "
           "SAMPLER=difficulty, MAX_ROLLOUTS or the weights)")
    sys.exit(say) if not found else tqdm.write(f"warning: {say}; training on those {found}")
