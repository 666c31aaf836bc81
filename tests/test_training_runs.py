"""Whole training runs on CPU (deepspeed --num_gpus 1, the tiny model): resume after a kill,
the variants without a server, a server killed mid-run, and a genonly generation worker."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import requests
import torch

import grpo_ref_split as grpo
from conftest import (
    ROOT,
    ServerProcess,
    free_port,
    kill_group,
    metrics,
    params,
    pull,
    train,
    trainer_cmd,
    trainer_env,
    wait_for,
)


def ds_config(tmp_path, scheduler):
    """ds_config.json with another scheduler block (None: none at all); returns its path."""
    with open(os.path.join(ROOT, "ds_config.json")) as f:
        config = json.load(f)
    config.pop("scheduler")
    if scheduler:
        config["scheduler"] = {"type": "WarmupCosineLR", "params": scheduler}
    path = tmp_path / f"ds_config_{len(os.listdir(tmp_path))}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_resume_after_a_kill_continues_like_the_uninterrupted_run(server, tiny_model_dir, tmp_path):
    """With a learning-rate schedule that changes every step: resume continues it where it
    stopped."""
    schedule = dict(
        warmup_num_steps=2, warmup_min_ratio=0.5, cos_min_ratio=0.1, warmup_type="linear"
    )
    run = dict(
        ALL_STEPS=3,
        SAVE_STEPS=1,
        KEEP_CHECKPOINTS=2,
        EVAL_STEPS=0,
        DS_CONFIG=ds_config(tmp_path, schedule),
    )
    straight = train(tiny_model_dir, server.url, tmp_path / "straight", 1, **run)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "straight")) == [
        "completions.jsonl",
        "curves.png",
        "metrics.jsonl",
        "step_2",
        "step_3",
    ]

    # Killed with SIGKILL (no clean-up of any kind) as soon as step_1 is saved, mid step 2.
    out = tmp_path / "killed"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            trainer_cmd(1),
            cwd=ROOT,
            env=trainer_env(tiny_model_dir, server.url, out, **run),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(lambda: (out / "step_1").exists() or proc.poll() is not None, timeout=300)
        kill_group(proc)
    saved = [n for n in os.listdir(out) if n.startswith("step_") and not n.endswith(".tmp")]
    assert "step_3" not in saved, "killed too late to test anything"
    assert os.path.exists(out / "step_1" / "deepspeed")  # the optimizer state is in the checkpoint
    wait_for(lambda: server.health()["pending"] == 0)
    # the killed run's last groups
    while requests.get(server.url + "/get", timeout=10).status_code == 200:
        pass

    resumed = train(tiny_model_dir, server.url, out, 1, RESUME=1, **run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    newest = max(int(n[5:]) for n in saved)
    assert (
        f"resumed from {out / f'step_{newest}'} (step {newest})" in resumed.stdout + resumed.stderr
    )
    steps = [m["step"] for m in metrics(out)[0]]
    assert steps == [1, 2, 3]  # the lines after the checkpoint were dropped, none is doubled
    straight_answers, resumed_answers = (
        [
            json.loads(line)
            for line in (tmp_path / name / "completions.jsonl").read_text().splitlines()
        ]
        for name in ("straight", "killed")
    )
    # and the answers: the same, in the same order, each once
    assert resumed_answers == straight_answers
    # The same step count, optimizer moments, question order and sampling stream: bit for bit the
    # weights of the run that was never interrupted (a fresh Adam or a re-seeded sampler would
    # differ).
    a, b = params(tmp_path / "straight" / "step_3"), params(out / "step_3")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["reward"] for m in metrics(out)[0]] == [
        m["reward"] for m in metrics(tmp_path / "straight")[0]
    ]
    lr = 1e-3  # trainer_env's LR: warmup 0.5 -> 0.75 of it, then cosine down to 0.1 at ALL_STEPS
    assert [m["lr"] for m in metrics(out)[0]] == pytest.approx([0.5 * lr, 0.75 * lr, 0.1 * lr])
    assert [m["lr"] for m in metrics(tmp_path / "straight")[0]] == [
        m["lr"] for m in metrics(out)[0]
    ]


def test_the_default_schedule_falls_from_lr_to_a_tenth_by_the_last_step(
    server, tiny_model_dir, tmp_path
):
    """ds_config.json's cosine (the demo's, bench/RESULTS.md): LR for DeepSpeed's warmup (at least 2
    steps, at warmup_min_ratio 1.0), then half-way down the cosine, 0.1 + 0.9 x (1 + cos(pi / 2)) /
    2 = 0.55 of it, then 0.1 of it at the last step."""
    run = train(
        tiny_model_dir,
        server.url,
        tmp_path,
        1,
        ALL_STEPS=4,
        EVAL_STEPS=0,
        SAVE_STEPS=0,
        DS_CONFIG=os.path.join(ROOT, "ds_config.json"),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lr = 1e-3  # trainer_env's LR
    assert [m["lr"] for m in metrics(tmp_path)[0]] == pytest.approx([lr, lr, 0.55 * lr, 0.1 * lr])


def test_the_fused_adamw_of_ds_config_steps_like_the_plain_loop():
    """ds_config.json asks DeepSpeed for torch's fused AdamW (faster: README, "Step anatomy");
    `"fused": false` is the plain path. Five steps on the same gradients give the same weights."""
    with open(os.path.join(ROOT, "ds_config.json")) as f:
        params_ = {
            k: v for k, v in json.load(f)["optimizer"]["params"].items() if k != "torch_adam"
        }
    assert params_.pop("fused") is True
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(1000, generator=g), torch.randn(37, 5, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in start] for _ in range(5)]
    weights = {}
    for fused in (True, False):
        ps = [torch.nn.Parameter(p.clone()) for p in start]
        opt = torch.optim.AdamW(ps, **params_, fused=fused, foreach=False)
        for step in grads:
            for p, grad in zip(ps, step):
                p.grad = grad.clone()
            opt.step()
        weights[fused] = ps
    assert all(
        torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(weights[True], weights[False])
    )
    # lr 1e-5 x 5 steps moved them
    assert all((a - p0).abs().max() > 1e-6 for a, p0 in zip(weights[True], start))


def test_resume_without_a_checkpoint_starts_at_step_one(server, tiny_model_dir, tmp_path):
    run = train(tiny_model_dir, server.url, tmp_path, 1, RESUME=1, ALL_STEPS=1, EVAL_STEPS=0)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no step_N checkpoint" in run.stdout + run.stderr
    assert [m["step"] for m in metrics(tmp_path)[0]] == [1]


def test_a_fresh_run_refuses_a_folder_with_another_runs_checkpoints(tiny_model_dir, tmp_path):
    """KEEP_CHECKPOINTS keeps the highest step_N: a fresh run beside an older run's step_5 would
    delete its own checkpoints, and RESUME would pick the old one. Nothing is written, nothing
    deleted."""
    old = tmp_path / "step_5"
    shutil.copytree(tiny_model_dir, old)
    before = sorted(os.listdir(old))
    run = train(tiny_model_dir, f"http://127.0.0.1:{free_port()}", tmp_path, 1, ALL_STEPS=1)
    assert run.returncode != 0
    assert f"{tmp_path}/ holds checkpoints of an earlier run" in run.stderr
    assert "RESUME=1" in run.stderr and "another OUTPUT_DIR" in run.stderr
    assert sorted(os.listdir(tmp_path)) == ["step_5"] and sorted(os.listdir(old)) == before


def test_beta_zero_and_the_variants_train_without_any_server(tiny_model_dir, tmp_path):
    """BETA=0 with LOSS_TYPE dapo, MASK_TRUNCATED and CLIP_EPS_HIGH on: no server is ever asked.
    Against the same run with the three off, step 1 samples the very same answers (seeded) and its
    loss differs: they reached the loss."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: any request would fail the run
    # 16: the longer sums are cut
    common = dict(BETA=0, MU=2, MAX_NEW_TOKENS=16, SERVER_TIMEOUT=5, EVAL_STEPS=0)
    run = train(
        tiny_model_dir,
        dead,
        tmp_path / "on",
        1,
        LOSS_TYPE="dapo",
        MASK_TRUNCATED=1,
        CLIP_EPS_HIGH=0.28,
        **common,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (
        "retrying" not in run.stderr and "kl" not in run.stdout.split("step    1")[1].split("\n")[0]
    )
    lines = metrics(tmp_path / "on")[0]
    assert [m["step"] for m in lines] == [1, 2] and all("kl" not in m for m in lines)
    assert all(m["ratio_drift"] > 0 for m in lines)  # MU = 2: the second pass sees a ratio != 1
    before, after = params(tiny_model_dir), params(tmp_path / "on" / "step_2")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    off = train(tiny_model_dir, dead, tmp_path / "off", 1, ALL_STEPS=1, **common)
    assert off.returncode == 0, off.stderr[-3000:]
    records = [
        [
            r
            for r in map(
                json.loads, (tmp_path / name / "completions.jsonl").read_text().splitlines()
            )
            if r["step"] == 1
        ]
        for name in ("on", "off")
    ]
    # the same samples ...
    assert [r["completion"] for r in records[0]] == [r["completion"] for r in records[1]]
    # ... some of them cut: MASK_TRUNCATED had answers to mask
    assert any(r["truncated"] for r in records[0])
    assert metrics(tmp_path / "off")[0][0]["loss"] != pytest.approx(lines[0]["loss"], rel=1e-3)


def test_a_run_trains_with_gspo(tiny_model_dir, tmp_path):
    """GSPO=1 (one ratio per answer) through a whole run, MU=2 so that the ratio is not 1: it
    finishes, its clip is the paper's, and its loss differs from the same run's per-token ratio from
    the second pass on."""
    dead = f"http://127.0.0.1:{free_port()}"
    common = dict(
        BETA=0, MU=2, ALL_STEPS=1, CLIP_EPS=3e-4, CLIP_EPS_HIGH=4e-4, SERVER_TIMEOUT=5, EVAL_STEPS=0
    )
    gspo = train(tiny_model_dir, dead, tmp_path / "gspo", 1, GSPO=1, **common)
    assert gspo.returncode == 0, gspo.stderr[-3000:]
    assert "warning: GSPO" not in gspo.stderr  # the paper's clip: no warning
    token = train(tiny_model_dir, dead, tmp_path / "token", 1, **common)
    assert token.returncode == 0, token.stderr[-3000:]
    (g,), (t,) = metrics(tmp_path / "gspo")[0], metrics(tmp_path / "token")[0]
    assert g["ratio_drift"] > 0 and g["loss"] != pytest.approx(t["loss"], rel=1e-4)


def test_the_trainer_survives_the_server_being_killed_mid_run(tiny_model_dir, tmp_path):
    port = free_port()
    srv = ServerProcess(tiny_model_dir, port, tmp_path / "server1.log")
    out = tmp_path / "out"
    log = open(tmp_path / "trainer.log", "w")
    proc = subprocess.Popen(
        trainer_cmd(1),
        cwd=ROOT,
        env=trainer_env(tiny_model_dir, srv.url, out, ALL_STEPS=4, SAVE_STEPS=4, EVAL_STEPS=0),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: (
                (out / "metrics.jsonl").exists()
                and (out / "metrics.jsonl").read_text().count("\n") >= 1
            ),
            timeout=300,
        )
        srv.proc.kill()  # SIGKILL: whatever it held is gone
        srv.proc.wait()
        srv.log.close()
        wait_for(
            lambda: "unreachable; retrying" in (tmp_path / "trainer.log").read_text(), timeout=300
        )
        srv = ServerProcess(tiny_model_dir, port, tmp_path / "server2.log")
        assert proc.wait(timeout=400) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            kill_group(proc)
        log.close()
        srv.stop()
    text = (tmp_path / "trainer.log").read_text()
    assert "unreachable; retrying" in text or "restarted" in text
    assert [m["step"] for m in metrics(out)[0]] == [1, 2, 3, 4]
    assert (out / "step_4").exists()


def test_a_genonly_worker_feeds_the_server_and_follows_new_checkpoints(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    srv = ServerProcess(tiny_model_dir, free_port(), tmp_path / "server.log")
    out = tmp_path / "out"
    out.mkdir()
    env = trainer_env(tiny_model_dir, srv.url, out, WORKER_MAX_QUEUED=2, MAX_NEW_TOKENS=24)
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [sys.executable, "grpo_ref_split.py", "genonly"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        # not in the trainer ranks' queue ...
        assert requests.get(srv.url + "/get", timeout=10).status_code == 204
        # ... in the workers' one
        tensors, meta = pull(srv.url, timeout=300, path="/get?from=workers")
        assert (
            meta["version"] == 0 and meta["worker"].startswith("worker-") and "ref_logps" in tensors
        )
        # Left alone, it stops at WORKER_MAX_QUEUED (plus one round in flight) instead of piling up
        # groups.
        wait_for(
            lambda: "waiting: the server holds 2 groups" in (tmp_path / "worker.log").read_text(),
            timeout=300,
        )
        h = srv.health()
        assert h["pending"] + h["ready_workers"] <= 2 + 2, h
        # A checkpoint with other weights appears (atomically, as save_checkpoint renames it): the
        # worker switches to it, and its groups' pi_old_logps are the new weights' log-probs of its
        # answers.
        moved = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with torch.no_grad():
            for p in moved.parameters():
                p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(0)) * 0.02)
        # the tokenizer; then the new weights over it
        shutil.copytree(tiny_model_dir, out / "step_3.tmp")
        moved.save_pretrained(out / "step_3.tmp")
        os.rename(out / "step_3.tmp", out / "step_3")
        deadline = time.time() + 300
        while meta["version"] != 3:
            assert time.time() < deadline, (tmp_path / "worker.log").read_text()[-2000:]
            tensors, meta = pull(srv.url, timeout=300, path="/get?from=workers")
        assert "policy version 3" in (tmp_path / "worker.log").read_text()
        ids, mask = tensors["input_ids"], tensors["completion_mask"]
        with torch.no_grad():
            new, old = (
                grpo.logps_for_run()(m.eval(), ids, torch.ones_like(ids), mask.shape[1])
                for m in
                # (G, T) each
                (moved, AutoModelForCausalLM.from_pretrained(tiny_model_dir))
            )
        # sampled and scored by the new weights
        assert (tensors["pi_old_logps"] - new)[mask].abs().max() < 1e-4
        assert (tensors["pi_old_logps"] - old)[mask].abs().max() > 1e-2  # not the old ones
        # version-3 groups waiting (the older ones were pulled)
        wait_for(lambda: srv.health()["ready_workers"] > 0, timeout=300)
    finally:
        kill_group(worker)
        log.close()

    # A trainer on the same server takes the worker's waiting groups too, and logs how stale they
    # are.
    try:
        wait_for(lambda: srv.health()["pending"] == 0)
        waiting = srv.health()["ready_workers"]
        assert waiting > 0
        run = train(
            tiny_model_dir,
            srv.url,
            tmp_path / "trainer",
            1,
            ALL_STEPS=2,
            EVAL_STEPS=0,
            EXTRA_GROUPS=8,
        )
        assert srv.health()["ready_workers"] == 0
        assert run.returncode == 0, run.stderr[-3000:]
        lines = metrics(tmp_path / "trainer")[0]
        # the worker's groups claim version 3, newer than the trainer's 0: dropped and counted, not
        # trained
        assert lines[0]["ahead_groups_dropped"] >= waiting and lines[0]["staleness"] == 0
    finally:
        srv.stop()


def test_a_task_that_never_gives_different_rewards_stops_the_run_with_advice(
    tiny_model_dir, tmp_path
):
    """Gold answers no model writes and 1-token answers (no format): every group's rewards are
    equal, so no group can be trained on; after MAX_ROLLOUTS rollouts the run stops and says what to
    try."""
    questions = tmp_path / "never.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"question": f"What is {i} + 1?", "answer": "#### 987654321"}) + "\n"
            for i in range(20)
        )
    )
    run = train(
        tiny_model_dir,
        f"http://127.0.0.1:{free_port()}",
        tmp_path / "out",
        1,
        BETA=0,
        MAX_ROLLOUTS=2,
        MAX_NEW_TOKENS=1,
        DATASET=str(questions),
        EVAL_STEPS=0,
        SERVER_TIMEOUT=5,
    )
    assert run.returncode != 0
    assert "2 rollouts in a row gave no group with different rewards" in run.stderr
    assert not (tmp_path / "out" / "step_1").exists()


