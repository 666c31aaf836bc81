"""End to end: `python ref_server.py` as a process, `deepspeed grpo_ref_split.py` on 1 and 2 CPU
ranks."""
import glob
import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, free_port, metrics, params, tiny_config, train


@pytest.mark.parametrize("ranks", [1, 2])
def test_training_steps_end_to_end(server, tiny_model_dir, tmp_path, ranks):
    before = server.health()
    port = free_port()
    # Covered here at no extra run: checkpointing, and micro-batches of one group (ranks pull
    # unequal numbers)
    extra = (
        {"GRADIENT_CHECKPOINTING": "1", "TRAIN_MICRO_BATCH": "1", "TENSORBOARD": "1"}
        if ranks == 2
        else {}
    )
    run = train(tiny_model_dir, server.url, tmp_path, ranks, master_port=port, **extra)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # DeepSpeed's 66 MiB per rank, named deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>: this
    # run's are gone (other test workers' runs may hold theirs right now).
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*") == []
    assert (
        "step    1 | loss" in run.stdout + run.stderr
        and "step    2 | loss" in run.stdout + run.stderr
    )

    lines, evals = metrics(tmp_path)
    assert [m["step"] for m in evals] == [0, 2]  # before training and at the end
    assert [m["step"] for m in lines] == [1, 2]  # rank 0 alone writes
    for m in lines:
        keys = (
            "loss",
            "reward",
            "reward_std",
            "kl",
            "clip_low",
            "clip_high",
            "ratio_drift",
            "length",
            "max_length",
            "staleness",
            "generate_s",
            "pi_old_s",
            "score_s",
            "wait_s",
            "fwd_bwd_s",
            "optim_s",
            "seconds",
        )
        assert all(math.isfinite(m[k]) for k in keys)
        assert 0 <= m["reward_format"] <= 1 and 0 <= m["reward_correct"] <= 1 and m["length"] > 0
    assert lines[0]["kl"] < 1e-6  # step 1: the policy is still the reference model
    assert lines[1]["kl"] > 0  # after one update it has moved away

    start, step1, step2 = (
        params(tiny_model_dir),
        params(tmp_path / "step_1"),
        params(tmp_path / "step_2"),
    )
    assert start.keys() == step2.keys()
    assert any(not torch.equal(start[k], step1[k]) for k in start), "step 1 changed no parameter"
    assert any(not torch.equal(step1[k], step2[k]) for k in start), "step 2 changed no parameter"
    # no half-written checkpoint
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())

    check_completions_log(tmp_path, ranks, lines, run.stdout + run.stderr)
    if ranks == 2:  # TENSORBOARD: each metrics.jsonl value is a scalar of the same step
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        tb = EventAccumulator(str(tmp_path / "tb"))
        tb.Reload()
        for key in ("reward", "loss", "kl", "eval_reward_correct"):
            want = [(m["step"], m[key]) for m in lines + evals if key in m]
            assert [
                (e.step, pytest.approx(m_, abs=1e-6)) for e, (_, m_) in zip(tb.Scalars(key), want)
            ] == want

    after = server.health()
    trained = after["served"] - before["served"]
    # each group once
    assert trained >= ranks * 2 and after["uploaded"] - before["uploaded"] == trained
    assert after["ref_errors"] == 0 and after["pending"] == 0 and after["ready"] == 0


def test_trainer_stops_when_the_server_holds_another_vocabulary(server, tokenizer, tmp_path):
    from transformers import LlamaForCausalLM

    other = tmp_path / "other_vocab"
    LlamaForCausalLM(tiny_config(tokenizer, vocab_size=len(tokenizer) + 64)).save_pretrained(other)
    tokenizer.save_pretrained(other)
    run = train(str(other), server.url, tmp_path / "out", 1)
    assert run.returncode != 0
    assert (
        "holds" in run.stderr
        and "vocab 49152" in run.stderr
        and "policy has vocab 49216" in run.stderr
    )
    assert (
        not (tmp_path / "out" / "metrics.jsonl").exists()
        or not (tmp_path / "out" / "metrics.jsonl").read_text()
    )


