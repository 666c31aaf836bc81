"""Shared fixtures: the embedded tokenizer, a tiny model that has learned the answer format, and a
reference server process. Run with: bash scripts/test.sh (or python -m pytest tests)."""
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED_GSM8K = os.path.join(ROOT, "..", "shared", "gsm8k")

import grpo_ref_split as grpo  # noqa: E402
import objectives  # noqa: E402
from features import weight_sync  # noqa: E402
from features.embedded_model import resolve_model_path  # noqa: E402
from features.fast_paths import completion_logps  # noqa: E402
from features.curves import is_eval  # noqa: E402
from features.wire import decode_batch, encode_batch  # noqa: E402
import ref_server  # noqa: E402
import rewards  # noqa: E402


# whole runs
SLOW_MODULES = {"test_e2e", "test_training_runs", "test_two_nodes", "test_vllm", "test_lora"}


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # pytest-xdist: share the cores out, each worker's own process and its children
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the trainers and servers it starts
        torch.set_num_threads(threads)  # more threads than cores spin against each other in OpenMP
    config.addinivalue_line(
        "markers",
        "slow: a DeepSpeed launch, a vLLM engine or a server process under load; "
        "`bash scripts/test.sh -m \"not slow\"` leaves them out",
    )


# The longest files first, longest at the head: pytest-xdist hands files out in this order, so the
# short ones fill the end and neither worker waits long for the other.
LONGEST_FIRST = (
    "test_training_runs",
    "test_tools",
    "test_vision",
    "test_vllm",
    "test_e2e",
    "test_lora",
)


def pytest_collection_modifyitems(items):
    """Every test of SLOW_MODULES is slow; elsewhere @pytest.mark.slow says so test by test. Files
    run LONGEST_FIRST, then in their usual order (a stable sort keeps each file whole)."""
    for item in items:
        if item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(LONGEST_FIRST)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def embedded_path():
    """The embedded SmolLM2 converted to a transformers folder (done once per machine)."""
    return resolve_model_path("")


@pytest.fixture(scope="session")
def tokenizer(embedded_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_path)


