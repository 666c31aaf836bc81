"""Issue 36's audit, each place it found wrong checked against hand numbers: "batch" reward scaling
of regrouped groups, of reward-model scores and over ranks; a tool answer cut by the call budget; a
group pulled a step late; the settings refused at start; `python grpo_ref_split.py` without the
launcher.

    bash scripts/test.sh -k audit
"""
import os
import statistics
import subprocess
import sys
from collections import Counter

import pytest
import torch

import grpo_ref_split as grpo
from conftest import ROOT, group, start, stop, wait_for
from features import reward_model, zero2
import objectives
from features.regroup import RegroupPool
from features.server_client import RefClient, with_advantages
from features.tools import calculator
from test_grpo_math import run_ranks
from test_tools import scripted_generate_with_tools

EPS = 1e-4  # STD_EPS


def by_hand(rewards, everything):
    """(r - its group's mean) / (the unbiased std of `everything` + EPS), in plain Python."""
    mean, std = statistics.fmean(rewards), statistics.stdev(everything)
    return [(r - mean) / (std + EPS) for r in rewards]


# ------------------------------------------------------------------------- 1. "batch" on the server
def answers_of_one_question(rewards):
    ids = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(1))
    ids[:, :3] = ids[0, :3]  # one prompt
    return dict(input_ids=ids, completion_mask=torch.ones(4, 4, dtype=torch.bool),
                scores=torch.tensor(rewards), advantages=torch.zeros(4))


def pulled_back(tensors, meta, monkeypatch):
    """The group as the trainer takes it from a server that changed its rewards, SCALE_REWARDS
    "batch": step 4 run on its rewards (server_client.with_advantages), then / the step's std."""
    monkeypatch.setattr(grpo, "SCALE_REWARDS", "batch")
    monkeypatch.setattr(grpo, "NUM_PRE_Q", 4)
    exchange = with_advantages(lambda groups, version, rank: [(tensors, meta)],
                               grpo.choose_parts().advantages)
    [(pulled, _)] = exchange([], 0, 0)
    rewards = pulled["scores"].tolist()
    # centred, no division
    assert pulled["advantages"].tolist() == pytest.approx([r - statistics.fmean(rewards)
                                                           for r in rewards])
    [(scaled, _)] = objectives.scale_to_step([(pulled, meta)], torch.zeros(0), "cpu",
                                             std_eps=EPS)  # the trainer's, one rank
    return scaled


def test_a_regrouped_group_is_divided_by_the_std_of_the_rewards_it_trains_with(monkeypatch):
    """The issue's numbers: [3, 3, 3, 3] uploaded with the rollout's std 1.2, then [0, 0, 0, 0] with
    0.0. The old server divided the mixed group's centred rewards by that 0.0 (+ 1e-4): advantages
    of +-15000. The server now sends the group's rewards alone; the trainer computes the rest."""
    pool = RegroupPool(pool_size=8, questions=4)
    meta = dict(plen=3, scale_rewards="batch")
    assert pool.add(answers_of_one_question([3.0] * 4), dict(meta, batch_std=1.2)) is None
    tensors, _ = pool.add(answers_of_one_question([0.0] * 4), dict(meta, batch_std=0.0))
    rewards = tensors["scores"].tolist()
    assert len(set(rewards)) == 2  # a group with variance, mixed from both uploads
    assert "advantages" not in tensors  # step 4 has one home: the trainer
    scaled = pulled_back(tensors, {}, monkeypatch)
    assert scaled["advantages"].tolist() == pytest.approx(by_hand(rewards, rewards), rel=1e-5)
    assert scaled["advantages"].abs().max() < 2


