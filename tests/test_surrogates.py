"""The objectives of 2025-26 beside GRPO's (issue 59, docs/loss.md): the surrogates OBJECTIVE cispo,
sapo and gmpo, the baselines ADVANTAGE rloo, reinforce_pp_baseline and passk, REWARD_NORM's GDPO and
TOP_ENTROPY_QUANTILE. Each by hand values, and its gradient against a definition written here.

    python -m pytest -q tests/test_surrogates.py
"""
import math
from dataclasses import replace

import pytest
import torch

import grpo_ref_split as grpo  # noqa: E402
import objectives  # noqa: E402
from conftest import set_setting
from test_variants import (PlainEngine, batch_for, fresh_model,  # noqa: F401 (fixtures)
                           short_rollout, tiny_policy)

EPS = 0.2  # CLIP_EPS and CLIP_EPS_HIGH in these hand values


def loss_and_grad(objective, log_ratio, advantages, **extra):
    """(loss, d loss / d log pi) of one answer's tokens under `objective`, reduce_loss "grpo"
    (its token mean); log pi_old = 0, so log pi is the log-ratio."""
    logps = torch.tensor([log_ratio], dtype=torch.float64, requires_grad=True)  # (1, T)
    mask = torch.ones_like(logps, dtype=torch.bool)  # (1, T)
    adv = torch.tensor([advantages], dtype=torch.float64)  # (1, T)
    per_token = objectives.variant_token_loss(logps=logps, pi_old_logps=torch.zeros_like(logps),
                                              kl=None,
                               advantages=adv, mask=mask, beta=0.0, clip_eps=EPS,
                               clip_eps_high=EPS, objective=objective, **extra)  # (1, T)
    loss = grpo.reduce_loss(per_token, mask, loss_type="grpo")
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.item(), grad.view(-1).tolist()


# ----------------------------------------------------------------------------- the surrogates
def test_cispo_keeps_the_gradient_of_a_token_past_the_clip_by_hand():
    """log r = [log 0.5, 0, log 1.5], A = [+1, -1, +1]: the weights min(r, 1.2) = [0.5, 1, 1.2],
    detached, so d loss / d log pi_t = -w_t A_t / 3 = [-1/6, +1/3, -0.4]. PPO's clip gives the third
    token (r 1.5 > 1.2 with A > 0) no gradient at all."""
    log_ratio = [math.log(0.5), 0.0, math.log(1.5)]
    _, grad = loss_and_grad("cispo", log_ratio, [1.0, -1.0, 1.0], cispo_max_ratio=1 + EPS)
    assert grad == pytest.approx([-1 / 6, 1 / 3, -0.4])
    _, clipped = loss_and_grad("clip", log_ratio, [1.0, -1.0, 1.0])
    assert clipped[2] == 0.0


def test_sapo_is_a_soft_gate_by_hand():
    """f(r) = 4 / tau sigmoid(tau (r - 1)); d f / d log pi = 4 s (1 - s) r. At r = 1.5, A = +1,
    tau_pos 1: s = sigmoid(0.5) = 0.62246, the gradient -4 s (1 - s) 1.5 / 2 = -0.70501 (token
    mean of 2). At r = 1, A = -1, tau_neg 1.05: s = 0.5, +4 (0.25) 1 / 2 = +0.5."""
    _, grad = loss_and_grad("sapo", [math.log(1.5), 0.0], [1.0, -1.0], sapo_taus=(1.0, 1.05))
    s = 1 / (1 + math.exp(-0.5))
    assert grad == pytest.approx([-4 * s * (1 - s) * 1.5 / 2, 0.5])
    assert grad[0] == pytest.approx(-0.70501, abs=1e-5)