def assert_same_adam_result(got, want, *, lr, updates):
    """Two AdamW implementations (DeepSpeed's vectorised CPU Adam, torch's) after `updates` steps of
    learning rate `lr`, held to a tolerance argued from the arithmetic, not tuned on one processor.
    Given the same gradient, fp32 updates differ by a few ulps, as AVX2 and AVX-512 round
    differently. But each later gradient is taken at weights that already differ, and Adam's m /
    sqrt(v) turns a small gradient difference into a large update difference wherever a gradient is
    small against its own history: an element's gap is bounded by the movement itself, lr per update
    at these betas, not by an ulp count. So each element may differ by 1/256 of the whole movement,
    and the mean gap must stay below 2**-14 of it: any real fault (a wrong beta or eps, a step
    skipped or doubled, a micro-batch lost) moves most elements by a large share of lr."""
    movement = lr * updates
    assert want.keys() == got.keys()
    gaps = torch.cat([(got[k].double() - want[k].double()).abs().flatten() for k in want])
    assert gaps.max() <= movement / 256, f"largest gap {gaps.max():.3e}, movement {movement:g}"
    assert gaps.mean() <= movement * 2**-14, f"mean gap {gaps.mean():.3e}, movement {movement:g}"


def test_optimizer_offload_trains_like_the_plain_optimizer_and_resumes_bit_for_bit(
    tiny_model_dir, tmp_path
):
    """OFFLOAD_OPTIMIZER=1 (ZeRO-Offload: DeepSpeed's CPU Adam steps AdamW's state in CPU memory)
    against torch's AdamW on the device: the same losses step for step and the same weights within
    fp32 rounding. Then resume: step 3 from the offloaded step_2 checkpoint equals the uninterrupted
    offloaded run's step 3 exactly."""
    dead = f"http://127.0.0.1:{free_port()}"
    run = dict(
        BETA=0, ALL_STEPS=3, SAVE_STEPS=1, KEEP_CHECKPOINTS=3, EVAL_STEPS=0, SERVER_TIMEOUT=5
    )
    plain = train(tiny_model_dir, dead, tmp_path / "plain", 1, **run)
    assert plain.returncode == 0, plain.stderr[-3000:]
    offload = train(tiny_model_dir, dead, tmp_path / "offload", 1, OFFLOAD_OPTIMIZER=1, **run)
    assert offload.returncode == 0, offload.stderr[-3000:]
    losses = [[m["loss"] for m in metrics(tmp_path / name)[0]] for name in ("plain", "offload")]
    assert len(losses[1]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7)
    want, got = params(tmp_path / "plain" / "step_3"), params(tmp_path / "offload" / "step_3")
    assert any(not torch.equal(want[k], params(tiny_model_dir)[k]) for k in want)  # it trained
    assert_same_adam_result(got, want, lr=1e-3, updates=3)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "offload", resumed)
    shutil.rmtree(resumed / "step_3")
    again = train(tiny_model_dir, dead, resumed, 1, OFFLOAD_OPTIMIZER=1, RESUME=1, **run)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {resumed / 'step_2'} (step 2)" in again.stdout + again.stderr
    straight, continued = params(tmp_path / "offload" / "step_3"), params(resumed / "step_3")
    assert all(torch.equal(straight[k], continued[k]) for k in straight)


