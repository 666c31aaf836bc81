"""Weights to generation workers without a shared disk. Trainer rank 0 serves its newest weights
(safetensors, never pickle) over HTTP every WEIGHT_SYNC_STEPS steps; a worker polls, downloads a
newer version in the background while it keeps generating with the old one, resumes a transfer cut
halfway (HTTP Range, pinned to that version), checks the whole file's size and sha256, and only then
swaps it in. There is no endpoint that writes weights: workers only read, with the REF_TOKEN when
one is set. Every client is served from the one published buffer (no copy per download), and a
client that never finishes its request loses its connection. A worker trusts nothing it reads: the
info document, the size (bounded by its own weights'), the body (capped, identity encoding, an
overall deadline, no redirects) and every tensor (name, shape, dtype, finite) are checked before the
first copy.

    WEIGHT_SYNC_STEPS=1 WEIGHT_SYNC_HOST=0.0.0.0 deepspeed grpo_ref_split.py           # the trainer
    WEIGHTS_FROM=http://<trainer>:59876 python grpo_ref_split.py genonly              # a worker
"""
import hashlib
import io
import json
import re
import sys
import threading
import time

import requests
import torch
import urllib3

from features import env_overrides
from features.http_server import json_errors, start_http, token_ok, warn_if_exposed

WEIGHT_SYNC_STEPS = 0  # > 0: rank 0 serves its weights to workers this often; 0 = step_N on disk
WEIGHT_SYNC_HOST = "127.0.0.1"  # where rank 0 serves them; "0.0.0.0" for other machines
WEIGHT_SYNC_PORT = 59876  # the port it serves them on
WEIGHTS_FROM = ""  # a worker: the trainer's http://host:WEIGHT_SYNC_PORT; "" = OUTPUT_DIR's step_N
PER_ADDRESS = 8  # connections one IP address may hold on the publisher (of its 64); 0 = no limit
env_overrides.apply_env_overrides(globals(), "features/weight_sync.py")


CHUNK_BYTES = 1 << 16  # read this much at a time: a cut loses at most this much of a download
MAX_DIGITS = 18  # a version or a Range offset: ASCII digits, at most this many (below 2**63)
RANGE = re.compile(r"bytes=([0-9]{1,%d})-$" % MAX_DIGITS)  # the one Range form a worker sends
MAX_INFO_BYTES = 4096  # /weights/info is a small JSON object; a longer answer is refused
MIN_RATE = 2**20  # bytes/s a transfer must average (after its grace time) or it is given up
MAX_BACKOFF_S = 60.0  # a worker refused or cut short waits twice as long each time, up to this
TRANSIENT = (requests.RequestException, urllib3.exceptions.HTTPError, OSError)  # link or peer away


class Refused(ValueError):
    """What a weight server sent cannot be used: malformed, too large, too slow, not the model's."""


class WeightPublisher:
    """Rank 0's read-only weight server: GET /weights/info and GET /weights?version=N."""

    def __init__(self, host: str, port: int, token: str):
        import bottle

        self.token = token
        self.lock = threading.Lock()
        self.current = None  # (version, safetensors bytes, sha256 hex) once published
        app = bottle.Bottle()

        @app.hook("before_request")
        def check_token():
            if not token_ok(bottle.request.environ.get("HTTP_AUTHORIZATION", ""), self.token):
                refuse(401, "missing or wrong token (send 'Authorization: Bearer <REF_TOKEN>')")

        @app.get("/weights/info")
        def info():
            with self.lock:
                current = self.current
            if current is None:
                refuse(404, "no weights published yet")
            version, body, sha = current
            return {"version": version, "size": len(body), "sha256": sha}

        @app.get("/weights")
        def weights():
            with self.lock:
                current = self.current
            asked = bottle.request.query.get("version", "")
            if not (asked.isascii() and asked.isdigit() and len(asked) <= MAX_DIGITS):
                refuse(400, "give the version you want: /weights?version=N (from /weights/info)")
            if current is None or int(asked) != current[0]:
                refuse(409, f"version {asked} is not the one served now: read /weights/info again")
            version, body, sha = current
            start = 0
            header = bottle.request.environ.get("HTTP_RANGE")
            if header is not None:
                match = RANGE.match(header)
                if match is None or int(match.group(1)) >= len(body):
                    refuse(416, f"Range must be 'bytes=N-' with N below {len(body)}")
                start = int(match.group(1))
            headers = {"Content-Type": "application/octet-stream", "X-Version": str(version),
                       "X-Sha256": sha, "Accept-Ranges": "bytes"}
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
            headers["Content-Length"] = str(len(body) - start)
            view = io.BytesIO(body)  # shares the published bytes: waitress reads it as a file
            view.seek(start)
            return bottle.HTTPResponse(view, status=206 if start else 200, headers=headers)

        def refuse(status, message):
            raise bottle.HTTPResponse(json.dumps({"error": message}), status=status,
                                      headers={"Content-Type": "application/json"})

        self.stop = start_http(json_errors(app), host, port, threads=4, backlog=64,
                               idle_timeout=10, max_body=1024, per_address=PER_ADDRESS)

    def publish(self, state_dict: dict, version: int):
        """Serve these weights as `version` from now on; a download of the old one then gets 409."""
        from safetensors.torch import save

        tensors = {}
        seen = set()
        for name, t in state_dict.items():
            # a tied head is the embedding: sent once, as the model names it
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            tensors[name] = t.detach().to("cpu", copy=True).contiguous()
        body = save(tensors, metadata={"version": str(version)})
        sha = hashlib.sha256(body).hexdigest()
        with self.lock:
            self.current = (version, body, sha)


