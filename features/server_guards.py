"""Guard: what keeps the reference server's queues safe to ask twice and bounded against any peer:
the upload ids that answer a retried upload once (UploadIds), the room every group takes while it
waits (Room), the pixels uploads may decode (DecodeBudget), the group a rank was handed until it
acknowledges it (Handouts) and the checked /get query (parse_get). ref_server.py's routes call
each in one line; a reader following a step there may skip this file (docs/server.md says why each
is needed).

    python -m pytest tests/test_server.py tests/test_reliability.py     # each bound and retry
"""
import collections
import queue
import threading
import time


class UploadIds:
    """The answers given to the newest `size` upload ids. A client that timed out before reading its
    answer retries with the same id and gets the first answer: the group is never queued twice."""

    NEW, IN_FLIGHT = "new", "in flight"

    def __init__(self, size):
        self.size = size
        self.answers = collections.OrderedDict()  # upload_id -> its answer, or IN_FLIGHT
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


class Room:
    """The server's memory limit: at most queue_size groups per kind (trainers', workers') and
    max_bytes in all, taken when an upload is accepted and given back when its batch is taken.
    Nothing waits for room: an upload that finds none is answered 503 at once, and one kind's full
    queue never holds up the other's."""

    def __init__(self, queue_size, max_bytes):
        self.queue_size = queue_size
        self.max_bytes = max_bytes
        self.held = {"trainers": 0, "workers": 0}  # groups accepted, not yet taken, per kind
        self.held_bytes = 0  # their bytes
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


class DecodeBudget:
    """How many image pixels the upload threads may decode: `per_second` flow in, at most `burst`
    saved up, shared by every peer. An upload that finds too few is answered 503 at once and
    retried later, so a peer with the token cannot keep the threads decoding (one upload is
    bounded by MAX_QUESTION_PIXELS, their flow by this). An upload charged by its headers whose
    images then fail to decode gives the pixels back to the shared budget and is charged to its
    sender's own failure budget: a peer sending headers that promise what the files do not hold
    spends what it may fail with, never what honest peers decode (issue 79's hostile peer).

    Whose failures: a sender is its address and its run (`key`). A run earns its own budget by
    decoding: each success adds its pixels (up to `burst`), each failure spends them. A run with
    no such credit (a new one, or one that only failed) fails on its address's budget, as all
    such runs there do. So a hostile peer on an honest run's address (one host, or behind NAT)
    spends that address's budget, never the honest run's credit, and cannot buy failures without
    as many pixels decoded first; inventing new runs gets it no budget of its own (issue 88)."""

    def __init__(self, per_second, burst):
        self.per_second = per_second
        self.burst = burst
        self.shared = Bucket(per_second, burst)
        self.failures = collections.OrderedDict()  # address -> Bucket its runs without credit share
        self.credit = collections.OrderedDict()  # (address, run) -> pixels it may fail with
        self.lock = threading.Lock()

    def take(self, pixels, peer="", run="") -> bool:
        """Charge `pixels` to the shared budget before decoding them; False (nothing charged)
        when it holds too few, or when the sender's run has too little credit and its address's
        failure budget too little too."""
        with self.lock:
            credit = self.credit.get((peer, run), 0)
            if pixels > credit and pixels > remembered(self.failures, peer, self._fresh).now():
                return False
            return self.shared.take(pixels)

    def decoded(self, pixels, peer="", run="") -> None:
        """The decoding that take charged worked: the run's credit grows by its pixels."""
        if not pixels:  # a text group: nothing decoded, nothing earned
            return
        with self.lock:
            credit = self.credit.pop((peer, run), 0)
            self.credit[(peer, run)] = min(self.burst, credit + pixels)  # most recent last
            while len(self.credit) > MAX_PEERS:
                self.credit.popitem(last=False)

    def failed(self, pixels, peer="", run="") -> None:
        """The decoding that take charged failed: give the pixels back to the shared budget and
        spend them from the run's credit, the rest from its address's failure budget."""
        with self.lock:
            self.shared.left = min(self.burst, self.shared.left + pixels)
            credit = self.credit.get((peer, run), 0)
            if credit:
                self.credit[(peer, run)] = max(0, credit - pixels)
            rest = max(0, pixels - credit)
            failures = remembered(self.failures, peer, self._fresh)
            failures.left = max(0.0, failures.now() - rest)

    def _fresh(self) -> "Bucket":
        return Bucket(self.per_second, self.burst)


def remembered(table: collections.OrderedDict, key, fresh) -> "Bucket":
    """table[key] (made by fresh() the first time), the most recent last: past MAX_PEERS keys the
    oldest are forgotten first (a forgotten one starts full)."""
    bucket = table.pop(key, None) or fresh()
    table[key] = bucket
    while len(table) > MAX_PEERS:
        table.popitem(last=False)
    return bucket


MAX_PEERS = 4096  # addresses, and runs, whose budgets are remembered (a forgotten one: fresh)


class Bucket:
    """A token bucket: `per_second` flow in, at most `burst` saved up (callers hold a lock)."""

    def __init__(self, per_second, burst):
        self.per_second = per_second
        self.burst = burst
        self.left = burst  # what may be spent now
        self.last = time.monotonic()

    def now(self) -> float:
        """What may be spent now, the flow since the last look added."""
        clock = time.monotonic()
        self.left = min(self.burst, self.left + (clock - self.last) * self.per_second)
        self.last = clock
        return self.left

    def take(self, amount) -> bool:
        if amount > self.now():
            return False
        self.left -= amount
        return True


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


def parse_get(query, max_ranks, max_ack_chars):
    """(kind, rank, ack) of a /get query: kind "workers" (from=workers) or "trainers", the asking
    rank (a rank takes back the groups it sent), the upload id it acknowledges (None: a plain take,
    at most max_ack_chars ASCII characters). ValueError naming the problem."""
    kind = "workers" if query.get("from") == "workers" else "trainers"
    rank = query.get("rank", "0")
    if not (rank.isascii() and rank.isdigit() and len(rank) < 6 and int(rank) < max_ranks):
        raise ValueError(f"rank must be an int in 0..{max_ranks - 1}, got {rank[:20]!r}")
    ack = query.get("ack")
    if ack is not None and (len(ack) > max_ack_chars or not (ack.isascii() and ack.isprintable())):
        raise ValueError(f"ack must be an upload id of at most {max_ack_chars} ASCII characters")
    return kind, int(rank), ack
