"""The reference server over real HTTP on loopback, with a tiny random model in this process."""
import json
import os
import pickle
import struct
import time

import pytest
import requests
import torch

import grpo_ref_split as grpo
from conftest import (
    VOCAB,
    fail_first_forward,
    free_port,
    group,
    pull,
    start,
    stop,
    upload_and_pull,
    wait_for,
)
from features.env_overrides import apply_env_overrides
from features.fingerprint import model_fingerprint
from features.fast_paths import completion_logps
from features.server_client import ServerError, request_with_retry, with_advantages
from features.wire import MAX_META_CHARS, decode_batch, encode_batch
import ref_server
from ref_server import RefServer


@pytest.fixture(scope="module")
def live(model):
    server, httpd, url = start(
        model, queue_size=8, max_body_bytes=200_000, max_rows=16, max_group_tokens=6000
    )
    yield server, url
    stop(server, httpd)


# ----------------------------------------------------------------------------- correct results
def test_health(live, model):
    """/health's values, not only its keys: what the server holds, its queues and its counters, read
    back against the server object itself (other tests of this module may have run first)."""
    server, url = live
    h = requests.get(url + "/health", timeout=5).json()
    assert h["vocab_size"] == VOCAB and h["device"] == "cpu" and h["model"] == "tiny"
    assert h["wire"] == 2  # the reward sums travel as "scores" (features/wire.py)
    assert h["fingerprint"] == model_fingerprint(model) and h["instance"] == server.instance
    assert h["reward_model"] == "" and h["regroup"] is False and h["regrouped"] == 0
    assert h["pending"] == server.pending.qsize() and h["ready"] == server.queue_of(0).qsize()
    assert h["ready_workers"] == 0 and h["held_bytes"] == server.room.held_bytes
    assert {k: h[k] for k in server.counters} == server.counters
    assert 0 <= h["uptime_s"] <= time.time() - server.started + 1
    before = dict(server.counters)
    body = encode_batch(*group(seed=11))
    assert requests.post(url + "/upload", data=body, timeout=10).status_code == 200
    wait_for(lambda: server.queue_of(0).qsize() == 1)
    # one group ready, not yet taken: its room is held
    h = requests.get(url + "/health", timeout=5).json()
    assert (
        h["uploaded"] == before["uploaded"] + 1
        and h["ready"] == 1
        and h["held_bytes"] == 2 * len(body)
    )
    pull(url)
    h = requests.get(url + "/health", timeout=5).json()
    # taken: room back
    assert h["served"] == before["served"] + 1 and h["ready"] == 0 and h["held_bytes"] == 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_logps_equal_a_direct_computation(live, model, temperature):
    server, url = live
    tensors, meta = group(G=5, plen=6, tc=7, seed=3, temperature=temperature, group_id="abc")
    back, back_meta = upload_and_pull(url, tensors, meta)
    assert back_meta == meta  # free metadata fields travel through untouched
    for k in tensors:
        assert torch.equal(back[k], tensors[k])
    with torch.no_grad():
        # (G, 7, V) predicts completion
        logits = model(tensors["input_ids"]).logits[:, 5:-1] / temperature
        want = (
            torch.log_softmax(logits, -1).gather(-1, tensors["input_ids"][:, 6:, None]).squeeze(-1)
        )
    assert back["ref_logps"].shape == (5, 7)
    assert torch.allclose(back["ref_logps"], want, atol=1e-5)


def test_a_mask_with_holes_comes_back_unchanged_with_every_positions_logps(live, model):
    """TOOLS: the toolkit's <result> tokens are False inside completion_mask. The server computes
    log-probs over the whole row (the results are context for what follows) and hands the mask back
    as it came."""
    server, url = live
    tensors, meta = group(G=3, plen=4, tc=8, seed=21)
    tensors["completion_mask"][:, 2:5] = False  # a result in the middle of each answer
    tensors["completion_mask"][1, 7] = False
    back, _ = upload_and_pull(url, tensors, meta)
    assert torch.equal(back["completion_mask"], tensors["completion_mask"])
    with torch.no_grad():
        ids = tensors["input_ids"]
        # (3, 8)
        want = (
            torch.log_softmax(model(ids).logits[:, 3:-1], -1)
            .gather(-1, ids[:, 4:, None])
            .squeeze(-1)
        )
    assert torch.allclose(back["ref_logps"], want, atol=1e-5)