def test_gmpo_clips_in_log_space_on_the_side_of_the_advantage_by_hand():
    """log r = [0.1, 0.5, -0.1], eps 0.2. A = +1: 0.5 is held at 0.2 (no gradient), the mean
    0.2 / 3 = 0.0667, ratio e^0.0667 = 1.0689, loss -1.0689; d / d log pi = -1.0689 / 3 on the two
    others. A = -1: max(log r, clamp) keeps 0.5 (the pessimistic side), mean 0.5 / 3, ratio
    1.1814, loss +1.1814, gradient +1.1814 / 3 on all three."""
    loss, grad = loss_and_grad("gmpo", [0.1, 0.5, -0.1], [1.0, 1.0, 1.0])
    ratio = math.exp(0.2 / 3)
    assert loss == pytest.approx(-ratio) and grad == pytest.approx([-ratio / 3, 0.0, -ratio / 3])
    loss, grad = loss_and_grad("gmpo", [0.1, 0.5, -0.1], [-1.0, -1.0, -1.0])
    ratio = math.exp(0.5 / 3)
    assert loss == pytest.approx(ratio) and grad == pytest.approx([ratio / 3] * 3)


def test_each_surrogate_against_its_definition_in_value_and_gradient():
    """Random answers of several lengths; each definition written here from its paper, in the
    loss's token mean per answer, then the mean over answers."""
    g = torch.Generator().manual_seed(0)
    logps = (torch.randn(6, 7, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    mask = torch.rand(6, 7, generator=g) > 0.25
    mask[:, 0] = True
    A = torch.randn(6, generator=g, dtype=torch.float64)[:, None].expand(6, 7)  # one per answer
    r = torch.exp(logps)  # log pi_old = 0

    def completions_mean(per_token):  # "grpo": each answer's token mean, then their mean
        return (torch.where(mask, per_token, 0.0).sum(1) / mask.sum(1)).mean()

    tau = torch.where(A > 0, 1.0, 1.05)
    s = torch.sigmoid(tau * (r - 1))
    log_r = logps
    clipped = log_r.clamp(-EPS, EPS)
    kept = torch.where(A > 0, torch.minimum(log_r, clipped), torch.maximum(log_r, clipped))
    geo = torch.exp(torch.where(mask, kept, 0.0).sum(1) / mask.sum(1))  # (6,)
    definitions = {
        "cispo": completions_mean(-torch.clamp(r, max=1 + EPS).detach() * A * logps),
        "sapo": completions_mean(-(4 / tau) * s * A),
        "gmpo": (-geo * A[:, 0]).mean(),
    }
    for objective, want in definitions.items():
        per_token = objectives.variant_token_loss(
            logps=logps, pi_old_logps=torch.zeros_like(logps), kl=None, advantages=A[:, 0],
            mask=mask, beta=0.0, clip_eps=EPS, clip_eps_high=EPS, objective=objective,
            cispo_max_ratio=1 + EPS)  # (6, 7)
        got = grpo.reduce_loss(per_token, mask, loss_type="grpo")
        (got_grad,) = torch.autograd.grad(got, logps)
        (want_grad,) = torch.autograd.grad(want, logps)
        # float64 sums of a few terms of size ~1: far below 1e-12
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=objective)
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-12, msg=objective)


@pytest.mark.parametrize("objective", objectives.OBJECTIVES)
def test_at_ratio_one_every_surrogate_has_the_policy_gradient(objective):
    """On the samples' own weights (r = 1) each surrogate's gradient is the policy gradient's,
    -A_t / |y| on each token: they differ only in how they treat a ratio that has moved."""
    _, grad = loss_and_grad(objective, [0.0, 0.0, 0.0, 0.0], [0.7] * 4,
                            sapo_taus=(objectives.SAPO_TAU_POS, objectives.SAPO_TAU_NEG))
    assert grad == pytest.approx([-0.7 / 4] * 4)


@pytest.mark.parametrize("objective", objectives.OBJECTIVES)
def test_at_ratio_one_with_vllm_weights_only_gmpo_moves_off_the_clip(objective):
    """The demo's case (docs/loss.md): r = 1 with vLLM's mismatch weights w_t. The clip, CISPO
    and SAPO give each token -w_t A / |y|; GMPO's one value per answer gives every token
    -mean(w) A / |y|. A = 0.7, w = [0.5, 1, 1.5, 2], |y| = 4, by hand."""
    weights = torch.tensor([[0.5, 1.0, 1.5, 2.0]], dtype=torch.float64)  # (1, T)
    _, grad = loss_and_grad(objective, [0.0] * 4, [0.7] * 4, weights=weights,
                            sapo_taus=(objectives.SAPO_TAU_POS, objectives.SAPO_TAU_NEG))
    if objective == "gmpo":
        assert grad == pytest.approx([-1.25 * 0.7 / 4] * 4)  # mean(w) = 1.25
    else:
        assert grad == pytest.approx([-w * 0.7 / 4 for w in (0.5, 1.0, 1.5, 2.0)])


