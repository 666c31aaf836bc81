"""Guard: the trainer's side of ref_server.py beyond the lesson's upload_and_pull: the handshake
(/health: the same model?), which route step 5 takes, and RefClient, which uploads safely to several
servers and pulls ready groups back through restarts, timeouts and a busy server.

    # the trainer makes one RefClient
    python ref_server.py & deepspeed --num_gpus 1 grpo_ref_split.py
"""
import sys
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import urlencode

import requests

from features import env_overrides
from features.fingerprint import model_fingerprint, vocab_fingerprint
from features.retry import READ_TIMEOUT_S, Backoff, ServerError, request_with_retry
from features.wire import WIRE_FORMAT, decode_batch, encode_batch

ALLOW_REF_MISMATCH = False  # True = train against a reference that is not the starting policy
env_overrides.apply_env_overrides(globals(), "features/server_client.py")

# Internal timings of the plumbing; SERVER_TIMEOUT (the trainer's) is the one to tune.
_POLL_FIRST_S = 0.02  # /get polls while a forward runs: the first wait, doubled each empty poll
_POLL_MAX_S = 0.05  # up to this, so a ready group waits at most this long to be fetched
_FAILOVER_S = 15.0  # several servers: one silent this long is skipped, its groups sent to another
_DOWN_RETRY_S = 30.0  # a skipped server is asked again after this long (it may have restarted)
_HEALTH_TIMEOUT_S = 5.0  # a /health answer slower than this counts as not answering
_REMEMBERED_IDS = 65536  # upload ids already handed to the trainer: a second copy is dropped