def test_reward_model_scores_are_divided_by_the_std_of_the_rewards_they_make(monkeypatch):
    """Rule rewards all 1 (the rollout's std 0.0) plus a reward model's scores: the old server gave
    advantages of thousands; now it centres, and the trainer divides by the std of the rewards with
    the scores in."""
    scores = torch.tensor([0.3, -0.1, 0.2, -0.4])
    monkeypatch.setattr(reward_model, "reward_scores", lambda model, question, answers: scores)
    tensors = dict(scores=torch.ones(4), advantages=torch.zeros(4))
    meta = dict(question="q", completions=["a"] * 4, scale_rewards="batch", batch_std=0.0)
    tensors, meta = reward_model.add_reward_model(tensors, meta, reward_model=None, weight=1.0)
    rewards = (1 + scores).tolist()
    assert "advantages" not in tensors  # stale with the new rewards: the trainer redoes them
    scaled = pulled_back(tensors, meta, monkeypatch)
    assert scaled["advantages"].tolist() == pytest.approx(by_hand(rewards, rewards), rel=1e-5)


# ---------------------------------------------------------------------------- 2. "batch" over ranks
# each rank's trained group, beside a dropped 0-group
RANK_REWARDS = ([0.0, 0.0, 0.0, 1.0], [0.0, 3.0, 3.0, 3.0])


def _rank_scaled(rank, world, port, results):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    groups = [({"scores": torch.tensor(RANK_REWARDS[rank])}, {})]
    [(tensors, _)] = objectives.scale_to_step(groups, torch.zeros(4), "cpu",
                                              std_eps=EPS)  # the dropped group's four zeros
    results.put((rank, tensors["advantages"].tolist()))
    dist.destroy_process_group()


def test_batch_scaling_divides_by_the_std_of_the_whole_steps_rewards_on_all_ranks():
    """Two forked gloo ranks. One rank's std gave the right answers 2.121 (0/1 group) and 0.483 (0/3
    group); the step's std over all 16 rewards gives each 0.623, so both groups weigh the same."""
    out = run_ranks(_rank_scaled, 2)
    everything = [*RANK_REWARDS[0], 0.0, 0.0, 0.0, 0.0, *RANK_REWARDS[1], 0.0, 0.0, 0.0, 0.0]
    for rank, rewards in enumerate(RANK_REWARDS):
        assert out[rank] == pytest.approx(by_hand(rewards, everything), rel=1e-5)
    assert out[0][3] == pytest.approx(0.623, abs=1e-3) and out[1][1] == pytest.approx(
        0.623, abs=1e-3
    )


# ----------------------------------------------------------------------------- 3. the call budget
LONG = (" 3 + 4 = 7, and 7 is the sum of 3 and 4, so the answer to the question is 7 </think>"
        "<answer>7</answer>")


def test_an_answer_cut_by_the_call_budget_trains_only_its_sampled_tokens_and_counts_as_truncated(
    monkeypatch, model, tokenizer
):
    """MAX_TOOL_CALLS = 1: answer 0 ends right after its second call's close, with no EOS. Its
    padding is the EOS id: a first-pad mask trained on that pad as if the policy had stopped, and
    called the answer stopped."""
    eos = tokenizer.eos_token_id
    script = {1: [" <tool>1 + 1</tool>", " <tool>2 + 2</tool>"], 2: [LONG]}
    monkeypatch.setattr(grpo.tools, "TOOLS", ["calculator"])
    monkeypatch.setattr(grpo.tools, "MAX_TOOL_CALLS", 1)
    monkeypatch.setattr(grpo, "NUM_PRE_Q", 2)
    monkeypatch.setattr(
        grpo.tools, "generate_with_tools", scripted_generate_with_tools(script, eos)
    )
    question = [dict(question="What is 1 + 1?", gold="2")]
    out = grpo.generate(model, tokenizer, question, rollout=grpo.choose_parts().rollout,
                        gen_config=None, eos_ids=[eos])
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    first, result, second = (
        enc(" <tool>1 + 1</tool>"),
        enc("<result>2</result>"),
        enc(" <tool>2 + 2</tool>"),
    )
    want = [True] * len(first) + [False] * len(result) + [True] * len(second)  # token by token
    assert out.mask[0].tolist() == want + [False] * (out.mask.shape[1] - len(want))
    # the padding the old mask took for a sampled EOS
    assert out.completion_ids[0, len(want)].item() == eos
    assert out.truncated == [True, False] and out.lengths[0] == len(first) + len(second)
    answer = enc(LONG) + [eos]  # longer than answer 0: its row is padded after the call
    assert len(answer) > len(want) and out.mask[1].tolist() == [True] * len(answer)
    monkeypatch.setattr(grpo, "MASK_TRUNCATED", True)  # DAPO's overlong filter now sees it
    # the stand-in pops its texts
    script.update({1: [" <tool>1 + 1</tool>", " <tool>2 + 2</tool>"], 2: [LONG]})
    masked = grpo.generate(model, tokenizer, question, rollout=grpo.choose_parts().rollout,
                           gen_config=None, eos_ids=[eos])
    assert not masked.mask[0].any() and masked.mask[1].sum() == len(answer)