def test_trainer_batch_of_padded_groups_gets_the_servers_logps(live, model):
    """The trainer left-pads prompts and right-pads completions; positions must not shift."""
    server, url = live
    batches = [upload_and_pull(url, *group(G=2, plen=p, tc=t, seed=p)) for p, t in [(3, 6), (8, 2)]]
    b = grpo.collate(batches, pad_id=0)
    with torch.no_grad():
        got = completion_logps(
            model,
            b.input_ids,
            b.attention_mask,
            b.mask.shape[1],
            1.0,
            chunk=grpo.fast_paths.LOGP_CHUNK,
            from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
        )
    assert torch.allclose(got[:2], batches[0][0]["ref_logps"], atol=1e-5)
    assert torch.allclose(got[2:, :2], batches[1][0]["ref_logps"], atol=1e-5)


def test_micro_batches_give_the_same_logps(model):
    """REF_MICRO_BATCH rows at a time, and all at once: both equal log_softmax of the model's own
    logits."""
    tensors, meta = group(G=7, plen=4, tc=5, seed=9)
    ids = tensors["input_ids"]
    with torch.no_grad():
        # (7, 5)
        want = (
            torch.log_softmax(model(ids).logits[:, 3:-1], -1)
            .gather(-1, ids[:, 4:, None])
            .squeeze(-1)
        )
    for micro_batch in (0, 2, 3):
        got = RefServer(model, "t", ref_micro_batch=micro_batch).reference_logps(ids, 4, 1.0)
        assert torch.allclose(got, want, atol=1e-5), micro_batch


# ----------------------------------------------------------------------------- bad input
def safetensors_with_header(header: dict, payload=b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = "/tmp/grpo_ref_server_pwned"


def mutate(**changes):
    """A valid group with some tensors replaced (None removes one) or metadata changed."""
    tensors, meta = group()
    for k, v in changes.items():
        if k.startswith("meta_"):
            meta[k[5:]] = v
        elif v is None:
            del tensors[k]
        else:
            tensors[k] = v(tensors[k]) if callable(v) else v
    return encode_batch(tensors, meta)


BAD = {
    "empty body": (b"", 400, "no header"),
    "random bytes": (os.urandom(64), 400, "not safetensors"),
    "truncated safetensors": (encode_batch(*group())[:-10], 400, "not safetensors"),
    "pickle payload": (pickle.dumps(Evil()), 400, "not safetensors"),
    "torch.save payload": (None, 400, "not safetensors"),  # filled in below
    "metadata not JSON": (
        safetensors_with_header({"__metadata__": {"json": "{plen: 3"}}),
        400,
        "metadata is not JSON",
    ),
    "metadata not an object": (
        safetensors_with_header({"__metadata__": {"json": "[1, 2]"}}),
        400,
        "JSON object",
    ),
    "missing input_ids": (mutate(input_ids=None), 400, "missing tensors: ['input_ids']"),
    "missing advantages": (mutate(advantages=None), 400, "missing tensors: ['advantages']"),
    "unexpected tensor": (mutate(extra=torch.zeros(2)), 400, "unexpected tensors: ['extra']"),
    "int32 ids": (mutate(input_ids=lambda t: t.int()), 400, "input_ids must be 2-D int64"),
    "1-D ids": (mutate(input_ids=lambda t: t.flatten()), 400, "input_ids must be 2-D int64"),
    "float64 advantages": (
        mutate(advantages=lambda t: t.double()),
        400,
        "advantages must be torch.float32",
    ),
    "int mask": (
        mutate(completion_mask=lambda t: t.long()),
        400,
        "completion_mask must be torch.bool",
    ),
    "negative id": (
        mutate(input_ids=lambda t: t.index_fill(1, torch.tensor([6]), -1)),
        400,
        "outside the vocabulary",
    ),
    "id = vocab": (
        mutate(input_ids=lambda t: t.index_fill(1, torch.tensor([6]), VOCAB)),
        400,
        "outside the vocab",
    ),
    "mask length mismatch": (
        mutate(completion_mask=lambda t: t[:, :-1]),
        400,
        "completion_mask must be",
    ),
    "pi_old_logps rows mismatch": (mutate(pi_old_logps=lambda t: t[:-1]), 400,
                                   "pi_old_logps must be"),
    "advantages rows mismatch": (mutate(advantages=lambda t: t[:-1]), 400, "advantages must be"),
    "plen 0": (mutate(meta_plen=0), 400, "plen must be an int in 1..8"),
    "plen = sequence length": (mutate(meta_plen=9), 400, "plen must be"),
    "plen missing": (mutate(meta_plen=None), 400, "plen must be"),
    "plen a string": (mutate(meta_plen="5"), 400, "plen must be"),
    "temperature 0": (
        mutate(meta_temperature=0),
        400,
        "temperature must be a number in [0.01, 100]",
    ),
    "temperature 1e-40": (
        mutate(meta_temperature=1e-40),
        400,
        "temperature must be a number in [0.01, 100]",
    ),
    "temperature 1e-300": (
        mutate(meta_temperature=1e-300),
        400,
        "temperature must be a number in [0.01, 100]",
    ),
    "temperature inf": (
        mutate(meta_temperature=float("inf")),
        400,
        "temperature must be a number in [0.01, 100]",
    ),
    "upload_id a number": (mutate(meta_upload_id=7), 400, "upload_id must be a string"),
    "NaN advantages": (
        mutate(advantages=lambda t: t.index_fill(0, torch.tensor([1]), float("nan"))),
        400,
        "advantages has NaN or inf",
    ),
    "inf pi_old_logps": (
        mutate(pi_old_logps=lambda t: t.index_fill(1, torch.tensor([0]), float("-inf"))),
        400,
        "pi_old_logps has NaN or inf",
    ),
    "too many rows": (encode_batch(*group(G=17)), 400, "17 rows; 1 to 16 allowed"),
    "metadata 70000 deep": (
        safetensors_with_header({"__metadata__": {"json": "[" * 70000}}),
        400,
        "nested too deeply",
    ),
    "metadata nested 5000 deep": (
        safetensors_with_header({"__metadata__": {"json": "[" * 5000 + "]" * 5000}}),
        400,
        "nested too deeply",
    ),
    "metadata nested 20 deep": (
        mutate(meta_extra=json.loads("[" * 20 + "]" * 20)),
        400,
        "deeper than 8",
    ),
    "version a string": (mutate(meta_version="3"), 400, "metadata version must be an int"),
    "question a number": (mutate(meta_question=3), 400, "metadata question must be a string"),
    "answers one short": (
        mutate(meta_completions=["a", "b"]),
        400,
        "metadata completions must be a list of 3 strings",
    ),
    "answers not strings": (
        mutate(meta_completions=[1, 2, 3]),
        400,
        "metadata completions must be a list of 3 strings",
    ),
    "rank a float": (mutate(meta_rank=1.0), 400, "metadata rank must be an int"),
    "worker a list": (mutate(meta_worker=["w"]), 400, "metadata worker must be a string"),
    "regrouped a number": (mutate(meta_regrouped=1), 400, "metadata regrouped must be a bool"),
    "sequence past the model's positions": (
        encode_batch(*group(G=1, plen=300, tc=300)),
        413,
        "at most 512 per row",
    ),
    "too many tokens in one group": (
        encode_batch(*group(G=16, plen=200, tc=200)),
        413,
        "6000 in all",
    ),
}


@pytest.fixture(scope="module")
def torch_save_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "x.pt"
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, path)
    return path.read_bytes()


