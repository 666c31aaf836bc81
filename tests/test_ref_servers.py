"""Several reference servers (REF_SERVER="http://a:59875,http://b:59875"): uploads go to the server
with the least work pending, each rank takes back the groups it sent, a server that stops answering
is skipped and the groups it held are uploaded again elsewhere, each trained once; every server
must hold the same reference model. In-process servers on loopback; tests/test_netns.py runs the
same across network namespaces."""
import threading
import time

import pytest
import requests
import torch

from conftest import CuttingProxy, group, start, stop, wait_for
from features import server_client
from features.server_client import RefClient
from features.wire import encode_batch


@pytest.fixture
def fast_failover(monkeypatch):
    monkeypatch.setattr(server_client, "_FAILOVER_S", 2.0)


def hold_forwards(server):
    """The server's reference forward waits until the returned event is set (a busy GPU)."""
    gate, real = threading.Event(), server.reference_logps

    def held(*args):
        gate.wait()
        return real(*args)

    server.reference_logps = held
    return gate


def test_the_same_group_gets_the_same_reference_log_probs_from_either_server(model):
    """Two servers with the same reference model: a group pulled through each carries equal
    ref_logps (bit for bit), whichever one computed them."""
    a, stop_a, url_a = start(model)
    b, stop_b, url_b = start(model)
    try:
        one = RefClient(url_a, timeout=60).upload_and_pull([group(seed=5)], version=0, rank=0)
        two = RefClient(url_b, timeout=60).upload_and_pull([group(seed=5)], version=0, rank=0)
    finally:
        stop(a, stop_a)
        stop(b, stop_b)
    assert a.counters["served"] == b.counters["served"] == 1
    assert torch.equal(one[0][0]["ref_logps"], two[0][0]["ref_logps"])


def test_groups_go_to_the_server_with_the_least_work_pending(model):
    """Server A's forward is held with three groups waiting; a client of A and B sends its next
    three groups to B (B's load, counting what it just sent, stays below A's 3), and gets all
    back."""
    a, stop_a, url_a = start(model)
    b, stop_b, url_b = start(model)
    gate = hold_forwards(a)
    try:
        for seed in (1, 2, 9, 10):  # another rank's groups: one in A's forward, three waiting
            requests.post(
                url_a + "/upload", data=encode_batch(*group(seed=seed, rank=1)), timeout=10
            )
        wait_for(lambda: requests.get(url_a + "/health").json()["pending"] == 3)
        client = RefClient(f"{url_a},{url_b}", timeout=60)
        got = client.upload_and_pull([group(seed=s) for s in (3, 4, 5)], version=0, rank=0)
        assert b.counters["uploaded"] == 3 and a.counters["uploaded"] == 4
        assert sorted(t["scores"][0].item() for t, _ in got) == sorted(
            group(seed=s)[0]["scores"][0].item() for s in (3, 4, 5)
        )
    finally:
        gate.set()
        stop(a, stop_a)
        stop(b, stop_b)


def test_a_server_that_stops_with_groups_held_is_skipped_and_they_come_back_from_the_other(
    model, fast_failover, capfd
):
    """Two groups, one to each server; A's forward is held, then A stops with its group. The client
    skips A, uploads that group again to B under the same upload id, and returns both groups once
    each; the next round goes to B alone."""
    a, stop_a, url_a = start(model)
    b, stop_b, url_b = start(model)
    gate = hold_forwards(a)
    client = RefClient(f"{url_a},{url_b}", timeout=120)
    result = []
    sent = [group(seed=1), group(seed=2)]
    t = threading.Thread(target=lambda: result.append(client.upload_and_pull(sent, 0, 0)))
    t.start()
    try:
        wait_for(lambda: a.counters["uploaded"] == 1 and b.counters["served"] == 1)
        gate.set()
        a.reference_logps = lambda *args: (_ for _ in ()).throw(RuntimeError("killed"))
        stop(a, stop_a)  # a server gone with its group: connections now refused
        t.join(timeout=60)
        assert not t.is_alive()
        got = result[0]
        assert sorted(tt["scores"][0].item() for tt, _ in got) == sorted(
            g[0]["scores"][0].item() for g in sent
        )  # both, each once
        assert len({meta["upload_id"] for _, meta in got}) == 2
        assert b.counters["uploaded"] == 2  # the one A held, uploaded again
        assert "stopped answering: skipped" in capfd.readouterr().err
        again = client.upload_and_pull([group(seed=3)], 1, 0)
        assert len(again) == 1 and b.counters["uploaded"] == 3
    finally:
        gate.set()
        stop(b, stop_b)


