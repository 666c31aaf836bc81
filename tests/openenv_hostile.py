"""A hostile environment served by OpenEnv's own server, for tests/test_environments.py: its step
misbehaves as HOSTILE says (nan: a reward that is not finite; huge: an observation of a megabyte;
text: an observation whose text is a number; silent: it never answers; fine: a one-step game).

    HOSTILE=nan HOSTILE_PORT=8123 python tests/openenv_hostile.py
"""
import math
import os
import time

HOSTILE = os.environ.get("HOSTILE", "fine")  # how its step misbehaves
HOSTILE_PORT = int(os.environ.get("HOSTILE_PORT", "8123"))  # where it listens


def build_app():
    from openenv.core.env_server import Action, Environment, Observation, State, create_app

    class Say(Action):
        message: str

    class Heard(Observation):
        text: object = ""
        rewards: dict = {}

    class Hostile(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kwargs):
            return Heard(text=f"Say anything ({seed}).", done=False, reward=0.0)

        def step(self, action, timeout_s=None, **kwargs):
            if HOSTILE == "silent":
                time.sleep(3600)
            if HOSTILE == "huge":
                return Heard(text="x" * 2**20, done=False, reward=0.0, rewards={"score": 0.0})
            if HOSTILE == "text":
                return Heard(text=7, done=True, reward=1.0, rewards={"score": 1.0})
            value = math.nan if HOSTILE == "nan" else 1.0
            return Heard(text="Thanks.", done=True, reward=value, rewards={"score": value})

        @property
        def state(self):
            return self._state

    return create_app(Hostile, Say, Heard, env_name="hostile", max_concurrent_envs=64)


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(build_app(), host="127.0.0.1", port=HOSTILE_PORT, log_level="warning")
