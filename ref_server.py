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
import sys
import threading
import time
import traceback
import uuid

import bottle
import torch

from grpo_common import (OPTIONAL, UPLOAD_SPEC, apply_env_overrides, completion_logps, decode_batch, encode_batch,
                         group_advantages, model_fingerprint, resolve_model_path)

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
MAX_GROUP_TOKENS = 65536  # rows x length per group (16 answers x 4096 tokens); more gets 413: one forward's memory
QUEUE_SIZE = 64  # groups held (waiting for the forward, or ready) per kind, trainers' and workers'; full -> 503
MAX_QUEUED_BYTES = 2 * 2**30  # bytes held in all queues together; full -> 503 with Retry-After
HTTP_THREADS = 8  # requests handled at once; more wait in the listen backlog (1024 connections)
IDLE_TIMEOUT = 30  # s before an idle or stalled connection (say, a body that never arrives) is closed
REF_MICRO_BATCH = 8  # rows per reference forward: bounds activation memory, not throughput
SHARED_PREFIX = True  # a group's prompt runs once, its KV cache shared by the rows; False = full rows
UPLOAD_IDS = 4096  # upload ids remembered: a retried upload gets its first answer and is never queued twice
# Reward model (a learned reward beside the trainer's rule rewards)
REWARD_MODEL = ""  # AutoModelForSequenceClassification id or folder; "" = none. It scores (question, answer) ...
REWARD_MODEL_WEIGHT = 1.0  # ... and this times its score is added to each answer's reward; advantages are redone here
# Regroup (simple_GRPO's regroup_ver)
REGROUP = False  # True = pool each question's answers; send out groups mixed across uploads with reward variance
REGROUP_POOL = 64  # answers kept per question, oldest dropped first
REGROUP_QUESTIONS = 4096  # questions remembered, the least recently uploaded forgotten first
apply_env_overrides(globals(), "ref_server.py")  # any constant above: `PORT=6000 python ref_server.py`


# ----------------------------------------------------------------------------- the server
class TooLarge(ValueError):
    """An upload over a size limit: 413."""


META_TYPES = {"version": int, "rank": int, "worker": str, "upload_id": str, "regrouped": bool,
              "question": str, "answers": list}  # optional fields; question and answers feed REWARD_MODEL


def validate_group(tensors: dict, meta: dict, vocab_size: int, max_rows: int, max_len: int, max_tokens: int):
    """Raise ValueError (TooLarge for a size limit) naming the first problem in an uploaded group."""
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
    temperature = meta.get("temperature", 1.0)  # below 0.01, logits / T overflow to inf and NaN log-probs
    if type(temperature) not in (int, float) or not 0.01 <= temperature <= 100:
        raise ValueError(f"metadata temperature must be a number in [0.01, 100], got {temperature!r}")
    for name, kind in META_TYPES.items():
        value = meta.get(name)
        if value is not None and (type(value) is not kind or name in ("worker", "upload_id") and len(value) > 200):
            wanted = "a string of at most 200 characters" if kind is str else f"a {kind.__name__}"
            raise ValueError(f"metadata {name} must be {wanted}, got {str(value)[:100]!r}")
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