# --------------------------------------------------------------------------- 4. a group a step late
def test_a_group_pulled_a_step_late_without_its_sampling_log_probs_is_dropped_and_counted(model):
    """Step 1's group misses upload_and_pull's deadline; step 2 pulls it (the server hands groups
    out in order). Without pi_old_logps its ratio would be 1 under weights that did not sample it:
    dropped and counted. With them it trains."""
    server, stop_serving, url = start(model)
    try:
        late, _ = group(seed=1)
        del late["pi_old_logps"]  # MU = 1, SKIP_PI_OLD: a rank's own group carries none
        client = RefClient(url, timeout=0.0)  # one rank's client, at step 1 with no time to wait
        assert client.upload_and_pull([(late, {"plen": 5})], version=0, rank=0) == []
        wait_for(lambda: server.queue_of(0).qsize() == 1)
        on_time, _ = group(seed=2)
        del on_time["pi_old_logps"]
        client.timeout = 60.0  # step 2
        got = client.upload_and_pull([(on_time, {"plen": 5})], version=1, rank=0)
    finally:
        stop(server, stop_serving)
    # step 1's group, pulled at step 2 beside its own
    assert [meta["version"] for _, meta in got] == [0, 1]
    late_one = got[:1]

    def drop_untrainable(groups, version):
        return grpo.drop_untrainable(groups, version, max_staleness=grpo.MAX_STALENESS)

    assert drop_untrainable(got, version=1) == (got[1:], Counter(late_groups_dropped=1))
    # what a worker's group carries
    with_logps = [(dict(got[0][0], pi_old_logps=torch.zeros(3, 4)), got[0][1])]
    assert drop_untrainable(with_logps, version=1) == (with_logps, Counter())
    # at the weights that sampled it
    assert drop_untrainable(late_one, version=0) == (late_one, Counter())


# -------------------------------------------------------------- settings refused or warned at start
@pytest.mark.parametrize("cap", [1.0, 0.5, -2.0])
def test_a_tis_cap_that_cannot_work_is_refused_before_any_model_loads(monkeypatch, tmp_path, cap):
    monkeypatch.setattr(grpo, "OUTPUT_DIR", str(tmp_path))
    monkeypatch.setattr(objectives, "TIS_CAP", cap)
    with pytest.raises(SystemExit, match=f"TIS_CAP = {cap}: .* above 1"):
        grpo.check_settings()
    for fine in (0.0, 1.5):
        monkeypatch.setattr(objectives, "TIS_CAP", fine)
        grpo.check_settings()


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo"])
def test_gspo_with_a_token_sum_loss_warns(monkeypatch, capfd, tmp_path, loss_type):
    monkeypatch.setattr(grpo, "OUTPUT_DIR", str(tmp_path))
    monkeypatch.setattr(grpo, "GSPO", True)
    monkeypatch.setattr(grpo, "CLIP_EPS", 3e-4)
    monkeypatch.setattr(grpo, "CLIP_EPS_HIGH", 4e-4)
    grpo.check_settings()
    assert "warning" not in capfd.readouterr().err  # GSPO with its own loss type
    monkeypatch.setattr(grpo, "LOSS_TYPE", loss_type)
    grpo.check_settings()
    assert (
        f"warning: GSPO with LOSS_TYPE '{loss_type}' weighs each completion's sequence loss by its "
        "length"
        in capfd.readouterr().err
    )


