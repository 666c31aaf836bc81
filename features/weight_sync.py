"""Weights to generation workers without a shared disk. Trainer rank 0 serves its newest weights
(safetensors, never pickle) over HTTP every WEIGHT_SYNC_STEPS steps; a worker polls, downloads a newer
version in the background while it keeps generating with the old one, resumes a transfer cut halfway
(HTTP Range, pinned to that version), checks the whole file's size and sha256, and only then swaps it
in. There is no endpoint that writes weights: workers only read, with the REF_TOKEN when one is set.

    WEIGHT_SYNC_STEPS=1 WEIGHT_SYNC_HOST=0.0.0.0 deepspeed grpo_ref_split.py           # the trainer
    WEIGHTS_FROM=http://<trainer>:59876 python grpo_ref_split.py genonly              # a worker
"""
import hashlib
import json
import re
import threading

import requests
import torch

from features.http_server import json_errors, start_http
from features.server_guard import token_ok

CHUNK_BYTES = 1 << 16  # read this much at a time: a cut loses at most this much of a download
RANGE = re.compile(r"bytes=(\d+)-$")  # the one Range form a worker sends: from an offset to the end


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
            if not asked.isdigit():
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
            part = body[start:] if start else body  # a copy only for a resumed transfer
            return bottle.HTTPResponse(part, status=206 if start else 200, headers=headers)

        def refuse(status, message):
            raise bottle.HTTPResponse(json.dumps({"error": message}), status=status,
                                      headers={"Content-Type": "application/json"})

        self.stop = start_http(json_errors(app), host, port, threads=4, backlog=64,
                               idle_timeout=60, max_body=1024)

    def publish(self, state_dict: dict, version: int):
        """Serve these weights as `version` from now on; a download of the old one then gets 409."""
        from safetensors.torch import save

        tensors, seen = {}, set()
        for name, t in state_dict.items():
            if t.data_ptr() in seen:  # a tied head is the embedding: sent once, as the model names it
                continue
            seen.add(t.data_ptr())
            tensors[name] = t.detach().to("cpu", copy=True).contiguous()
        body = save(tensors, metadata={"version": str(version)})
        sha = hashlib.sha256(body).hexdigest()
        with self.lock:
            self.current = (version, body, sha)


def start_publisher(model, version, *, rank, every, host, port, token):
    """Rank 0's WeightPublisher serving `model` as `version` (the step it starts from), or None: on
    other ranks, and when every is 0 (workers read OUTPUT_DIR's checkpoints instead)."""
    if rank != 0 or every <= 0:
        return None
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
    """A worker's background download of each newer version; take() hands over a checked one."""

    def __init__(self, url: str, token: str, version: int, *, poll_s=2.0, retry_s=1.0,
                 timeout_s=30.0):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.version = version  # the newest version downloaded and checked
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.ready = None  # (version, state dict) waiting for take()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.counts = {"resumed": 0, "bad_checksum": 0, "replaced": 0}
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
        while not self.stopping.is_set():
            try:
                info = requests.get(self.url + "/weights/info", headers=self.headers,
                                    timeout=self.timeout_s)
                if info.status_code == 200 and info.json()["version"] > self.version:
                    self._download(info.json())
            except (requests.RequestException, ValueError):
                pass  # the trainer is away or the link is down: ask again after poll_s
            self.stopping.wait(self.poll_s)

    def _download(self, info: dict):
        """The whole of version info["version"], resumed where a cut left it; kept only if its size
        and sha256 are the ones announced."""
        from safetensors.torch import load

        body = bytearray()
        while len(body) < info["size"] and not self.stopping.is_set():
            headers = dict(self.headers)
            if body:
                headers["Range"] = f"bytes={len(body)}-"
            try:
                with requests.get(self.url + "/weights", params={"version": info["version"]},
                                  headers=headers, stream=True, timeout=self.timeout_s) as answer:
                    if answer.status_code == 409:  # a newer version replaced it: start over
                        self.counts["replaced"] += 1
                        return
                    if answer.status_code not in (200, 206):
                        raise requests.HTTPError(f"{answer.status_code}: {answer.text[:200]}")
                    if answer.status_code == 200:
                        body.clear()  # a whole answer starts at byte 0
                    for chunk in answer.iter_content(CHUNK_BYTES):
                        body += chunk
                        self.progress = (len(body), info["size"])
            except requests.RequestException:
                self.counts["resumed"] += 1
                self.stopping.wait(self.retry_s)
        if len(body) != info["size"] or hashlib.sha256(body).hexdigest() != info["sha256"]:
            self.counts["bad_checksum"] += 1
            return  # never a mix: the next poll downloads it again from byte 0
        tensors = load(bytes(body))
        with self.lock:
            self.ready = (info["version"], tensors)
        self.version = info["version"]


def swap_in(model, tensors: dict):
    """Load a fetched version into the worker's model in place; every name must be the model's.
    LoRA adapters ("lora_A:<weight>", "lora_B:<weight>") set weight = its base + B @ A, the base
    being the weight as it was before the first adapters came (kept aside, once)."""
    own = dict(model.named_parameters())
    targets = {name.split(":", 1)[1] for name in tensors if name.startswith("lora_A:")}
    plain = {name: value for name, value in tensors.items() if ":" not in name}
    unknown = sorted((set(plain) | targets) - set(own))
    if unknown:
        raise ValueError(f"weights for parameters this model does not have: {unknown[:5]}")
    base = model.__dict__.setdefault("lora_base_weights", {})  # a plain attribute, not a buffer
    with torch.no_grad():
        for name, value in plain.items():
            own[name].copy_(value.to(own[name].dtype))
        for name in targets:
            if name not in base:
                base[name] = own[name].detach().clone()
            delta = tensors[f"lora_B:{name}"].float() @ tensors[f"lora_A:{name}"].float()  # (out, in)
            own[name].copy_((base[name].float() + delta).to(own[name].dtype))
