"""An example multi-turn environment served by OpenEnv: guess the number. reset(seed) thinks of a
whole number from 1 to GUESS_MAX; each step reads the guess in the model's <answer> tags and says
"higher" or "lower", until the guess is right (reward "solved" 1) or GUESS_TURNS guesses are spent
(0). OpenEnv's own server (FastAPI under uvicorn, HTTP and WebSocket, one session per episode)
serves it; the trainer reaches it with OpenEnv's client (environments.py, "openenv:<url>").

    python scripts/guess_number_env.py          # serves on GUESS_PORT
    ENVIRONMENTS='[["openenv:http://127.0.0.1:8011", 1.0]]' bash scripts/run_demo.sh
"""
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from features import env_overrides  # noqa: E402

GUESS_MAX = 8  # the number lies in 1..GUESS_MAX; two guesses win 3 of 8 at best
GUESS_TURNS = 2  # guesses an episode allows: two fit the trainer's MAX_NEW_TOKENS 64
GUESS_HOST = "127.0.0.1"  # where the server listens; "0.0.0.0" for other hosts
GUESS_PORT = 8011  # its port
GUESS_EXAMPLE = True  # the opening shows a worked first guess (another game's); False = none
GUESS_SESSIONS = 256  # WebSocket sessions at once: one per answer in flight (ranks x Q x G)
env_overrides.apply_env_overrides(globals(), "scripts/guess_number_env.py")

ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")  # the guess: the last one written


def rules(max_number: int, turns: int) -> str:
    """The game's rules: what the model reads as the user's last message."""
    return (f"I am thinking of a whole number from 1 to {max_number}. You have {turns} guesses; "
            "after each one I say higher or lower.")


def opening(max_number: int, turns: int, example: bool = True) -> list:
    """The episode's opening messages (the observation's `messages`: the trainer prompts with them,
    environments.py): a system turn naming the tags, a worked first guess of another game (1 to
    100) as the trainer's own prompt shows one sum, then the rules. Without the example
    SmolLM2-135M writes "The answer is 8." and is told "No guess found" (bench/RESULTS.md).
    example False: the earlier runs' opening, one message."""
    if not example:
        return [{"role": "user", "content": (
            f"I am thinking of a whole number from 1 to {max_number}. Guess it: write your guess "
            f"in <answer></answer>. After each guess I say higher or lower; you have {turns} "
            "guesses.")}]
    tags = ("Think inside <think> </think> tags, then write only your guess inside <answer> "
            "</answer> tags.")
    worked = "<think> The middle of 1 and 100 is 50. </think><answer>50</answer>"
    return [{"role": "system", "content": tags},
            {"role": "user", "content": rules(100, turns)},
            {"role": "assistant", "content": worked},
            {"role": "user", "content": rules(max_number, turns)}]


def judge(message: str, secret: int) -> tuple:
    """(feedback text, solved) for one message: the last <answer> number against the secret."""
    guesses = ANSWER_RE.findall(message)
    if not guesses:
        return "No guess found: write a number in <answer></answer>.", False
    guess = int(guesses[-1])
    if guess == secret:
        return "Right!", True
    return ("Higher." if guess < secret else "Lower."), False


def build_app(max_number: int = GUESS_MAX, turns: int = GUESS_TURNS,
              sessions: int = GUESS_SESSIONS, example: bool = GUESS_EXAMPLE):
    """OpenEnv's FastAPI app for the game (its models and its Environment defined here, so the
    module stays import-safe without OpenEnv installed)."""
    from openenv.core.env_server import Action, Environment, Observation, State, create_app

    class GuessAction(Action):
        message: str  # the model's whole turn

    class GuessObservation(Observation):
        text: str = ""  # what the model reads next
        messages: list = []  # at reset: the opening messages (the text is the last one's)
        rewards: dict = {}  # {name: value} of the step just taken

    class GuessNumber(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True  # each session its own instance

        def __init__(self):
            super().__init__()
            self.secret = None
            self.left = 0
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kwargs):
            self.secret = random.Random(seed).randint(1, max_number)
            self.left = turns
            self._state = State(episode_id=episode_id, step_count=0)
            messages = opening(max_number, turns, example)
            return GuessObservation(text=messages[-1]["content"], messages=messages, done=False,
                                    reward=0.0)

        def step(self, action, timeout_s=None, **kwargs):
            if self.secret is None:
                raise ValueError("step before reset")
            self._state.step_count += 1
            self.left -= 1
            feedback, solved = judge(action.message, self.secret)
            done = solved or self.left <= 0
            reward = float(solved)
            return GuessObservation(text=feedback, done=done, reward=reward,
                                    rewards={"solved": reward})

        @property
        def state(self):
            return self._state

    return create_app(GuessNumber, GuessAction, GuessObservation, env_name="guess_number",
                      max_concurrent_envs=sessions)


def main():
    import uvicorn

    print(f"guess_number: OpenEnv server on http://{GUESS_HOST}:{GUESS_PORT}", flush=True)
    uvicorn.run(build_app(), host=GUESS_HOST, port=GUESS_PORT, log_level="warning")


if __name__ == "__main__":
    main()