# ----------------------------------------------------------------------------- 5. no launcher
def test_without_the_launcher_the_trainer_is_a_world_of_one(monkeypatch, capfd):
    for name in zero2.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    zero2.one_process_without_launcher()
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == (
        "0",
        "0",
        "1",
    )
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
    assert "no launcher: one process" in capfd.readouterr().err
    monkeypatch.setenv("RANK", "1")  # a launcher's variables are left as they are
    monkeypatch.setenv("MASTER_PORT", "29511")
    zero2.one_process_without_launcher()
    assert os.environ["RANK"] == "1" and os.environ["MASTER_PORT"] == "29511"
    assert capfd.readouterr().err == ""


@pytest.mark.slow
def test_python_grpo_ref_split_trains_as_one_process(tiny_model_dir, tmp_path):
    """A newcomer's first command, `python grpo_ref_split.py`, with no launcher: it trains (BETA =
    0, no server)."""
    env = {k: v for k, v in os.environ.items() if k not in zero2.LAUNCHER_VARIABLES}
    env.update(
        MODEL_PATH=tiny_model_dir,
        OUTPUT_DIR=str(tmp_path / "out"),
        ALL_STEPS="1",
        Q_BATCH_SIZE="2",
        NUM_PRE_Q="4",
        MAX_NEW_TOKENS="16",
        EVAL_STEPS="0",
        BETA="0",
        LR="1e-3",
    )
    run = subprocess.run(
        [sys.executable, "grpo_ref_split.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no launcher: one process" in run.stderr and "mpi4py" not in run.stderr
    assert (tmp_path / "out" / "step_1").is_dir()


# ----------------------------------------------------------------------------- 4. each reward once
def rollout_of(rewards_per_group, masked_groups=()):
    """A Rollout of len(rewards_per_group) groups of 4 answers, 3 prompt and 2 answer tokens each;
    the answers of `masked_groups` have no token left to train (MASK_TRUNCATED)."""
    n = 4 * len(rewards_per_group)
    mask = torch.ones(n, 2, dtype=torch.bool)
    for q in masked_groups:
        mask[4 * q : 4 * q + 4] = False
    return grpo.Rollout(
        prompt_ids=torch.ones(n, 3, dtype=torch.long),
        prompt_mask=torch.ones(n, 3, dtype=torch.long),
        completion_ids=torch.full((n, 2), 2),
        mask=mask,
        texts=["a"] * n,
        lengths=[2] * n,
        truncated=[False] * n,
        golds=["1"] * n,
        questions=["q"] * n,
    )


@pytest.mark.parametrize("keep_all", [False, True])
def test_batch_scaling_counts_every_generated_reward_once(keep_all, monkeypatch):
    """The issue's numbers: groups [1, 1, 1, 1] and [0, 1, 2, 3], and a varied group whose answers
    are all masked. Whether the server keeps equal groups (REGROUP, a reward model: keep_all) or
    not, each reward enters the step's std once: 12 rewards, std 0.937 (the old count, with
    [1, 1, 1, 1] uploaded and listed as dropped too, gave 0.718 on the first two groups, against
    their 0.886)."""
    monkeypatch.setattr(grpo.fast_paths, "SKIP_PI_OLD", True)
    monkeypatch.setattr(grpo, "NUM_PRE_Q", 4)
    rewards = [[1.0] * 4, [0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 0.0, 2.0]]
    scores = torch.tensor(sum(rewards, []))
    sampled = rollout_of(rewards, masked_groups=(2,))
    groups, dropped = grpo.pack_groups(None, sampled, scores, torch.zeros(12),
                                       varied=grpo.varied_groups(scores), keep_all=keep_all,
                                       with_pi_old=False, logps_of=None, meta={})
    assert len(groups) == (2 if keep_all else 1)
    scaled = objectives.scale_to_step(groups, dropped, "cpu", std_eps=EPS)
    varied = [tensors for tensors, _ in scaled if tensors["scores"].std() > 0][0]
    everything = sum(rewards, [])
    assert varied["advantages"].tolist() == pytest.approx(by_hand(rewards[1], everything), rel=1e-5)
