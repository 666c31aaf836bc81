"""Reference server: holds the frozen reference model and turns scored groups into ready batches.

Generators POST a scored group to /upload; a worker thread adds the reference model's per-token
log-probs of the completion tokens (ref_logps) and queues it; trainers GET /get to take one
(204 when none is ready). Groups from genonly workers (metadata "worker") wait apart, for
GET /get?from=workers. With REGROUP on, answers are pooled per question and sent out in groups
that have reward variance. The wire format (grpo_common.py) is safetensors with JSON metadata: no
pickle, so a payload can never run code here. Give it its own GPU (or machine):

    python ref_server.py                              # CPU here, the embedded SmolLM2-135M
    CUDA_VISIBLE_DEVICES=7 python ref_server.py       # the usual GPU layout

Every UPPER_CASE constant below can be overridden by an environment variable of the same name.
"""
import collections
import hashlib
import hmac
import json
import queue
import signal
import socketserver
import sys
import threading
import time
import traceback
import uuid
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import bottle
import torch

from grpo_common import (UPLOAD_SPEC, OPTIONAL, apply_env_overrides, completion_logps, decode_batch, encode_batch,
                         group_advantages, resolve_model_path)

# ----------------------------------------------------------------------------- constants
# Model
MODEL_PATH = ""  # hub id or local folder; "" = the embedded SmolLM2-135M-Instruct (GGUF wheel)
# Network
HOST = "127.0.0.1"  # loopback only; "0.0.0.0" serves other machines (set REF_TOKEN then)
PORT = 59875  # TCP port; the trainer's REF_SERVER must point here
REF_TOKEN = ""  # shared secret sent as "Authorization: Bearer ..."; "" = no auth
# Limits (a bad or hostile client can cost at most this much)
MAX_BODY_BYTES = 64 * 2**20  # bytes per upload; larger bodies get 413 before being read
MAX_ROWS = 512  # completions per uploaded group
QUEUE_SIZE = 64  # groups waiting for the reference forward, and ready groups; full -> 503
REF_MICRO_BATCH = 8  # rows per reference forward: bounds activation memory, not throughput
UPLOAD_IDS = 4096  # upload ids remembered: a retried upload gets its first answer and is never queued twice
# Regroup (simple_GRPO's regroup_ver)
REGROUP = False  # True = pool each question's answers; send out groups mixed across uploads with reward variance
REGROUP_POOL = 64  # answers kept per question, oldest dropped first
REGROUP_QUESTIONS = 4096  # questions remembered, the least recently uploaded forgotten first
apply_env_overrides(globals(), "ref_server.py")  # any constant above: `PORT=6000 python ref_server.py`