def test_trainer_stops_when_the_server_holds_other_weights_unless_allowed(
    server, tiny_model_dir, tokenizer, tmp_path
):
    """Same vocabulary and config, other weights (the server's model, nudged): the handshake
    compares fingerprints, not only vocabulary sizes."""
    from transformers import AutoModelForCausalLM

    other = tmp_path / "other_weights"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    model.save_pretrained(other)
    tokenizer.save_pretrained(other)
    run = train(str(other), server.url, tmp_path / "out", 1)
    assert run.returncode != 0
    assert (
        "whose weights differ from this policy's" in run.stderr
        and "ALLOW_REF_MISMATCH=1" in run.stderr
    )
    run = train(
        str(other),
        server.url,
        tmp_path / "allowed",
        1,
        ALLOW_REF_MISMATCH=1,
        ALL_STEPS=1,
        EVAL_STEPS=0,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # against another model from the first step
    assert metrics(tmp_path / "allowed")[0][0]["kl"] > 0


def test_use_triton_trains_one_step_like_the_pytorch_path(server, tiny_model_dir, tmp_path):
    """USE_TRITON=1 under the interpreter: same rollout (same seed), so the same loss and update."""
    runs = {}
    for name, env in (("torch", {}), ("triton", {"USE_TRITON": "1", "TRITON_INTERPRET": "1"})):
        run = train(tiny_model_dir, server.url, tmp_path / name, 1, ALL_STEPS="1", **env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        runs[name] = metrics(tmp_path / name)[0][0]
    assert math.isfinite(runs["triton"]["loss"])
    assert runs["triton"]["reward"] == runs["torch"]["reward"]  # the very same rollout
    assert abs(runs["triton"]["loss"] - runs["torch"]["loss"]) < 1e-5
    # pi_old and the metrics read from it: both paths sum fp32 per-token values (2**-24 relative
    # rounding each) over a few hundred tokens, so they agree to ~1e-6 relative; 1e-4 leaves margin.
    for key in ("kl", "entropy", "clip_low", "clip_high", "ratio_drift"):
        assert runs["triton"][key] == pytest.approx(runs["torch"][key], rel=1e-4, abs=1e-6), key
    start = params(tiny_model_dir)
    d_torch = {k: v - start[k] for k, v in params(tmp_path / "torch" / "step_1").items()}
    d_triton = {k: v - start[k] for k, v in params(tmp_path / "triton" / "step_1").items()}
    moved = agree = 0
    for k in start:  # Adam's first step moves each weight by about +-LR in the gradient's sign
        big = d_torch[k].abs() > 5e-4
        moved += int(big.sum())
        agree += int((torch.sign(d_torch[k]) == torch.sign(d_triton[k]))[big].sum())
    assert moved > 1000 and agree / moved > 0.99, (moved, agree)


def test_evaluation_is_logged_and_does_not_change_training(server, tiny_model_dir, tmp_path):
    # SAVE_STEPS 0: only at the end
    for name, every, save in (("no_eval", "0", "0"), ("eval", "1", "2")):
        run = train(
            tiny_model_dir, server.url, tmp_path / name, 1, EVAL_STEPS=every, SAVE_STEPS=save
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "no_eval").glob("step_*")) == ["step_2"]
    train_lines, evals = metrics(tmp_path / "eval")
    assert [m["step"] for m in evals] == [0, 1, 2]  # before step 1, then every step
    assert all(
        0 <= m["eval_reward_correct"] <= 1 and 0 <= m["eval_reward_format"] <= 1 for m in evals
    )
    plain, _ = metrics(tmp_path / "no_eval")
    # the same samples were drawn
    assert [m["reward"] for m in train_lines] == [m["reward"] for m in plain]
    with_eval, without = (
        params(tmp_path / "eval" / "step_2"),
        params(tmp_path / "no_eval" / "step_2"),
    )
    assert all(torch.equal(with_eval[k], without[k]) for k in with_eval)
    assert (tmp_path / "eval" / "curves.png").exists()


def check_completions_log(out, ranks, lines, output):
    """completions.jsonl holds every rank's sampled answers of each step (2 questions x 4 answers
    per rollout), scored as the metrics say; the step line shows one; scripts/show_completions.py
    ranks a step's answers."""
    answers = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    for m in lines:
        step = [a for a in answers if a["step"] == m["step"]]
        assert (
            {a["rank"] for a in step} == set(range(ranks))
            and len(step) >= ranks * 8
            and len(step) % 4 == 0
        )
        for a in step:
            # REWARDS' weights
            assert a["reward"] == pytest.approx(2 * a["reward_correct"] + a["reward_format"])
            assert (
                a["completion"].startswith("<think>")
                and 0 < a["length"] <= 16
                and isinstance(a["truncated"], bool)
            )
            assert a["gold"] and a["question"]
        # a group's advantages are its rewards relative to its mean
        for i in range(0, len(step), 4):
            group = step[i : i + 4]
            assert (
                len({a["question"] for a in group}) == 1
                and abs(sum(a["advantage"] for a in group)) < 1e-5
            )
        # cut answers used the whole budget
        assert all(a["length"] == 16 for a in step if a["truncated"])
    assert output.count("  sample | reward") == len(lines)
    show = subprocess.run(
        [sys.executable, "scripts/show_completions.py", str(out / "completions.jsonl"), "2", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert show.returncode == 0, show.stderr
    rewards = [a["reward"] for a in answers if a["step"] == 2]
    best, worst = max(rewards), min(rewards)
    assert show.stdout.startswith("step 2: ") and f"best:\nreward {best:g} " in show.stdout
    assert f"worst:\nreward {worst:g} " in show.stdout
    missing = subprocess.run(
        [sys.executable, "scripts/show_completions.py", str(out / "completions.jsonl"), "7"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert (
        missing.returncode == 1
        and "no answers of step 7; the file holds steps 1..2" in missing.stderr
    )