@pytest.mark.parametrize("name", list(BAD))
def test_bad_upload_gets_its_4xx_and_the_server_still_serves(live, name, torch_save_bytes):
    server, url = live
    body, status, message = BAD[name]
    body = torch_save_bytes if body is None else body
    if os.path.exists(MARKER):
        os.remove(MARKER)
    rejected = server.counters["rejected"]
    r = requests.post(url + "/upload", data=body, timeout=10)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert server.counters["rejected"] == rejected + 1
    assert not os.path.exists(MARKER), "a payload ran code on the server"
    back, _ = upload_and_pull(url, *group(seed=5))  # still serving valid requests
    assert back["ref_logps"].shape == (3, 4)


def test_a_body_over_the_limit_gets_413_before_it_is_read(live):
    """MAX_BODY_BYTES is waitress's own limit: a Content-Length over it is answered 413 at the
    headers, so a client that announces a huge body and then stalls after 3 bytes is answered at
    once, not left hanging (waitress would otherwise buffer the body until IDLE_TIMEOUT before the
    app saw the request)."""
    import socket

    server, url = live
    r = requests.post(url + "/upload", data=b"\0" * 200_001, timeout=10)
    assert r.status_code == 413 and "exceeds max_body of 200000" in r.text
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        # then nothing
        sock.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 200001\r\n\r\nabc")
        start, answer = time.time(), b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(4096)
            assert chunk, f"connection closed without an answer: {answer!r}"
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and time.time() - start < 5, answer[:200]
    back, _ = upload_and_pull(url, *group(seed=5))  # still serving valid requests
    assert back["ref_logps"].shape == (3, 4)


