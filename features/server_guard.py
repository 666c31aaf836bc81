"""The servers' guard against faulty and hostile peers (ref_server.py's, and the weight
publisher's): the HTTP server itself (waitress with bounded threads and backlog; idle, stalled and
trickling connections closed; a stop that frees the port), what an upload must be before any of it
reaches the model, the token check, the memory of upload ids that makes a client's retried upload
safe, the handouts that make taking a group safe to ask twice, the byte budget, and a warning when a
server is reachable beyond loopback unguarded. A bad or hostile client gets a 4xx naming the
problem, and can cost at most the server's limits (docs/server.md lists them).

    python -m pytest tests/test_server.py -k bad_upload   # every kind of bad upload, over HTTP
"""
import collections
import hmac
import json
import queue
import sys
import threading
import time

import torch

from features.vision import unpack_images
from features.wire import IMAGE_FIELDS, META_FIELDS, OPTIONAL, UPLOAD_SPEC, carries_images

MAX_NAME_CHARS = 200  # metadata worker and upload_id: a name, never a payload
TEMPERATURES = (0.01, 100)  # below 0.01, logits / T overflow to inf and the log-probs are NaN
MAX_ACK_CHARS = 200  # an acknowledged upload id: a name, never a payload
MAX_RANKS = 4096  # trainer ranks a server keeps ready queues for
CHECKED_META = ("version", "rank", "worker", "upload_id", "regrouped", "question", "answers")
META_TYPES = {name: META_FIELDS[name][0] for name in CHECKED_META}  # optional fields' types


class TooLarge(ValueError):
    """An upload over a size limit: 413."""


def validate_group(tensors: dict, meta: dict, vocab_size: int, max_rows: int, max_len: int,
                   max_tokens: int) -> dict:
    """The group's metadata with null fields dropped (null = not given); raise ValueError (TooLarge
    for a size limit) naming the first problem in an uploaded group."""
    missing = [k for k in UPLOAD_SPEC if k not in tensors and k not in OPTIONAL]
    if missing:
        raise ValueError(f"missing tensors: {missing}")
    unknown = sorted(set(tensors) - set(UPLOAD_SPEC) - set(IMAGE_FIELDS))
    if unknown:
        raise ValueError(f"unexpected tensors: {unknown}")
    if carries_images(tensors):  # text uploads carry none
        unpack_images(tensors)  # the images' fields, counts and sizes; decoded by the server
    ids = tensors["input_ids"]
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D int64, got {ids.dtype} {tuple(ids.shape)}")
    g, l = ids.shape
    if not 1 <= g <= max_rows:
        raise ValueError(f"input_ids has {g} rows; 1 to {max_rows} allowed")
    if l > max_len or g * l > max_tokens:
        raise TooLarge(f"group of {g} x {l} tokens: at most {max_len} per row (the model's "
                       f"positions) and {max_tokens} in all (MAX_GROUP_TOKENS)")
    plen = meta.get("plen")
    if type(plen) is not int or not 1 <= plen < l:
        raise ValueError(f"metadata plen must be an int in 1..{l - 1} (sequence length {l}), "
                         f"got {plen!r}")
    temperature = meta.get("temperature", 1.0)
    lowest, highest = TEMPERATURES
    if type(temperature) not in (int, float) or not lowest <= temperature <= highest:
        raise ValueError(f"metadata temperature must be a number in {list(TEMPERATURES)}, "
                         f"got {temperature!r}")
    for name, kind in META_TYPES.items():  # absent or null: the field is not given
        value = meta.get(name)
        named = name in ("worker", "upload_id")  # names, never payloads
        if value is not None and (type(value) is not kind or named and len(value) > MAX_NAME_CHARS):
            wanted = f"a {kind.__name__}"
            if kind is str:
                wanted = f"a string of at most {MAX_NAME_CHARS} characters"
            shown = str(value)[:MAX_NAME_CHARS // 2]
            raise ValueError(f"metadata {name} must be {wanted}, got {shown!r}")
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
            raise ValueError(f"{name} must be {dtype} {shape(g, l, plen)}, "
                             f"got {t.dtype} {tuple(t.shape)}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{name} has NaN or inf values")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"input_ids outside the vocabulary [0, {vocab_size}): "
                         f"{ids.min()}..{ids.max()}")
    return {k: v for k, v in meta.items() if v is not None}


def token_ok(authorization: str, token: str) -> bool:
    """Whether the raw Authorization header carries the REF_TOKEN ("" = no auth), compared in
    constant time. Raw bytes: a header that is not UTF-8 is simply wrong, not a crash."""
    expected = f"Bearer {token}".encode()
    return not token or hmac.compare_digest(authorization.encode("latin-1"), expected)


class UploadIds:
    """The answers given to the newest `size` upload ids. A client that timed out before reading its
    answer retries with the same id and gets the first answer: the group is never queued twice."""

    NEW, IN_FLIGHT = "new", "in flight"

    def __init__(self, size):
        # upload_id -> its answer, or IN_FLIGHT
        self.size, self.answers = size, collections.OrderedDict()
        self.lock = threading.Lock()

    def claim(self, uid):
        """NEW (handle it: the id is now IN_FLIGHT), IN_FLIGHT (its first try is still being
        handled), or the first try's answer. An upload without an id (None) is always NEW."""
        with self.lock:
            first = self.answers.get(uid, self.NEW) if uid else self.NEW
            if uid and first == self.NEW:
                self.answers[uid] = self.IN_FLIGHT
                # the oldest id is forgotten: a retry that late is new
                while len(self.answers) > self.size:
                    self.answers.popitem(last=False)
            return first

    def settle(self, uid, answer):
        """The id's answer, or with None (the upload was refused: 503) the id forgotten, so a retry
        is new."""
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
    """The server's memory limit: at most queue_size groups per kind (trainers', workers') and
    max_bytes in all, taken when an upload is accepted and given back when its batch is taken.
    Nothing waits for room: an upload that finds none is answered 503 at once, and one kind's full
    queue never holds up the other's."""

    def __init__(self, queue_size, max_bytes):
        self.queue_size, self.max_bytes = queue_size, max_bytes
        # groups and bytes accepted, not yet taken
        self.held, self.held_bytes = {"trainers": 0, "workers": 0}, 0
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