# ----------------------------------------------------------------------------- the baselines
def test_rloo_by_hand():
    """[1, 0, 0, 1]: each answer against the mean of the other three, 2/3 and -2/3; no std."""
    got = objectives.rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 0.0, 6.0]), 4)
    assert got.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, -4.0, 4.0])


def test_passk_gives_the_best_answer_alone_its_lead_by_hand():
    """[0.2, 1, 0.5, 0]: the best leads the second by 0.5, over the group's std 0.43493: 1.14961
    on it, 0 elsewhere. Two equal bests: no lead, all 0."""
    got = objectives.passk_advantages(torch.tensor([0.2, 1.0, 0.5, 0.0, 1.0, 0.0, 1.0, 0.0]), 4,
                                      std_eps=grpo.STD_EPS)
    std = torch.tensor([0.2, 1.0, 0.5, 0.0]).std().item()
    assert std == pytest.approx(0.43493, abs=1e-5)
    assert got.tolist() == pytest.approx([0.0, 0.5 / (std + grpo.STD_EPS), 0.0, 0.0] + [0.0] * 4)


def test_gdpo_normalises_each_reward_before_the_sum_by_hand():
    """correct [1, 1, 0, 0] (weight 2) and format [1, 0, 1, 0] (weight 1): each z-score is
    +-0.86603 (std 0.57735), so 2 c + f = [2.598, 0.866, -0.866, -2.598]. Summed first, [3, 2, 1, 0]
    gives GRPO's [1.162, 0.387, -0.387, -1.162]: format's steps weigh as much as correct's."""
    each = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # (N, K)
    got = objectives.gdpo_advantages(each, torch.tensor([2.0, 1.0]), 4, std_eps=grpo.STD_EPS)
    z = 0.5 / (math.sqrt(1 / 3) + grpo.STD_EPS)
    assert got.tolist() == pytest.approx([3 * z, z, -z, -3 * z])
    assert got[0].item() == pytest.approx(2.598, abs=1e-3)


def test_a_group_with_equal_sums_but_different_rewards_trains_under_gdpo(monkeypatch):
    """Issue 59: a group is uninformative only if every reward is equal within it. correct
    [1, 0, 1, 0] and format [0, 1, 0, 1], both weight 1: every sum is 1. GRPO drops the group;
    normalize_then_sum keeps it."""
    monkeypatch.setattr(grpo, "NUM_PRE_Q", 4)
    monkeypatch.setattr(grpo, "REWARDS", [(grpo.reward_correct, 1.0), (grpo.reward_format, 1.0)])
    each = {"reward_correct": [1.0, 0.0, 1.0, 0.0], "reward_format": [0.0, 1.0, 0.0, 1.0]}
    scores = torch.ones(4)
    assert grpo.choose_parts().has_signal(scores, each).tolist() == [False]
    monkeypatch.setattr(grpo, "REWARD_NORM", "normalize_then_sum")
    assert grpo.choose_parts().has_signal(scores, each).tolist() == [True]