def publisher_from(model, version, rank, token):
    """start_publisher with this module's WEIGHT_SYNC_STEPS, _HOST and _PORT; token: REF_TOKEN."""
    return start_publisher(model, version, rank=rank, every=WEIGHT_SYNC_STEPS,
                           host=WEIGHT_SYNC_HOST, port=WEIGHT_SYNC_PORT, token=token)


def start_publisher(model, version, *, rank, every, host, port, token):
    """Rank 0's WeightPublisher serving `model` as `version` (the step it starts from), or None: on
    other ranks, and when every is 0 (workers read OUTPUT_DIR's checkpoints instead)."""
    if rank != 0 or every <= 0:
        return None
    warn_if_exposed(host, token, "download the trained weights")
    publisher = WeightPublisher(host, port, token)
    with torch.no_grad():
        publisher.publish(policy_weights(model), version)
    print(f"weights for workers: http://{host}:{port}/weights (every {every} steps)", flush=True)
    return publisher


def policy_weights(model) -> dict:
    """What a worker loads: the trained weights under the plain model's names, each once (a tied
    embedding and head are one tensor). LoRA: the adapters alone, "lora_A:<weight>" and
    "lora_B:<weight>" with B already times the adapter's scaling, so the worker adds B @ A to
    the base weight it holds (about 1% of the bytes)."""
    if not hasattr(model, "get_base_model"):
        return dict(model.named_parameters())
    from peft.tuners.lora import LoraLayer

    adapters = {}
    for name, layer in model.get_base_model().named_modules():
        if isinstance(layer, LoraLayer):
            adapter = layer.active_adapters[0]
            weight = f"{name}.weight"
            adapters[f"lora_A:{weight}"] = layer.lora_A[adapter].weight
            adapters[f"lora_B:{weight}"] = layer.lora_B[adapter].weight * layer.scaling[adapter]
    return adapters


def publish_every(publisher, model, step: int, every: int):
    """After step `step`: publish the weights as version `step` when it is a multiple of `every`
    (rank 0 holds the publisher; other ranks pass None)."""
    if publisher is not None and every > 0 and step % every == 0:
        with torch.no_grad():
            publisher.publish(policy_weights(model), step)