def test_a_second_copy_of_a_group_uploaded_again_is_dropped(model, capfd):
    """A group the client already uploaded again elsewhere, handed over later by the first server
    (it came back after a pause): dropped, not trained twice; the round's own group comes back."""
    a, stop_a, url_a = start(model)
    client = RefClient(url_a, timeout=60)
    tensors, meta = group(seed=7)
    client.uploaded["the-old-id"] = None  # ours, and taken back already
    client.received["the-old-id"] = None
    try:
        body = encode_batch(tensors, {**meta, "rank": 0, "version": 0, "upload_id": "the-old-id"})
        requests.post(url_a + "/upload", data=body, timeout=10)
        wait_for(lambda: a.queue_of(0).qsize() == 1)
        got = client.upload_and_pull([group(seed=8)], 1, 0)
    finally:
        stop(a, stop_a)
    assert [m["version"] for _, m in got] == [1]
    assert "dropped a second copy of a group" in capfd.readouterr().err


def test_a_group_another_run_left_on_this_ranks_queue_is_not_trained(model, capfd):
    """An earlier run (crashed, or ended with its last group taken but not yet acknowledged) left a
    group of version 0 in rank 0's queue: a new run's client takes it (the queue is rank 0's) but
    drops it, since it never uploaded it; a group of the same version would otherwise train."""
    a, stop_a, url_a = start(model)
    try:
        body = encode_batch(*group(seed=30, rank=0, version=0, upload_id="an-earlier-run"))
        requests.post(url_a + "/upload", data=body, timeout=10)
        wait_for(lambda: a.queue_of(0).qsize() == 1)
        got = RefClient(url_a, timeout=60).upload_and_pull([group(seed=31)], 0, 0)
    finally:
        stop(a, stop_a)
    assert [t["scores"][0].item() for t, _ in got] == [group(seed=31)[0]["scores"][0].item()]
    assert "dropped a group this trainer did not upload" in capfd.readouterr().err


def test_each_rank_takes_back_only_its_own_groups(model):
    """Rank 1's ready group stays for rank 1: rank 0's pull never takes it."""
    a, stop_a, url_a = start(model)
    try:
        requests.post(url_a + "/upload", data=encode_batch(*group(seed=1, rank=1)), timeout=10)
        wait_for(lambda: a.queue_of(1).qsize() == 1)
        got = RefClient(url_a, timeout=60).upload_and_pull([group(seed=2)], 0, 0)
        assert [m["rank"] for _, m in got] == [0] and a.queue_of(1).qsize() == 1
        assert requests.get(url_a + "/get?rank=x").status_code == 400
        for bad in ("99999", "\u00b2", "9" * 5000, "-1"):
            assert requests.get(url_a + "/get", params={"rank": bad}).status_code == 400, bad
    finally:
        stop(a, stop_a)


def test_every_server_must_hold_the_same_reference_model(model, tokenizer):
    """The handshake checks each server in REF_SERVER: one holding other weights stops the trainer
    at start, naming it, even with ALLOW_REF_MISMATCH (the servers must agree with each other)."""
    other = type(model)(model.config).eval()
    with torch.no_grad():
        for p_other, p in zip(other.parameters(), model.parameters()):
            p_other.copy_(p + 0.01)
    a, stop_a, url_a = start(model)
    b, stop_b, url_b = start(other)
    try:
        client = RefClient(f"{url_a},{url_b}", timeout=30)
        with pytest.raises(SystemExit, match=f"reference server at {url_b} holds"):
            client.health(model, tokenizer)
        with pytest.raises(SystemExit, match="differ in \\['fingerprint'\\]"):
            client.health(model, tokenizer, allow_mismatch=True)
        assert (
            RefClient(f"{url_a}, {url_a}/", timeout=30).health(model, tokenizer)["model"] == "tiny"
        )
    finally:
        stop(a, stop_a)
        stop(b, stop_b)
    with pytest.raises(ValueError, match="names no server"):
        RefClient(" , ")


