"""The reference server's guard: what an upload must be before any of it reaches the model, the token check,
the memory of upload ids that makes a client's retry safe, and a warning when it serves beyond loopback
unguarded. A bad or hostile client gets a 4xx naming the problem, and can cost at most the server's limits
(docs/server.md lists them).

    python -m pytest tests/test_server.py -k bad_upload        # every kind of bad upload, over real HTTP
"""
import collections
import hmac
import sys
import threading

import torch

from features.wire import OPTIONAL, UPLOAD_SPEC

MAX_NAME_CHARS = 200  # metadata worker and upload_id: a name, never a payload
TEMPERATURES = (0.01, 100)  # below 0.01, logits / T overflow to inf and the log-probs are NaN
MAX_RANKS = 4096  # trainer ranks a server keeps ready queues for
META_TYPES = {"version": int, "rank": int, "worker": str, "upload_id": str, "regrouped": bool,
              "question": str, "answers": list}  # optional fields; question and answers feed REWARD_MODEL


class TooLarge(ValueError):
    """An upload over a size limit: 413."""


def validate_group(tensors: dict, meta: dict, vocab_size: int, max_rows: int, max_len: int, max_tokens: int) -> dict:
    """The group's metadata with null fields dropped (null = not given); raise ValueError (TooLarge for a size
    limit) naming the first problem in an uploaded group."""
    missing = [k for k in UPLOAD_SPEC if k not in tensors and k not in OPTIONAL]
    if missing:
        raise ValueError(f"missing tensors: {missing}")
    unknown = sorted(set(tensors) - set(UPLOAD_SPEC))
    if unknown:
        raise ValueError(f"unexpected tensors: {unknown}")
    ids = tensors["input_ids"]
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D int64, got {ids.dtype} {tuple(ids.shape)}")
    g, l = ids.shape
    if not 1 <= g <= max_rows:
        raise ValueError(f"input_ids has {g} rows; 1 to {max_rows} allowed")
    if l > max_len or g * l > max_tokens:
        raise TooLarge(f"group of {g} x {l} tokens: at most {max_len} per row (the model's positions) and "
                       f"{max_tokens} in all (MAX_GROUP_TOKENS)")
    plen = meta.get("plen")
    if type(plen) is not int or not 1 <= plen < l:
        raise ValueError(f"metadata plen must be an int in 1..{l - 1} (sequence length {l}), got {plen!r}")
    temperature = meta.get("temperature", 1.0)
    if type(temperature) not in (int, float) or not TEMPERATURES[0] <= temperature <= TEMPERATURES[1]:
        raise ValueError(f"metadata temperature must be a number in {list(TEMPERATURES)}, got {temperature!r}")
    for name, kind in META_TYPES.items():  # absent or null: the field is not given
        value = meta.get(name)
        if value is not None and (type(value) is not kind or kind is str and len(value) > MAX_NAME_CHARS
                                  and name in ("worker", "upload_id")):
            wanted = f"a string of at most {MAX_NAME_CHARS} characters" if kind is str else f"a {kind.__name__}"
            raise ValueError(f"metadata {name} must be {wanted}, got {str(value)[:MAX_NAME_CHARS // 2]!r}")
    rank = meta.get("rank")
    if rank is not None and not 0 <= rank < MAX_RANKS:  # each rank gets a ready queue of its own
        raise ValueError(f"metadata rank must be an int in 0..{MAX_RANKS - 1}, got {rank!r}")
    answers = meta.get("answers")
    if answers is not None and (len(answers) != g or not all(isinstance(a, str) for a in answers)):
        raise ValueError(f"metadata answers must be a list of {g} strings, one per row")
    for name, (dtype, shape) in UPLOAD_SPEC.items():
        if name not in tensors:
            continue
        t = tensors[name]
        if t.dtype != dtype or tuple(t.shape) != shape(g, l, plen):
            raise ValueError(f"{name} must be {dtype} {shape(g, l, plen)}, got {t.dtype} {tuple(t.shape)}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{name} has NaN or inf values")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"input_ids outside the vocabulary [0, {vocab_size}): {ids.min()}..{ids.max()}")
    return {k: v for k, v in meta.items() if v is not None}


def token_ok(authorization: str, token: str) -> bool:
    """Whether the raw Authorization header carries the REF_TOKEN ("" = no auth), compared in constant time.
    Raw bytes: a header that is not UTF-8 is simply wrong, not a crash."""
    return not token or hmac.compare_digest(authorization.encode("latin-1"), f"Bearer {token}".encode())


class UploadIds:
    """The answers given to the newest `size` upload ids. A client that timed out before reading its answer
    retries with the same id and gets the first answer: the group is never queued twice."""

    NEW, IN_FLIGHT = "new", "in flight"

    def __init__(self, size):
        self.size, self.answers = size, collections.OrderedDict()  # upload_id -> its answer, or IN_FLIGHT
        self.lock = threading.Lock()

    def claim(self, uid):
        """NEW (handle it: the id is now IN_FLIGHT), IN_FLIGHT (its first try is still being handled), or the
        first try's answer. An upload without an id (None) is always NEW."""
        with self.lock:
            first = self.answers.get(uid, self.NEW) if uid else self.NEW
            if uid and first == self.NEW:
                self.answers[uid] = self.IN_FLIGHT
                while len(self.answers) > self.size:  # the oldest id is forgotten: a retry that late is new
                    self.answers.popitem(last=False)
            return first

    def settle(self, uid, answer):
        """The id's answer, or with None (the upload was refused: 503) the id forgotten, so a retry is new."""
        with self.lock:
            if uid and answer is None:
                self.answers.pop(uid, None)
            elif uid:
                self.answers[uid] = answer


def exposure_warning(host: str, token: str, what: str = "upload and read batches") -> str | None:
    """A warning when a server (the reference server, the weight publisher) is reachable beyond this
    machine with no token to guard it; `what` says what anyone could then do."""
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.") or token:
        return None
    return f"WARNING: serving on {host} without REF_TOKEN: anyone who reaches this port can {what}"


def warn_if_exposed(host: str, token: str, what: str = "upload and read batches"):
    """Print exposure_warning on stderr when there is one."""
    warning = exposure_warning(host, token, what)
    if warning:
        print(warning, file=sys.stderr, flush=True)


class Room:
    """The server's memory limit: at most queue_size groups per kind (trainers', workers') and max_bytes in all,
    taken when an upload is accepted and given back when its batch is taken. Nothing waits for room: an upload
    that finds none is answered 503 at once, and one kind's full queue never holds up the other's."""

    def __init__(self, queue_size, max_bytes):
        self.queue_size, self.max_bytes = queue_size, max_bytes
        self.held, self.held_bytes = {"trainers": 0, "workers": 0}, 0  # groups and bytes accepted, not yet taken
        self.lock = threading.Lock()

    def take(self, kind, nbytes) -> bool:
        with self.lock:
            room = self.held[kind] < self.queue_size and self.held_bytes + nbytes <= self.max_bytes
            if room:
                self.held[kind] += 1
                self.held_bytes += nbytes
            return room

    def give_back(self, kind, nbytes):
        with self.lock:
            self.held[kind] -= 1
            self.held_bytes -= nbytes