class WeightFetcher:
    """A worker's background download of each newer version; take() hands over a checked one.
    max_bytes: the largest file it accepts (weights_budget of its own model); check(tensors): raises
    ValueError when they cannot go into its model (check_weights), before take() sees them."""

    def __init__(self, url: str, token: str, version: int, *, max_bytes: int, check=None,
                 poll_s=2.0, retry_s=1.0, timeout_s=30.0, min_rate=MIN_RATE, grace_s=60.0):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.headers["Accept-Encoding"] = "identity"  # never a compressed body (a gzip bomb)
        self.version = version  # the newest version downloaded and checked
        self.max_bytes = max_bytes
        self.check = check
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.min_rate = min_rate  # a transfer's deadline: grace_s + its size / min_rate
        self.grace_s = grace_s
        self.ready = None  # (version, state dict) waiting for take()
        self.refused_sha = None  # a file refused once is not downloaded again
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.counts = {"resumed": 0, "bad_checksum": 0, "replaced": 0, "refused": 0}
        self.progress = (0, 0)  # (bytes downloaded, bytes in all) of the transfer under way
        self.thread = threading.Thread(target=self._run, name="weights", daemon=True)
        self.thread.start()

    def take(self):
        """(version, state dict) of a newer checked version, once; None if there is none yet."""
        with self.lock:
            ready = self.ready
            self.ready = None
        return ready

    def stop(self):
        self.stopping.set()
        self.thread.join(timeout=10)

    def _run(self):
        """Poll forever: a refused or cut answer is said, counted and waited out (longer each time,
        up to MAX_BACKOFF_S); nothing a server sends ends this thread."""
        wait_s = self.poll_s
        while not self.stopping.is_set():
            try:
                info = self._info()
                if info["version"] > self.version and info["sha256"] != self.refused_sha:
                    self._download(info)
                wait_s = self.poll_s
            except TRANSIENT:  # the trainer is away or the link is down: ask again later
                wait_s = min(max(wait_s, self.retry_s) * 2, MAX_BACKOFF_S)
            except Exception as e:  # Refused, or anything a hostile answer could raise
                self.counts["refused"] += 1
                print(f"[weights] refused what {self.url} sent: {str(e)[:300]}; keeping version "
                      f"{self.version}", file=sys.stderr, flush=True)
                wait_s = min(max(wait_s, self.retry_s) * 2, MAX_BACKOFF_S)
            self.stopping.wait(wait_s)

    def _get(self, path, **kwargs):
        answer = requests.get(self.url + path, headers=kwargs.pop("headers", self.headers),
                              stream=True, timeout=self.timeout_s, allow_redirects=False, **kwargs)
        if 300 <= answer.status_code < 400:
            answer.close()
            raise Refused(f"a redirect ({answer.status_code}) from {path}: not followed")
        return answer

    def _info(self) -> dict:
        """/weights/info checked: {"version": int >= 0, "size": 1..max_bytes, "sha256": hex}."""
        with self._get("/weights/info") as answer:
            if answer.status_code != 200:
                return {"version": -1, "size": 0, "sha256": ""}  # none published yet
            body = read_capped(answer, MAX_INFO_BYTES, time.time() + self.timeout_s)
        try:
            info = json.loads(body)
        except (ValueError, RecursionError):
            raise Refused(f"/weights/info is not JSON: {bytes(body[:80])!r}") from None
        if not isinstance(info, dict):
            raise Refused(f"/weights/info is not a JSON object: {type(info).__name__}")
        version = info.get("version")
        size = info.get("size")
        sha = info.get("sha256")
        if type(version) is not int or not 0 <= version < 2**63:
            raise Refused(f"/weights/info version must be an int in 0..2**63-1, "
                          f"got {version!r:.40}")
        if type(size) is not int or not 0 < size <= self.max_bytes:
            raise Refused(f"/weights/info size must be an int in 1..{self.max_bytes} (this "
                          f"worker's weights), got {size!r:.40}")
        if not (isinstance(sha, str) and re.fullmatch("[0-9a-f]{64}", sha)):
            raise Refused(f"/weights/info sha256 must be 64 hex digits, got {sha!r:.80}")
        return {"version": version, "size": size, "sha256": sha}

    def _download(self, info: dict):
        """The whole of version info["version"], resumed where a cut left it, within its deadline;
        kept only if its size and sha256 are the ones announced and check() accepts it."""
        from safetensors.torch import load

        body = bytearray()
        deadline = time.time() + self.grace_s + info["size"] / self.min_rate
        wait_s = self.retry_s
        while len(body) < info["size"] and not self.stopping.is_set():
            if time.time() > deadline:
                raise Refused(f"version {info['version']} not whole by its deadline "
                              f"({len(body)} of {info['size']} bytes)")
            headers = dict(self.headers)
            if body:
                headers["Range"] = f"bytes={len(body)}-"
            try:
                with self._get("/weights", params={"version": info["version"]},
                               headers=headers) as answer:
                    if answer.status_code == 409:  # a newer version replaced it: start over
                        self.counts["replaced"] += 1
                        return
                    if answer.status_code not in (200, 206):  # its body is not read: unbounded
                        raise requests.HTTPError(f"/weights answered {answer.status_code}")
                    if answer.status_code == 200:
                        body.clear()  # a whole answer starts at byte 0
                    read_capped(answer, info["size"], deadline, into=body, progress=self)
            except TRANSIENT:  # cut short: resume after a pause, longer each time
                self.counts["resumed"] += 1
                self.stopping.wait(wait_s)
                wait_s = min(wait_s * 2, MAX_BACKOFF_S)
        if len(body) != info["size"] or hashlib.sha256(body).hexdigest() != info["sha256"]:
            self.counts["bad_checksum"] += 1
            return  # never a mix: the next poll downloads it again from byte 0
        try:
            tensors = load(bytes(body))
            if self.check is not None:
                self.check(tensors)
        except Exception as e:  # not safetensors, or not this model's weights
            self.refused_sha = info["sha256"]
            raise Refused(f"version {info['version']}: {str(e)[:300]}") from None
        with self.lock:
            self.ready = (info["version"], tensors)
        self.version = info["version"]