def test_a_group_taken_with_ack_is_handed_again_until_acknowledged(model):
    """GET /get?rank=0&ack=... keeps the group it hands out: asked again without acknowledging it
    (its answer was lost), the same group comes back; acknowledged by its X-Upload-Id, it is gone
    and its room given back. A plain GET (no ack) takes a group for good."""
    a, stop_a, url_a = start(model)
    try:
        for seed, uid in ((1, "first"), (2, "second")):
            body = encode_batch(*group(seed=seed, rank=0, upload_id=uid))
            assert requests.post(url_a + "/upload", data=body, timeout=10).status_code == 200
        wait_for(lambda: a.queue_of(0).qsize() == 2)
        one = requests.get(url_a + "/get", params={"rank": 0, "ack": ""}, timeout=10)
        again = requests.get(url_a + "/get", params={"rank": 0, "ack": ""}, timeout=10)
        assert one.headers["X-Upload-Id"] == again.headers["X-Upload-Id"] == "first"
        assert one.content == again.content and a.counters["served"] == 1
        two = requests.get(url_a + "/get", params={"rank": 0, "ack": "first"}, timeout=10)
        assert two.headers["X-Upload-Id"] == "second"
        done = requests.get(url_a + "/get", params={"rank": 0, "ack": "second"}, timeout=10)
        assert done.status_code == 204 and a.room.held_bytes == 0
        assert requests.get(url_a + "/get", params={"rank": 0, "ack": "x" * 300}).status_code == 400
        requests.post(url_a + "/upload", data=encode_batch(*group(seed=3, rank=0)), timeout=10)
        wait_for(lambda: a.queue_of(0).qsize() == 1)
        assert requests.get(url_a + "/get", timeout=10).status_code == 200
        assert requests.get(url_a + "/get", timeout=10).status_code == 204  # taken for good
    finally:
        stop(a, stop_a)


def test_an_answer_cut_mid_body_is_asked_again_and_the_group_comes_once(model):
    """The first /get answer (a group of 8 x 300 tokens) is cut halfway, as when the server dies
    mid-response: the client does not crash, asks again, and gets that group once, at once, not
    after SERVER_TIMEOUT."""
    a, stop_a, url_a = start(model)
    relay = CuttingProxy(int(url_a.rsplit(":", 1)[1]), after=5000, cuts=1)
    try:
        client = RefClient(relay.url, timeout=60)
        began = time.time()
        got = client.upload_and_pull([group(G=8, plen=100, tc=200, seed=4)], 0, 0)
        assert relay.cuts == 0 and len(got) == 1 and time.time() - began < 20
        sent = group(G=8, plen=100, tc=200, seed=4)[0]["input_ids"]
        assert torch.equal(got[0][0]["input_ids"], sent)
        assert client.upload_and_pull([group(seed=5)], 1, 0)[0][1]["version"] == 1  # nothing late
    finally:
        stop(a, stop_a)


def test_a_slow_server_s_late_copy_of_a_group_sent_again_is_never_trained_twice(
    model, fast_failover, monkeypatch, capfd
):
    """Server A answers uploads after the failover time (alive, only slow): the client sends the
    group again to B and trains it from there. A then queues its own copy; when the next step's
    group goes to A, A's copy is dropped and only the new group comes back."""
    monkeypatch.setattr(server_client, "_DOWN_RETRY_S", 0.0)
    a, stop_a, url_a = start(model)
    b, stop_b, url_b = start(model)
    real_accept = a._accept

    def slow_accept(*args):
        time.sleep(3.0)
        return real_accept(*args)

    a._accept = slow_accept
    client = RefClient(f"{url_a},{url_b}", timeout=60)
    try:
        first = client.upload_and_pull([group(seed=1)], 0, 0)
        assert [m["version"] for _, m in first] == [0] and b.counters["uploaded"] == 1
        wait_for(lambda: a.queue_of(0).qsize() == 1)  # A's late copy, ready
        a._accept = real_accept
        client.down[url_b] = time.time() + 3600  # the next upload goes to A
        second = client.upload_and_pull([group(seed=2)], 1, 0)
        assert [m["version"] for _, m in second] == [1]
        assert "dropped a second copy of a group" in capfd.readouterr().err
    finally:
        stop(a, stop_a)
        stop(b, stop_b)


