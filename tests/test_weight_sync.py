"""Weights to workers over HTTP (features/weight_sync.py) and the staleness bound: versions served
and fetched whole, a transfer cut halfway resumed, a version replaced mid-transfer never mixed, the
guard."""
import requests
import torch

import grpo_ref_split as grpo
from conftest import CuttingProxy, free_port, wait_for
from features import weight_sync


def weights(seed, n=3, size=300_000):
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(size, generator=g) for i in range(n)}


def test_a_worker_fetches_each_published_version_whole(publisher):
    """Versions 1 then 2: each arrives bit for bit, tied names sent once, with the size and sha256
    that /weights/info announced."""
    fetcher = weight_sync.WeightFetcher(publisher.url, "", version=0, max_bytes=2**30, poll_s=0.05)
    try:
        first = weights(1)
        publisher.publish(first, 1)
        wait_for(lambda: fetcher.ready is not None, timeout=60)
        version, got = fetcher.take()
        assert version == 1 and got.keys() == first.keys()
        assert all(torch.equal(got[k], first[k]) for k in first)
        assert fetcher.take() is None  # handed over once
        second = weights(2)
        publisher.publish(second, 2)
        wait_for(lambda: fetcher.ready is not None, timeout=60)
        version, got = fetcher.take()
        assert version == 2 and all(torch.equal(got[k], second[k]) for k in second)
    finally:
        fetcher.stop()
    shared = torch.nn.Linear(4, 4).weight
    publisher.publish({"embed.weight": shared, "head.weight": shared}, 3)
    info = requests.get(publisher.url + "/weights/info", timeout=10).json()
    body = requests.get(publisher.url + "/weights", params={"version": 3}, timeout=10).content
    from safetensors.torch import load

    assert info["version"] == 3 and info["size"] == len(body)
    assert list(load(body)) == ["embed.weight"]  # a tied tensor once, as the model names it


def fetch_once(url, cleanup=None):
    """The first version a fresh WeightFetcher at `url` checks and hands over, and its counts."""
    fetcher = weight_sync.WeightFetcher(url, "", version=0, max_bytes=2**30, poll_s=0.05,
                                        retry_s=0.05)
    try:
        wait_for(lambda: fetcher.ready is not None, timeout=60)
        version, got = fetcher.take()
    finally:
        fetcher.stop()
        if cleanup is not None:
            cleanup()
    return version, got, fetcher.counts


def test_a_transfer_cut_halfway_resumes_and_ends_on_the_whole_version(publisher):
    """The link drops twice in the middle of the answer: the worker resumes with Range requests and
    swaps in exactly the published tensors; it never hands over a partial file."""
    published = weights(3)
    publisher.publish(published, 1)
    proxy = CuttingProxy(int(publisher.url.rsplit(":", 1)[1]), after=1_500_000, cuts=2)
    version, got, counts = fetch_once(proxy.url)
    assert version == 1 and all(torch.equal(got[k], published[k]) for k in published)
    assert counts["resumed"] >= 1 and proxy.connections >= 3


def test_a_version_replaced_mid_transfer_is_never_mixed(publisher):
    """The first transfer is cut; before the worker resumes, version 2 replaces version 1: the
    resume of version 1 is refused (409), and the worker ends on version 2 whole, never on a mix."""
    publisher.publish(weights(4), 1)
    proxy = CuttingProxy(int(publisher.url.rsplit(":", 1)[1]), after=1_000_000, cuts=1)
    second = weights(5)
    original = requests.get

    def get(url, *args, **kwargs):  # before any resume: the trainer publishes version 2
        if "Range" in kwargs.get("headers", {}) and publisher.current[0] == 1:
            publisher.publish(second, 2)
        return original(url, *args, **kwargs)

    weight_sync.requests.get = get

    def restore():
        weight_sync.requests.get = original
    version, got, counts = fetch_once(proxy.url, cleanup=restore)
    assert counts["replaced"] == 1
    assert version == 2 and all(torch.equal(got[k], second[k]) for k in second)


