"""A hostile environment served by OpenEnv's own server, for tests/test_environments.py: its step
misbehaves as HOSTILE says (nan: a reward that is not finite; huge: an observation of 16 MB;
text: an observation whose text is a number; silent: it never answers; die: the server exits in
the middle of the episode; messages: its reset's opening messages are not {"role", "content"}
strings; fine: a one-step game whose reward is the message's length / 100).
Three more speak OpenEnv's WebSocket protocol by hand (build_raw_app), to send what OpenEnv's own
server never would: no_done (a step reply without done), done_text (done "yes"), nan_raw (a reward
NaN as JSON's NaN token, not OpenEnv's null). Sessions before HOSTILE_FROM_SESSION (counted from
1, in the order they open) play fine: a run's load (its openings and the probe, one session) and
its first step pass, and a later step meets the hostile replies.

    HOSTILE=nan HOSTILE_PORT=8123 python tests/openenv_hostile.py
"""
import itertools
import math
import os
import time

HOSTILE = os.environ.get("HOSTILE", "fine")  # how its step misbehaves
HOSTILE_PORT = int(os.environ.get("HOSTILE_PORT", "8123"))  # where it listens
HOSTILE_FROM_SESSION = int(os.environ.get("HOSTILE_FROM_SESSION", "1"))  # 1 = every session
SESSIONS = itertools.count(1)  # the number of each session as it opens


def fine_score(message) -> float:
    """The honest game's reward: a message's length / 100 (answers differ, so groups do)."""
    return len(str(message)) / 100


def build_app():
    from openenv.core.env_server import Action, Environment, Observation, State, create_app

    class Say(Action):
        message: str

    class Heard(Observation):
        text: object = ""
        rewards: dict = {}
        messages: object = None  # at reset: the opening messages, where an environment sends them

    class Hostile(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(step_count=0)
            self.how = HOSTILE if next(SESSIONS) >= HOSTILE_FROM_SESSION else "fine"

        def reset(self, seed=None, episode_id=None, **kwargs):
            text = f"Say anything ({seed})."
            if self.how == "messages":  # a content that is not a string
                return Heard(text=text, messages=[{"role": "user", "content": 7}], done=False,
                             reward=0.0)
            return Heard(text=text, done=False, reward=0.0)

        def step(self, action, timeout_s=None, **kwargs):
            if self.how == "silent":
                time.sleep(3600)
            if self.how == "die":
                os._exit(1)  # mid-episode: this session's reset was answered
            if self.how == "huge":
                return Heard(text="x" * 2**24, done=False, reward=0.0, rewards={"score": 0.0})
            if self.how == "text":
                return Heard(text=7, done=True, reward=1.0, rewards={"score": 1.0})
            value = math.nan if self.how == "nan" else fine_score(action.message)
            return Heard(text="Thanks.", done=True, reward=value, rewards={"score": value})

        @property
        def state(self):
            return self._state

    return create_app(Hostile, Say, Heard, env_name="hostile", max_concurrent_envs=64)


def build_raw_app():
    """OpenEnv's protocol by hand (GET /health; a WebSocket at /ws taking {"type": "reset" |
    "step" | "close", "data": ...} and answering {"type": "observation", "data": payload}), whose
    step replies leave out done (no_done) or send it as a string (done_text)."""
    from fastapi import FastAPI, WebSocket, WebSocketDisconnect

    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "healthy"}

    @app.websocket("/ws")
    async def session(socket: WebSocket):
        await socket.accept()
        how = HOSTILE if next(SESSIONS) >= HOSTILE_FROM_SESSION else "fine"
        try:
            while True:
                message = await socket.receive_json()
                if message.get("type") == "close":
                    break
                if message.get("type") == "reset":
                    seed = message.get("data", {}).get("seed")
                    data = {"observation": {"text": f"Say anything ({seed})."}, "reward": 0.0,
                            "done": False}
                else:
                    said = message.get("data", {}).get("message", "")
                    score = math.nan if how == "nan_raw" else fine_score(said)
                    data = {"observation": {"text": "Thanks.", "rewards": {"score": score}},
                            "reward": score}
                    if how == "done_text":
                        data["done"] = "yes"
                    if how in ("nan_raw", "fine"):
                        data["done"] = True
                await socket.send_json({"type": "observation", "data": data})
        except WebSocketDisconnect:
            pass

    return app


if __name__ == "__main__":
    import uvicorn

    app = build_raw_app() if HOSTILE in ("no_done", "done_text", "nan_raw") else build_app()
    uvicorn.run(app, host="127.0.0.1", port=HOSTILE_PORT, log_level="warning")