def test_head_get_answers_and_takes_nothing(live):
    server, url = live
    assert requests.head(url + "/get", timeout=10).status_code == 204
    tensors, meta = group(seed=11, n=11)
    assert (
        requests.post(url + "/upload", data=encode_batch(tensors, meta), timeout=10).status_code
        == 200
    )
    wait_for(lambda: server.queue_of(0).qsize() == 1)
    for _ in range(3):
        r = requests.head(url + "/get", timeout=10)
        assert (
            r.status_code == 200
            and r.headers["X-Ref-Instance"] == server.instance
            and not r.content
        )
    assert server.queue_of(0).qsize() == 1  # still there
    assert pull(url)[1]["n"] == 11


def test_a_repeated_upload_id_gets_its_first_answer_and_queues_nothing(live):
    server, url = live
    body = encode_batch(*group(seed=12, n=12, upload_id="retry-me"))
    uploaded = server.counters["uploaded"]
    first = requests.post(url + "/upload", data=body, timeout=10).json()
    wait_for(lambda: server.queue_of(0).qsize() == 1)
    # a client retrying after a timeout
    again = requests.post(url + "/upload", data=body, timeout=10).json()
    assert again == first and server.counters["uploaded"] == uploaded + 1
    assert pull(url)[1]["n"] == 12
    # Queued once: room is taken synchronously when an upload is accepted, so a queued repeat would
    # still hold it.
    assert server.room.held == {"trainers": 0, "workers": 0} and server.pending.qsize() == 0
    assert requests.get(url + "/get", timeout=10).status_code == 204