def test_optimizer_offload_with_lora_micro_batches_and_two_passes_trains_like_the_plain_optimizer(
    tiny_model_dir, tmp_path
):
    """OFFLOAD_OPTIMIZER with LORA_RANK, TRAIN_MICRO_BATCH = 1 and MU = 2: the adapters' AdamW state
    on the CPU gives the losses and adapter weights of torch's AdamW within fp32 rounding."""
    dead = f"http://127.0.0.1:{free_port()}"
    run = dict(
        BETA=0, ALL_STEPS=2, EVAL_STEPS=0, SERVER_TIMEOUT=5, LORA_RANK=4, TRAIN_MICRO_BATCH=1, MU=2
    )
    for name, offload in (("plain", 0), ("offload", 1)):
        done = train(tiny_model_dir, dead, tmp_path / name, 1, OFFLOAD_OPTIMIZER=offload, **run)
        assert done.returncode == 0, done.stderr[-3000:]
    losses = [[m["loss"] for m in metrics(tmp_path / name)[0]] for name in ("plain", "offload")]
    assert len(losses[1]) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7)
    from safetensors.torch import load_file

    want, got = (
        load_file(tmp_path / name / "step_2" / "adapter_model.safetensors")
        for name in ("plain", "offload")
    )
    assert want.keys() == got.keys() and any(v.abs().sum() > 0 for v in want.values())
    assert_same_adam_result(got, want, lr=1e-3, updates=4)