def test_the_weight_channel_is_read_only_and_guarded():
    """With a token: 401 without it; no route writes weights (405); a bad version or range is a 4xx
    that names the problem; before the first publication /weights/info is 404."""
    port = free_port()
    pub = weight_sync.WeightPublisher("127.0.0.1", port, token="s3cret")
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer s3cret"}
    try:
        assert requests.get(url + "/weights/info", headers=auth, timeout=10).status_code == 404
        pub.publish(weights(6, n=1, size=1000), 7)
        assert requests.get(url + "/weights/info", timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert requests.get(url + "/weights", params={"version": 7}, headers=wrong,
                            timeout=10).status_code == 401
        for method in (requests.post, requests.put):
            answer = method(url + "/weights", data=b"x" * 100, headers=auth, timeout=10)
            assert answer.status_code in (401, 405) and answer.status_code != 200
        answer = requests.post(url + "/weights", data=b"x", headers=auth, timeout=10)
        assert answer.status_code == 405
        bad = requests.get(url + "/weights", params={"version": "seven"}, headers=auth, timeout=10)
        assert bad.status_code == 400 and "version" in bad.json()["error"]
        old = requests.get(url + "/weights", params={"version": 6}, headers=auth, timeout=10)
        assert old.status_code == 409
        for header in ("bytes=99999999-", "bytes=0-10", "items=3-"):
            ranged = requests.get(
                url + "/weights",
                params={"version": 7},
                headers={**auth, "Range": header},
                timeout=10,
            )
            assert ranged.status_code == 416, header
        whole = requests.get(url + "/weights", params={"version": 7}, headers=auth, timeout=10)
        tail = requests.get(
            url + "/weights",
            params={"version": 7},
            headers={**auth, "Range": "bytes=100-"},
            timeout=10,
        )
        assert tail.status_code == 206 and tail.content == whole.content[100:]
    finally:
        pub.stop()


def test_groups_older_than_max_staleness_are_dropped_and_counted():
    """At version 12 with MAX_STALENESS 3: a worker's group of version 9 (with pi_old_logps) trains,
    one of version 8 is dropped as stale; a group of the current version always trains."""
    logps = {"pi_old_logps": torch.zeros(1)}
    groups = [
        (logps, {"version": 12}),
        (logps, {"version": 9}),
        (logps, {"version": 8}),
        ({}, {"version": 12}),
        (logps, {"version": 2}),
    ]
    kept, counts = grpo.drop_untrainable(groups, 12, max_staleness=3)
    assert [meta["version"] for _, meta in kept] == [12, 9, 12]
    assert counts["stale_groups_dropped"] == 2 and counts["late_groups_dropped"] == 0


def test_a_worker_without_a_shared_disk_swaps_in_weights_served_over_http(tiny_model_dir, tmp_path):
    """A genonly worker with WEIGHTS_FROM and an OUTPUT_DIR it shares with nobody: the weights the
    trainer's publisher serves as version 3 reach it over HTTP, and its groups then carry version 3
    and the new weights' log-probs (pi_old_logps), not the old ones."""
    import subprocess
    import sys
    import time

    from transformers import AutoModelForCausalLM

    from conftest import ROOT, ServerProcess, kill_group, pull, trainer_env

    srv = ServerProcess(tiny_model_dir, free_port(), tmp_path / "server.log")
    port = free_port()
    pub = weight_sync.WeightPublisher("127.0.0.1", port, token="")
    env = trainer_env(
        tiny_model_dir,
        srv.url,
        tmp_path / "worker_out",
        WORKER_MAX_QUEUED=2,
        MAX_NEW_TOKENS=24,
        WEIGHTS_FROM=f"http://127.0.0.1:{port}",
    )
    log_path = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "grpo_ref_split.py", "genonly"],
        cwd=ROOT,
        env=env,
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        tensors, meta = pull(srv.url, timeout=300, path="/get?from=workers")
        assert meta["version"] == 0
        moved = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with torch.no_grad():
            for p in moved.parameters():
                p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(0)) * 0.02)
        pub.publish(weight_sync.policy_weights(moved), 3)
        deadline = time.time() + 300
        while meta["version"] != 3:
            assert time.time() < deadline, log_path.read_text()[-2000:]
            tensors, meta = pull(srv.url, timeout=300, path="/get?from=workers")
        assert "swapped in the trainer's weights: policy version 3" in log_path.read_text()
        ids, mask = tensors["input_ids"], tensors["completion_mask"]
        with torch.no_grad():
            new, old = (
                grpo.logps_for_run()(m.eval(), ids, torch.ones_like(ids), mask.shape[1])
                for m in (moved, AutoModelForCausalLM.from_pretrained(tiny_model_dir))
            )  # (G, T)
        assert (tensors["pi_old_logps"] - new)[mask].abs().max() < 1e-4
        assert (tensors["pi_old_logps"] - old)[mask].abs().max() > 1e-2
        # no checkpoint anywhere: nothing shared on disk
        assert not list(tmp_path.glob("**/step_*"))
    finally:
        kill_group(worker)
        pub.stop()
        srv.stop()


def test_lora_sends_the_adapters_alone_and_the_worker_merges_them(tiny_model_dir, publisher):
    """A LoRA policy publishes only its adapters (B times its scaling): a few percent of the full
    weights' bytes; a plain worker model that swaps them in twice holds the merged weights each
    time (peft's own merge, lora.merged_state_dict), not base + both deltas."""
    from transformers import AutoModelForCausalLM

    from features import lora

    policy = lora.add_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        rank=4,
        alpha=8,
        targets="all-linear",
        seed=0,
    )
    worker = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    full_bytes = sum(p.numel() * p.element_size() for p in worker.parameters())
    for version in (1, 2):
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:  # B starts at 0: give the adapters something to say
                    p.add_(torch.randn_like(p) * 0.05)
        weight_sync.publish_every(publisher, policy, version, 1)
        body = requests.get(
            publisher.url + "/weights", params={"version": version}, timeout=30
        ).content
        assert len(body) < 0.2 * full_bytes
        from safetensors.torch import load

        weight_sync.swap_in(worker, load(body))
        merged = lora.merged_state_dict(policy)
        own = worker.state_dict()
        for name, value in merged.items():
            torch.testing.assert_close(own[name], value, rtol=1e-5, atol=1e-6)
