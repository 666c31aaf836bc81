"""Guard: waiting out a reference server that is unreachable, busy or silent: one backoff (pauses
that double up to a cap, a note on stderr every so often, a deadline) and request_with_retry, the
HTTP request every client makes with it. RefClient's search for a live server waits with the same
one.

    python -c "from features.retry import request_with_retry as ask
print(ask('GET', 'http://127.0.0.1:59875/health').json())"   # waits for a starting server
"""
import sys
import time

import requests

# Internal timings; SERVER_TIMEOUT (the trainer's) is the one to tune.
RETRY_FIRST_S = 0.2  # the first pause before asking again an unreachable or busy server
RETRY_MAX_S = 5.0  # the longest pause: the pauses double up to this
NOTE_EVERY_S = 10.0  # a retrying client says so on stderr at most this often
READ_TIMEOUT_S = 60.0  # a request the server has not answered by then is retried (a stuck server)


class ServerError(RuntimeError):
    """The server refused a request (4xx): retrying the same bytes cannot help."""


class Backoff:
    """The pauses between tries of one wait: wait(problem) sleeps the next pause, saying so at most
    every NOTE_EVERY_S, or raises TimeoutError once give_up_after seconds have passed since the
    first try."""

    def __init__(self, give_up_after: float, what: str,
                 hint: str = "is `python ref_server.py` running?"):
        self.give_up_after = give_up_after
        self.what = what  # who is waited for, as the messages name it
        self.hint = hint  # what the message at the deadline asks
        self.start = time.time()
        self.delay = RETRY_FIRST_S
        self.last_note = 0.0

    def wait(self, problem: str):
        """After a failed try (`problem` says how it failed): pause, or give up."""
        waited = time.time() - self.start
        if waited > self.give_up_after:
            raise TimeoutError(f"{self.what} still {problem} after {waited:.0f} s; {self.hint}")
        if time.time() - self.last_note > NOTE_EVERY_S:
            print(f"[retry] {self.what} {problem}; retrying for up to {self.give_up_after:.0f} s",
                  file=sys.stderr, flush=True)
            self.last_note = time.time()
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, RETRY_MAX_S)


def request_with_retry(method, url, token="", data=None, give_up_after=600.0,
                       what="reference server", read_timeout=READ_TIMEOUT_S,
                       hint="is `python ref_server.py` running?"):
    """One HTTP request; connection errors, timeouts and 503 (queue full) are retried with backoff.
    A retried upload is safe when it carries an upload_id: the server answers a repeat, queues
    nothing. hint: what the message at the deadline asks (the reference server's by default)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    backoff = Backoff(give_up_after, f"{what} at {url}", hint)
    while True:
        try:
            r = requests.request(method, url, data=data, headers=headers, timeout=read_timeout)
            if r.status_code < 400:
                return r
            if r.status_code != 503:
                raise ServerError(f"{what} answered {r.status_code} to {method} {url}: "
                                  f"{r.text[:300]}")
            problem = "busy (503, queue full)"
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError,
                requests.exceptions.ContentDecodingError):  # refused, reset, or cut mid-body
            problem = "unreachable"
        except requests.Timeout:  # a read timeout: the server may be stuck, or just slow
            problem = f"silent for {read_timeout:g} s"
        backoff.wait(problem)