def read_capped(answer, limit: int, deadline: float, into=None, progress=None) -> bytearray:
    """The raw body of a streamed `answer`, appended to `into`, refused (Refused) past `limit` bytes
    in all, past `deadline`, or in any encoding but identity. Each read returns what has arrived, so
    a trickle cannot hold it past the deadline longer than one read's socket timeout."""
    body = bytearray() if into is None else into
    encoding = answer.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
        raise Refused(f"a body in {encoding[:40]!r} encoding; asked for identity")
    while True:
        if time.time() > deadline:
            raise Refused(f"an answer still coming at its deadline ({len(body)} bytes)")
        chunk = answer.raw.read1(CHUNK_BYTES, decode_content=False)
        if not chunk:
            return body
        if len(body) + len(chunk) > limit:
            raise Refused(f"an answer longer than the {limit} bytes expected")
        body += chunk
        if progress is not None:
            progress.progress = (len(body), limit)


def weights_budget(model) -> int:
    """The largest weight file a worker with `model` accepts: every parameter in float32, plus a
    safetensors header allowance. A LoRA file of adapters is far below it."""
    params = list(model.parameters())
    return sum(4 * p.numel() for p in params) + 2**20 + 1024 * len(params)


def check_weights(model, tensors: dict):
    """Raise ValueError naming the first reason `tensors` cannot go into `model` whole: a file is
    either every parameter under the model's names, or LoRA adapters ("lora_A:<weight>" (r, in) and
    "lora_B:<weight>" (out, r) in pairs) of its 2-D weights; floating dtypes, finite values."""
    own = dict(model.named_parameters())
    if not tensors:
        raise ValueError("a weight file with no tensors")
    for name, value in tensors.items():
        if not value.is_floating_point():
            raise ValueError(f"{name[:100]} is {value.dtype}; weights are floating point")
        if not torch.isfinite(value).all():
            raise ValueError(f"{name[:100]} has NaN or inf values")
    adapters = {name for name in tensors if ":" in name}
    if adapters and len(adapters) != len(tensors):
        raise ValueError("a weight file mixes LoRA adapters and whole parameters")
    if not adapters:
        unknown = sorted(set(tensors) - set(own))
        missing = sorted(set(own) - set(tensors))
        if unknown or missing:
            raise ValueError(f"not this model's parameters: unknown {unknown[:3]}, missing "
                             f"{missing[:3]} ({len(unknown)} and {len(missing)} in all)")
        for name, value in tensors.items():
            if value.shape != own[name].shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)}, the model's is "
                                 f"{tuple(own[name].shape)}")
        return
    for name in adapters:
        kind, _, weight = name.partition(":")
        if kind not in ("lora_A", "lora_B") or weight not in own or own[weight].dim() != 2:
            raise ValueError(f"{name[:100]} names no LoRA adapter of this model's 2-D weights")
        if f"lora_A:{weight}" not in tensors or f"lora_B:{weight}" not in tensors:
            raise ValueError(f"{weight}: lora_A and lora_B come in pairs")
        a = tensors[f"lora_A:{weight}"]
        b = tensors[f"lora_B:{weight}"]
        out_features, in_features = own[weight].shape
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (
                out_features, a.shape[0]):
            raise ValueError(f"{weight}: adapters {tuple(a.shape)} and {tuple(b.shape)} do not "
                             f"make its {tuple(own[weight].shape)}")


def swap_in(model, tensors: dict):
    """Load a fetched version into the worker's model in place, all or nothing: check_weights first,
    so a refused file changes no parameter. LoRA adapters ("lora_A:<weight>", "lora_B:<weight>") set
    weight = its base + B @ A, the base being the weight as it was before the first adapters came
    (kept aside, once)."""
    check_weights(model, tensors)
    own = dict(model.named_parameters())
    targets = {name.split(":", 1)[1] for name in tensors if name.startswith("lora_A:")}
    base = model.__dict__.setdefault("lora_base_weights", {})  # a plain attribute, not a buffer
    with torch.no_grad():
        for name, value in tensors.items():
            if ":" not in name:
                own[name].copy_(value.to(own[name].dtype))
        for name in targets:
            if name not in base:
                base[name] = own[name].detach().clone()
            # (out, in)
            delta = tensors[f"lora_B:{name}"].float() @ tensors[f"lora_A:{name}"].float()
            own[name].copy_((base[name].float() + delta).to(own[name].dtype))
