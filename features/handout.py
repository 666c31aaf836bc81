"""Taking a ready group from the reference server safely twice: GET /get?rank=N&ack=ID hands a rank
the group at the head of its queue and keeps it until the rank's next call acknowledges it by id.
An answer lost on the way (a cut link, a server killed mid-response) is simply asked for again and
the same group comes back, so no group is lost between server and trainer and none is handed out
twice. A plain GET /get (no ack) takes the group for good, as simple clients expect.

    python -m pytest tests/test_ref_servers.py -k acknowledged     # the test of this module
"""
import queue
import threading

MAX_ACK_CHARS = 200  # an acknowledged upload id: a name, never a payload


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