@pytest.mark.parametrize("setting, want", [
    (dict(ADVANTAGE="rloo"), "rloo"),
    (dict(ADVANTAGE="passk"), "passk"),
    (dict(ADVANTAGE="reinforce_pp_baseline"), "centred"),
    (dict(REWARD_NORM="normalize_then_sum"), "gdpo"),
    (dict(), "grpo"),
])
def test_step_4_takes_the_chosen_baseline(setting, want, monkeypatch):
    monkeypatch.setattr(grpo, "NUM_PRE_Q", 4)
    monkeypatch.setattr(grpo, "REWARDS", [(grpo.reward_correct, 2.0), (grpo.reward_format, 1.0)])
    for name, value in setting.items():
        monkeypatch.setattr(grpo, name, value)
    each = {"reward_correct": [1.0, 1.0, 0.0, 0.0], "reward_format": [1.0, 0.0, 1.0, 0.0]}
    scores = torch.tensor([3.0, 2.0, 1.0, 0.0])
    expected = {
        "rloo": objectives.rloo_advantages(scores, 4),
        "passk": objectives.passk_advantages(scores, 4, std_eps=grpo.STD_EPS),
        "centred": scores - scores.mean(),
        "gdpo": objectives.gdpo_advantages(torch.tensor([each["reward_correct"],
                                                         each["reward_format"]]).T,
                                           torch.tensor([2.0, 1.0]), 4, std_eps=grpo.STD_EPS),
        "grpo": grpo.advantages_in_groups(scores, 4),
    }[want]
    assert grpo.choose_parts().advantages(scores, each).tolist() == pytest.approx(expected.tolist())
    assert grpo.rescaled_at_step() == (want in ("centred", "gdpo"))


def test_reinforce_pp_baseline_divides_by_the_std_over_the_answers_that_train_by_hand():
    """Centred advantages [1, -1] and [3, -3]: the step's 4 trained advantages have mean 0 and
    unbiased std sqrt(20 / 3) = 2.5820, so [0.3873, -0.3873] and [1.1619, -1.1619], whatever
    was dropped (issue 79: the dropped groups' zeros used to shrink the std, scaling the same
    answers by how many groups were dropped)."""
    groups = [({"advantages": torch.tensor([1.0, -1.0])}, {}),
              ({"advantages": torch.tensor([3.0, -3.0])}, {})]
    std = math.sqrt(20 / 3)
    for dropped in (torch.zeros(0), torch.zeros(2), torch.zeros(16)):
        settings = grpo.advantage_settings(grpo.choose_task().rewards)
        got = objectives.at_step(groups, dropped, "cpu", replace(settings,
                                                                 advantage="reinforce_pp_baseline"))
        assert [t["advantages"].tolist() for t, _ in got] == [
            pytest.approx([1 / (std + 1e-4), -1 / (std + 1e-4)], rel=1e-6),
            pytest.approx([3 / (std + 1e-4), -3 / (std + 1e-4)], rel=1e-6)]