def test_a_workers_group_on_two_servers_is_taken_once(model):
    """A worker's upload that failed over sits on both servers under one upload id: a trainer rank
    taking extras from both takes it once."""
    a, stop_a, url_a = start(model)
    b, stop_b, url_b = start(model)
    try:
        body = encode_batch(*group(seed=6, worker="w1", version=0, upload_id="w1-group"))
        for url in (url_a, url_b):
            assert requests.post(url + "/upload", data=body, timeout=10).status_code == 200
        wait_for(lambda: a.ready["workers"].qsize() == 1 and b.ready["workers"].qsize() == 1)
        client = RefClient(f"{url_a},{url_b}", timeout=60, extra_groups=4)
        got = client.upload_and_pull([group(seed=7)], 0, 0)
        assert sorted(m.get("worker", "") for _, m in got) == ["", "w1"]
    finally:
        stop(a, stop_a)
        stop(b, stop_b)


def test_groups_sampled_by_newer_weights_are_dropped_and_counted():
    """After RESUME from step 5, a group of version 9 (a crashed run's leftover, a worker ahead) is
    dropped and counted as ahead; a group with no version counts as the oldest (0) here and in
    REGROUP alike, so at version 5 it is late (kept only with pi_old_logps)."""
    import grpo_ref_split as grpo
    from features.wire import sampled_version

    logps = {"pi_old_logps": torch.zeros(1)}
    groups = [(logps, {"version": 9}), (logps, {"version": 5}), ({}, {}), (logps, {})]
    kept, counts = grpo.drop_untrainable(groups, 5, max_staleness=10)
    assert [meta.get("version") for _, meta in kept] == [5, None]
    assert counts == {
        "ahead_groups_dropped": 1,
        "late_groups_dropped": 1,
        "stale_groups_dropped": 0,
    }
    assert sampled_version({}) == sampled_version({"version": None}) == 0


def exchanges(monkeypatch, url, timeout=60.0):
    """Step 5's two clients against one server at `url`: the lesson's plain upload_and_pull (as
    main() binds it to its run) and the sturdy RefClient, as (name, function(groups, version,
    rank)); `timeout` seconds of SERVER_TIMEOUT for both."""
    import functools

    import grpo_ref_split as grpo

    monkeypatch.setattr(grpo, "REF_SERVER", url)
    monkeypatch.setattr(grpo, "SERVER_TIMEOUT", timeout)
    plain = functools.partial(grpo.upload_and_pull, run="this-run")
    return [("plain", plain), ("sturdy", RefClient(url, timeout=timeout).upload_and_pull)]


@pytest.mark.parametrize("which", ["plain", "sturdy"])
def test_both_step_5_clients_bring_back_a_late_group_of_theirs_and_drop_an_earlier_runs(
    which, model, monkeypatch
):
    """An earlier run left a group queued for rank 0: either client drops it. Step 1's group whose
    reference forward outlasts the deadline comes back at step 2, first, beside step 2's own, with
    its version; drop_untrainable then drops it (no pi_old_logps: its ratio would be 1) and counts
    it."""
    import grpo_ref_split as grpo

    server, stop_serving, url = start(model)
    forward = server.reference_logps
    gate = threading.Event()

    def held(*args, **kwargs):  # step 1's forward outlasts its deadline
        gate.wait(timeout=60)
        return forward(*args, **kwargs)

    try:
        leftover, meta = group(seed=30)
        tagged = {**meta, "rank": 0, "version": 7, "upload_id": "an-earlier-run-0"}
        answer = requests.post(url + "/upload", data=encode_batch(leftover, tagged), timeout=10)
        assert answer.status_code == 200
        wait_for(lambda: server.queue_of(0).qsize() == 1)
        server.reference_logps = held
        exchange = dict(exchanges(monkeypatch, url, timeout=1.0))[which]
        late, on_time = group(seed=31), group(seed=32)
        for tensors, _ in (late, on_time):
            del tensors["pi_old_logps"]  # MU = 1: a rank's own groups carry none
        assert exchange([late], 0, 0) == []  # step 1: the leftover dropped, its own not ready
        gate.set()
        monkeypatch.setattr(grpo, "SERVER_TIMEOUT", 60.0)
        if which == "sturdy":
            exchange.__self__.timeout = 60.0
        got = exchange([on_time], 1, 0)  # step 2
    finally:
        gate.set()
        stop(server, stop_serving)
    assert [meta["version"] for _, meta in got] == [0, 1]
    assert torch.equal(got[0][0]["scores"], late[0]["scores"])
    assert torch.equal(got[1][0]["scores"], on_time[0]["scores"])
    kept, counts = grpo.drop_untrainable(got, 1, max_staleness=grpo.MAX_STALENESS)
    assert kept == got[1:] and counts["late_groups_dropped"] == 1