class RefClient:
    """A trainer's (or worker's) connection to the reference servers at `urls` (REF_SERVER: one URL,
    or several separated by commas, each holding the same reference model). Each group goes to the
    server with the least work pending and comes back from it; a server that stops answering (for
    _FAILOVER_S, when there are others) is skipped, and the groups it held are uploaded again to
    another. With one server it is waited for, up to `timeout` (SERVER_TIMEOUT)."""

    def __init__(self, urls, token="", timeout=600.0, extra_groups=0):
        self.urls = [url.strip().rstrip("/") for url in urls.split(",") if url.strip()]
        if not self.urls:
            raise ValueError(f"REF_SERVER names no server: {urls!r}")
        self.token = token
        self.timeout = timeout
        self.extra_groups = extra_groups
        self.fingerprint = None  # the reference model every server must hold (the first handshake)
        self.down = {}  # url -> when it last failed to answer; skipped for _DOWN_RETRY_S
        self.uploaded = OrderedDict()  # upload ids this client sent (bounded): nothing else is ours
        self.received = OrderedDict()  # upload ids already taken back (bounded): copies are dropped
        self.acks = {}  # (url, workers?) -> the upload id it handed us last, acknowledged next call

    def _give_up_after(self):  # one server: wait for it; several: move on to another soon
        return self.timeout if len(self.urls) == 1 else min(self.timeout, _FAILOVER_S)

    def _call(self, method, url, path, data=None):
        give_up = self._give_up_after()
        return request_with_retry(method, url + path, self.token, data, give_up_after=give_up,
                                  read_timeout=min(READ_TIMEOUT_S, max(give_up, 1.0)))

    def health(self, model=None, tokenizer=None, allow_mismatch=False, teacher=False) -> dict:
        """Given the policy (before any update): every server's /health, after checking it holds the
        model this policy starts from (vocabulary, config and weights, unless allow_mismatch), or a
        teacher with the same vocabulary if `teacher` (None: either), and the same one as the
        others; the first's. Without: the least loaded server's (its "url" added)."""
        if model is None:
            url, health = self.least_loaded()[0]
            return {**health, "url": url}
        answers = [self._call("GET", url, "/health").json() for url in self.urls]
        first = answers[0]
        for url, health in zip(self.urls, answers):
            check_reference(url, health, model, tokenizer, allow_mismatch, teacher)
            differ = [k for k in ("fingerprint", "regroup", "reward_model", "role")
                      if health.get(k) != first.get(k)]
            if differ:
                sys.exit(f"reference servers {self.urls[0]} and {url} differ in {differ}: every "
                         "server in REF_SERVER must run the same MODEL_PATH and settings")
        self.fingerprint = answers[0]["fingerprint"]
        return answers[0]

    def least_loaded(self) -> list:
        """[(url, /health)] of the servers answering now, the fewest groups pending first; waits up
        to `timeout` while none answers. A server holding another model than the handshake's is
        skipped (a restart with other weights)."""
        backoff = Backoff(self.timeout, f"reference server {', '.join(self.urls)}")
        while True:
            live = []
            for url in self.urls:
                if time.time() - self.down.get(url, -1e9) < _DOWN_RETRY_S:
                    continue
                try:
                    health = self._call_once("GET", url, "/health").json()
                except (requests.RequestException, ValueError):
                    self.down[url] = time.time()
                    continue
                if self.fingerprint and health.get("fingerprint") != self.fingerprint:
                    print(
                        f"reference server {url} now holds another model: skipped",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.down[url] = time.time()
                    continue
                live.append((url, health))
            if live:
                return sorted(live, key=lambda pair: pair[1]["pending"])
            self.down.clear()  # none answers: try them all again after the pause
            backoff.wait("unreachable")

    def _call_once(self, method, url, path):
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        r = requests.request(method, url + path, headers=headers, timeout=_HEALTH_TIMEOUT_S)
        if r.status_code in (401, 403):  # a wrong token is a setting to fix, not a server to skip
            raise ServerError(f"reference server at {url} answered {r.status_code}: {r.text[:300]}")
        r.raise_for_status()
        return r

    def upload(self, groups, **tags) -> dict:
        """POST each group, `tags` and a fresh upload_id added to its metadata, to the server with
        the least work pending (counting what this call sent). Returns {upload_id: (url, instance)}
        of the groups made ready (REGROUP may hold one back). A server that stops answering is
        skipped."""
        loads = {url: health["pending"] for url, health in self.least_loaded()}
        sent = {}
        # the upload_id stays with the group: a retry is never queued twice
        for tensors, meta in groups:
            meta = {**meta, **tags, "upload_id": meta.get("upload_id") or uuid.uuid4().hex}
            remember(self.uploaded, meta["upload_id"])
            while True:
                url = min(loads, key=loads.get)
                try:
                    answer = self._call("POST", url, "/upload", encode_batch(tensors, meta)).json()
                    break
                except TimeoutError:
                    self._gone(url)
                    del loads[url]
                    loads = loads or {u: health["pending"] for u, health in self.least_loaded()}
            loads[url] += 1
            if answer["groups"]:
                sent[meta["upload_id"]] = (url, answer["instance"])
        return sent

    def _gone(self, url):
        """A server that stopped answering: skip it for a while; raise if it is the only one."""
        if len(self.urls) == 1:
            raise TimeoutError(
                f"reference server at {url} stopped answering for {self.timeout:.0f} s; "
                "is `python ref_server.py` running?"
            )
        print(f"reference server {url} stopped answering: skipped", file=sys.stderr, flush=True)
        self.down[url] = time.time()

    def upload_and_pull(self, groups, version, rank):
        """Step 5: upload our groups, take each back from its server with its ref_logps, and up to
        extra_groups more that genonly workers left waiting.

        A rank takes back exactly the groups it sent (GET /get?rank=N), so when a server stops
        answering or restarts (a new instance id), the ones it still held are known and uploaded
        again to another server (or the restarted one) under the same upload ids. Every take
        acknowledges the one before (ref_server.py, Handouts), so an answer lost on the way is
        handed again; and a group is taken back once: any later copy of an upload id (a slow
        server's first copy, a worker's group that sits on two servers) is dropped. A group whose
        reference forward failed comes back as an error: one group fewer, said on stderr. A group of
        an earlier step that missed its deadline is returned too (its version tells drop_untrainable
        whether it may train)."""
        waiting = {}
        for tensors, meta in groups:
            uid = uuid.uuid4().hex
            waiting[uid] = (tensors, {**meta, "upload_id": uid})
        got = []
        deadline = time.time() + self.timeout
        while waiting:  # past the deadline, groups sent again come back as late ones next step
            sent = self.upload(waiting.values(), version=version, rank=rank)
            back, again = self._pull(sent, rank, deadline)
            got += back
            waiting = {uid: waiting[uid] for uid in again}
        return got + self._extras(rank)

    def _take(self, url, rank, workers=False):
        """(answer, upload id, (tensors, meta) or None for a failed forward) of one GET /get of this
        rank's next group (workers': theirs) from `url`, acknowledging the one it handed us last;
        the upload id None when nothing is ready. Raises TimeoutError as _call does."""
        query = {"rank": rank, "ack": self.acks.get((url, workers), "")}
        if workers:
            query["from"] = "workers"
        r = self._call("GET", url, "/get?" + urlencode(query))
        if r.status_code != 200:
            return r, None, None
        group = None
        if r.headers.get("Content-Type") != "application/json":  # JSON: its forward failed
            group = decode_batch(r.content)
        uid = r.headers.get("X-Upload-Id", "")
        self.acks[(url, workers)] = uid
        return r, uid, group

    def _first_copy(self, uid) -> bool:
        """Whether the group `uid` comes back for the first time (remembered from now on)."""
        if uid in self.received:
            return False
        remember(self.received, uid)
        return True

    def _pull(self, sent, rank, deadline):
        """(groups back, upload ids to send again) of `sent` ({upload_id: (url, instance)})."""
        owed = dict(sent)
        back = []
        again = []
        delay = _POLL_FIRST_S

        # owed groups `url` no longer holds (instance: the live one)
        def take_lost(url, instance=None):
            lost = [
                uid
                for uid, (where, held_by) in owed.items()
                if where == url and held_by != instance
            ]
            for uid in lost:
                del owed[uid]
            return lost

        while owed and time.time() < deadline:
            progress = False
            for url in {url for url, _ in owed.values()}:
                try:
                    r, uid, group = self._take(url, rank)
                except TimeoutError:
                    self._gone(url)
                    again += take_lost(url)
                    continue
                handed = r.status_code == 200
                progress = progress or handed
                if handed and uid not in self.uploaded:  # a leftover of another run on this rank
                    print(
                        f"[rank {rank}] dropped a group this trainer did not upload (an earlier "
                        f"run's), handed over by {url}",
                        file=sys.stderr,
                        flush=True,
                    )
                elif handed and not self._first_copy(uid):  # its other copy came back already
                    print(
                        f"[rank {rank}] dropped a second copy of a group, handed over by {url}",
                        file=sys.stderr,
                        flush=True,
                    )
                elif handed and group is None:  # its forward failed: that group will not come
                    print(
                        f"[rank {rank}] the reference server lost a group: {r.json()['error']}",
                        file=sys.stderr,
                        flush=True,
                    )
                    owed.pop(uid, None)
                elif handed:
                    owed.pop(uid, None)
                    back.append(group)
                lost = take_lost(url, r.headers.get("X-Ref-Instance"))
                if lost:
                    print(
                        f"[rank {rank}] the reference server {url} restarted: {len(lost)} uploaded "
                        "groups were lost with it; uploading them again",
                        file=sys.stderr,
                        flush=True,
                    )
                    again += lost
            if not progress:  # the reference forward is still running; a 204 poll is a tiny request
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
            else:
                delay = _POLL_FIRST_S
        return back, again

    def _extras(self, rank):
        """Up to extra_groups of the groups genonly workers left waiting, from any server answering;
        each upload id once, however many servers hold a copy."""
        extras = []
        for url, _ in self.least_loaded() if self.extra_groups else []:
            while len(extras) < self.extra_groups:
                try:
                    r, uid, group = self._take(url, rank, workers=True)
                except TimeoutError:
                    break
                if r.status_code != 200:
                    break
                if self._first_copy(uid) and group is not None:  # not a failed forward's
                    extras.append(group)
        return extras


def remember(ids: OrderedDict, uid):
    """Add `uid` to a bounded memory of upload ids, the oldest forgotten past _REMEMBERED_IDS."""
    ids[uid] = None
    while len(ids) > _REMEMBERED_IDS:
        ids.popitem(last=False)


def check_reference(url, health, model, tokenizer, allow_mismatch, teacher=False):
    """Stop unless the server at `url` (its /health) holds the model this policy starts from (the
    same vocabulary, config and weights, unless allow_mismatch), or with `teacher` a teacher: any
    model with the same vocabulary. teacher None: either role (a worker, which only samples)."""
    spoken = health.get("wire", 1)  # a server from before the format had a number: 1
    if spoken != WIRE_FORMAT:
        sys.exit(
            f"the server at {url} speaks wire format {spoken}, this trainer {WIRE_FORMAT} "
            "(features/wire.py): restart it from this checkout"
        )
    role = health.get("role", "reference")
    if teacher and role != "teacher":
        sys.exit(
            f"DISTILL_COEF > 0 wants a teacher, but the server at {url} holds {health['model']} "
            "as a reference: start it with TEACHER=1 and the teacher's MODEL_PATH"
        )
    if teacher is False and role == "teacher":  # k3 towards a teacher: the forward KL's gradient
        sys.exit(
            f"the server at {url} holds {health['model']} as a teacher: set DISTILL_COEF > 0 "
            "to distill from it, or restart it without TEACHER for a reference"
        )
    words = health.get("vocabulary")
    if (role == "teacher" or words) and words != vocab_fingerprint(tokenizer):
        sys.exit(
            f"the server at {url} holds {health['model']}, whose vocabulary (hash {words}) is not "
            f"this policy's ({vocab_fingerprint(tokenizer)}): token ids would mean other text "
            "there; a teacher must share the student's tokenizer"
        )
    if role == "teacher":  # any weights and shape; every id of ours must exist there
        if len(tokenizer) > health["vocab_size"]:
            sys.exit(
                f"the teacher at {url} has {health['vocab_size']} output ids, fewer than this "
                f"tokenizer's {len(tokenizer)}"
            )
        return
    vocab = model.get_output_embeddings().weight.shape[0]
    if health["vocab_size"] != vocab or len(tokenizer) > health["vocab_size"]:
        sys.exit(
            f"reference server at {url} holds {health['model']} with vocab {health['vocab_size']}, "
            f"but this policy has vocab {vocab} (tokenizer {len(tokenizer)}): start it with the "
            "same MODEL_PATH"
        )
    ours = model_fingerprint(model)
    differ = [k for k in ours if health["fingerprint"].get(k) != ours[k]]
    if differ and not allow_mismatch:
        sys.exit(
            f"reference server at {url} holds {health['model']}, whose {' and '.join(differ)} "
            "differ "
            f"from this policy's ({health['fingerprint']} against {ours}): start it with the same "
            "MODEL_PATH, or set ALLOW_REF_MISMATCH=1 to train against another reference on purpose"
        )


@dataclass(frozen=True)
class Route:
    """How step 5 runs this run, as the handshake found the servers."""
    exchange: object  # exchange(groups, version, rank) -> the groups pulled back
    regroup: bool  # the server pools completions of older weights: uploads carry pi_old_logps
    keeps_equal: bool  # groups of equal rewards are uploaded too (REGROUP, REWARD_MODEL)


def route_for_run(one_server, *, urls, token, timeout, uses_server, model, tokenizer, teacher,
                  variant_advantages, advantages) -> Route:
    """The run's Route: one_server (the lesson's upload_and_pull) with one plain server; RefClient's
    with several servers, workers' groups or REGROUP; our own groups back without a server. The
    servers' /health is checked first (check_reference). A server that changes rewards (REGROUP,
    a REWARD_MODEL) sends groups back without advantages: advantages(rewards, None) -> (G,) is
    the trainer's step 4, run on them here; a variant's baseline is refused with such a server."""
    from features import worker  # EXTRA_GROUPS: workers' groups come through RefClient

    if not uses_server:  # BETA 0, or LoRA's base as the reference: our own groups come back
        return Route(exchange=own_groups, regroup=False, keeps_equal=False)
    client = RefClient(urls, token, timeout, worker.EXTRA_GROUPS)
    health = client.health(model, tokenizer, ALLOW_REF_MISMATCH, teacher=teacher)
    regroup = bool(health.get("regroup"))
    rescores = regroup or bool(health.get("reward_model"))
    if rescores and variant_advantages:
        sys.exit("the server changes rewards (REGROUP or a REWARD_MODEL), and the advantages are "
                 "redone from them by GRPO's rule: ADVANTAGE, REWARD_NORM and SCALE_REWARDS "
                 "other than GRPO's need a plain server")
    exchange = one_server
    if "," in urls or worker.EXTRA_GROUPS > 0 or regroup:  # RefClient's failover and extras
        exchange = client.upload_and_pull
    if rescores:
        exchange = with_advantages(exchange, advantages)
    return Route(exchange=exchange, regroup=regroup, keeps_equal=rescores)


def with_advantages(exchange, advantages):
    """exchange, with each group that came back without advantages (its rewards changed on the
    server) given them: advantages(rewards, None) -> (G,)."""
    def exchanged(groups, version, rank):
        pulled = exchange(groups, version, rank)
        return [(tensors, meta) if "advantages" in tensors
                else ({**tensors, "advantages": advantages(tensors["scores"], None)}, meta)
                for tensors, meta in pulled]
    return exchanged


def uses_server(*, beta, distill_coef) -> bool:
    """Whether the trainer uses ref_server.py: a teacher (distill_coef > 0), or a reference
    (beta != 0) that is not LoRA's base (features/lora.py)."""
    from features import lora

    return distill_coef > 0 or (beta != 0 and not lora.own_reference())


def own_groups(groups, version, rank) -> list:
    """Step 5 without a server (BETA 0, or LoRA's base as the reference): our own groups, tagged
    with the policy version that sampled them."""
    return [(tensors, {**meta, "version": version}) for tensors, meta in groups]