# ----------------------------------------------------------------------------- the server
def validate_group(tensors: dict, meta: dict, vocab_size: int, max_rows: int) -> None:
    """Raise ValueError naming the first problem in an uploaded group."""
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
    plen = meta.get("plen")
    if not isinstance(plen, int) or isinstance(plen, bool) or not 1 <= plen < l:
        raise ValueError(f"metadata plen must be an int in 1..{l - 1} (sequence length {l}), got {plen!r}")
    temperature = meta.get("temperature", 1.0)  # below 0.01, logits / T overflow to inf and NaN log-probs
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0.01 <= temperature <= 100:
        raise ValueError(f"metadata temperature must be a number in [0.01, 100], got {temperature!r}")
    for name, (dtype, shape) in UPLOAD_SPEC.items():
        if name not in tensors:
            continue
        t = tensors[name]
        if t.dtype != dtype or tuple(t.shape) != shape(g, l, plen):
            raise ValueError(f"{name} must be {dtype} {shape(g, l, plen)}, got {t.dtype} {tuple(t.shape)}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{name} has NaN or inf values")
    upload_id = meta.get("upload_id")
    if upload_id is not None and (not isinstance(upload_id, str) or not 0 < len(upload_id) <= 64):
        raise ValueError(f"metadata upload_id must be a string of 1 to 64 characters, got {upload_id!r}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"input_ids outside the vocabulary [0, {vocab_size}): {ids.min()}..{ids.max()}")


class RefServer:
    """The queues, the worker thread and the bottle app around one reference model."""

    def __init__(self, model, model_name, token="", queue_size=QUEUE_SIZE, micro_batch=REF_MICRO_BATCH,
                 max_body=MAX_BODY_BYTES, max_rows=MAX_ROWS, regroup=REGROUP, pool_size=REGROUP_POOL,
                 pool_questions=REGROUP_QUESTIONS):
        self.model, self.model_name, self.token = model, model_name, token
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.micro_batch, self.max_body, self.max_rows = micro_batch, max_body, max_rows
        self.pending = queue.Queue(queue_size)  # validated groups waiting for the reference forward
        self.ready = queue.Queue(queue_size)  # encoded batches that trainer ranks generated, waiting for one
        self.ready_workers = queue.Queue(queue_size)  # ... and those genonly workers generated (meta "worker")
        self.counters = dict(uploaded=0, served=0, rejected=0, busy=0, ref_errors=0, regrouped=0)
        self.regroup, self.pool_size, self.pool_questions = regroup, pool_size, pool_questions
        self.pools = {}  # REGROUP: question key -> list of answer rows, in upload order
        self.answers = collections.OrderedDict()  # upload_id -> its answer (None while it is being handled)
        self.lock = threading.Lock()
        self.started = time.time()
        self.instance = uuid.uuid4().hex  # changes on restart: clients learn their queued groups are gone
        self.stopping = threading.Event()
        self.worker = threading.Thread(target=self._work, name="ref-forward", daemon=True)
        self.app = self._build_app()

    def count(self, name):
        with self.lock:
            self.counters[name] += 1

    def reference_logps(self, input_ids, plen, temperature):
        """(G, L - plen) reference log-probs of the completion tokens, REF_MICRO_BATCH rows at a time."""
        ids = input_ids.to(self.device)  # (G, L)
        with torch.no_grad():
            return completion_logps(self.model, ids, torch.ones_like(ids), ids.shape[1] - plen,
                                    temperature, self.micro_batch).cpu()  # (G, T)

    def _work(self):
        while not self.stopping.is_set():
            try:
                tensors, meta = self.pending.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                tensors["ref_logps"] = self.reference_logps(tensors["input_ids"], meta["plen"],
                                                            meta.get("temperature", 1.0))  # (G, T)
                if not torch.isfinite(tensors["ref_logps"]).all():  # never hand a trainer NaN or inf
                    raise FloatingPointError("the reference forward gave NaN or inf log-probs")
                batch = encode_batch(tensors, meta)
            except Exception:  # e.g. out of memory: lose this group, keep serving the others
                self.count("ref_errors")
                traceback.print_exc()
                continue
            while not self.stopping.is_set():  # blocks while trainers are behind: backpressure
                try:
                    (self.ready_workers if meta.get("worker") else self.ready).put(batch, timeout=0.2)
                    break
                except queue.Full:
                    continue

    def regroup_answers(self, tensors, meta):
        """REGROUP: add this upload's answers to its question's pool, and take out a group of as
        many answers, with different rewards and fresh advantages, when the pool has one; else None.

        A question whose answers all scored the same (no signal on its own) still teaches once a
        later upload brings a different reward. Answers leave the pool when sent: none is trained
        twice. Each keeps its own gen_logps, so the clipped ratio stays right for older answers.
        """
        g, plen = tensors["input_ids"].shape[0], meta["plen"]
        prompt = tensors["input_ids"][0, :plen]  # (plen,) one prompt per group: the question's identity
        key = (hashlib.sha256(prompt.numpy().tobytes()).hexdigest(), meta.get("temperature", 1.0))
        rows = [{name: t[i] for name, t in tensors.items() if name != "advantages"}  # recomputed per new group
                | {"version": meta.get("version", 0)} for i in range(g)]
        with self.lock:
            pool = (self.pools.pop(key, []) + rows)[-self.pool_size :]
            rewards = torch.stack([r["rewards"] for r in pool])  # (n,)
            picked = []
            if len(pool) >= g and rewards.unique().numel() > 1:
                order = torch.randperm(len(pool)).tolist()
                picked = order[:g]
                if rewards[picked].unique().numel() == 1:  # swap in one answer with another reward
                    picked[-1] = next(i for i in order[g:] if rewards[i] != rewards[picked[0]])
                self.counters["regrouped"] += 1
            chosen = [pool[i] for i in picked]
            pool = [r for i, r in enumerate(pool) if i not in picked]
            if pool:
                self.pools[key] = pool  # re-inserted last: dicts keep order, so the first key is the stalest
            while len(self.pools) > self.pool_questions:
                self.pools.pop(next(iter(self.pools)))
        if not chosen:
            return None
        tlen = max(len(r["completion_mask"]) for r in chosen)  # answers from several uploads: pad to the longest

        def padded(name, width, fill):  # (G, width)
            return torch.stack([torch.cat([r[name], r[name].new_full((width - len(r[name]),), fill)]) for r in chosen])

        out = dict(input_ids=padded("input_ids", plen + tlen, 0),  # (G, plen + tlen) the padding is masked out
                   completion_mask=padded("completion_mask", tlen, False),  # (G, tlen)
                   rewards=torch.stack([r["rewards"] for r in chosen]))  # (G,)
        out["advantages"] = group_advantages(out["rewards"], g)  # (G,) relative to this new group
        if all("gen_logps" in r for r in chosen):
            out["gen_logps"] = padded("gen_logps", tlen, 0.0)  # (G, tlen)
        return out, {**meta, "version": min(r["version"] for r in chosen), "regrouped": True}

    def _check_token(self):
        if not self.token:
            return
        sent = bottle.request.get_header("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self.token}".encode()):
            self._refuse(401, "missing or wrong token (send 'Authorization: Bearer <REF_TOKEN>')")

    def _refuse(self, status, message, counter="rejected", headers=()):
        self.count(counter)
        raise bottle.HTTPResponse(json.dumps({"error": message}), status=status,
                                  headers={"Content-Type": "application/json", **dict(headers)})

    def _busy(self):
        self._refuse(503, "queue full, retry later", "busy", {"Retry-After": "1"})

    def _read_body(self):
        length = bottle.request.content_length
        if length < 0 or "chunked" in bottle.request.get_header("Transfer-Encoding", "").lower():
            self._refuse(411, "Content-Length is required")
        if length > self.max_body:
            self._refuse(413, f"body of {length} bytes is over the limit of {self.max_body} (MAX_BODY_BYTES)")
        return bottle.request.environ["wsgi.input"].read(length)

    def _accept(self, tensors, meta):
        if self.pending.full():  # before regrouping: a refused upload must not take answers out of a pool
            self._busy()
        group = self.regroup_answers(tensors, meta) if self.regroup else (tensors, meta)
        if group is not None:  # None: pooled, no group with reward variance for this question yet
            try:
                self.pending.put_nowait(group)
            except queue.Full:
                self._busy()
        self.count("uploaded")
        return {"ok": True, "groups": int(group is not None), "pending": self.pending.qsize(),
                "instance": self.instance}

    def _build_app(self):
        app = bottle.Bottle()
        app.add_hook("before_request", self._check_token)

        @app.post("/upload")
        def upload():
            body = self._read_body()
            try:
                tensors, meta = decode_batch(body)
                validate_group(tensors, meta, self.vocab_size, self.max_rows)
            except ValueError as e:
                self._refuse(400, str(e))
            uid = meta.get("upload_id")  # a client's retry of an upload whose answer it never read
            with self.lock:
                first = self.answers.get(uid, "new") if uid else "none"
                if first == "new":
                    self.answers[uid] = None
                    while len(self.answers) > UPLOAD_IDS:
                        self.answers.popitem(last=False)
            if first is None:  # the first try is still being handled: the next retry gets its answer
                self._busy()
            if isinstance(first, dict):
                return first
            try:
                answer = self._accept(tensors, meta)
            except bottle.HTTPResponse:  # refused (503): a retry must be handled anew
                with self.lock:
                    self.answers.pop(uid, None)
                raise
            if uid:
                with self.lock:
                    self.answers[uid] = answer
            return answer

        @app.get("/get")
        def get():
            headers = {"X-Ref-Instance": self.instance}
            ready = self.ready_workers if bottle.request.query.get("from") == "workers" else self.ready
            if bottle.request.method == "HEAD":  # bottle routes HEAD here too: answer, but take nothing
                return bottle.HTTPResponse(status=200 if ready.qsize() else 204, headers=headers)
            try:  # workers' groups are kept apart so a trainer rank never takes another rank's group as an extra
                batch = ready.get_nowait()
            except queue.Empty:
                return bottle.HTTPResponse(status=204, headers=headers)
            self.count("served")
            return bottle.HTTPResponse(batch, status=200,
                                       headers={"Content-Type": "application/octet-stream", **headers})

        @app.get("/health")
        def health():
            with self.lock:
                counters = dict(self.counters)
            return dict(model=self.model_name, vocab_size=self.vocab_size, device=str(self.device),
                        instance=self.instance, pending=self.pending.qsize(), ready=self.ready.qsize(),
                        ready_workers=self.ready_workers.qsize(), regroup=self.regroup,
                        uptime_s=round(time.time() - self.started, 1), **counters)

        def json_error(err):
            bottle.response.content_type = "application/json"
            return json.dumps({"error": f"{err.status}: {err.body}"})

        for status in (400, 404, 405, 500):
            app.error(status)(json_error)
        return app


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck client never keeps the process alive
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, code="-", size="-"):
        if str(code)[:1] == "4":  # only refusals; 200/204/503 are the normal polling answers
            super().log_request(code, size)


def serve(server: RefServer, host: str, port: int):
    """Start the forward worker and an HTTP thread; returns a stop() that ends both (and frees the port)."""
    httpd = make_server(host, port, server.app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
    server.worker.start()
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()

    def stop():
        server.stopping.set()
        httpd.shutdown()
        httpd.server_close()
        server.worker.join(timeout=10)

    return stop


def exposure_warning(host: str, token: str) -> str | None:
    """A warning when the server is reachable beyond this machine with no token to guard it."""
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.") or token:
        return None
    return f"WARNING: serving on {host} without REF_TOKEN: anyone who reaches this port can upload and read batches"


def main():
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(MODEL_PATH)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    warning = exposure_warning(HOST, REF_TOKEN)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    server = RefServer(model, MODEL_PATH or "SmolLM2-135M-Instruct (embedded)", token=REF_TOKEN)
    stop = serve(server, HOST, PORT)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print(f"reference server ready on http://{HOST}:{PORT} ({path}, {device}, vocab {server.vocab_size})", flush=True)
    while not done.wait(1.0):
        pass
    print("shutting down", flush=True)
    stop()


if __name__ == "__main__":
    main()