@pytest.mark.parametrize("which", ["plain", "sturdy"])
def test_both_step_5_clients_bring_each_group_back_once_with_the_same_ref_logps(
    which, model, monkeypatch
):
    """The same three groups through either client: each comes back once, tagged with the version
    and rank, with ref_logps equal bit for bit to what the server computes for it."""
    server, stop_serving, url = start(model)
    try:
        exchange = dict(exchanges(monkeypatch, url))[which]
        sent = [group(seed=s) for s in (11, 12, 13)]
        got = exchange(sent, 4, 0)
        assert [m["version"] for _, m in got] == [4, 4, 4]
        assert [m["rank"] for _, m in got] == [0, 0, 0]
        assert sorted(t["scores"][0].item() for t, _ in got) == sorted(
            t["scores"][0].item() for t, _ in sent
        )
        for tensors, meta in got:
            want = server.reference_logps(tensors["input_ids"], meta["plen"], 1.0)
            assert torch.equal(tensors["ref_logps"], want)
        assert server.counters["served"] == 3
    finally:
        stop(server, stop_serving)


@pytest.mark.parametrize("which", ["plain", "sturdy"])
def test_both_step_5_clients_never_take_a_group_twice_across_steps(which, model, monkeypatch):
    """Step after step on one server: each call brings back its own groups and no group a call
    before took (the last one a call takes is acknowledged before it returns, or remembered)."""
    server, stop_serving, url = start(model)
    try:
        exchange = dict(exchanges(monkeypatch, url))[which]
        for step in range(3):
            sent = [group(seed=40 + 2 * step), group(seed=41 + 2 * step)]
            got = exchange(sent, step, 0)
            assert [meta["version"] for _, meta in got] == [step, step]
            want = sorted(tensors["scores"][0].item() for tensors, _ in sent)
            assert sorted(tensors["scores"][0].item() for tensors, _ in got) == want
        assert server.counters["served"] == 6
    finally:
        stop(server, stop_serving)


@pytest.mark.parametrize("which", ["plain", "sturdy"])
def test_both_step_5_clients_survive_a_restarted_server(which, model, monkeypatch):
    """The server's forward is held with two groups uploaded; it stops and a new one starts on the
    same port (a new instance, empty queues): either client uploads what was lost again and gets
    each group back once."""
    server, stop_serving, url = start(model)
    port = int(url.rsplit(":", 1)[1])
    gate = threading.Event()

    def dies_in_forward(*args):  # released only once the server no longer answers
        gate.wait()
        raise RuntimeError("killed")

    server.reference_logps = dies_in_forward
    exchange = dict(exchanges(monkeypatch, url))[which]
    result = []
    sent = [group(seed=21), group(seed=22)]
    t = threading.Thread(target=lambda: result.append(exchange(sent, 0, 0)))
    t.start()
    again = None
    try:
        wait_for(lambda: server.counters["uploaded"] == 2)
        threading.Timer(1.0, gate.set).start()  # after its HTTP server has stopped
        stop(server, stop_serving)
        again, stop_again, _ = start(model, port=port)
        t.join(timeout=60)
        assert not t.is_alive()
        got = result[0]
        assert sorted(tt["scores"][0].item() for tt, _ in got) == sorted(
            g[0]["scores"][0].item() for g in sent
        )
        assert again.counters["uploaded"] == 2 and again.counters["served"] == 2
    finally:
        gate.set()
        if again is not None:
            stop(again, stop_again)