def test_a_read_timeout_is_retried_until_give_up():
    """A server that accepts and never answers: the client retries (it used to die on the first
    ReadTimeout)."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    threading.Thread(
        target=lambda: [accepted.append(listener.accept()) for _ in range(16)], daemon=True
    ).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(TimeoutError, match="silent for 0.2 s"):
            request_with_retry("GET", url + "/health", give_up_after=1.0, read_timeout=0.2)
        assert len(accepted) >= 2  # tried again after the first timeout
    finally:
        listener.close()


def test_a_chunked_body_is_read_whole_and_checked_like_any_other(live):
    server, url = live
    r = requests.post(url + "/upload", data=iter([b"abc", b"def"]), timeout=10)  # no Content-Length
    assert r.status_code == 400 and "not safetensors" in r.json()["error"]
    body = encode_batch(*group(seed=13, n=13))
    r = requests.post(url + "/upload", data=iter([body[:100], body[100:]]), timeout=10)
    assert r.status_code == 200, r.text
    assert pull(url)[1]["n"] == 13


@pytest.mark.parametrize(
    "method, path, status",
    [("GET", "/nope", 404), ("DELETE", "/get", 405), ("GET", "/upload", 405)],
)
def test_unknown_route_and_wrong_method_answer_json(live, method, path, status):
    server, url = live
    r = requests.request(method, url + path, timeout=10)
    assert r.status_code == status and "error" in r.json()


# ---------------------------------------------------------------------- token, backpressure, errors
def test_token_is_required_when_set(model):
    server, httpd, url = start(model, ref_token="s3cret")
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path in (("GET", "/health"), ("GET", "/get"), ("POST", "/upload")):
                r = requests.request(method, url + path, headers=headers, timeout=5)
                assert r.status_code == 401 and "token" in r.json()["error"]
        assert (
            request_with_retry("GET", url + "/health", token="s3cret").json()["vocab_size"] == VOCAB
        )
        with pytest.raises(ServerError, match="401"):
            request_with_retry("GET", url + "/health", token="nope")
    finally:
        stop(server, httpd)


def test_full_queues_answer_503_and_the_client_retries_until_there_is_room(model):
    server, stop_serving, url = start(model, queue_size=1)
    try:
        bodies = [encode_batch(*group(seed=i, n=i)) for i in range(3)]
        assert requests.post(url + "/upload", data=bodies[0]).status_code == 200
        # room for one group, taken until it is pulled
        r = requests.post(url + "/upload", data=bodies[1])
        assert (
            r.status_code == 503
            and r.headers["Retry-After"] == "1"
            and server.counters["busy"] == 1
        )
        wait_for(lambda: server.queue_of(0).qsize() == 1)
        import threading

        threading.Timer(1.0, lambda: pull(url)).start()  # a trainer catches up later
        # retried, then accepted
        request_with_retry("POST", url + "/upload", data=bodies[1], give_up_after=30)
        assert (
            pull(url)[1]["n"] == 1
            and server.counters["uploaded"] == 2
            and server.counters["served"] == 2
        )
    finally:
        stop(server, stop_serving)


def test_workers_groups_never_hold_up_the_trainers_groups(model):
    """Each kind has its own room: workers' groups that nobody takes fill theirs, and trainers'
    groups still go through the same forward thread and come back."""
    server, stop_serving, url = start(model, queue_size=2)
    try:
        for i in range(2):
            assert (
                requests.post(
                    url + "/upload", data=encode_batch(*group(seed=i, worker="w"))
                ).status_code
                == 200
            )
        assert (
            requests.post(
                url + "/upload", data=encode_batch(*group(seed=5, worker="w"))
            ).status_code
            == 503
        )
        wait_for(lambda: server.ready["workers"].qsize() == 2)
        for n in range(2):
            assert (
                requests.post(
                    url + "/upload", data=encode_batch(*group(seed=7 + n, n=n))
                ).status_code
                == 200
            )
            assert pull(url, timeout=10)[1]["n"] == n
    finally:
        stop(server, stop_serving)


def test_queued_bytes_are_bounded_too(model):
    body = encode_batch(*group(G=8, plen=40, tc=40))
    # 2 x body per group held
    server, stop_serving, url = start(model, queue_size=64, max_queued_bytes=5 * len(body))
    try:
        codes = [requests.post(url + "/upload", data=body).status_code for _ in range(4)]
        assert codes == [200, 200, 503, 503] and server.room.held_bytes <= 5 * len(body)
        for _ in range(2):
            pull(url)
        assert (
            server.room.held_bytes == 0
            and requests.post(url + "/upload", data=body).status_code == 200
        )
    finally:
        stop(server, stop_serving)


def test_a_failing_reference_forward_is_reported_and_the_server_goes_on(model, capfd):
    server, httpd, url = start(model)
    fail_first_forward(server)
    try:
        body = encode_batch(*group(seed=1, n=1, upload_id="u1"))
        assert requests.post(url + "/upload", data=body).status_code == 200
        wait_for(lambda: server.counters["ref_errors"] == 1)
        assert requests.get(url + "/health").json()["ref_errors"] == 1
        # the uploader learns of it: an error in its place, never half a group
        r = requests.get(url + "/get")
        assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
        assert "simulated CUDA out of memory" in r.json()["error"] and r.json()["upload_id"] == "u1"
        assert requests.get(url + "/get").status_code == 204
        back, meta = upload_and_pull(url, *group(seed=2, n=2))
        assert meta["n"] == 2 and server.worker.is_alive()
        assert "simulated CUDA out of memory" in capfd.readouterr().err
    finally:
        stop(server, httpd)


def test_client_gives_up_with_a_clear_message_when_nothing_listens():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match="is `python ref_server.py` running"):
        request_with_retry("GET", url + "/health", give_up_after=1.0)


def test_env_overrides_cast_to_the_constants_type(monkeypatch, capfd):
    ns = {"PORT": 1, "HOST": "a", "FLAG": False, "RATE": 0.5, "lower": 1}
    monkeypatch.setenv("PORT", "6000")
    monkeypatch.setenv("FLAG", "true")
    monkeypatch.setenv("RATE", "1e-3")
    monkeypatch.setenv("lower", "9")
    apply_env_overrides(ns, "x.py")
    assert ns == {"PORT": 6000, "HOST": "a", "FLAG": True, "RATE": 1e-3, "lower": 1}
    err = capfd.readouterr().err
    assert (
        "[x.py] PORT = 6000 (environment; default 1)" in err
        and "FLAG = True" in err
        and "HOST" not in err
    )
    monkeypatch.setenv("PORT", "sixty")
    with pytest.raises(SystemExit, match="PORT='sixty': not a valid int"):
        apply_env_overrides(ns, "x.py")


def test_a_misspelt_constant_in_the_environment_is_named(monkeypatch, capfd):
    ns = {"ALL_STEPS": 30, "SAVE_STEPS": 10, "BETA": 0.04}
    monkeypatch.setenv("ALL_STEP", "5")
    monkeypatch.setenv("BETTA", "0")
    apply_env_overrides(ns, "trainer.py")
    assert ns == {"ALL_STEPS": 30, "SAVE_STEPS": 10, "BETA": 0.04}  # nothing changed
    err = capfd.readouterr().err
    assert "ALL_STEP is not a constant of trainer.py; did you mean ALL_STEPS?" in err
    assert "BETTA is not a constant of trainer.py; did you mean BETA?" in err


def test_the_real_environment_of_a_run_raises_no_false_warning(monkeypatch, capfd):
    """The launcher's and the other file's variables (RANK, MASTER_PORT, PORT, REF_SERVER...) are
    not typos."""
    import grpo_ref_split
    import ref_server

    everyday = [
        "PATH",
        "HOME",
        "HOSTNAME",
        "PWD",
        "LANG",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CROSS_RANK",
        "CROSS_SIZE",
        "PYTHONPATH",
        "OMP_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
        "TRITON_INTERPRET",
        "XDG_CACHE_HOME",
        "TMPDIR",
        "USER",
        "SHELL",
        "TERM",
    ]
    import types

    # strings: any value casts, only names matter
    trainer = {k: "" for k in vars(grpo_ref_split) if k.isupper()}
    server = {k: "" for k in vars(ref_server) if k.isupper()}
    features = {
        m.__name__: {k: "" for k in vars(m) if k.isupper()}
        for m in vars(grpo_ref_split).values()
        # USE_VLLM...
        if isinstance(m, types.ModuleType) and m.__name__.startswith("features.")
    }
    assert "USE_VLLM" in features["features.vllm_engine"] and "USE_VLLM" not in trainer
    every = [name for constants in [trainer, server, *features.values()] for name in constants]
    for name in everyday + every:
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    monkeypatch.setenv("RANK", "0")  # rank 0 prints; the other ranks stay quiet
    apply_env_overrides(trainer, "grpo_ref_split.py")
    apply_env_overrides(server, "ref_server.py")
    for name, constants in features.items():
        apply_env_overrides(constants, name)
    err = capfd.readouterr().err
    assert "WARNING" not in err and "[ref_server.py] PORT = " in err


def test_fingerprint_tells_models_apart_but_not_dtypes(live, model, tokenizer):
    import copy

    from transformers import LlamaForCausalLM

    from conftest import tiny_config

    server, url = live
    same = model_fingerprint(model)
    assert requests.get(url + "/health", timeout=5).json()["fingerprint"] == same
    assert model_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == same  # a bf16 server
    nudged = copy.deepcopy(model)
    with torch.no_grad():
        next(nudged.parameters()).add_(1e-2)
    nudged_print = model_fingerprint(nudged)
    assert nudged_print["config"] == same["config"] and nudged_print["weights"] != same["weights"]
    torch.manual_seed(1)
    deeper = LlamaForCausalLM(tiny_config(tokenizer, num_hidden_layers=3))
    assert model_fingerprint(deeper)["config"] != same["config"]


def test_fingerprint_samples_parameters_past_float32_precision():
    """The embedded model's embedding has 28,311,552 values: float32 positions would round past its
    end."""
    import types

    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace(to_dict=lambda: {"vocab_size": 1})
            self.w = torch.nn.Parameter(torch.ones(28_311_552))

    big = Big()
    first = model_fingerprint(big)  # used to raise IndexError
    with torch.no_grad():
        big.w[-1] = -1.0  # the last value is sampled
    assert model_fingerprint(big)["weights"] != first["weights"]


def test_metadata_has_a_size_limit():
    header = {"__metadata__": {"json": json.dumps({"plen": 1, "note": "x" * MAX_META_CHARS})}}
    with pytest.raises(ValueError, match=f"characters; at most {MAX_META_CHARS}"):
        decode_batch(safetensors_with_header(header))


@pytest.fixture(scope="module")
def reward_model(tokenizer):
    """A tiny random sequence classifier on the SmolLM2 vocabulary, built from a config (no
    download)."""
    from transformers import LlamaForSequenceClassification

    from conftest import tiny_config

    torch.manual_seed(5)
    return LlamaForSequenceClassification(tiny_config(tokenizer, num_labels=1)).eval()


def test_a_reward_model_adds_its_weighted_score_and_the_trainer_redoes_the_advantages(
    model, tokenizer, reward_model, monkeypatch
):
    server, stop_serving, url = start(
        model,
        reward_model=(reward_model, tokenizer),
        reward_model_name="tiny-rm",
        reward_model_weight=0.5,
    )
    try:
        assert requests.get(url + "/health", timeout=5).json()["reward_model"] == "tiny-rm"
        tensors, meta = group(G=4, seed=3)
        tensors["scores"] = torch.tensor([3.0, 3.0, 1.0, 0.0])  # the trainer's rule rewards
        answers = [
            "<think> 3 + 4 </think><answer>7</answer>",
            "<think></think><answer>7</answer>",
            "8",
            "seven",
        ]
        back, back_meta = upload_and_pull(
            url, tensors, {**meta, "question": "What is 3 + 4?", "completions": answers}
        )
        enc = tokenizer(
            ["What is 3 + 4?"] * 4, answers, return_tensors="pt", padding=True, truncation=True
        )
        with torch.no_grad():
            scores = reward_model(**enc).logits[:, 0]  # (4,)
        assert scores.std() > 0  # the classifier does tell the answers apart
        rewards = tensors["scores"] + 0.5 * scores
        assert torch.allclose(back["scores"], rewards, atol=1e-6)
        assert "advantages" not in back  # stale with the new rewards: step 4 is the trainer's
        monkeypatch.setattr(grpo, "NUM_PRE_Q", 4)
        [(redone, _)] = with_advantages(lambda *_: [(back, back_meta)],
                                        grpo.choose_parts().advantages)([], 0, 0)
        # unbiased std, as GRPO's advantages_in_groups
        by_hand = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        assert torch.allclose(redone["advantages"], by_hand, atol=1e-5)
        assert back_meta["reward_model_mean"] == pytest.approx(scores.mean().item(), abs=1e-6)
        r = requests.post(url + "/upload", data=encode_batch(*group(seed=4)), timeout=10)
        assert r.status_code == 400 and "needs question and completions" in r.json()["error"]
    finally:
        stop(server, stop_serving)


def test_regroup_takes_an_upload_without_a_version_then_one_with_a_version(model):
    """A hostile client's mix: with REGROUP on, an upload whose version is null, then one with
    version 2 for the same question. It used to answer 500 (None < 2 while taking the group's oldest
    version); now the null counts as not given, version 0, and the group that comes out is the
    oldest answer's."""
    server, stop_serving, url = start(model, regroup=True)
    try:
        a, meta = group(G=4, plen=5, tc=3, seed=1)
        b, _ = group(G=4, plen=5, tc=3, seed=2)
        b["input_ids"][:, :5] = a["input_ids"][0, :5]  # the same question
        a["scores"], b["scores"] = torch.zeros(4), torch.ones(4)  # each alone: no signal
        first = requests.post(
            url + "/upload", data=encode_batch(a, {**meta, "version": None}), timeout=10
        )
        assert first.status_code == 200 and first.json()["groups"] == 0, first.text
        second = requests.post(
            url + "/upload", data=encode_batch(b, {**meta, "version": 2}), timeout=10
        )
        assert second.status_code == 200 and second.json()["groups"] == 1, second.text
        tensors, out_meta = pull(url)
        assert (
            out_meta["version"] == 0
            and out_meta["regrouped"]
            and tensors["scores"].unique().numel() == 2
        )
    finally:
        stop(server, stop_serving)


