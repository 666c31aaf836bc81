"""Across real network hosts on this machine: Linux network namespaces joined by veth pairs give the
trainer, workers and reference servers their own addresses; `ip link set ... down` cuts a link.
Root is needed; without it (or without `ip`) these tests skip and say why."""
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import requests

from conftest import ROOT, kill_group, metrics, trainer_cmd, trainer_env, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2's `ip`")


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Hosts 'trainer' (10.77.N.1) and 'worker' (10.77.N.2) joined by one veth pair; yields
    (namespaces, addresses, the worker's end of the link)."""
    tag = uuid.uuid4().hex[:6]
    subnet = int(tag, 16) % 200 + 20
    names = {"trainer": f"gt{tag}", "worker": f"gw{tag}"}
    ends = {"trainer": f"vt{tag}", "worker": f"vw{tag}"}
    addresses = {"trainer": f"10.77.{subnet}.1", "worker": f"10.77.{subnet}.2"}
    for ns in names.values():
        ip("netns", "add", ns)
    try:
        ip("link", "add", ends["trainer"], "type", "veth", "peer", "name", ends["worker"])
        for host in names:
            ip("link", "set", ends[host], "netns", names[host])
            ip("-n", names[host], "addr", "add", f"{addresses[host]}/24", "dev", ends[host])
            ip("-n", names[host], "link", "set", ends[host], "up")
            ip("-n", names[host], "link", "set", "lo", "up")
        yield names, addresses, ends["worker"]
    finally:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


PUBLISHER = """
import hashlib, json, sys, time, torch
sys.path.insert(0, {root!r})
from features import weight_sync
pub = weight_sync.WeightPublisher({host!r}, {port}, token="t0ken")
g = torch.Generator().manual_seed(7)
tensors = {{f"w{{i}}": torch.randn(2_500_000, generator=g) for i in range(4)}}  # 40 MB
pub.publish(tensors, 5)
digest = hashlib.sha256(b"".join(tensors[k].numpy().tobytes() for k in sorted(tensors))).hexdigest()
open({out!r}, "w").write(json.dumps({{"version": 5, "digest": digest}}))
time.sleep(3600)
"""

FETCHER = """
import hashlib, json, sys, time, urllib3
sys.path.insert(0, {root!r})
from features import weight_sync
weight_sync.CHUNK_BYTES = 16384
plain = urllib3.response.HTTPResponse.read1
def slow(self, *args, **kwargs):  # a slow reader: the transfer lasts long enough to cut
    time.sleep(0.002)
    return plain(self, *args, **kwargs)
urllib3.response.HTTPResponse.read1 = slow
f = weight_sync.WeightFetcher({url!r}, "t0ken", version=0, max_bytes=2**30, poll_s=0.2, retry_s=0.5,
                             timeout_s=2)
while (got := f.take()) is None:
    open({progress!r}, "w").write(json.dumps(f.progress))
    time.sleep(0.05)
version, tensors = got
digest = hashlib.sha256(b"".join(tensors[k].numpy().tobytes() for k in sorted(tensors))).hexdigest()
open({out!r}, "w").write(json.dumps({{"version": version, "digest": digest, **f.counts}}))
"""


def test_a_worker_whose_link_goes_down_mid_transfer_ends_on_the_whole_version(two_hosts, tmp_path):
    """The trainer's host serves 40 MB of weights; the worker's host downloads them slowly; a third
    of the way in its link is set down for 4 s, then up: the worker resumes and ends with exactly
    the published tensors (the same digest), never a partial or mixed file."""
    names, addresses, worker_link = two_hosts
    port = 59876
    published, fetched, progress = (tmp_path / n for n in ("published.json", "fetched.json",
                                                           "progress.json"))
    script = PUBLISHER.format(root=ROOT, host=addresses["trainer"], port=port, out=str(published))
    trainer = subprocess.Popen(
        ["ip", "netns", "exec", names["trainer"], sys.executable, "-c", script],
        start_new_session=True,
        stderr=open(tmp_path / "trainer.log", "w"),
    )
    worker = None
    try:
        wait_for(published.exists, timeout=120)
        url = f"http://{addresses['trainer']}:{port}"
        script = FETCHER.format(root=ROOT, url=url, out=str(fetched), progress=str(progress))
        worker = subprocess.Popen(
            ["ip", "netns", "exec", names["worker"], sys.executable, "-c", script],
            start_new_session=True,
            stderr=open(tmp_path / "worker.log", "w"),
        )

        def fraction():
            try:
                done, size = json.loads(progress.read_text())
            except (OSError, ValueError):
                return 0.0
            return done / size if size else 0.0

        wait_for(lambda: fraction() > 0.3, timeout=120)
        assert fraction() < 0.9, "the transfer ran too fast to cut in the middle"
        ip("-n", names["worker"], "link", "set", worker_link, "down")
        time.sleep(4)  # the cut lasts; the worker's reads time out and it retries
        assert not fetched.exists()
        ip("-n", names["worker"], "link", "set", worker_link, "up")
        wait_for(fetched.exists, timeout=180)
        time.sleep(0.2)
        want, got = json.loads(published.read_text()), json.loads(fetched.read_text())
        assert got["version"] == want["version"] == 5
        assert got["digest"] == want["digest"]
        assert got["resumed"] >= 1 and got["bad_checksum"] == 0
    finally:
        for proc in (worker, trainer):
            if proc is not None:
                kill_group(proc)


def start_on(namespace, command, log_path, procs, **env):
    """`command` in network namespace `namespace`, its output to log_path, added to procs (the
    test kills them all at its end)."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", namespace, *command],
        cwd=ROOT,
        env={**os.environ, **{k: str(v) for k, v in env.items()}},
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    procs.append(proc)
    return proc


@pytest.fixture
def four_hosts():
    """Hosts 'trainer', 'ref_a', 'ref_b' and 'worker', each a network namespace with its own
    address (10.78.N.1-4), joined by veth pairs to a bridge that also gives this test process
    10.78.N.254; yields (namespaces, addresses)."""
    tag = uuid.uuid4().hex[:6]
    subnet = int(tag, 16) % 200 + 20
    hosts = ["trainer", "ref_a", "ref_b", "worker"]
    names = {host: f"g{i}{tag}" for i, host in enumerate(hosts)}
    addresses = {host: f"10.78.{subnet}.{i + 1}" for i, host in enumerate(hosts)}
    bridge = f"br{tag}"
    ip("link", "add", bridge, "type", "bridge")
    try:
        ip("addr", "add", f"10.78.{subnet}.254/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for i, host in enumerate(hosts):
            ns, inside, outside = names[host], f"v{i}{tag}", f"p{i}{tag}"
            ip("netns", "add", ns)
            ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            ip("link", "set", inside, "netns", ns)
            ip("link", "set", outside, "master", bridge)
            ip("link", "set", outside, "up")
            ip("-n", ns, "addr", "add", f"{addresses[host]}/24", "dev", inside)
            ip("-n", ns, "link", "set", inside, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield names, addresses
    finally:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def test_a_run_on_four_hosts_loses_a_reference_server_and_drops_a_stale_worker(
    four_hosts, tiny_model_dir, tmp_path
):
    """A trainer, two reference servers and a worker on four hosts. Server A is killed once step 1
    is logged: the run finishes on B, every step training exactly its own groups that had reward
    variance (none lost, none twice). The worker never gets new weights (its OUTPUT_DIR is its
    own), so with MAX_STALENESS 1 its groups are dropped and counted from step 3 on."""
    names, addresses = four_hosts
    servers, procs = {}, []

    def run_on(host, command, log, **env):
        return start_on(names[host], command, tmp_path / log, procs, **env)

    try:
        for host in ("ref_a", "ref_b"):
            servers[host] = run_on(
                host,
                [sys.executable, "ref_server.py"],
                f"{host}.log",
                MODEL_PATH=tiny_model_dir,
                HOST=addresses[host],
                PORT=59875,
            )
        urls = ",".join(f"http://{addresses[host]}:59875" for host in ("ref_a", "ref_b"))

        def both_up():
            try:
                return all(requests.get(url + "/health", timeout=2).ok for url in urls.split(","))
            except requests.RequestException:
                return False

        wait_for(both_up, timeout=180)
        out = tmp_path / "out"
        settings = dict(ALL_STEPS=5, SAVE_STEPS=0, EVAL_STEPS=0, MAX_STALENESS=1, EXTRA_GROUPS=2)
        worker = run_on(
            "worker",
            [sys.executable, "grpo_ref_split.py", "genonly"],
            "worker.log",
            **trainer_env(
                tiny_model_dir, urls, tmp_path / "worker_out", WORKER_MAX_QUEUED=4, **settings
            ),
        )
        trainer = run_on(
            "trainer",
            trainer_cmd(1),
            "trainer.log",
            **trainer_env(tiny_model_dir, urls, out, **settings),
        )
        wait_for(
            lambda: (
                (out / "metrics.jsonl").exists()
                and any(
                    "completions_trained" in line
                    for line in (out / "metrics.jsonl").read_text().splitlines()
                )
            ),
            timeout=400,
        )
        kill_group(servers["ref_a"])  # mid-run, with whatever it held
        assert trainer.wait(timeout=500) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert worker.poll() is None  # still generating, against B
        steps, _ = metrics(out)
        assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
        for m in steps:
            # varied groups' answers
            own = round(m["completions_generated"] * (1 - m["zero_var_groups"]))
            if m["step"] >= 3:  # the worker's groups are 2 or more versions behind: none trains
                assert m["completions_trained"] == own, m
            else:
                assert m["completions_trained"] >= own, m
        assert sum(m.get("stale_groups_dropped", 0) for m in steps[2:]) >= 1
        health_b = requests.get(urls.split(",")[1] + "/health", timeout=5).json()
        assert health_b["served"] >= 1 and health_b["ref_errors"] == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)


RELAY = """
import os, socket, sys, threading, time
listen, upstream, mode, limit = {listen!r}, {upstream}, {mode!r}, {limit}
began = time.time()
def pipe(src, dst, answers, state):
    sent = 0
    try:
        while data := src.recv(65536):
            if not answers and sent == 0:
                state["upload"] = data.startswith(b"POST /upload")
            slow = mode == "slow" and time.time() - began < limit and state.get("upload")
            if answers and sent == 0 and slow:
                time.sleep(4.0)  # an upload's answer: alive, but slower than the failover time
            if answers and mode == "die" and len(data) + sent > limit:
                dst.sendall(data[: max(0, limit - sent)])
                os._exit(0)  # the server is killed in the middle of an answer
            dst.sendall(data)
            sent += len(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
server = socket.create_server((listen, 59875))
while True:
    client, _ = server.accept()
    up = socket.create_connection(("127.0.0.1", upstream))
    state = {{}}
    threading.Thread(target=pipe, args=(client, up, False, state), daemon=True).start()
    threading.Thread(target=pipe, args=(up, client, True, state), daemon=True).start()
"""


@pytest.mark.parametrize("fault", ["die", "slow"])
def test_groups_through_a_server_killed_mid_answer_or_slow_past_failover_come_back_once(
    fault, four_hosts, tiny_model_dir, tmp_path, monkeypatch, capfd
):
    """Two reference servers on their own hosts; this process uploads 8 steps of 2 groups (8 x 300
    tokens) through RefClient. 'die': server A's host is killed in the middle of its first group
    answer. 'slow': A answers uploads 4 s late for its first 8 s (alive, past the 2 s failover
    time), so it queues copies of groups the client sends again to B, and hands them over when later
    steps poll it. Either way every group comes back exactly once, and nothing else does."""
    from conftest import group
    from features import server_client

    monkeypatch.setattr(server_client, "_FAILOVER_S", 2.0)
    monkeypatch.setattr(server_client, "_DOWN_RETRY_S", 1.0)
    names, addresses = four_hosts
    procs = []

    def run_on(host, command, log, **env):
        return start_on(names[host], command, tmp_path / log, procs, **env)

    try:
        for host in ("ref_a", "ref_b"):
            run_on(
                host,
                [sys.executable, "ref_server.py"],
                f"{host}.log",
                MODEL_PATH=tiny_model_dir,
                HOST="127.0.0.1",
                PORT=59870,
            )
        urls = [f"http://{addresses[host]}:59875" for host in ("ref_a", "ref_b")]
        wait_for(
            lambda: all(
                (tmp_path / f"{h}.log").read_text().count("ready on") for h in ("ref_a", "ref_b")
            ),
            timeout=180,
        )
        limit = 5000 if fault == "die" else 8
        run_on(
            "ref_a",
            [
                sys.executable,
                "-c",
                RELAY.format(listen=addresses["ref_a"], upstream=59870, mode=fault, limit=limit),
            ],
            "relay_a.log",
        )
        run_on(
            "ref_b",
            [
                sys.executable,
                "-c",
                RELAY.format(listen=addresses["ref_b"], upstream=59870, mode="pass", limit=0),
            ],
            "relay_b.log",
        )

        def both_up():
            try:
                return all(requests.get(url + "/health", timeout=8).ok for url in urls)
            except requests.RequestException:
                return False

        wait_for(both_up, timeout=60)
        client = server_client.RefClient(",".join(urls), timeout=120)
        sent, back = {}, []
        for step in range(8):
            groups = [group(G=8, plen=100, tc=200, seed=10 * step + i) for i in range(2)]
            for tensors, _ in groups:
                sent[tensors["input_ids"][0, :8].tolist().__repr__()] = step
            back += client.upload_and_pull(groups, step, 0)
            time.sleep(1.0)  # later steps come after A's slow spell
        keys = [tensors["input_ids"][0, :8].tolist().__repr__() for tensors, _ in back]
        assert sorted(keys) == sorted(sent), (len(keys), len(sent))  # each once, none lost
        err = capfd.readouterr().err
        if fault == "slow":  # the case happened: A's late copies came and were dropped
            assert "dropped a second copy of a group" in err, err[-2000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)