def tiny_config(tokenizer, **overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        head_dim=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def sft_target(rng, a, b):
    """What the tiny model learns to write after the <think> prefill: the tag format most of the
    time with a right or a random sum, sometimes a bare number. Its samples then differ in both
    rewards, like a weak real model's, so GRPO groups carry signal."""
    x = a + b if rng.random() < 0.5 else rng.randint(2, 40)
    return f" {a} + {b} </think><answer>{x}</answer>" if rng.random() < 0.7 else f" {x}"


def tool_target(rng, a, b):
    """Mostly a calculator call (its result written out, as the rollout appends it), else
    sft_target."""
    call = (f" {a} + {b} = <tool>{a} + {b}</tool><result>{a + b}</result> </think>"
            f"<answer>{a + b}</answer>")
    return call if rng.random() < 0.9 else sft_target(rng, a, b)


def built_once(tmp_path_factory, name, build):
    """The folder `name`, made by build(folder) once per test session: under pytest-xdist the
    workers share one folder beside their own temp folders, and a file lock lets the first worker
    build it while the others wait, so each worker never pays for the same read-only model."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest's temp folder for this run, above every worker's own
    folder = root / name
    done = folder / ".built"
    with FileLock(str(folder) + ".lock"):
        if not done.exists():
            if folder.exists():
                shutil.rmtree(folder)  # a build that an earlier worker left half done
            folder.mkdir()
            build(folder)
            done.touch()
    return str(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    """A 2-layer Llama on the SmolLM2 vocabulary, taught the answer format by 150 SFT steps (~30
    s)."""
    return built_once(
        tmp_path_factory,
        "tiny_model",
        lambda folder: sft_tiny_model(tokenizer, folder, sft_target, mixed=False),
    )


@pytest.fixture(scope="session")
def tool_model_dir(tokenizer, tmp_path_factory):
    """The same on the mixed task, most of its answers a calculator call (TOOLS's runs)."""
    return built_once(
        tmp_path_factory,
        "tool_model",
        lambda folder: sft_tiny_model(tokenizer, folder, tool_target, mixed=True),
    )


def sft_tiny_model(tokenizer, folder, target, mixed):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    rng = random.Random(0)
    model = LlamaForCausalLM(tiny_config(tokenizer))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    problems = rewards.make_arithmetic(2400, 20, seed=1, mixed=mixed)
    for i in range(150):
        rows = problems[i * 16 : (i + 1) * 16]
        prompts = [grpo.build_prompt(tokenizer, r["question"]) for r in rows]
        targets = []
        for r in rows:
            a, b = (int(s) for s in r["answer"].split("=")[0].split("+"))
            targets.append(
                tokenizer.encode(target(rng, a, b), add_special_tokens=False)
                + [tokenizer.eos_token_id]
            )
        ids, attn, Tc = pack(tokenizer, prompts, targets)
        logps = completion_logps(model, ids, attn, Tc, 1.0, chunk=128, from_hidden=True)  # (B, Tc)
        mask = attn[:, -Tc:].bool()  # (B, Tc)
        loss = -objectives.masked_mean(logps, mask).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 2.0, f"tiny SFT did not converge (loss {loss.item():.2f})"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def pack(tokenizer, prompts, targets):
    """Left-padded prompts followed by right-padded target ids: (ids, attention_mask, Tc)."""
    enc = tokenizer(
        prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
    )
    Tc = max(len(t) for t in targets)
    tgt = torch.full((len(targets), Tc), tokenizer.pad_token_id)
    tgt_attn = torch.zeros(len(targets), Tc, dtype=torch.long)
    for i, t in enumerate(targets):
        tgt[i, : len(t)] = torch.tensor(t)
        tgt_attn[i, : len(t)] = 1
    return torch.cat([enc.input_ids, tgt], 1), torch.cat([enc.attention_mask, tgt_attn], 1), Tc


def setting_home(name):
    """The module that holds the setting `name`: the trainer (the lesson's constants), objectives.py
    (the variants' settings) or the feature module it reads it from (features/vllm_engine.py's
    USE_VLLM...)."""
    import types

    import grpo_ref_split

    homes = [grpo_ref_split] + [
        m
        for m in vars(grpo_ref_split).values()
        if isinstance(m, types.ModuleType)
        and (m.__name__.startswith("features.") or m.__name__ in ("objectives", "environments"))
    ]
    return next(m for m in homes if name in vars(m) and name.isupper())


def set_setting(monkeypatch, name, value):
    """monkeypatch the setting `name` where it lives (setting_home), put back after the test."""
    monkeypatch.setattr(setting_home(name), name, value)


def trainer_cmd(ranks, master_port=None):
    """The trainer's command line. Several ranks, or a given master port: `deepspeed --num_gpus
    ranks grpo_ref_split.py` (DeepSpeed names its shared memory after the port, so runs in parallel
    test workers never share it; test_e2e runs the README's launch this way on 1 and 2 ranks). One
    rank otherwise: `python grpo_ref_split.py`, the world of one the trainer makes itself
    (features/zero2.py), which skips the launcher's start and its once-a-second exit poll on each of
    the suite's many one-rank runs."""
    if ranks == 1 and master_port is None:
        return [sys.executable, "grpo_ref_split.py"]
    return [
        os.path.join(os.path.dirname(sys.executable), "deepspeed"),
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(master_port or free_port()),
        "grpo_ref_split.py",
    ]


def trainer_env(model_dir, url, out, **env):
    """A tiny, quick training run: 2 steps of 2 questions x 4 answers x 16 tokens."""
    return {
        **os.environ,
        "MODEL_PATH": str(model_dir),
        "REF_SERVER": url,
        "OUTPUT_DIR": str(out),
        "ALL_STEPS": "2",
        "SAVE_STEPS": "1",
        "Q_BATCH_SIZE": "2",
        "NUM_PRE_Q": "4",
        "MAX_NEW_TOKENS": "16",
        "LR": "1e-3",
        "EVAL_SIZE": "8",
        "SERVER_TIMEOUT": "120",
        **{k: str(v) for k, v in env.items()},
    }


def train(model_dir, url, out, ranks, master_port=None, **env):
    """The trainer (trainer_cmd) to the end; returns the CompletedProcess."""
    return subprocess.run(
        trainer_cmd(ranks, master_port),
        cwd=ROOT,
        env=trainer_env(model_dir, url, out, **env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def params(folder):
    from transformers import AutoModelForCausalLM

    return {
        k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()
    }


def metrics(out):
    """(training lines, eval lines) of out/metrics.jsonl."""
    import json

    lines = [
        json.loads(line) for line in pathlib.Path(out, "metrics.jsonl").read_text().splitlines()
    ]
    return [m for m in lines if not is_eval(m)], [m for m in lines if is_eval(m)]


class ServerProcess:
    """`python ref_server.py` as a child process, for the end-to-end and fault tests."""

    def __init__(self, model_dir, port, log_path, **env):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        full_env = {
            **os.environ,
            "MODEL_PATH": model_dir,
            "PORT": str(port),
            **{k: str(v) for k, v in env.items()},
        }
        self.proc = subprocess.Popen(
            [sys.executable, "ref_server.py"],
            cwd=ROOT,
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, (
                f"ref_server.py exited early: {pathlib.Path(log_path).read_text()[-2000:]}"
            )
            try:
                self.health()
                return
            except requests.ConnectionError:
                time.sleep(0.3)
        raise TimeoutError("ref_server.py did not come up in 120 s")

    def health(self):
        return requests.get(self.url + "/health", timeout=5).json()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def kill_group(proc):
    """SIGKILL a process started with start_new_session=True, and everything it started."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """`python ref_server.py` on the tiny model, one per test module that asks for it."""
    s = ServerProcess(tiny_model_dir, free_port(), tmp_path_factory.mktemp("srv") / "server.log")
    yield s
    s.stop()


# ------------------------------------------------------------------------ in-process server helpers
VOCAB = 49152  # the SmolLM2 tokenizer's


@pytest.fixture(scope="session")
def model(tokenizer):
    """A tiny random Llama on the SmolLM2 vocabulary, for servers run inside the test process."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(tokenizer)).eval()


def start(model, port=None, **kw):
    """A RefServer on loopback in this process: (server, its stop function, url)."""
    server = ref_server.RefServer(model, "tiny", **kw)
    port = port or free_port()
    return server, ref_server.serve(server, "127.0.0.1", port), f"http://127.0.0.1:{port}"


def stop(server, stop_serving):
    stop_serving()
    assert not server.worker.is_alive()


def fail_first_forward(server):
    """The server's next reference forward raises (as a CUDA out-of-memory would); later ones
    work."""
    real, calls = server.reference_logps, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated CUDA out of memory")
        return real(*args)

    server.reference_logps = flaky


def group(G=3, plen=5, tc=4, seed=0, **meta):
    g = torch.Generator().manual_seed(seed)
    tensors = dict(
        input_ids=torch.randint(0, VOCAB, (G, plen + tc), generator=g),
        completion_mask=torch.ones(G, tc, dtype=torch.bool),
        advantages=torch.randn(G, generator=g),
        scores=torch.rand(G, generator=g),
        pi_old_logps=-torch.rand(G, tc, generator=g),
    )
    tensors["input_ids"][:, :plen] = tensors["input_ids"][0, :plen].clone()  # one prompt per group
    return tensors, {"plen": plen, "temperature": 1.0, **meta}


def pull(url, timeout=30, path="/get"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = requests.get(url + path, timeout=10)
        if r.status_code == 200:
            return decode_batch(r.content)
        assert r.status_code == 204
        time.sleep(0.02)
    raise TimeoutError("no batch came back")


def upload_and_pull(url, tensors, meta):
    r = requests.post(url + "/upload", data=encode_batch(tensors, meta), timeout=10)
    assert r.status_code == 200, r.text
    return pull(url)


def wait_for(cond, timeout=20):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture
def publisher():
    """A WeightPublisher on loopback (its url added), stopped after the test."""
    port = free_port()
    pub = weight_sync.WeightPublisher("127.0.0.1", port, token="")
    pub.url = f"http://127.0.0.1:{port}"
    yield pub
    pub.stop()


class CuttingProxy:
    """A TCP relay to `upstream` that closes an answer after relaying exactly `after` bytes of it,
    `cuts` times: a link that drops halfway through a transfer, or a server killed mid-answer
    (short answers pass whole)."""

    def __init__(self, upstream_port, after, cuts):
        self.after = after
        self.cuts = cuts
        self.lock = threading.Lock()
        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self.pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self.pipe, args=(upstream, client, True), daemon=True).start()

    def cut_now(self, sent):
        with self.lock:
            if self.cuts > 0 and sent > self.after:
                self.cuts -= 1
                return True
        return False

    def pipe(self, source, target, answers):
        sent = 0
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if answers and self.cut_now(sent + len(data)):  # cut at exactly `after` bytes
                    target.sendall(data[: max(0, self.after - sent)])
                    break
                target.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (source, target):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