def test_stop_frees_the_port_and_a_waitress_without_its_socket_map_is_named():
    """stop() walks waitress's private socket map (features/http_server.close_sockets): the port is
    free at once after it; a waitress that no longer has that map is a clear error, not a server
    that never stops."""
    import socket
    from types import SimpleNamespace

    from features.http_server import close_sockets, start_http

    port = free_port()
    stop_http = start_http(
        lambda environ, start_response: [],
        "127.0.0.1",
        port,
        threads=1,
        backlog=8,
        idle_timeout=5,
        max_body=100,
    )
    stop_http()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises if anything still listens there
    with pytest.raises(RuntimeError, match="no socket map"):
        close_sockets(SimpleNamespace(task_dispatcher=None))


def test_a_retry_while_the_first_try_is_in_flight_gets_503_and_then_the_first_answer(model):
    """Two tries of one upload_id at once (a client that timed out and retried): the second,
    arriving while the first is still being handled, gets 503 (retry later); its next retry gets the
    first try's answer."""
    import threading

    server, stop_serving, url = start(model)
    gate, real = threading.Event(), server._accept
    # the first try stays in flight until the gate opens
    server._accept = lambda *a: gate.wait(30) and real(*a)
    try:
        body = encode_batch(*group(seed=21, n=21, upload_id="slow"))
        first = []
        t = threading.Thread(
            target=lambda: first.append(requests.post(url + "/upload", data=body, timeout=60))
        )
        t.start()
        wait_for(lambda: server.answered.answers.get("slow", None) == "in flight")
        retry = requests.post(url + "/upload", data=body, timeout=10)
        assert retry.status_code == 503 and retry.headers["Retry-After"] == "1"
        gate.set()
        t.join(timeout=30)
        assert first[0].status_code == 200 and first[0].json()["groups"] == 1
        again = requests.post(url + "/upload", data=body, timeout=10)
        assert again.json() == first[0].json() and server.counters["uploaded"] == 1  # queued once
    finally:
        gate.set()
        stop(server, stop_serving)


