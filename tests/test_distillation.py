"""On-policy distillation (DISTILL_COEF) and DeepSeek-V3.2's two corrections (KL_BIAS_CORRECTION,
OFF_POLICY_DELTA): the objective's gradient on a tiny categorical policy, hand values, the teacher
handshake (vocabulary, role) and the settings refused at start.

    python -m pytest -q tests/test_distillation.py
"""
import math
from dataclasses import replace

import pytest
import requests
import torch

import grpo_ref_split as grpo  # noqa: E402
import objectives  # noqa: E402
from conftest import VOCAB, group, pull, set_setting, start, stop
from features.variant_fields import BatchExtras
from features.wire import encode_batch
from features.fingerprint import vocab_fingerprint
from features.server_client import check_reference
from features.wire import WIRE_FORMAT

K = 5  # the categorical policy's choices: one-token answers


def categorical():
    """(policy logits with gradient (K,), teacher log-probs (K,)): fixed, far apart."""
    theta = torch.tensor([0.3, -1.2, 0.8, 0.0, -0.4], dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.tensor([-0.5, 1.0, 0.2, 0.7, -1.5], dtype=torch.float64), 0)
    return theta, teacher


def distill_loss(theta, teacher, answers, *, coef):
    """The trainer's loss (variant_token_loss, reduce_loss "grpo") on one-token answers (N,): reward
    advantages 0, so the teacher's term is all; pi_old = the sampling weights (ratio 1)."""
    logps = torch.log_softmax(theta, 0)[answers][:, None]  # (N, 1)
    old = logps.detach()  # (N, 1)
    mask = torch.ones_like(logps, dtype=torch.bool)  # (N, 1)
    advantages = objectives.distill_advantages(torch.zeros(len(answers), dtype=theta.dtype),
                                         teacher_logps=teacher[answers][:, None],
                                               pi_old_logps=old, mask=mask, coef=coef)  # (N, 1)
    per_token = objectives.variant_token_loss(logps=logps, pi_old_logps=old, kl=None,
                                              advantages=advantages, mask=mask, beta=0.0,
                                              clip_eps=0.2, clip_eps_high=0.2)  # (N, 1)
    return grpo.reduce_loss(per_token, mask, loss_type="grpo")


def reverse_kl_grad(theta, teacher, coef):
    """coef x grad KL(pi || teacher), by autograd on the closed form sum pi (log pi - log t)."""
    logp = torch.log_softmax(theta, 0)
    kl = (logp.exp() * (logp - teacher)).sum()
    return coef * torch.autograd.grad(kl, theta)[0]


def test_distillation_gradient_is_the_reverse_kl_gradient_exactly_in_expectation():
    """E over y ~ pi of the loss's gradient, summed over all K answers weighted by pi(y) (no
    sampling): equal to coef x grad KL(pi || teacher) up to float64 rounding."""
    theta, teacher = categorical()
    coef = 0.7
    pi = torch.softmax(theta, 0).detach()
    expected = sum(pi[y] * torch.autograd.grad(
        distill_loss(theta, teacher, torch.tensor([y]), coef=coef), theta)[0] for y in range(K))
    assert torch.allclose(expected, reverse_kl_grad(theta, teacher, coef), atol=1e-12)


def test_distillation_gradient_by_monte_carlo_against_the_exact_one():
    """200,000 answers sampled from pi, the loss of all of them at once: its gradient is the mean of
    the per-answer gradients g_y = coef (log pi(y) - log t(y)) (e_y - pi), whose standard error
    (their std / sqrt(N)) is measured here. Each of the K components must lie within 6 standard
    errors of coef x grad KL(pi || teacher): a correct estimator fails that with probability about
    2e-9 per component; a flipped sign misses by about 2 |gradient| / SE, hundreds of SEs."""
    theta, teacher = categorical()
    coef = 0.7
    n = 200_000
    generator = torch.Generator().manual_seed(0)
    pi = torch.softmax(theta, 0).detach()
    answers = torch.multinomial(pi, n, replacement=True, generator=generator)  # (N,)
    grad = torch.autograd.grad(distill_loss(theta, teacher, answers, coef=coef), theta)[0]
    logp = torch.log(pi)
    per_completion = coef * (logp[answers] - teacher[answers])[:, None] * (
        torch.nn.functional.one_hot(answers, K).double() - pi)  # (N, K) each answer's gradient
    assert torch.allclose(per_completion.mean(0), grad, atol=1e-12)  # the loss is their mean
    standard_error = per_completion.std(0) / math.sqrt(n)  # (K,)
    exact = reverse_kl_grad(theta, teacher, coef)
    assert ((grad - exact).abs() <= 6 * standard_error).all(), (grad, exact, standard_error)
    assert (exact.abs() > 20 * standard_error).all()  # the test can tell a sign flip apart


