"""LoRA (LORA_RANK > 0): only the adapters train, the reference is the base with the adapters
switched off (no server), checkpoints hold the adapters, resume is exact, and the merged folder is
the trained policy."""
import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import grpo_ref_split as grpo
from conftest import free_port, group, metrics, params, pull, start, stop, train
from features.fast_paths import completion_logps
from features.lora import add_lora
from test_variants import PlainEngine

LORA = dict(LORA_RANK=4, LORA_ALPHA=8, SAVE_STEPS=1, EVAL_STEPS=0,
            # nobody listens: no server is used
            REF_SERVER=f"http://127.0.0.1:{free_port()}", SERVER_TIMEOUT=5)


def load(folder):
    """A plain transformers model. Imported here, not at the top: transformers' modeling code
    imports triton, which must come after tests/test_triton.py sets TRITON_INTERPRET (collection
    imports every module first)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def logps_of(model, seed=0):
    """Log-probs of a fixed batch of 4 random rows (prompt 8, completion 6 tokens) at
    TEMPERATURE."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49152, (4, 14), generator=g)
    with torch.no_grad():
        return grpo.logps_for_run()(model.eval(), ids, torch.ones_like(ids), 6)  # (4, 6)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Three LoRA runs on one rank: 3 steps straight; 2 steps; those 2 resumed to 3."""
    out = tmp_path_factory.mktemp("lora")
    straight = train(tiny_model_dir, "", out / "straight", 1, ALL_STEPS=3, **LORA)
    first = train(tiny_model_dir, "", out / "resumed", 1, ALL_STEPS=2, **LORA)
    resumed = train(tiny_model_dir, "", out / "resumed", 1, ALL_STEPS=3, RESUME=1, **LORA)
    for run in (straight, first, resumed):
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out, straight.stdout + straight.stderr


def test_lora_trains_only_the_adapters_against_the_base_without_a_server(runs, tiny_model_dir):
    out, log = runs
    base = params(tiny_model_dir)
    assert "LoRA rank 4: " in log and "trainable parameters of" in log
    step = out / "straight" / "step_3"
    # no full copy
    assert sorted(f for f in os.listdir(step) if "safetensors" in f) == [
        "adapter_model.safetensors"
    ]
    adapters = load_file(step / "adapter_model.safetensors")
    assert adapters and all("lora_A" in k or "lora_B" in k for k in adapters)
    # B starts at 0: it trained
    assert all(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)
    # The merged folder is the base plus the adapters' update on the targeted layers, and the base
    # elsewhere: the frozen weights did not move.
    merged = params(out / "straight" / "merged")
    assert merged.keys() == base.keys()
    targeted = {
        k.split("base_model.model.")[1].replace(".lora_A.weight", ".weight")
        for k in adapters
        if "lora_A" in k
    }
    assert targeted and all(torch.equal(merged[k], base[k]) for k in base if k not in targeted)
    assert all(not torch.equal(merged[k], base[k]) for k in targeted)
    scale = 8 / 4  # LORA_ALPHA / LORA_RANK
    for k in targeted:
        a, b = (adapters[f"base_model.model.{k[: -len('.weight')]}.lora_{x}.weight"] for x in "AB")
        torch.testing.assert_close(merged[k], base[k] + scale * b @ a, rtol=0, atol=1e-6)
    lines, _ = metrics(out / "straight")
    assert lines[0]["kl"] < 1e-9  # step 1: B = 0, so the policy is exactly the base: the reference
    assert lines[2]["kl"] > 0  # the adapters moved it away from the base they are switched off for


def test_the_merged_folder_and_a_worker_reproduce_the_trained_policy(
    runs, tiny_model_dir, monkeypatch
):
    out, _ = runs
    from peft import PeftModel

    trained = PeftModel.from_pretrained(load(tiny_model_dir), out / "straight" / "step_3")
    merged = load(out / "straight" / "merged")  # no peft
    assert (logps_of(trained) - logps_of(load(tiny_model_dir))).abs().max() > 1e-4
    torch.testing.assert_close(logps_of(merged), logps_of(trained), rtol=0, atol=1e-5)
    # a genonly worker loads step_N like this
    monkeypatch.setattr(grpo, "MODEL_PATH", tiny_model_dir)
    worker, *_ = grpo.load_policy(str(out / "straight" / "step_3"), torch.device("cpu"))
    torch.testing.assert_close(logps_of(worker), logps_of(trained), rtol=0, atol=0)