def test_an_upload_id_refused_with_503_is_forgotten_and_the_oldest_ids_are_evicted(model):
    """A retry after a 503 (no room) is a new upload, not the 503 again; past UPLOAD_IDS ids the
    oldest is forgotten, so its late retry is handled anew (queued again)."""
    server, stop_serving, url = start(model, queue_size=1, upload_ids=2)
    try:
        bodies = {
            uid: encode_batch(*group(seed=30 + i, n=i, upload_id=uid))
            for i, uid in enumerate("abc")
        }
        assert requests.post(url + "/upload", data=bodies["a"], timeout=10).status_code == 200
        full = requests.post(url + "/upload", data=bodies["b"], timeout=10)
        # the queue holds a's group: b is refused, and its id forgotten
        assert full.status_code == 503
        assert "b" not in server.answered.answers
        pull(url)  # a's group taken: room again
        # handled anew
        assert requests.post(url + "/upload", data=bodies["b"], timeout=10).json()["groups"] == 1
        pull(url)
        assert requests.post(url + "/upload", data=bodies["c"], timeout=10).status_code == 200
        pull(url)
        assert list(server.answered.answers) == ["b", "c"]  # two remembered: a, the oldest, evicted
        uploaded = server.counters["uploaded"]
        assert requests.post(url + "/upload", data=bodies["a"], timeout=10).json()["groups"] == 1
        # a's late retry: queued
        assert server.counters["uploaded"] == uploaded + 1 and pull(url)[1]["n"] == 0
    finally:
        stop(server, stop_serving)