# ----------------------------------------------------------------------------- high-entropy tokens
def test_the_top_entropy_share_by_hand_and_only_those_tokens_train():
    """Entropies [0.1, 2.0, 0.5, 3.0 | 1.0, (padding 9.0)], top 0.4 of the 5 answer tokens: the
    0.6 quantile of [0.1, 0.5, 1.0, 2.0, 3.0] is 1.4 (linear between 1.0 and 2.0), so 2.0 and 3.0
    train; the padding's 9.0 never counts. In the loss the others get no surrogate gradient."""
    entropy = torch.tensor([[0.1, 2.0, 0.5, 3.0], [1.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[True] * 4, [True, False, False, False]])
    keep = objectives.high_entropy_mask(entropy=entropy, mask=mask, quantile=0.4)
    assert keep.tolist() == [[0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert objectives.high_entropy_mask(entropy=entropy, mask=mask, quantile=1.0).tolist() == \
        mask.float().tolist()
    logps = torch.zeros(2, 4, requires_grad=True)
    per_token = objectives.variant_token_loss(logps=logps, pi_old_logps=logps.detach(), kl=None,
                                              advantages=torch.tensor([1.0, 1.0]), mask=mask,
                                              beta=0.0, clip_eps=EPS, clip_eps_high=EPS,
                                              weights=keep)
    (grad,) = torch.autograd.grad(grpo.reduce_loss(per_token, mask, loss_type="grpo"), logps)
    assert (grad != 0).tolist() == [[False, True, False, True], [False] * 4]


def test_the_entropy_threshold_is_the_quantile_past_two_to_the_24_tokens():
    """Issue 79: torch.quantile refuses more than 2^24 values, a long chain-of-thought batch's
    token count. quantile_of equals it below that (linear between the two nearest ranks, value for
    value) and goes on past it."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 1000):
        values = torch.randn(n, generator=g)
        for q in (0.0, 0.2, 0.37, 0.8, 1.0):
            assert torch.equal(objectives.quantile_of(values, q), torch.quantile(values, q))
    many = torch.arange(2**24 + 1, dtype=torch.float32)  # 0, 1, ..., 2^24
    with pytest.raises(RuntimeError):
        torch.quantile(many, 0.8)
    assert objectives.quantile_of(many, 0.5).item() == 2**23


def _rank_threshold(rank, world, port, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    entropy = torch.tensor([[1.0, 2.0, 3.0]]) if rank == 0 else torch.tensor([[10.0, 20.0, 0.0]])
    mask = torch.tensor([[True, True, True]]) if rank == 0 else torch.tensor([[True, True, False]])
    keep = objectives.high_entropy_mask(entropy=entropy, mask=mask, quantile=0.4)
    results.put((rank, keep.tolist()))
    dist.destroy_process_group()


def test_the_entropy_threshold_is_global_over_the_ranks():
    """Two gloo ranks with answer-token entropies [1, 2, 3] and [10, 20] (one padding): the top 0.4
    of all five is 10 and 20 (the 0.6 quantile, 3 + 0.4 x 7 = 5.8), so rank 0 trains none of its
    tokens; each rank's own threshold would have kept its 3 and its 20."""
    from test_grpo_math import run_ranks

    got = dict(run_ranks(_rank_threshold, 2))
    assert got[0] == [[0.0, 0.0, 0.0]] and got[1] == [[1.0, 1.0, 0.0]]


# ----------------------------------------------------------------------------- refused at start
@pytest.mark.parametrize("setting, message", [
    (dict(OBJECTIVE="ppo"), "OBJECTIVE = 'ppo'"),
    (dict(ADVANTAGE="gae"), "ADVANTAGE = 'gae'"),
    (dict(REWARD_NORM="sum"), "REWARD_NORM = 'sum'"),
    (dict(TOP_ENTROPY_QUANTILE=0.0), "TOP_ENTROPY_QUANTILE = 0.0"),
    (dict(TOP_ENTROPY_QUANTILE=1.5), "TOP_ENTROPY_QUANTILE = 1.5"),
    (dict(OBJECTIVE="sapo", SAPO_TAU_NEG=0.0), "temperatures above 0"),
    (dict(OBJECTIVE="cispo", LOSS_TYPE="dapo", USE_TRITON=True), "USE_TRITON fuses PPO's clip"),
    (dict(TOP_ENTROPY_QUANTILE=0.2, USE_TRITON=True), "USE_TRITON fuses PPO's clip"),
    (dict(OBJECTIVE="cispo", LOSS_TYPE="dapo", GSPO=True), "GSPO with OBJECTIVE 'cispo'"),
    (dict(OBJECTIVE="gmpo", DISTILL_COEF=1.0, BETA=0.0), "GMPO takes one advantage per completion"),
    (dict(OBJECTIVE="gmpo", LOSS_TYPE="dapo"), "OBJECTIVE gmpo with LOSS_TYPE 'dapo'"),
    (dict(ADVANTAGE="rloo", SCALE_REWARDS="batch"), "bring their own scale"),
    (dict(REWARD_NORM="normalize_then_sum", ADVANTAGE="passk"), "choose one of the two"),
    # issue 79: accepted, then silently wrong
    (dict(OBJECTIVE="sapo", SAPO_TAU_POS=float("nan")), "finite"),
    (dict(OBJECTIVE="sapo", SAPO_TAU_NEG=float("inf")), "finite"),
    (dict(CLIP_EPS_HIGH=-0.1), "CLIP_EPS_HIGH = -0.1"),
    (dict(CLIP_EPS=float("nan")), "CLIP_EPS = nan"),
    (dict(OBJECTIVE="cispo"), "CISPO is defined with one token mean"),
    (dict(OBJECTIVE="cispo", LOSS_TYPE="dapo", CISPO_MAX_RATIO=0.5), "CISPO_MAX_RATIO = 0.5"),
    (dict(OBJECTIVE="gmpo", TOP_ENTROPY_QUANTILE=0.2), "OBJECTIVE gmpo with TOP_ENTROPY"),
    (dict(OBJECTIVE="gmpo", TIS_MODE="token_mask"), 'TIS_MODE "token_mask"'),
    (dict(KL_BIAS_CORRECTION=True, BETA=0.0), "no penalty to correct"),
])
def test_a_variant_that_cannot_work_is_refused_at_start(setting, message, monkeypatch, tmp_path):
    monkeypatch.setattr(grpo, "OUTPUT_DIR", str(tmp_path))
    for name, value in setting.items():
        set_setting(monkeypatch, name, value)
    with pytest.raises(SystemExit, match=message):
        grpo.check_settings()


@pytest.mark.parametrize("setting", [
    dict(OBJECTIVE="cispo", LOSS_TYPE="dapo", MU=2),
    dict(OBJECTIVE="sapo", DISTILL_COEF=1.0, BETA=0.0),
    dict(OBJECTIVE="gmpo"), dict(ADVANTAGE="reinforce_pp_baseline"),
    dict(REWARD_NORM="normalize_then_sum"), dict(TOP_ENTROPY_QUANTILE=0.2),
])
def test_the_variants_that_work_together_start(setting, monkeypatch, tmp_path):
    monkeypatch.setattr(grpo, "OUTPUT_DIR", str(tmp_path))
    for name, value in setting.items():
        set_setting(monkeypatch, name, value)
    grpo.check_settings()


# ----------------------------------------------------------------------------- through the step
@pytest.mark.parametrize("setting", [
    dict(OBJECTIVE="cispo", LOSS_TYPE="dapo"), dict(OBJECTIVE="sapo"), dict(OBJECTIVE="gmpo"),
    dict(TOP_ENTROPY_QUANTILE=0.3),
])
def test_policy_loss_runs_each_variant_and_it_changes_the_gradient(setting, fresh_model,
                                                                   monkeypatch):
    """Step 6 as the trainer runs it, on a batch whose pi_old is away from the weights (so each
    surrogate's own treatment of the ratio shows): a finite loss, and a gradient that is not the
    default's."""
    b = batch_for(fresh_model)
    b.pi_old_logps = b.ref_logps - 0.3 * torch.arange(6.0)  # (4, 6) ratios well away from 1
    b.pi_old_rows = torch.ones(4, dtype=torch.bool)
    params = list(fresh_model.parameters())

    def gradient():
        engine = PlainEngine(fresh_model, lr=0.0)
        loss, metrics = grpo.choose_parts().loss(engine, replace(b, normalizer=4.0))
        assert torch.isfinite(loss) and metrics["kl"] >= 0
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    default = gradient()
    for name, value in setting.items():
        monkeypatch.setattr(grpo, name, value)
    varied = gradient()
    assert torch.isfinite(varied).all() and not torch.allclose(varied, default)


@pytest.mark.parametrize("setting", [
    dict(ADVANTAGE="rloo"), dict(ADVANTAGE="passk"), dict(ADVANTAGE="reinforce_pp_baseline"),
    dict(REWARD_NORM="normalize_then_sum"),
])
def test_steps_2_to_4_pack_each_baselines_advantages(setting, tiny_policy, monkeypatch):
    """A rollout on the tiny model (8 questions x 4 answers): each uploaded group's advantages
    are the chosen baseline's of its own rewards (REWARDS' weighted sums, or each reward for
    GDPO)."""
    for name, value in setting.items():
        monkeypatch.setattr(grpo, name, value)
    groups, _ = short_rollout(tiny_policy, monkeypatch, False, max_new_tokens=24)
    assert groups
    for tensors, _ in groups:
        rewards = tensors["scores"]
        if "ADVANTAGE" in setting:
            want = grpo.choose_parts().advantages(rewards, each=None)
            assert tensors["advantages"].tolist() == pytest.approx(want.tolist(), abs=1e-6)
        else:  # GDPO's sum of normalised rewards: centred like any group's
            assert tensors["advantages"].sum().item() == pytest.approx(0.0, abs=1e-5)
