"""An example multi-turn environment served by OpenEnv: guess the number. reset(seed) thinks of a
whole number from 1 to GUESS_MAX; each step reads the guess in the model's <answer> tags and says
"higher" or "lower", until the guess is right (reward "solved" 1) or GUESS_TURNS guesses are spent
(0). OpenEnv's own server (FastAPI under uvicorn, HTTP and WebSocket, one session per answer)
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
GUESS_EXAMPLE = True  # the opening shows a worked first guess (another game's); False = rules alone
GUESS_SESSIONS = 256  # WebSocket sessions at once: one per answer in flight (ranks x Q x G)
env_overrides.apply_env_overrides(globals(), "scripts/guess_number_env.py")

ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")  # the guess: the last one written


def opening(max_number: int, turns: int, example: bool = True) -> str:
    """The first observation: the game's rules and, with `example`, a worked first guess of another
    game (as the trainer's own prompt shows one sum): without it SmolLM2-135M writes "The answer
    is 8." and is told "No guess found" (bench/RESULTS.md)."""
    if not example:
        return (f"I am thinking of a whole number from 1 to {max_number}. Guess it: write your "
                f"guess in <answer></answer>. After each guess I say higher or lower; you have "
                f"{turns} guesses.")
    return (f"I am thinking of a whole number from 1 to {max_number}. You have {turns} guesses; "
            "after each one I say higher or lower. Think inside <think> </think> tags, then write "
            "only your guess inside <answer> </answer> tags. A first guess for a number from 1 to "
            "100: <think> The middle of 1 and 100 is 50. </think><answer>50</answer>")


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
            return GuessObservation(text=opening(max_number, turns, example), done=False,
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
