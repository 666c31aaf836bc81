"""The trainer's side of ref_server.py: the handshake (/health: the same model?), uploads that are safe to retry,
and pulling ready groups back, through restarts, timeouts and a busy server.

    python ref_server.py & deepspeed --num_gpus 1 grpo_ref_split.py     # the trainer makes one RefClient
"""
import sys
import time
import uuid

import requests

from features.fingerprint import model_fingerprint
from features.wire import decode_batch, encode_batch

# Internal timings of the plumbing; SERVER_TIMEOUT (the trainer's) is the one to tune.
_POLL_FIRST_S, _POLL_MAX_S = 0.02, 0.05  # /get polls while a forward runs: a group is at most _POLL_MAX_S late
_RETRY_FIRST_S, _RETRY_MAX_S = 0.2, 5.0  # backoff between retries of an unreachable or busy server
_NOTE_EVERY_S = 10.0  # a retrying client says so on stderr at most this often
_READ_TIMEOUT_S = 60.0  # a request the server has not answered by then is retried (a stuck server)


class ServerError(RuntimeError):
    """The server refused a request (4xx): retrying the same bytes cannot help."""


def request_with_retry(method, url, token="", data=None, give_up_after=600.0, what="reference server",
                       read_timeout=_READ_TIMEOUT_S):
    """One HTTP request; connection errors, timeouts and 503 (queue full) are retried with backoff.
    A retried upload is safe when it carries an upload_id: the server answers a repeat, queues nothing."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    start, delay, last_note = time.time(), _RETRY_FIRST_S, 0.0
    while True:
        try:
            r = requests.request(method, url, data=data, headers=headers, timeout=read_timeout)
            if r.status_code < 400:
                return r
            if r.status_code != 503:
                raise ServerError(f"{what} answered {r.status_code} to {method} {url}: {r.text[:300]}")
            problem = "busy (503, queue full)"
        except requests.ConnectionError:
            problem = "unreachable"
        except requests.Timeout:  # a read timeout: the server may be stuck, or just slow
            problem = f"silent for {read_timeout:g} s"
        waited = time.time() - start
        if waited > give_up_after:
            raise TimeoutError(f"{what} at {url} still {problem} after {waited:.0f} s; "
                               "is `python ref_server.py` running?")
        if time.time() - last_note > _NOTE_EVERY_S:
            print(f"[retry] {what} {problem}; retrying for up to {give_up_after:.0f} s", file=sys.stderr, flush=True)
            last_note = time.time()
        time.sleep(delay)
        delay = min(delay * 2, _RETRY_MAX_S)


class RefClient:
    """A trainer's (or worker's) connection to the reference server at `url` (REF_SERVER)."""

    def __init__(self, url, token="", timeout=600.0, extra_groups=0):
        self.url, self.token, self.timeout, self.extra_groups = url, token, timeout, extra_groups

    def request(self, method, path, data=None):
        return request_with_retry(method, self.url + path, self.token, data, give_up_after=self.timeout)

    def health(self, model=None, tokenizer=None, allow_mismatch=False) -> dict:
        """The server's /health, after checking (given the policy, before any update) that it holds the model
        this policy starts from: the same vocabulary, config and weights, unless allow_mismatch."""
        health = self.request("GET", "/health").json()
        if model is None:
            return health
        vocab = model.get_output_embeddings().weight.shape[0]
        if health["vocab_size"] != vocab or len(tokenizer) > health["vocab_size"]:
            sys.exit(f"reference server at {self.url} holds {health['model']} with vocab {health['vocab_size']}, "
                     f"but this policy has vocab {vocab} (tokenizer {len(tokenizer)}): start it with the same "
                     "MODEL_PATH")
        ours = model_fingerprint(model)
        differ = [k for k in ours if health["fingerprint"].get(k) != ours[k]]
        if differ and not allow_mismatch:
            sys.exit(f"reference server at {self.url} holds {health['model']}, whose {' and '.join(differ)} differ "
                     f"from this policy's ({health['fingerprint']} against {ours}): start it with the same "
                     "MODEL_PATH, or set ALLOW_REF_MISMATCH=1 to train against another reference on purpose")
        return health

    def upload(self, groups, **tags):
        """POST each group with `tags` added to its metadata; returns (server instance, groups it made ready)."""
        instance, made_ready = None, 0
        for tensors, meta in groups:  # a fresh upload_id per group: a retry after a timeout is not queued twice
            body = encode_batch(tensors, {**meta, **tags, "upload_id": uuid.uuid4().hex})
            r = self.request("POST", "/upload", body).json()
            instance, made_ready = r["instance"], made_ready + r["groups"]  # REGROUP may hold one back (0)
        return instance, made_ready

    def upload_and_pull(self, groups, version, rank):
        """Step 5: upload our groups, then take back as many ready groups (any rank's) as ours made ready,
        with their ref_logps, and up to extra_groups more that genonly workers left waiting.

        Every rank takes what it gave, so no rank can starve. If the server restarted meanwhile (a
        new instance id), the groups it held are gone: we return short at once and the caller
        regenerates, so nothing is trained twice and nothing waits forever. A group whose reference
        forward failed comes back as an error: one group fewer, said on stderr.
        """
        instance, owed = self.upload(groups, version=version, rank=rank)
        got, deadline, delay = [], time.time() + self.timeout, _POLL_FIRST_S
        while owed > len(got) and time.time() < deadline:
            r = self.request("GET", "/get")
            if r.status_code == 200 and r.headers.get("Content-Type") == "application/json":  # its forward failed
                print(f"[rank {rank}] the reference server lost a group: {r.json()['error']}", file=sys.stderr,
                      flush=True)
                owed -= 1
            elif r.status_code == 200:
                got.append(decode_batch(r.content))
                delay = _POLL_FIRST_S
            if r.headers.get("X-Ref-Instance") != instance:
                print(f"[rank {rank}] the reference server restarted: {owed - len(got)} uploaded groups "
                      "were lost with it; regenerating", file=sys.stderr, flush=True)
                break
            if r.status_code == 204:  # the reference forward is still running; a 204 poll is a tiny request
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
        for _ in range(self.extra_groups):
            r = self.request("GET", "/get?from=workers")
            if r.status_code != 200:
                break
            if r.headers.get("Content-Type") != "application/json":  # not a group whose forward failed
                got.append(decode_batch(r.content))
        return got