def test_resume_from_an_adapter_checkpoint_is_bit_identical(runs):
    out, _ = runs
    for name in ("step_3/adapter_model.safetensors", "merged/model.safetensors"):
        a, b = load_file(out / "straight" / name), load_file(out / "resumed" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert [m["reward"] for m in metrics(out / "resumed")[0]] == [
        m["reward"] for m in metrics(out / "straight")[0]
    ]
    answers = [
        [json.loads(x) for x in (out / n / "completions.jsonl").read_text().splitlines()]
        for n in ("straight", "resumed")
    ]
    assert answers[0] == answers[1]


def test_reference_from_the_disabled_adapters_equals_the_servers_on_the_base(model, monkeypatch):
    server, stop_serving, url = start(model)  # the server holds the base model
    try:
        tensors, meta = group(G=3, plen=5, tc=4, seed=3)
        del tensors["pi_old_logps"]
        import requests

        from features.wire import encode_batch

        assert (
            requests.post(url + "/upload", data=encode_batch(tensors, meta), timeout=10).status_code
            == 200
        )
        served, _ = pull(url)
    finally:
        stop(server, stop_serving)
    monkeypatch.setattr(grpo.lora, "LORA_RANK", 4)
    monkeypatch.setattr(grpo, "TEMPERATURE", meta["temperature"])
    policy = add_lora(
        copy.deepcopy(model),
        rank=grpo.lora.LORA_RANK,
        alpha=grpo.lora.LORA_ALPHA,
        targets=grpo.lora.LORA_TARGETS,
        seed=grpo.SEED,
    )
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained adapter: the policy is no longer the base
    batch = grpo.collate([({k: v for k, v in tensors.items()}, meta)], pad_id=0)
    assert batch.ref_logps is None  # nothing went to a server
    b = grpo.prepare_batch(PlainEngine(policy, lr=0.0), batch, normalizer=1.0,
                          fills=grpo.fills_for_run())  # REF_FROM_BASE's
    torch.testing.assert_close(b.ref_logps, served["ref_logps"], rtol=0, atol=1e-5)
    own = completion_logps(
        policy,
        b.input_ids,
        b.attention_mask,
        4,
        meta["temperature"],
        chunk=grpo.fast_paths.LOGP_CHUNK,
        from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
    )
    # with the adapters on it would have differed
    assert (own - served["ref_logps"]).abs().max() > 1e-3


def test_lora_on_two_zero2_ranks_keeps_them_in_step(tiny_model_dir, tmp_path):
    """With gradient checkpointing and micro-batches of one group: the adapters' gradients reduce
    like any."""
    run = train(
        tiny_model_dir,
        "",
        tmp_path,
        2,
        ALL_STEPS=2,
        GRADIENT_CHECKPOINTING=1,
        TRAIN_MICRO_BATCH=1,
        **LORA,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines, _ = metrics(tmp_path)
    assert [m["max_weight_gap"] for m in lines] == [0.0, 0.0] and lines[1]["kl"] > 0
    adapters = load_file(tmp_path / "step_2" / "adapter_model.safetensors")
    assert all(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)


def test_a_worker_refuses_to_feed_a_trainer_that_takes_its_reference_from_the_base(tiny_model_dir):
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "MODEL_PATH": tiny_model_dir, "LORA_RANK": "4", "GENONLY": "1"}
    run = subprocess.run(
        [sys.executable, "grpo_ref_split.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        run.returncode == 1 and "REF_FROM_BASE, trainers never read from the server" in run.stderr
    )


def test_lora_with_the_reference_on_the_server(server, tiny_model_dir, tmp_path):
    """REF_FROM_BASE=0: the server holds the base; its fingerprint check sees the base under the
    adapters."""
    before = server.health()
    run = train(
        tiny_model_dir,
        server.url,
        tmp_path,
        1,
        **{**LORA, "REF_SERVER": server.url, "REF_FROM_BASE": 0, "SERVER_TIMEOUT": 120},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines, _ = metrics(tmp_path)
    # the server's reference is the policy's start
    assert lines[0]["kl"] < 1e-9 and lines[1]["kl"] > 0
    assert server.health()["served"] - before["served"] >= 2  # the groups went through it