def test_distill_advantages_by_hand():
    """A_t = A + c (log t - log pi_old) on answer tokens, A on padding (whose loss is masked)."""
    advantages = torch.tensor([1.0, -0.5])
    teacher = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    sampler = torch.tensor([[-2.0, -2.0, -1.0], [-1.5, -0.25, -9.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    got = objectives.distill_advantages(advantages, teacher_logps=teacher, pi_old_logps=sampler,
                                  mask=mask, coef=0.5)
    assert got.tolist() == [[1.5, 1.0, 1.0], [0.0, -0.5, 4.0]]


def test_a_discounted_teacher_term_adds_the_later_tokens_by_hand():
    """DISTILL_DISCOUNT g: A_t = A + coef sum_{t' >= t} g^(t' - t) (log teacher - log pi_old)_t'.
    Terms [1, -2, 4] and a padding token, g 0.5, coef 2, A 0.1: t=2: 4; t=1: -2 + 2 = 0;
    t=0: 1 + 0.5 (-2) + 0.25 (4) = 1; x2 + 0.1 -> [2.1, 0.1, 8.1], padding 0.1. g 0: each its
    own."""
    teacher = torch.tensor([[1.0, -2.0, 4.0, 9.0]])
    sampler = torch.zeros(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    got = objectives.distill_advantages(torch.tensor([0.1]), teacher_logps=teacher,
                                  pi_old_logps=sampler, mask=mask, coef=2.0, discount=0.5)
    assert got.view(-1).tolist() == pytest.approx([2.1, 0.1, 8.1, 0.1])
    own = objectives.distill_advantages(torch.tensor([0.1]), teacher_logps=teacher,
                                  pi_old_logps=sampler, mask=mask, coef=2.0)
    assert own.view(-1).tolist() == pytest.approx([2.1, -3.9, 8.1, 0.1])


def test_a_matched_teacher_term_has_the_group_terms_size_by_hand():
    """DISTILL_SCALE "matched" (issue 60, item 6): advantages [1, -1] on 2 tokens each, terms
    [[0.3, 0.1], [-0.2, 0.0]] and a padding token. rms(A) over the 4 tokens = 1; rms(term) =
    sqrt((0.09 + 0.01 + 0.04 + 0) / 4) = 0.18708; so the term x 5.3452, coef 0.5:
    A_t = [1 + 0.80178, 1 + 0.26726, -1 - 0.53452, -1 + 0]; padding keeps A."""
    teacher = torch.tensor([[0.3, 0.1, 7.0], [-0.2, 0.0, 7.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    got = objectives.distill_advantages(torch.tensor([1.0, -1.0]), teacher_logps=teacher,
                                  pi_old_logps=torch.zeros(2, 3), mask=mask, coef=0.5,
                                  matched=True)
    scale = 1 / math.sqrt(0.14 / 4)
    assert scale == pytest.approx(5.3452, abs=1e-4)
    want = [[1 + 0.5 * 0.3 * scale, 1 + 0.5 * 0.1 * scale, 1.0],
            [-1 - 0.5 * 0.2 * scale, -1.0, -1.0]]
    assert got.tolist() == [pytest.approx(row, abs=1e-5) for row in want]


def test_matched_scaling_needs_rewards_and_a_sampled_term(monkeypatch, tmp_path):
    no_rewards = [(fn, 0.0) for fn, _ in grpo.REWARDS]
    fine = dict(REWARDS=grpo.REWARDS, DISTILL_COEF=1.0, DISTILL_TOP_K=0)
    for setting in (dict(REWARDS=no_rewards), dict(DISTILL_COEF=0.0), dict(DISTILL_TOP_K=5)):
        teacher_settings(monkeypatch, tmp_path, DISTILL_SCALE="matched", **(fine | setting))
        with pytest.raises(SystemExit, match='DISTILL_SCALE "matched"'):
            grpo.check_settings()
    teacher_settings(monkeypatch, tmp_path, DISTILL_SCALE="matched", **fine)
    grpo.check_settings()
    teacher_settings(monkeypatch, tmp_path, DISTILL_SCALE="always")
    with pytest.raises(SystemExit, match="DISTILL_SCALE = 'always'"):
        grpo.check_settings()


def test_teacher_first_needs_rewards_a_teacher_and_a_threshold(monkeypatch, tmp_path):
    """TEACHER_FIRST_KL (issue 60, item 6): the rewards join later, so there must be rewards to
    join and a teacher to start with; a negative or NaN threshold is refused. 0 is off."""
    no_rewards = [(fn, 0.0) for fn, _ in grpo.REWARDS]
    fine = {"REWARDS": grpo.REWARDS, "DISTILL_COEF": 1.0, "TEACHER_FIRST_KL": 0.05}
    for setting, message in (({"REWARDS": no_rewards}, "REWARDS weight"),
                             ({"DISTILL_COEF": 0.0}, "DISTILL_COEF > 0"),
                             ({"TEACHER_FIRST_KL": -0.01}, "or 0 = off"),
                             ({"TEACHER_FIRST_KL": float("nan")}, "or 0 = off")):
        teacher_settings(monkeypatch, tmp_path, **(fine | setting))
        with pytest.raises(SystemExit, match=message):
            grpo.check_settings()
    teacher_settings(monkeypatch, tmp_path, **fine)
    grpo.check_settings()
    teacher_settings(monkeypatch, tmp_path, **(fine | {"TEACHER_FIRST_KL": 0.0}))
    grpo.check_settings()


def test_teacher_steps_needs_rewards_a_teacher_and_steps_left_for_the_rewards(monkeypatch,
                                                                              tmp_path):
    """TEACHER_STEPS (distillation, then RL): the rewards take over after it, so there must be
    rewards, a teacher, and steps left after it; a count that is not a whole number >= 0 is
    refused, and so is either rule of the two terms' mix (TEACHER_FIRST_KL, DISTILL_BELOW),
    which has no step to act on. 0 is off."""
    no_rewards = [(fn, 0.0) for fn, _ in grpo.REWARDS]
    fine = {"REWARDS": grpo.REWARDS, "DISTILL_COEF": 1.0, "TEACHER_STEPS": 10, "ALL_STEPS": 30,
            "TEACHER_FIRST_KL": 0.0, "DISTILL_BELOW": 0.0}
    for setting, message in (({"REWARDS": no_rewards}, "REWARDS weight"),
                             ({"DISTILL_COEF": 0.0}, "DISTILL_COEF > 0"),
                             ({"TEACHER_STEPS": -1}, "or 0 = off"),
                             ({"TEACHER_STEPS": 2.5}, "a whole number"),
                             ({"ALL_STEPS": 10}, "the rewards would never train"),
                             ({"TEACHER_FIRST_KL": 0.05}, "TEACHER_FIRST_KL has nothing"),
                             ({"DISTILL_BELOW": 2.0}, "DISTILL_BELOW has nothing")):
        teacher_settings(monkeypatch, tmp_path, **(fine | setting))
        with pytest.raises(SystemExit, match=message):
            grpo.check_settings()
    teacher_settings(monkeypatch, tmp_path, **fine)
    grpo.check_settings()
    teacher_settings(monkeypatch, tmp_path, **(fine | {"TEACHER_STEPS": 0, "ALL_STEPS": 1}))
    grpo.check_settings()


def test_teacher_steps_hand_the_steps_from_the_teacher_to_the_rewards(monkeypatch):
    """Steps 1..TEACHER_STEPS train the teacher alone, every later one the rewards alone; at 0
    every step trains both. Once the teacher has left no answer takes its term, whatever
    DISTILL_BELOW would say, and distill_advantages returns the group term itself."""
    from features import teacher_mix

    monkeypatch.setattr(teacher_mix, "TEACHER_STEPS", 2)
    assert [teacher_mix.teacher_trains(step) for step in (1, 2, 3, 4)] == [1, 1, 0, 0]
    assert [teacher_mix.rewards_train(step) for step in (1, 2, 3, 4)] == [0, 0, 1, 1]
    monkeypatch.setattr(teacher_mix, "TEACHER_STEPS", 0)
    assert all(teacher_mix.teacher_trains(step) for step in (1, 2, 3))
    assert all(teacher_mix.rewards_train(step) for step in (1, 2, 3))
    monkeypatch.setattr(teacher_mix, "TEACHER_STEPS", 2)
    first = teacher_mix.phase(1, joined=True)
    second = teacher_mix.next_phase(first, teacher_kl=0.5)
    third = teacher_mix.next_phase(second, teacher_kl=0.5)
    assert [(p.step, p.teacher, p.rewards) for p in (first, second, third)] == [
        (1, True, False), (2, True, False), (3, False, True)]
    monkeypatch.setattr(teacher_mix, "TEACHER_STEPS", 0)
    monkeypatch.setattr(teacher_mix, "TEACHER_FIRST_KL", 0.05)  # waits until a low teacher_kl
    waiting = teacher_mix.phase(1, joined=False)
    assert not waiting.rewards and not teacher_mix.next_phase(waiting, teacher_kl=0.06).rewards
    assert teacher_mix.next_phase(waiting, teacher_kl=0.05).rewards
    monkeypatch.setattr(teacher_mix, "TEACHER_FIRST_KL", 0.0)
    rewards = torch.tensor([0.0, 2.0])  # (B,)
    assert teacher_mix.teacher_rows(rewards, teacher_on=False).tolist() == [False, False]
    monkeypatch.setattr(teacher_mix, "DISTILL_BELOW", 2.0)
    assert teacher_mix.teacher_rows(rewards).tolist() == [True, False]
    assert teacher_mix.teacher_rows(rewards, teacher_on=False).tolist() == [False, False]
    group = torch.tensor([0.5, -0.5])  # (B,)
    got = objectives.distill_advantages(group, teacher_logps=torch.full((2, 3), -1.0),
                                  pi_old_logps=torch.full((2, 3), -2.0),
                                  mask=torch.ones(2, 3), coef=1.0, matched=True,
                                  teacher_rows=teacher_mix.teacher_rows(rewards, teacher_on=False))
    assert got.tolist() == [[0.5] * 3, [-0.5] * 3]


def test_the_hand_off_clears_a_bare_optimizer_and_a_resume_keeps_teacher_steps(monkeypatch,
                                                                              tmp_path):
    """Issue 79: the hand-off assumed ZeRO's wrapper (engine.optimizer.optimizer); a ZeRO stage 0
    fp32 config hands back the bare AdamW, and step TEACHER_STEPS + 1 raised AttributeError. And a
    resume with another TEACHER_STEPS changed the phase of the steps left without a word: it is
    refused at start, from the checkpoint's settings.json."""
    import json
    import types

    from features import checkpoints, teacher_mix

    weight = torch.nn.Parameter(torch.ones(2))
    adamw = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.ones(2)
    adamw.step()
    assert adamw.state
    engine = types.SimpleNamespace(optimizer=adamw, global_rank=1)  # stage 0: the bare AdamW
    teacher_mix.hand_off(engine, 4)
    assert not adamw.state
    folder = tmp_path / "step_10"
    folder.mkdir()
    (folder / "settings.json").write_text(json.dumps({"TEACHER_STEPS": 5}))
    teacher_settings(monkeypatch, tmp_path, RESUME=True, TEACHER_STEPS=8)
    with pytest.raises(SystemExit, match="started with 5"):
        grpo.check_settings()  # before any model loads
    monkeypatch.setattr(teacher_mix, "TEACHER_STEPS", 5)
    teacher_mix.check_resumed(*checkpoints.newest_settings(str(tmp_path)))  # the same: resumes
    (folder / "settings.json").unlink()  # a checkpoint from before settings were saved
    with pytest.raises(SystemExit, match="does not say its TEACHER_STEPS"):
        teacher_mix.check_resumed(*checkpoints.newest_settings(str(tmp_path)))


def test_the_hand_off_makes_the_next_optimizer_step_a_fresh_adamws_first(monkeypatch, capsys):
    """TEACHER_STEPS 3: step 4's phase, and no other, hands off; hand_off clears the optimizer's
    state, so the step after it moves the weights exactly as a new AdamW would from the same
    weights and gradient, where the teacher stage's moments, kept, move them differently."""
    from types import SimpleNamespace

    from features import teacher_mix

    monkeypatch.setattr(teacher_mix, "TEACHER_STEPS", 3)
    assert [teacher_mix.phase(step, joined=True).hand_off for step in (1, 3, 4, 5)] == [
        False, False, True, False]
    g = torch.Generator().manual_seed(0)
    gradients = [torch.randn(5, generator=g) for _ in range(4)]  # the teacher's 3, then one
    moved = {}
    for handed in (True, False):
        weight = torch.nn.Parameter(torch.ones(5))
        adamw = torch.optim.AdamW([weight], lr=0.1)
        engine = SimpleNamespace(optimizer=SimpleNamespace(optimizer=adamw), global_rank=0)
        for gradient in gradients[:3]:
            weight.grad = gradient.clone()
            adamw.step()
        if handed:
            teacher_mix.hand_off(engine, 4)
        before = weight.detach().clone()
        weight.grad = gradients[3].clone()
        adamw.step()
        moved[handed] = (before, weight.detach().clone())
    fresh_weight = torch.nn.Parameter(moved[True][0].clone())
    fresh_weight.grad = gradients[3].clone()
    torch.optim.AdamW([fresh_weight], lr=0.1).step()
    assert torch.equal(moved[True][1], fresh_weight.detach())
    assert not torch.allclose(moved[False][1], fresh_weight.detach(), atol=1e-3)
    assert capsys.readouterr().out.count("AdamW's moments cleared") == 1


def test_teacher_share_is_the_teacher_terms_part_of_the_advantages_size_by_hand():
    """run_log.teacher_metrics' teacher_share: group advantages [1, -1] on 2 answer tokens each
    (rms 1), teacher terms [[0.3, 0.1], [-0.2, 0.0]] (rms sqrt(0.14 / 4) = 0.18708) and a
    padding token whose values must not count: 0.18708 / 1.18708 = 0.15760. With the group term
    at 0 (TEACHER_FIRST_KL's wait) the share is 1; token_share 0.5 halves each metric."""
    from features.run_log import teacher_metrics

    mask = torch.tensor([[True, True, False], [True, True, False]])
    group = torch.tensor([1.0, -1.0])
    term = torch.tensor([[0.3, 0.1, 9.0], [-0.2, 0.0, 9.0]])
    old = torch.zeros(2, 3)
    b = grpo.Batch(input_ids=None, attention_mask=None, mask=mask, advantages=group,
                   ref_logps=None, pi_old_logps=None, pi_old_rows=None, token_share=0.5,
                   extra=BatchExtras(teacher_logps=term))
    got = teacher_metrics(b, pi_old_logps=old, token_advantages=group[:, None] + term)
    rms = math.sqrt(0.14 / 4)
    assert got["teacher_share"] == pytest.approx(0.5 * rms / (1 + rms), abs=1e-6)
    assert got["teacher_kl"] == pytest.approx(0.5 * -0.2 / 4, abs=1e-6)
    waiting = grpo.Batch(**{**b.__dict__, "advantages": torch.zeros(2)})
    alone = teacher_metrics(waiting, pi_old_logps=old, token_advantages=term)
    assert alone["teacher_share"] == pytest.approx(0.5, abs=1e-6)
    assert "teacher_share" not in teacher_metrics(b, pi_old_logps=old)  # DISTILL_TOP_K: not given


def test_a_discount_outside_zero_to_one_or_without_a_teacher_is_refused(monkeypatch, tmp_path):
    for coef, discount in ((1.0, 1.5), (1.0, -0.1), (0.0, 0.5)):
        teacher_settings(monkeypatch, tmp_path, DISTILL_COEF=coef, DISTILL_DISCOUNT=discount)
        with pytest.raises(SystemExit, match="DISTILL_DISCOUNT"):
            grpo.check_settings()
    teacher_settings(monkeypatch, tmp_path, DISTILL_DISCOUNT=0.9)
    grpo.check_settings()


def test_per_token_advantages_of_equal_values_give_the_per_answer_loss():
    torch.manual_seed(0)
    logps = torch.randn(3, 4, requires_grad=True)
    old = (logps + 0.1 * torch.randn(3, 4)).detach()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    advantages = torch.tensor([0.5, -1.0, 2.0])
    loss = dict(logps=logps, pi_old_logps=old, ref_logps=None, mask=mask, beta=0.0, clip_eps=0.2,
                clip_eps_high=0.28)
    per_completion = grpo.grpo_loss(advantages=advantages, **loss)
    del loss["ref_logps"]
    per_token = objectives.variant_token_loss(advantages=advantages[:, None].expand(3, 4), kl=None,
                                              **loss)
    assert torch.equal(per_completion, per_token)


# ----------------------------------------------------------------------------- DeepSeek-V3.2
def test_bias_corrected_kl_by_hand():
    """One token, pi = 0.5, pi_old = 0.25, ref = 0.25: r = 2, d = log ref - log pi = -log 2,
    k3 = e^d - d - 1 = 0.5 + log 2 - 1. The corrected penalty is r k3; its derivative in log pi
    is r k3 + r (1 - e^d) = 2 (log 2 - 0.5) + 2 (0.5) = 2 log 2 (the plain one: 1 - e^d = 0.5)."""
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    common = dict(pi_old_logps=old, ref_logps=ref, advantages=torch.zeros(1, dtype=torch.float64),
                  mask=mask, beta=1.0, clip_eps=0.2, clip_eps_high=0.2)
    k3_value = 0.5 + math.log(2) - 1
    kl = grpo.reference_kl(ref, logp, mask)  # (1, 1)
    corrected = objectives.variant_token_loss(logps=logp, bias_corrected_kl=True, kl=kl,
                                              **{k: v for k, v in common.items()
                                                 if k != "ref_logps"}).sum()
    assert corrected.item() == pytest.approx(2 * k3_value, abs=1e-12)
    gradient = torch.autograd.grad(corrected, logp)[0].item()
    assert gradient == pytest.approx(2 * math.log(2), abs=1e-12)
    plain = grpo.grpo_loss(logps=logp, **common).sum()
    assert plain.item() == pytest.approx(k3_value, abs=1e-12)
    assert torch.autograd.grad(plain, logp)[0].item() == pytest.approx(0.5, abs=1e-12)


def test_bias_corrected_kl_gives_the_reverse_kl_gradient_off_policy():
    """Answers sampled from pi_old != pi, the exact expectation over all K: the corrected penalty's
    gradient is grad KL(pi || ref); the plain k3's is not (it is off by far more than rounding)."""
    theta, ref = categorical()
    old_logits = torch.tensor([1.0, 0.0, -1.0, 0.5, 0.2], dtype=torch.float64)
    pi_old = torch.softmax(old_logits, 0)

    def expected_grad(corrected):
        total = torch.zeros(K, dtype=torch.float64)
        for y in range(K):
            logps = torch.log_softmax(theta, 0)[y].view(1, 1)
            mask = torch.ones(1, 1, dtype=torch.bool)
            loss = objectives.variant_token_loss(
                logps=logps,
                pi_old_logps=torch.log(pi_old[y]).view(1, 1),
                kl=grpo.reference_kl(ref[y].view(1, 1), logps, mask),
                advantages=torch.zeros(1).double(),
                mask=torch.ones(1, 1, dtype=torch.bool),
                beta=1.0,
                clip_eps=0.2,
                clip_eps_high=0.2,
                bias_corrected_kl=corrected,
            ).sum()
            total += pi_old[y] * torch.autograd.grad(loss, theta)[0]
        return total

    exact = reverse_kl_grad(theta, ref, 1.0)
    assert torch.allclose(expected_grad(True), exact, atol=1e-12)
    assert (expected_grad(False) - exact).abs().max() > 0.1


class Rows:
    """The three Batch fields off_policy_mask reads."""

    def __init__(self, mask, vllm_logps=None, vllm_rows=None):
        self.mask = mask
        self.vllm_logps = vllm_logps
        self.vllm_rows = vllm_rows


def off_policy_keep(advantages, old, logps, mask, delta, vllm_logps=None, vllm_rows=None):
    """The trainer's mask as policy_loss builds it: pi_old is vLLM's log-probs on the rows
    it sampled, pi_old on the others."""
    sampled_by = grpo.pi_old_everywhere(old, vllm_logps, vllm_rows, mask)  # (B, T)
    return objectives.off_policy_mask(advantages=advantages, pi_old_logps=sampled_by,
                                      logps=logps, mask=mask, delta=delta)  # (B, T)


def test_off_policy_sequence_mask_by_hand():
    """Four answers of two tokens, delta 0.1. log(pi_old / pi) per token: row 0 [0.3, 0.1] mean 0.2,
    A < 0: masked. Row 1 the same drift, A > 0: kept. Row 2 A < 0, mean 0.05: kept. Row 3 A < 0,
    its second token padding: mean over the one real token 0.3: masked."""
    logps = torch.zeros(4, 2)
    old = torch.tensor([[0.3, 0.1], [0.3, 0.1], [0.1, 0.0], [0.3, 5.0]])
    mask = torch.tensor([[True, True], [True, True], [True, True], [True, False]])
    advantages = torch.tensor([-1.0, 1.0, -1.0, -0.5])[:, None].expand(4, 2)  # one per answer
    keep = off_policy_keep(advantages, old, logps, mask, 0.1)
    assert keep.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]


def test_with_per_token_advantages_the_mask_reads_each_tokens_own_sign():
    """Issue 60: with a teacher the answer's mean advantage is about minus the KL, so a whole-answer
    rule dropped every drifted answer in pure distillation, its tokens the teacher prefers with it.
    Each token's own sign decides: on an answer drifted past delta, [+0.8, -4, 0] keeps its first
    and third tokens; on one within delta, every token stays."""
    advantages = torch.tensor([[0.8, -4.0, 0.0], [0.8, -4.0, 0.0]])  # mean < 0 on both
    old = torch.tensor([[0.3, 0.3, 0.3], [0.05, 0.05, 0.05]])  # drift 0.3 and 0.05
    mask = torch.ones(2, 3, dtype=torch.bool)
    keep = off_policy_keep(advantages, old, torch.zeros(2, 3), mask, 0.1)
    assert keep.tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]


def test_off_policy_mask_reads_vllms_log_probs_where_it_sampled():
    """Row 0 sampled by vLLM (drift from its log-probs, 0.5: masked); row 1 not (pi_old, 0:
    kept)."""
    mask = torch.ones(2, 1, dtype=torch.bool)
    keep = off_policy_keep(torch.tensor([[-1.0], [-1.0]]), torch.zeros(2, 1), torch.zeros(2, 1),
                           mask, 0.2, vllm_logps=torch.tensor([[0.5], [0.5]]),
                           vllm_rows=torch.tensor([True, False]))
    assert keep.view(-1).tolist() == [0.0, 1.0]


def test_gspo_with_a_teachers_per_token_advantages_moves_each_token_by_its_own():
    """Issue 60: GSPO took the answer's mean log-ratio, so every token got the answer's mean
    teacher term: for advantages [+0.8, -4, 0] the gradient on log pi was [+0.36, +0.36, +0.36],
    pushing down the token the teacher prefers. GSPO-token keeps GSPO's value and gives
    d loss / d log pi_t = -ratio A_t / |y| ("grpo" loss, one answer): [-0.27, +1.33, 0] at ratio 1,
    as without GSPO."""
    logps = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    advantages = torch.tensor([[0.8, -4.0, 0.0]])
    for old, ratio in ((logps.detach(), 1.0), (logps.detach() - 0.03, math.exp(0.03))):
        per_token = objectives.variant_token_loss(logps=logps, pi_old_logps=old, kl=None,
                                                  advantages=advantages, mask=mask, beta=0.0,
                                                  clip_eps=0.2, clip_eps_high=0.2,
                                                  gspo=True)  # (1, 3)
        loss = grpo.reduce_loss(per_token, mask, loss_type="grpo")
        (grad,) = torch.autograd.grad(loss, logps)
        want = [-ratio * a / 3 for a in (0.8, -4.0, 0.0)]
        assert grad.view(-1).tolist() == pytest.approx(want, abs=1e-6)
        assert loss.item() == pytest.approx(-ratio * (0.8 - 4.0) / 3, abs=1e-6)  # GSPO's value


def test_gspo_with_one_advantage_per_answer_is_the_sequence_objective_in_value_and_gradient():
    """GSPO's definition, written here: s = exp(mean_t log(pi / pi_old)) per answer, the loss
    -min(s A, clip(s, 1 - eps, 1 + eps) A) averaged over answers. The per-token form gives the
    same value and gradient, inside and outside the clip range."""
    g = torch.Generator().manual_seed(0)
    logps = (torch.randn(4, 5, generator=g) - 2).requires_grad_()
    old = logps.detach() + torch.tensor([0.0, 0.001, -0.002, 0.01])[:, None]  # some past 3e-3
    mask = torch.rand(4, 5, generator=g) > 0.2
    mask[:, 0] = True
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5])
    eps = 3e-3
    s = torch.exp(objectives.masked_mean(logps - old, mask))  # (4,)
    want = -torch.min(s * advantages, s.clamp(1 - eps, 1 + eps) * advantages).mean()
    per_token = objectives.variant_token_loss(logps=logps, pi_old_logps=old, kl=None,
                                              advantages=advantages[:, None].expand(4, 5),
                                              mask=mask, beta=0.0, clip_eps=eps,
                                              clip_eps_high=eps, gspo=True)  # (4, 5)
    got = grpo.reduce_loss(per_token, mask, loss_type="grpo")
    (want_grad,) = torch.autograd.grad(want, logps)
    (got_grad,) = torch.autograd.grad(got, logps)
    # float32 sums of five terms of size ~2: a few ulps
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)


def test_a_masked_answer_keeps_its_kl_penalty():
    """The mask multiplies the surrogate only: a masked answer's loss is beta k3 alone."""
    logps = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    common = dict(
        logps=logps,
        pi_old_logps=logps,
        ref_logps=ref,
        advantages=torch.tensor([-2.0]),
        mask=torch.ones(1, 2, dtype=torch.bool),
        beta=0.1,
        clip_eps=0.2,
        clip_eps_high=0.2,
    )
    kl = grpo.reference_kl(common.pop("ref_logps"), logps, common["mask"])  # (1, 2)
    masked = objectives.variant_token_loss(weights=torch.zeros(1, 1), kl=kl, **common)
    assert torch.allclose(masked, 0.1 * grpo.k3(ref, logps))


# -------------------------------------------------------------------------- the teacher's handshake
class Vocab:
    """A tokenizer as vocab_fingerprint and check_reference see it."""

    def __init__(self, words):
        self.words = words

    def get_vocab(self):
        return dict(self.words)

    def __len__(self):
        return len(self.words)


def test_the_vocabulary_hash_sees_two_ids_swapped():
    same_size = Vocab({"a": 0, "b": 1, "c": 2})
    swapped = Vocab({"a": 0, "b": 2, "c": 1})
    assert vocab_fingerprint(same_size) == vocab_fingerprint(Vocab({"c": 2, "a": 0, "b": 1}))
    assert vocab_fingerprint(same_size) != vocab_fingerprint(swapped)


def health_of(role, tokenizer, model, **changes):
    from features.fingerprint import model_fingerprint

    return {
        "model": "m",
        "vocab_size": model.get_output_embeddings().weight.shape[0],
        "fingerprint": model_fingerprint(model),
        "vocabulary": vocab_fingerprint(tokenizer),
        "role": role,
        "wire": WIRE_FORMAT,
        **changes,
    }


def test_a_server_of_another_wire_format_is_refused_at_start(model, tokenizer):
    """A server from an older checkout reads an upload's reward sums under another name: the
    handshake stops the trainer before step 1, naming both formats."""
    current = health_of("reference", tokenizer, model)
    check_reference("u", current, model, tokenizer, False)
    older = {k: v for k, v in current.items() if k != "wire"}  # before formats had a number
    with pytest.raises(SystemExit, match="speaks wire format 1, this trainer 2"):
        check_reference("u", older, model, tokenizer, False)
    with pytest.raises(SystemExit, match="speaks wire format 3"):
        check_reference("u", dict(current, wire=3), model, tokenizer, False)


def test_a_teacher_needs_the_same_vocabulary_not_the_same_weights(model, tokenizer):
    other = {"config": "0", "weights": "0"}
    check_reference(
        "u",
        health_of("teacher", tokenizer, model, fingerprint=other),
        model,
        tokenizer,
        False,
        teacher=True,
    )  # other weights and shape: fine
    with pytest.raises(SystemExit, match="vocabulary .* is not this policy's"):
        check_reference(
            "u",
            health_of("teacher", tokenizer, model, vocabulary="0" * 16),
            model,
            tokenizer,
            False,
            teacher=True,
        )
    with pytest.raises(SystemExit, match="vocabulary"):  # a teacher that does not say: refused
        check_reference(
            "u",
            health_of("teacher", tokenizer, model, vocabulary=""),
            model,
            tokenizer,
            False,
            teacher=True,
        )
    with pytest.raises(SystemExit, match="fewer than this tokenizer's"):
        check_reference(
            "u",
            health_of("teacher", tokenizer, model, vocab_size=100),
            model,
            tokenizer,
            False,
            teacher=True,
        )


def test_roles_must_match_what_the_trainer_asks_for(model, tokenizer):
    with pytest.raises(SystemExit, match="wants a teacher, but .* as a reference"):
        check_reference(
            "u", health_of("reference", tokenizer, model), model, tokenizer, False, teacher=True
        )
    with pytest.raises(SystemExit, match="as a teacher: set DISTILL_COEF"):
        check_reference("u", health_of("teacher", tokenizer, model), model, tokenizer, False)
    for role in ("teacher", "reference"):  # a worker only samples: either will do
        check_reference(
            "u", health_of(role, tokenizer, model), model, tokenizer, False, teacher=None
        )
    with pytest.raises(SystemExit, match="vocabulary"):  # a reference with another vocabulary
        check_reference(
            "u",
            health_of("reference", tokenizer, model, vocabulary="0" * 16),
            model,
            tokenizer,
            False,
        )


def test_the_server_says_its_role_and_vocabulary(model):
    from conftest import start, stop
    import requests

    for teacher, role in ((True, "teacher"), (False, "reference")):
        server, stop_serving, url = start(model, teacher=teacher, vocabulary="abc")
        try:
            health = requests.get(url + "/health", timeout=10).json()
        finally:
            stop(server, stop_serving)
        assert (health["role"], health["vocabulary"]) == (role, "abc")


# ------------------------------------------------------------------------ settings refused at start
def teacher_settings(monkeypatch, tmp_path, **changes):
    monkeypatch.setattr(grpo, "OUTPUT_DIR", str(tmp_path))
    for name, value in {"DISTILL_COEF": 1.0, "BETA": 0.0, **changes}.items():
        set_setting(monkeypatch, name, value)


def test_a_k3_penalty_towards_a_teacher_is_refused(monkeypatch, tmp_path):
    teacher_settings(monkeypatch, tmp_path)
    grpo.check_settings()
    teacher_settings(monkeypatch, tmp_path, BETA=0.04)
    with pytest.raises(SystemExit, match="forward KL"):
        grpo.check_settings()
    teacher_settings(monkeypatch, tmp_path, BETA=0.04, LORA_RANK=8, REF_FROM_BASE=True)
    grpo.check_settings()  # the reference is LoRA's base, the server the teacher
    assert grpo.server_client.uses_server(beta=grpo.BETA, distill_coef=grpo.DISTILL_COEF)


@pytest.mark.parametrize(
    "setting",
    [
        dict(DISTILL_COEF=1.0),
        dict(OFF_POLICY_DELTA=0.1),
        dict(KL_BIAS_CORRECTION=True, DISTILL_COEF=0.0),
    ],
)
def test_triton_is_refused_with_a_teacher_or_a_correction(monkeypatch, tmp_path, setting):
    teacher_settings(monkeypatch, tmp_path, USE_TRITON=True, **setting)
    with pytest.raises(SystemExit, match="USE_TRITON takes one advantage per completion"):
        grpo.check_settings()


def test_dynamic_sampling_with_a_teacher_says_it_draws_once(monkeypatch, tmp_path, capsys):
    """Issue 60: with a teacher every group is kept (its term varies within any group), so
    DYNAMIC_SAMPLING silently did nothing; it is said at start."""
    teacher_settings(monkeypatch, tmp_path, DYNAMIC_SAMPLING=True)
    grpo.check_settings()
    assert "DYNAMIC_SAMPLING with DISTILL_COEF: every group trains" in capsys.readouterr().out
    teacher_settings(monkeypatch, tmp_path, DYNAMIC_SAMPLING=True, DISTILL_COEF=0.0)
    grpo.check_settings()
    assert "DYNAMIC_SAMPLING" not in capsys.readouterr().out


def test_groups_of_one_only_for_pure_distillation(monkeypatch, tmp_path):
    teacher_settings(monkeypatch, tmp_path, NUM_PRE_Q=1)
    with pytest.raises(SystemExit, match="NUM_PRE_Q = 1: a group needs 2"):
        grpo.check_settings()  # REWARDS still weigh
    no_rewards = [(fn, 0.0) for fn, _ in grpo.REWARDS]
    teacher_settings(monkeypatch, tmp_path, NUM_PRE_Q=1, REWARDS=no_rewards)
    grpo.check_settings()
    teacher_settings(monkeypatch, tmp_path, NUM_PRE_Q=1, REWARDS=no_rewards, DISTILL_COEF=0.0)
    with pytest.raises(SystemExit, match="NUM_PRE_Q = 1"):
        grpo.check_settings()
    scores = torch.tensor([3.0, 0.0])  # a group of one has no spread: advantage 0, not NaN
    assert grpo.advantages_in_groups(scores, 1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("setting", [dict(DISTILL_COEF=-1.0), dict(OFF_POLICY_DELTA=-0.1)])
def test_negative_weights_are_refused(monkeypatch, tmp_path, setting):
    teacher_settings(monkeypatch, tmp_path, **setting)
    with pytest.raises(SystemExit, match="each is 0 .off. or above"):
        grpo.check_settings()


# -------------------------------------------------------------------------- a run against a teacher
def test_pure_distillation_trains_every_answer_and_moves_towards_the_teacher(
    tiny_model_dir, tokenizer, tmp_path
):
    """The trainer (deepspeed, one CPU rank) as a student, a noisy copy of the SFT-trained tiny
    model; ref_server.py with TEACHER=1 holds the model itself. Pure distillation: REWARDS weighed
    0, groups of one. Every sampled answer trains (equal rewards are not dropped), the teacher
    metrics are logged, and after 6 steps at LR 1e-3 the student's teacher_kl has fallen. The same
    student with DISTILL_COEF 0 is refused by that server at the handshake."""
    from transformers import LlamaForCausalLM

    from conftest import ServerProcess, free_port, metrics, train

    torch.manual_seed(1)
    student = tmp_path / "student"  # the teacher's weights, each tensor + noise of 0.3 its std
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for weight in model.parameters():
            weight += 0.3 * weight.std() * torch.randn_like(weight)
    model.save_pretrained(student)
    tokenizer.save_pretrained(student)
    teacher = ServerProcess(tiny_model_dir, free_port(), tmp_path / "teacher.log", TEACHER=1)
    try:
        assert teacher.health()["role"] == "teacher"
        run = train(
            student,
            teacher.url,
            tmp_path / "out",
            1,
            DISTILL_COEF=1.0,
            BETA=0.0,
            REWARDS='[["reward_correct", 0.0], ["reward_format", 0.0]]',
            NUM_PRE_Q=1,
            Q_BATCH_SIZE=8,
            ALL_STEPS=6,
            SAVE_STEPS=0,
            EVAL_STEPS=0,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        refused = train(student, teacher.url, tmp_path / "refused", 1, EVAL_STEPS=0)
    finally:
        teacher.stop()
    steps = metrics(tmp_path / "out")[0]
    assert [m["completions_trained"] for m in steps] == [m["completions_generated"] for m in steps]
    assert all(m["completions_generated"] == 8 for m in steps)
    assert all(0 <= m["teacher_better"] <= 1 for m in steps)
    kl = [m["teacher_kl"] for m in steps]
    assert kl[0] > 0.1  # the noise moved the student away from the teacher
    assert sum(kl[-2:]) < 0.8 * sum(kl[:2]), kl
    assert refused.returncode != 0
    assert "as a teacher: set DISTILL_COEF > 0" in refused.stdout + refused.stderr


def test_teacher_first_trains_on_the_teacher_alone_until_its_kl_is_low_then_the_rewards_join(
    tiny_model_dir, tokenizer, tmp_path
):
    """TEACHER_FIRST_KL in the trainer's loop, the default rewards, the tiny model as the
    teacher. A student near it (each weight + noise of 0.1 its std: rewards still differ within
    groups) with TEACHER_FIRST_KL 1e6, met by step 1's teacher_kl: step 1 trains on the
    teacher's term alone (teacher_share 1, the group term 0 though rewards differ), steps 2 and 3
    with the rewards too. A student far from it (noise 0.3) with TEACHER_FIRST_KL 1e-4: its KL
    stays above, so every step waits. Then TEACHER_STEPS 1 with the near student: step 1 trains
    on the teacher alone, steps 2 and 3 on the rewards alone (teacher_share exactly 0)."""
    from transformers import LlamaForCausalLM

    from conftest import ServerProcess, free_port, metrics, train

    torch.manual_seed(2)
    students = {}  # noise -> folder: the teacher's weights, each tensor + noise x its std
    for noise in (0.1, 0.3):
        model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
        with torch.no_grad():
            for weight in model.parameters():
                weight += noise * weight.std() * torch.randn_like(weight)
        students[noise] = tmp_path / f"student_{noise}"
        model.save_pretrained(students[noise])
        tokenizer.save_pretrained(students[noise])
    teacher = ServerProcess(tiny_model_dir, free_port(), tmp_path / "teacher.log", TEACHER=1)
    runs = {}
    try:
        for noise, join_kl, steps in ((0.1, 1e6, 3), (0.3, 1e-4, 2)):
            out = tmp_path / f"join_{join_kl}"
            run = train(students[noise], teacher.url, out, 1, DISTILL_COEF=1.0, BETA=0.0,
                        TEACHER_FIRST_KL=join_kl, ALL_STEPS=steps,
                        Q_BATCH_SIZE=4, SAVE_STEPS=0, EVAL_STEPS=0)
            assert run.returncode == 0, run.stderr[-3000:]
            runs[join_kl] = metrics(out)[0]
        out = tmp_path / "handoff"  # TEACHER_STEPS: the teacher alone, then the rewards alone
        run = train(students[0.1], teacher.url, out, 1, DISTILL_COEF=1.0, BETA=0.0,
                    TEACHER_STEPS=1, ALL_STEPS=3, Q_BATCH_SIZE=4, SAVE_STEPS=0, EVAL_STEPS=0)
        assert run.returncode == 0, run.stderr[-3000:]
        handoff = metrics(out)[0]
        handed = run.stdout + run.stderr  # the hand-off says so, once, at step 2
    finally:
        teacher.stop()
    joined = runs[1e6]
    assert [m["rewards_joined"] for m in joined] == [0.0, 1.0, 1.0]
    assert joined[0]["reward_std"] > 0, joined  # the rewards differed, and still did not count
    assert joined[0]["teacher_share"] == pytest.approx(1.0, abs=1e-6)
    varied = [m for m in joined[1:] if m["reward_std"] > 0]
    assert varied and all(m["teacher_share"] < 0.99 for m in varied), joined
    waiting = runs[1e-4]
    assert all(m["teacher_kl"] > 1e-4 for m in waiting), waiting
    assert [m["rewards_joined"] for m in waiting] == [0.0, 0.0]
    assert all(m["teacher_share"] == pytest.approx(1.0, abs=1e-6) for m in waiting)
    # TEACHER_STEPS 1: step 1 as TEACHER_FIRST_KL's first (the teacher alone), then the rewards
    # alone: the teacher's term is exactly 0 (share 0), its KL still logged from the server's
    assert [m["rewards_joined"] for m in handoff] == [0.0, 1.0, 1.0]
    assert handoff[0]["teacher_share"] == pytest.approx(1.0, abs=1e-6)
    assert [m["teacher_share"] for m in handoff[1:]] == [0.0, 0.0], handoff
    assert all(m["teacher_kl"] != 0 for m in handoff), handoff
    assert handed.count("step 2: the teacher's 1 steps are over") == 1, handed[-3000:]
    # every group trains while the teacher does; after it, as in GRPO, only groups whose rewards
    # differ (zero_var_groups: the share of groups with one reward for all)
    assert handoff[0]["completions_trained"] == handoff[0]["completions_generated"]
    for m in handoff[1:]:
        kept = 1 - m["zero_var_groups"]
        assert m["completions_trained"] == m["completions_generated"] * kept, m
    # the check above tells dropping from keeping only where some group's rewards were all equal
    assert any(m["zero_var_groups"] > 0 for m in handoff[1:]), handoff


# ------------------------------------------------------------- the teacher's top-k (DISTILL_TOP_K)
def test_the_top_k_reverse_kl_is_the_full_reverse_kl_at_k_equal_v_in_value_and_gradient():
    """The definition written here: KL(pi || t) = sum_v pi(v) (log pi(v) - log t(v)) over the whole
    vocabulary (11 tokens). At k = V the top-k term is it, value and gradient; at k = 3 it is the
    same sum over the teacher's 3 likeliest tokens alone."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(2, 3, 11, generator=g, dtype=torch.float64), -1)
    student = torch.log_softmax(logits, -1)  # (B, T, V)
    full = (student.exp() * (student - teacher)).sum(-1)  # (B, T)
    top = teacher.topk(11, -1)
    got = objectives.topk_reverse_kl(student_logps=student.gather(-1, top.indices),
                               teacher_logps=top.values)  # (B, T)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-12)
    (want_grad,) = torch.autograd.grad(full.sum(), logits, retain_graph=True)
    (got_grad,) = torch.autograd.grad(got.sum(), logits, retain_graph=True)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-12)
    three = teacher.topk(3, -1).indices  # (B, T, 3)
    partial = objectives.topk_reverse_kl(student_logps=student.gather(-1, three),
                                         teacher_logps=teacher.gather(-1, three))
    kept = three[0, 0].tolist()
    by_hand = sum(student[0, 0, v].exp() * (student[0, 0, v] - teacher[0, 0, v]) for v in kept)
    p_tail = 1 - sum(student[0, 0, v].exp() for v in kept)  # the rest of the vocabulary, a bin
    t_tail = 1 - sum(teacher[0, 0, v].exp() for v in kept)
    by_hand = by_hand + p_tail * (p_tail.log() - t_tail.log())
    assert partial[0, 0].item() == pytest.approx(by_hand.item(), abs=1e-12)


def test_the_top_k_term_brings_the_student_to_the_teacher_on_its_k_tokens():
    """Issue 79's audit, k = 4 of V = 11: gradient descent on the sum over the teacher's top 4 alone
    stopped at pi = teacher / e on them (their mass 0.914 / e), the rest of pi's mass outside,
    further from the teacher than the uniform start. With the tail bin it reaches pi = teacher on
    the 4 (and so on the tail's mass), and the full reverse KL falls."""
    torch.manual_seed(0)
    teacher = torch.log_softmax(torch.randn(11, dtype=torch.float64) * 1.5, 0)  # (V,)
    top = teacher.topk(4)
    theta = torch.zeros(11, dtype=torch.float64, requires_grad=True)  # uniform start
    def full_kl():
        student = torch.log_softmax(theta, 0)
        return (student.exp() * (student - teacher)).sum().item()
    start = full_kl()
    optimizer = torch.optim.SGD([theta], lr=0.5)
    for _ in range(3000):
        student = torch.log_softmax(theta, 0)
        loss = objectives.topk_reverse_kl(student_logps=student[top.indices][None, None],
                                          teacher_logps=top.values[None, None]).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    student = torch.log_softmax(theta, 0).detach()
    ratios = (student[top.indices] - top.values).exp()  # (4,) pi / teacher on the k
    assert ratios.tolist() == pytest.approx([1.0] * 4, abs=1e-6)
    assert full_kl() < start


def test_a_teacher_server_sends_its_k_likeliest_tokens_and_the_trainer_lays_them_out(model):
    """An upload asking teacher_top_k = 5 comes back with (G, T, 5) ids and log-probs: the tiny
    model's own top 5 of log softmax(logits / T) at each answer position (computed here without
    the server's paths), and collate puts them on the answer columns."""
    server, stop_serving, url = start(model, teacher=True)
    try:
        tensors, meta = group(G=3, plen=5, tc=4, seed=2, rank=0, teacher_top_k=5, temperature=0.7)
        r = requests.post(url + "/upload", data=encode_batch(tensors, meta), timeout=30)
        assert r.status_code == 200, r.text
        back, back_meta = pull(url + "", path="/get?rank=0")
    finally:
        stop(server, stop_serving)
    with torch.no_grad():
        logits = model(input_ids=tensors["input_ids"]).logits[:, 4:-1]  # (G, T, V)
        want = torch.log_softmax(logits.float() / 0.7, -1).topk(5, -1)
    assert torch.equal(back["teacher_topk_ids"], want.indices)
    # the same fp32 forward, the server's micro-batched: a few ulps of log-probs near 10
    torch.testing.assert_close(back["teacher_topk_logps"], want.values, rtol=0, atol=1e-4)
    batch = grpo.collate([(back, back_meta)], 0, teacher=True, top_k=5, vocab_size=VOCAB)
    assert batch.extra.teacher_topk_ids.shape == (3, 4, 5)
    assert torch.equal(batch.extra.teacher_topk_ids, back["teacher_topk_ids"])


def test_a_reference_server_refuses_top_k_and_so_does_any_server_past_its_bound(model):
    server, stop_serving, url = start(model)
    teacher, stop_teacher, teacher_url = start(model, teacher=True)
    try:
        for where, k, message in ((url, 5, "asks a teacher"), (teacher_url, 65, "1..64"),
                                  (teacher_url, 0, "1..64"), (teacher_url, "5", "an int")):
            tensors, meta = group(seed=3, teacher_top_k=k)
            r = requests.post(where + "/upload", data=encode_batch(tensors, meta), timeout=30)
            assert r.status_code == 400 and message in r.json()["error"], (k, r.text)
    finally:
        stop(server, stop_serving)
        stop(teacher, stop_teacher)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("teacher_topk_ids"), "no top-k tokens"),
    (lambda t: t.update(teacher_topk_ids=t["teacher_topk_ids"][:, :, :2]), "must be int64"),
    (lambda t: t.update(teacher_topk_ids=t["teacher_topk_ids"].int()), "must be int64"),
    (lambda t: t["teacher_topk_ids"].__setitem__((0, 0, 0), VOCAB), "outside the vocabulary"),
    (lambda t: t["teacher_topk_ids"].__setitem__((0, 0, 0), -1), "outside the vocabulary"),
    (lambda t: t["teacher_topk_logps"].__setitem__((0, 0, 0), 0.5), "finite log-probs"),
    (lambda t: t["teacher_topk_logps"].__setitem__((0, 0, 0), float("nan")), "finite log-probs"),
    (lambda t: t.update(teacher_topk_logps=t["teacher_topk_logps"].double()), "must be float32"),
    (lambda t: t["teacher_topk_logps"].__setitem__((0, 0), -0.1), "of a distribution"),  # > 1
])
def test_a_hostile_teacher_reply_is_refused_before_any_of_it_is_used(change, message):
    tensors, meta = group(G=2, plen=3, tc=4, seed=4)
    tensors["ref_logps"] = -torch.rand(2, 4)
    tensors["teacher_topk_ids"] = torch.randint(0, VOCAB, (2, 4, 3))
    tensors["teacher_topk_logps"] = torch.log_softmax(torch.randn(2, 4, 10), -1).topk(3).values
    grpo.collate([(dict(tensors), meta)], 0, teacher=True, top_k=3, vocab_size=VOCAB)  # as sent
    change(tensors)
    with pytest.raises(ValueError, match=message):
        grpo.collate([(tensors, meta)], 0, teacher=True, top_k=3, vocab_size=VOCAB)


@pytest.mark.parametrize("setting, message", [
    (dict(DISTILL_TOP_K=20, DISTILL_COEF=0.0), "DISTILL_TOP_K = 20"),
    (dict(DISTILL_TOP_K=65), "DISTILL_TOP_K = 65"),
    (dict(DISTILL_TOP_K=20, DISTILL_DISCOUNT=0.5), "DISTILL_DISCOUNT .* do not apply"),
    (dict(DISTILL_TOP_K=20, USE_TRITON=True), "USE_TRITON"),
])
def test_top_k_settings_that_cannot_work_are_refused(setting, message, monkeypatch, tmp_path):
    teacher_settings(monkeypatch, tmp_path, **setting)
    with pytest.raises(SystemExit, match=message):
        grpo.check_settings()


def test_the_top_k_term_enters_the_loss_as_coef_times_its_token_means(monkeypatch):
    """policy_loss with DISTILL_TOP_K on a tiny model: its loss minus the same batch's without the
    term is coef x the mean over answers of each answer's token mean of the reverse KL over the
    teacher's top k and the tail's bin, computed here from the model's own logits."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from conftest import tiny_config
    from test_variants import PlainEngine, batch_for

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(grpo.resolve_model_path(""))
    model = LlamaForCausalLM(tiny_config(tok))
    b = batch_for(model)
    g = torch.Generator().manual_seed(5)
    b.extra.teacher_topk_ids = torch.randint(0, 49152, (4, 6, 3), generator=g)
    teacher = torch.log_softmax(torch.randn(4, 6, 8, generator=g) * 2, -1)  # (B, T, 8)
    b.extra.teacher_topk_logps = teacher.topk(3).values  # (B, T, 3): of one distribution each
    b.extra.teacher_logps = b.ref_logps
    b.normalizer = 4.0  # the answers of the step
    b.ref_logps = None
    set_setting(monkeypatch, "BETA", 0.0)
    set_setting(monkeypatch, "DISTILL_COEF", 2.0)
    set_setting(monkeypatch, "DISTILL_TOP_K", 3)
    engine = PlainEngine(model, lr=0.0)
    with_term, _ = grpo.choose_parts().loss(engine, b)
    set_setting(monkeypatch, "DISTILL_COEF", 1e-30)  # the same path, the term vanishing
    without, _ = grpo.choose_parts().loss(engine, b)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, -7:-1]
        student = torch.log_softmax(logits.float() / grpo.TEMPERATURE, -1).gather(
            -1, b.extra.teacher_topk_ids)  # (B, T, k)
        kl = (student.exp() * (student - b.extra.teacher_topk_logps)).sum(-1)  # (B, T) the k's bins
        p_tail = 1 - student.double().exp().sum(-1)  # (B, T) the rest of the vocabulary's bin
        t_tail = 1 - b.extra.teacher_topk_logps.double().exp().sum(-1)  # (B, T)
        kl = kl + (p_tail * (p_tail.log() - t_tail.log())).float()  # (B, T)
        mask = b.mask.bool()
        want = 2.0 * (torch.where(mask, kl, 0.0).sum(1) / mask.sum(1)).sum() / b.normalizer
    assert (with_term - without).item() == pytest.approx(want.item(), rel=1e-4)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update(ref_logps=t["ref_logps"][:, :3]), "ref_logps must be float32"),
    (lambda t: t.update(ref_logps=t["ref_logps"].double()), "ref_logps must be float32"),
    (lambda t: t["ref_logps"].__setitem__((0, 0), float("inf")), "ref_logps has NaN"),
    (lambda t: t["pi_old_logps"].__setitem__((1, 2), float("nan")), "pi_old_logps has NaN"),
])
def test_a_servers_log_probs_are_checked_before_the_loss_reads_them(change, message):
    """What a trainer reads from a server (or a worker's upload through it) is checked and bounded
    before use: a wrong shape or a NaN in ref_logps or pi_old_logps stops collate with its name."""
    tensors, meta = group(G=2, plen=3, tc=4, seed=6)
    tensors["ref_logps"] = -torch.rand(2, 4)
    grpo.collate([(dict(tensors), meta)], 0)  # as sent
    change(tensors)
    with pytest.raises(ValueError, match=message):
        grpo.collate([(tensors, meta)], 0)


def test_the_teacher_term_only_on_the_answers_chosen_by_hand():
    """DISTILL_BELOW's mask in distill_advantages: answers [True, False] keep the first answer's
    terms (A + c (log t - log pi_old)) and leave the second at its A. Matched, the term's rms is
    over the first answer's tokens alone: terms [0.3, -0.4] (rms sqrt(0.125)), A [1, -1] (rms 1),
    so the term x 1 / sqrt(0.125) = 2.8284, coef 0.5."""
    teacher = torch.tensor([[0.3, -0.4], [2.0, 5.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    chosen = torch.tensor([True, False])
    got = objectives.distill_advantages(torch.tensor([1.0, -1.0]), teacher_logps=teacher,
                                  pi_old_logps=torch.zeros(2, 2), mask=mask, coef=0.5,
                                  teacher_rows=chosen)
    assert got.tolist() == [pytest.approx([1.15, 0.8]), [-1.0, -1.0]]
    matched = objectives.distill_advantages(torch.tensor([1.0, -1.0]), teacher_logps=teacher,
                                      pi_old_logps=torch.zeros(2, 2), mask=mask, coef=0.5,
                                      matched=True, teacher_rows=chosen)
    scale = 1 / math.sqrt(0.125)
    assert matched.tolist() == [pytest.approx([1 + 0.15 * scale, 1 - 0.2 * scale]), [-1.0, -1.0]]
    nobody = objectives.distill_advantages(torch.tensor([1.0, -1.0]), teacher_logps=teacher,
                                     pi_old_logps=torch.zeros(2, 2), mask=mask, coef=0.5,
                                     matched=True, teacher_rows=torch.tensor([False, False]))
    assert nobody.tolist() == [[1.0, 1.0], [-1.0, -1.0]]  # no term to size: A alone, no NaN


def test_collate_carries_each_answers_reward():
    first, second = group(G=3, seed=0), group(G=2, seed=1, plen=4, tc=3)
    batch = grpo.collate([first, second], pad_id=0)
    assert batch.extra.scores.tolist() == torch.cat([first[0]["scores"],
                                                second[0]["scores"]]).tolist()


@pytest.mark.parametrize("top_k", [0, 3])
def test_distill_below_gives_the_teacher_term_to_the_answers_under_it_alone(monkeypatch, top_k):
    """policy_loss on a tiny model, rewards [3, 0, 2, 1.5] and DISTILL_BELOW 2: the loss equals
    the same batch's with every answer taking the term but answers 0 and 2 given a teacher equal
    to pi_old (a term of 0; top-k: their teacher log-probs equal to the student's own), and
    differs from the loss where all four take it. pi_old is the batch's pi_old_logps, and the top-k
    copy comes from the same forward the loss runs, so each spared term is 0 exactly and the two
    losses are the same sums of the same floats on any processor: 1e-6 is for the report only."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from conftest import tiny_config
    from test_variants import PlainEngine, batch_for

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(grpo.resolve_model_path(""))
    model = LlamaForCausalLM(tiny_config(tok))
    b = batch_for(model)
    g = torch.Generator().manual_seed(3)
    pi_old = b.ref_logps + 0.1 * torch.randn(4, 6, generator=g)  # (B, T) what the loss reads
    b.pi_old_logps = pi_old
    b.pi_old_rows = torch.ones(4, dtype=torch.bool)
    b.extra.teacher_logps = pi_old - torch.rand(4, 6, generator=g)  # (B, T)
    b.ref_logps = None
    b.extra.scores = torch.tensor([3.0, 0.0, 2.0, 1.5])
    b.normalizer = 4.0
    correct = b.extra.scores >= 2  # (B,) the answers that keep their rewards' term alone
    spared = replace(b, extra=replace(b.extra))  # its own extra, changed below
    spared.extra.teacher_logps = torch.where(correct[:, None], pi_old,
                                             b.extra.teacher_logps)  # (B, T)
    if top_k:
        b.extra.teacher_topk_ids = torch.randint(0, 49152, (4, 6, top_k), generator=g)
        teacher = torch.log_softmax(torch.randn(4, 6, 8, generator=g) * 2, -1)  # (B, T, 8)
        b.extra.teacher_topk_logps = teacher.topk(top_k).values  # (B, T, k): of one distribution
        with torch.no_grad():
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
            own = torch.log_softmax(logits[:, -7:-1].float() / grpo.TEMPERATURE, -1)
            own = own.gather(-1, b.extra.teacher_topk_ids)  # (B, T, k) the student's at those ids
        spared.extra.teacher_topk_ids = b.extra.teacher_topk_ids
        spared.extra.teacher_topk_logps = torch.where(correct[:, None, None], own,
                                                      b.extra.teacher_topk_logps)  # (B, T, k)
    set_setting(monkeypatch, "BETA", 0.0)
    set_setting(monkeypatch, "DISTILL_COEF", 2.0)
    set_setting(monkeypatch, "DISTILL_TOP_K", top_k)
    engine = PlainEngine(model, lr=0.0)
    set_setting(monkeypatch, "DISTILL_BELOW", 2.0)
    below, _ = grpo.choose_parts().loss(engine, b)
    set_setting(monkeypatch, "DISTILL_BELOW", 0.0)
    every, _ = grpo.choose_parts().loss(engine, b)
    want, _ = grpo.choose_parts().loss(engine, spared)
    assert below.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    assert abs(every.item() - below.item()) > 1e-4  # 100x the tolerance above


def test_distill_below_needs_a_teacher_and_rewards(monkeypatch, tmp_path):
    rewards = grpo.REWARDS
    no_rewards = [(fn, 0.0) for fn, _ in rewards]
    for setting in (dict(DISTILL_BELOW=-1.0), dict(DISTILL_BELOW=2.0, DISTILL_COEF=0.0),
                    dict(DISTILL_BELOW=2.0, REWARDS=no_rewards, NUM_PRE_Q=8)):
        teacher_settings(monkeypatch, tmp_path, **setting)
        with pytest.raises(SystemExit, match="DISTILL_BELOW"):
            grpo.check_settings()
    teacher_settings(monkeypatch, tmp_path, DISTILL_BELOW=2.0, REWARDS=rewards)
    grpo.check_settings()