class RefServer:
    """The queues, the worker thread and the bottle app around one reference model.

    Room is taken when an upload is accepted (QUEUE_SIZE groups per kind, MAX_QUEUED_BYTES in all) and
    given back when its batch is taken, so the forward thread never waits for room: a full queue of
    workers' groups cannot hold up the trainers' ones, and a full server answers 503 at once.
    """

    def __init__(self, model, model_name, token="", queue_size=QUEUE_SIZE, micro_batch=REF_MICRO_BATCH,
                 max_body=MAX_BODY_BYTES, max_rows=MAX_ROWS, regroup=REGROUP, pool_size=REGROUP_POOL,
                 pool_questions=REGROUP_QUESTIONS, max_bytes=MAX_QUEUED_BYTES, max_tokens=MAX_GROUP_TOKENS,
                 reward_model=None, reward_model_name="", reward_model_weight=REWARD_MODEL_WEIGHT):
        self.model, self.model_name, self.token = model, model_name, token
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_len = getattr(model.config, "max_position_embeddings", None) or 2**31
        self.fingerprint = model_fingerprint(model)  # trainers check they start from the same model
        self.micro_batch, self.max_body, self.max_rows, self.max_tokens = micro_batch, max_body, max_rows, max_tokens
        self.queue_size, self.max_bytes = queue_size, max_bytes
        self.reward_model, self.reward_model_name = reward_model, reward_model_name  # (model, tokenizer) or None
        self.reward_model_weight = reward_model_weight
        self.pending = queue.Queue()  # (tensors, meta, kind, nbytes) waiting for the reference forward
        self.ready = queue.Queue()  # (body, content type, nbytes) that trainer ranks generated, waiting for one
        self.ready_workers = queue.Queue()  # ... and those genonly workers generated (meta "worker")
        self.held, self.held_bytes = {"trainers": 0, "workers": 0}, 0  # groups and bytes accepted, not yet taken
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
                                    temperature, self.micro_batch, SHARED_PREFIX).cpu()  # (G, T)

    def reward_scores(self, question, answers):
        """(G,) the reward model's score of each (question, answer) pair, its first logit."""
        model, tokenizer = self.reward_model
        device = next(model.parameters()).device
        enc = tokenizer([question] * len(answers), answers, return_tensors="pt", padding=True, truncation=True)
        with torch.no_grad():
            return model(**enc.to(device)).logits[:, 0].float().cpu()  # (G,)

    def _work(self):
        while not self.stopping.is_set():
            try:
                tensors, meta, kind, nbytes = self.pending.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                tensors["ref_logps"] = self.reference_logps(tensors["input_ids"], meta["plen"],
                                                            meta.get("temperature", 1.0))  # (G, T)
                if not torch.isfinite(tensors["ref_logps"]).all():  # never hand a trainer NaN or inf
                    raise FloatingPointError("the reference forward gave NaN or inf log-probs")
                if self.reward_model is not None:  # the last reward is known here: advantages are redone here
                    scores = self.reward_scores(meta["question"], meta["answers"])  # (G,)
                    tensors["rewards"] = tensors["rewards"] + self.reward_model_weight * scores  # (G,)
                    tensors["advantages"] = group_advantages(tensors["rewards"], len(scores))  # (G,)
                    meta = {**meta, "reward_model_mean": scores.mean().item()}
                item = (encode_batch(tensors, meta), "application/octet-stream", nbytes)
            except Exception as e:  # e.g. out of memory: this group is lost, and whoever takes it next is told
                self.count("ref_errors")
                traceback.print_exc()
                error = {"error": f"the reference forward failed: {e!r}", "upload_id": meta.get("upload_id")}
                item = (json.dumps(error).encode(), "application/json", nbytes)
            (self.ready_workers if kind == "workers" else self.ready).put(item)  # room was taken at upload

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
                | {"version": meta.get("version", 0), "answer": (meta.get("answers") or [None] * g)[i]}
                for i in range(g)]
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
        for name in OPTIONAL:  # gen_logps, sampler_logps: kept when every chosen answer has them
            if all(name in r for r in chosen):
                out[name] = padded(name, tlen, 0.0)  # (G, tlen)
        answers = [r["answer"] for r in chosen]  # each answer's own text, for a REWARD_MODEL
        meta = {k: v for k, v in meta.items() if k != "answers"} | ({"answers": answers} if None not in answers else {})
        return out, {**meta, "version": min(r["version"] for r in chosen), "regrouped": True}

    def _check_token(self):
        if not self.token:
            return
        sent = bottle.request.environ.get("HTTP_AUTHORIZATION", "")  # raw: bottle's decoding fails on non-UTF-8
        if not hmac.compare_digest(sent.encode("latin-1"), f"Bearer {self.token}".encode()):
            self._refuse(401, "missing or wrong token (send 'Authorization: Bearer <REF_TOKEN>')")

    def _refuse(self, status, message, counter="rejected", headers=()):
        self.count(counter)
        raise bottle.HTTPResponse(json.dumps({"error": message}), status=status,
                                  headers={"Content-Type": "application/json", **dict(headers)})

    def _busy(self):
        self._refuse(503, "queue full, retry later", "busy", {"Retry-After": "1"})

    def _read_body(self):
        length = bottle.request.content_length
        if length < 0:
            self._refuse(411, "Content-Length is required")
        if length > self.max_body:
            self._refuse(413, f"body of {length} bytes is over the limit of {self.max_body} (MAX_BODY_BYTES)")
        return bottle.request.environ["wsgi.input"].read(length)

    def _accept(self, tensors, meta, nbytes):
        kind = "workers" if meta.get("worker") else "trainers"
        with self.lock:  # before regrouping: a refused upload must not take answers out of a pool
            room = self.held[kind] < self.queue_size and self.held_bytes + nbytes <= self.max_bytes
            if room:
                self.held[kind] += 1
                self.held_bytes += nbytes
        if not room:
            self._busy()
        group = self.regroup_answers(tensors, meta) if self.regroup else (tensors, meta)
        if group is None:  # pooled: no group with reward variance for this question yet
            self._give_back(kind, nbytes)
        else:
            self.pending.put((*group, kind, nbytes))
        self.count("uploaded")
        return {"ok": True, "groups": int(group is not None), "pending": self.pending.qsize(),
                "instance": self.instance}

    def _give_back(self, kind, nbytes):
        with self.lock:
            self.held[kind] -= 1
            self.held_bytes -= nbytes

    def _build_app(self):
        app = bottle.Bottle()
        app.add_hook("before_request", self._check_token)

        @app.post("/upload")
        def upload():
            body = self._read_body()
            try:
                tensors, meta = decode_batch(body)
                validate_group(tensors, meta, self.vocab_size, self.max_rows, self.max_len, self.max_tokens)
                if self.reward_model is not None and (meta.get("question") is None or meta.get("answers") is None):
                    raise ValueError("this server has a REWARD_MODEL: metadata needs question and answers")
            except ValueError as e:
                self._refuse(413 if isinstance(e, TooLarge) else 400, str(e))
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
                answer = self._accept(tensors, meta, 2 * len(body))  # the tensors, then the encoded batch
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
                body, content_type, nbytes = ready.get_nowait()
            except queue.Empty:
                return bottle.HTTPResponse(status=204, headers=headers)
            self._give_back("workers" if ready is self.ready_workers else "trainers", nbytes)
            if content_type == "application/octet-stream":
                self.count("served")
            return bottle.HTTPResponse(body, status=200, headers={"Content-Type": content_type, **headers})

        @app.get("/health")
        def health():
            with self.lock:
                counters = dict(self.counters)
            return dict(model=self.model_name, vocab_size=self.vocab_size, fingerprint=self.fingerprint,
                        device=str(self.device), reward_model=self.reward_model_name,
                        instance=self.instance, pending=self.pending.qsize(), ready=self.ready.qsize(),
                        ready_workers=self.ready_workers.qsize(), held_bytes=self.held_bytes, regroup=self.regroup,
                        uptime_s=round(time.time() - self.started, 1), **counters)

        def json_error(err):
            bottle.response.content_type = "application/json"
            return json.dumps({"error": f"{err.status}: {err.body}"})

        for status in (400, 404, 405, 500):
            app.error(status)(json_error)
        return app