def test_nan_reference_log_probs_are_never_handed_to_a_trainer(model):
    server, stop_serving, url = start(model)
    server.reference_logps = lambda ids, plen, t, upload=None, completion_mask=None: torch.full(
        (ids.shape[0], ids.shape[1] - plen), float("nan")
    )
    try:
        body = encode_batch(*group(seed=40, upload_id="nan"))
        assert requests.post(url + "/upload", data=body, timeout=10).status_code == 200
        wait_for(lambda: server.counters["ref_errors"] == 1)
        r = requests.get(url + "/get", timeout=10)
        assert (
            r.headers["Content-Type"] == "application/json"
            and "NaN or inf log-probs" in r.json()["error"]
        )
    finally:
        stop(server, stop_serving)


def test_a_workers_group_whose_forward_failed_is_left_out_of_a_trainers_extras(model, capfd):
    """The trainer takes EXTRA_GROUPS of the workers' groups; one that comes back as an error is
    skipped and the rest are taken, so a lost worker group never stops a trainer."""
    from features.server_client import RefClient

    server, stop_serving, url = start(model)
    fail_first_forward(server)
    try:
        for i in range(3):  # the first one's forward fails
            body = encode_batch(*group(seed=50 + i, n=50 + i, worker="w1", version=0))
            assert requests.post(url + "/upload", data=body, timeout=10).status_code == 200
        wait_for(lambda: server.ready["workers"].qsize() == 3)
        got = RefClient(url, timeout=60, extra_groups=4).upload_and_pull(
            [group(seed=60, n=60)], version=1, rank=0
        )
        assert (
            sorted(meta["n"] for _, meta in got) == [51, 52, 60]
            and server.ready["workers"].qsize() == 0
        )
    finally:
        stop(server, stop_serving)


@pytest.mark.slow
def test_the_server_process_loads_a_reward_model_and_names_it(
    tiny_model_dir, tokenizer, reward_model, tmp_path
):
    """ref_server.py's main() with REWARD_MODEL: the model is loaded from its folder, /health names
    it, and a group comes back with the reward model's mean score."""
    from conftest import ServerProcess

    folder = tmp_path / "rm"
    reward_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    srv = ServerProcess(
        tiny_model_dir, free_port(), tmp_path / "server.log", REWARD_MODEL=str(folder)
    )
    try:
        assert srv.health()["reward_model"] == str(folder)
        tensors, meta = group(
            G=3, plen=5, tc=4, seed=70, question="What is 1 + 1?", completions=["2", "3", "11"]
        )
        back, back_meta = upload_and_pull(srv.url, tensors, meta)
        assert "reward_model_mean" in back_meta and back["scores"].shape == (3,)
    finally:
        srv.stop()


def test_each_server_setting_is_its_constant_or_a_keyword_and_a_misspelled_one_is_refused(model):
    """RefServer reads settings_now(): a keyword of the same name replaces one, and a name that
    is not a setting stops at once (it would otherwise be silently ignored)."""
    with pytest.raises(TypeError, match="queue_sise"):
        RefServer(model, "t", queue_sise=2)
    server = RefServer(model, "t", queue_size=3)
    assert server.settings.queue_size == 3 and server.room.queue_size == 3
    assert server.settings.max_rows == ref_server.MAX_ROWS
    assert server.settings.regroup == ref_server.REGROUP