# ----------------------------------------------------------------------------- taking a group twice
# GET /get?rank=N&ack=ID hands a rank the group at the head of its queue and keeps it until the
# rank's next call acknowledges it by id. An answer lost on the way (a cut link, a server killed
# mid-response) is asked for again and the same group comes back: none is lost or handed twice.
# A plain GET /get (no ack) takes the group for good, as simple clients expect.

class Handouts:
    """The one group each taker (a trainer rank, for its own or for workers' groups) was handed last
    and has not acknowledged: kept until acknowledged, handed again if asked again without the ack.
    Items are (body, content type, bytes of room, upload id)."""

    def __init__(self):
        self.held = {}  # taker -> item
        self.lock = threading.Lock()

    def take(self, taker, ready: queue.Queue, ack, give_back):
        """(the item to answer with or None, whether it is handed out for the first time). taker
        is (kind, rank); give_back(kind, nbytes) frees the room of an item gone for good. ack None:
        a plain take, the held item (if any) or the next one leaves at once. ack a string: the held
        item is dropped if it is that id, then the held item (or the next one, now held)."""
        with self.lock:
            held = self.held.pop(taker, None)
            if held is not None and ack is not None and ack == held[3]:
                give_back(taker[0], held[2])
                held = None
            fresh = held is None
            if fresh:
                try:
                    held = ready.get_nowait()
                except queue.Empty:
                    return None, False
            if ack is None:
                give_back(taker[0], held[2])
            else:
                self.held[taker] = held
            return held, fresh


def parse_get(query, max_ranks):
    """(kind, rank, ack) of a /get query: kind "workers" (from=workers) or "trainers", the asking
    rank (a rank takes back the groups it sent), the upload id it acknowledges (None: a plain take).
    ValueError naming the problem."""
    kind = "workers" if query.get("from") == "workers" else "trainers"
    rank = query.get("rank", "0")
    if not (rank.isascii() and rank.isdigit() and len(rank) < 6 and int(rank) < max_ranks):
        raise ValueError(f"rank must be an int in 0..{max_ranks - 1}, got {rank[:20]!r}")
    ack = query.get("ack")
    if ack is not None and (len(ack) > MAX_ACK_CHARS or not (ack.isascii() and ack.isprintable())):
        raise ValueError(f"ack must be an upload id of at most {MAX_ACK_CHARS} ASCII characters")
    return kind, int(rank), ack


# ----------------------------------------------------------------------------- the HTTP server

def start_http(app, host, port, *, threads, backlog, idle_timeout, max_body, request_deadline=None):
    """Serve the WSGI `app` on a daemon thread; returns stop(), which ends the loop and frees the
    port. A request (headers and body) must arrive whole within request_deadline seconds of its
    first byte (default idle_timeout), so no client holds one of the `backlog` connections long."""
    from waitress.channel import HTTPChannel
    from waitress.parser import HTTPRequestParser
    from waitress.server import create_server

    class TimedParser(HTTPRequestParser):  # remembers when its request's first byte came
        def __init__(self, adj):
            super().__init__(adj)
            self.began = time.monotonic()

    class TimedChannel(HTTPChannel):
        parser_class = TimedParser

    httpd = create_server(app, host=host, port=port, threads=threads, backlog=backlog,
                          connection_limit=backlog, channel_timeout=idle_timeout,
                          cleanup_interval=1,
                          max_request_body_size=max_body, ident="ref_server")
    httpd.channel_class = TimedChannel
    deadline = request_deadline or idle_timeout
    idle_cleanup = httpd.maintenance

    def maintenance(now):  # each second: idle channels, then requests past their deadline
        idle_cleanup(now)
        for channel in list(httpd.active_channels.values()):
            request = getattr(channel, "request", None)
            if isinstance(request, TimedParser) and time.monotonic() - request.began > deadline:
                channel.will_close = True

    httpd.maintenance = maintenance
    stopping = threading.Event()

    def run():
        try:
            httpd.run()
        except OSError:  # stop() closed the sockets under its select(): the end, not an error
            if not stopping.is_set():
                raise

    thread = threading.Thread(target=run, name="http", daemon=True)
    thread.start()

    def stop():
        stopping.set()
        httpd.task_dispatcher.shutdown()
        close_sockets(httpd)
        thread.join(timeout=10)

    return stop


def close_sockets(httpd):
    """Close every socket of a waitress server, the listening one too: its loop ends, the port is
    free. waitress has no public call for it; its private socket map missing is an error
    (tests/test_server.py checks it)."""
    sockets = getattr(httpd, "_map", None)
    if not isinstance(sockets, dict) or not sockets:
        raise RuntimeError(f"waitress {type(httpd).__name__} has no socket map: "
                           "features/server_guard.close_sockets needs updating for this waitress "
                           "version")
    for channel in list(sockets.values()):
        channel.close()


def json_errors(app):
    """The bottle `app` with its own error pages (bad request, unknown path or method, a crash) as
    JSON, like every other answer of the server; returns it."""
    import bottle

    def json_error(err):
        bottle.response.content_type = "application/json"
        return json.dumps({"error": f"{err.status}: {err.body}"})

    for status in (400, 404, 405, 500):
        app.error(status)(json_error)
    return app