def serve(server: RefServer, host: str, port: int):
    """Start the forward worker and a waitress HTTP server (bounded threads, a listen backlog of 1024,
    idle connections closed, malformed HTTP answered 400 before bottle sees it); returns stop()."""
    from waitress.server import create_server

    httpd = create_server(server.app, host=host, port=port, threads=HTTP_THREADS, backlog=1024, connection_limit=1024,
                          channel_timeout=IDLE_TIMEOUT, cleanup_interval=max(1, IDLE_TIMEOUT // 3),
                          max_request_body_size=2 * server.max_body + 2**20, ident="ref_server")  # ours says 413 first
    def run():
        try:
            httpd.run()
        except OSError:  # stop() closed the sockets under its select(): the end, not an error
            if not server.stopping.is_set():
                raise

    http = threading.Thread(target=run, name="http", daemon=True)
    server.worker.start()
    http.start()

    def stop():
        server.stopping.set()
        httpd.task_dispatcher.shutdown()
        for channel in list(httpd._map.values()):  # the listening socket too: the loop ends, the port is free
            channel.close()
        http.join(timeout=10)
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
    reward_model = None
    if REWARD_MODEL:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        rm = AutoModelForSequenceClassification.from_pretrained(REWARD_MODEL, dtype=dtype).to(device).eval()
        reward_model = (rm.requires_grad_(False), AutoTokenizer.from_pretrained(REWARD_MODEL))
    server = RefServer(model, MODEL_PATH or "SmolLM2-135M-Instruct (embedded)", token=REF_TOKEN,
                       reward_model=reward_model, reward_model_name=REWARD_MODEL)
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
