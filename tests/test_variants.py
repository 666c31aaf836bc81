"""The loss variants (clip-higher, token-level mean, BETA = 0, MU > 1, MASK_TRUNCATED), the metrics
they log, and the server's REGROUP mode: each shown to change what it should."""
import math
from collections import Counter
from dataclasses import replace

import pytest
import requests
import torch
from transformers import GenerationConfig

import grpo_ref_split as grpo  # noqa: E402
import objectives  # noqa: E402
import rewards
from conftest import group, pull, start, stop
from features.fast_paths import completion_logps
from features.run_log import clock, sample_stats, step_metrics
from features.wire import META_FIELDS, encode_batch
from reference_loss import torch_loss


# ----------------------------------------------------------------------------- the loss
def test_clip_eps_high_lets_a_good_token_grow_further():
    # ratio e^0.22 = 1.246 with A = +1: clipped at 1.2 by the symmetric clip, not at 1.28 (DAPO)
    logps = torch.tensor([[-1.0]], requires_grad=True)
    gen, ref, adv = torch.tensor([[-1.22]]), torch.tensor([[-1.0]]), torch.tensor([1.0])
    mask = torch.ones(1, 1, dtype=torch.bool)
    sym = torch_loss(
        logps=logps, ref_logps=ref, pi_old_logps=gen, advantages=adv, mask=mask, beta=0.0,
        clip_eps=0.2
    )
    high = torch_loss(
        logps=logps,
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=0.0,
        clip_eps=0.2,
        clip_eps_high=0.28,
    )
    assert sym.item() == pytest.approx(-1.2, rel=1e-6)
    assert high.item() == pytest.approx(-math.exp(0.22), rel=1e-6)
    assert torch.autograd.grad(sym, logps)[0].item() == 0.0  # clipped: no policy gradient
    assert torch.autograd.grad(high, logps)[0].item() == pytest.approx(-math.exp(0.22), rel=1e-6)
    # and the low side is still CLIP_EPS: ratio e^-0.3 with A = -1 is clipped at 0.8 either way
    low = torch_loss(
        logps=logps,
        ref_logps=ref,
        pi_old_logps=gen + 0.52,
        advantages=-adv,
        mask=mask,
        beta=0.0,
        clip_eps=0.2,
        clip_eps_high=0.28,
    )
    assert low.item() == pytest.approx(0.8, rel=1e-6)


def test_token_mean_weighs_every_token_the_same():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])  # -A at ratio 1, A = -x
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    logps = torch.zeros(2, 4)
    adv = -per_token[:, 0]  # the loss is -A per token with ratio 1, beta 0
    seq = torch_loss(
        logps=logps,
        ref_logps=None,
        pi_old_logps=None,
        advantages=adv,
        mask=mask,
        beta=0.0,
        clip_eps=0.2,
    )
    tok = torch_loss(
        logps=logps,
        ref_logps=None,
        pi_old_logps=None,
        advantages=adv,
        mask=mask,
        beta=0.0,
        clip_eps=0.2,
        loss_type="dapo",
    )
    assert seq.item() == pytest.approx((1.0 + 4.0) / 2)  # each answer weighs 1/2
    assert tok.item() == pytest.approx((4 * 1.0 + 4.0) / 5)  # each token weighs 1/5


def test_beta_zero_needs_no_reference_log_probs():
    """BETA = 0 without reference log-probs: the clipped surrogate alone, against the plain-Python
    loss."""
    from test_grpo_math import naive_loss

    torch.manual_seed(0)
    logps, gen = -torch.rand(3, 5), -torch.rand(3, 5)
    adv, mask = torch.randn(3), torch.rand(3, 5) > 0.3
    without = torch_loss(
        logps=logps,
        ref_logps=None,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=0.0,
        clip_eps=0.2,
    )
    want = naive_loss(
        logps.tolist(), [[0.0] * 5] * 3, gen.tolist(), adv.tolist(), mask.tolist(), 0.0, 0.2
    )
    assert without.item() == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="needs beta=0"):
        torch_loss(
            logps=logps,
            ref_logps=None,
            pi_old_logps=gen,
            advantages=adv,
            mask=mask,
            beta=0.04,
            clip_eps=0.2,
        )


def test_gspo_matches_a_hand_computation_in_value_and_gradient():
    # Two answers of 3 and 2 valid tokens (one padded column). Per answer i: s = exp(mean_t(logp -
    # gen)), loss_i = -min(s A, clip(s, 1 - lo, 1 + hi) A) + beta mean_t k3; the loss is the mean
    # over answers.
    logps = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, 9.0]], requires_grad=True)
    # answer 0: s = e^0.0667; answer 1: s = e^-0.005
    gen = torch.tensor([[-1.1, -0.6, -2.0], [-0.29, -1.2, 0.0]])
    ref = torch.tensor([[-0.9, -0.7, -1.5], [-0.4, -1.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, beta, lo, hi = torch.tensor([1.0, -1.0]), 0.1, 3e-2, 4e-2
    loss = torch_loss(
        logps=logps,
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=beta,
        clip_eps=lo,
        clip_eps_high=hi,
        gspo=True,
    )
    (grad,) = torch.autograd.grad(loss, logps)

    want, want_grad = 0.0, torch.zeros(2, 3)
    for i in range(2):
        n = int(mask[i].sum())
        lp, g, r, a = logps[i, :n].tolist(), gen[i, :n].tolist(), ref[i, :n].tolist(), adv[i].item()
        s = math.exp(sum(x - y for x, y in zip(lp, g)) / n)
        clipped = min(max(s, 1 - lo), 1 + hi)
        kl = sum(math.exp(y - x) - (y - x) - 1 for x, y in zip(lp, r)) / n
        want += (-min(s * a, clipped * a) + beta * kl) / 2
        unclipped = s * a <= clipped * a  # min() took the unclipped term: its gradient flows
        # d/dlogp_t of -s A is -s A / n; of k3(ref, logp) it is 1 - exp(ref - logp)
        for t in range(n):
            want_grad[i, t] = ((-s * a / n) if unclipped else 0.0) / 2 + beta * (
                1 - math.exp(r[t] - lp[t])
            ) / n / 2
    assert loss.item() == pytest.approx(want, rel=1e-5)  # fp32
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    # answer 0: s = 1.069 > 1.04 with A > 0, so its surrogate is clipped and only the KL term moves
    # it
    assert grad[0, 0].item() == pytest.approx(beta * (1 - math.exp(0.1)) / 3 / 2, rel=1e-5)
    # answer 1: s = 0.995 inside [0.97, 1.04]: its surrogate's gradient -s A / n / 2 = +0.249 flows
    assert grad[1, 0].item() == pytest.approx(
        math.exp(-0.005) / 2 / 2 + beta * (1 - math.exp(-0.1)) / 2 / 2, rel=1e-5
    )
    # the token-level loss on the same numbers differs: the ratio really is per answer
    assert (
        abs(
            torch_loss(
                logps=logps,
                ref_logps=ref,
                pi_old_logps=gen,
                advantages=adv,
                mask=mask,
                beta=beta,
                clip_eps=lo,
                clip_eps_high=hi,
            ).item()
            - want
        )
        > 1e-3
    )


def test_gspo_on_policy_is_the_mean_token_gradient_and_refused_by_triton(monkeypatch):
    torch.manual_seed(0)
    logps, adv = -torch.rand(3, 5, requires_grad=True), torch.randn(3)
    mask = torch.rand(3, 5) > 0.3
    mask[:, 0] = True
    seq = torch_loss(
        logps=logps,
        ref_logps=None,
        pi_old_logps=None,
        advantages=adv,
        mask=mask,
        beta=0.0,
        clip_eps=3e-4,
        clip_eps_high=4e-4,
        gspo=True,
    )
    tok = torch_loss(
        logps=logps,
        ref_logps=None,
        pi_old_logps=None,
        advantages=adv,
        mask=mask,
        beta=0.0,
        clip_eps=3e-4,
        clip_eps_high=4e-4,
    )
    # ratio 1: both are -mean(A) in value, and -A_i / n_i on each valid token in gradient (GRPO's
    # per-answer mean)
    assert seq.item() == pytest.approx(tok.item()) == pytest.approx(-adv.mean().item())
    torch.testing.assert_close(
        torch.autograd.grad(seq, logps)[0], torch.autograd.grad(tok, logps)[0]
    )
    monkeypatch.setattr(grpo, "GSPO", True)
    monkeypatch.setattr(grpo.fast_paths, "USE_TRITON", True)
    with pytest.raises(SystemExit, match="GSPO"):
        grpo.check_settings()


def test_clip_fractions_count_only_the_cut_gradients(fresh_model, monkeypatch):
    """The clip_low / clip_high metrics of policy_loss: pi_old set so that each token's ratio is
    known (1.35 or 0.74), then only the tokens whose gradient the clip cuts count: ratio > 1 +
    CLIP_EPS_HIGH with A > 0, ratio < 1 - CLIP_EPS with A < 0, over the valid tokens (3 of 4)."""
    b = batch_for(fresh_model)
    # one answer
    b = grpo.Batch(**{k: v[:1] if torch.is_tensor(v) else v for k, v in vars(b).items()})
    b.mask = torch.tensor([[True, True, True, False, False, False]])
    now = grpo.logps_for_run()(fresh_model, b.input_ids, b.attention_mask, 6).detach()  # (1, 6)
    # ratios 1.35, 0.74, 1.35, (0.74)
    b.pi_old_logps = now - torch.tensor([[0.3, -0.3, 0.3, -0.3, 0.3, 0.3]])
    engine = PlainEngine(fresh_model, lr=0.0)
    for adv, eps_high, want in (
        (1.0, 0.2, (0.0, 2 / 3)),
        (-1.0, 0.2, (1 / 3, 0.0)),
        (1.0, 0.4, (0.0, 0.0)),
    ):
        monkeypatch.setattr(grpo, "CLIP_EPS_HIGH", eps_high)
        b_adv = replace(b, advantages=torch.tensor([adv]), normalizer=1.0)
        _, m = grpo.choose_parts().loss(engine, b_adv)
        assert (m["clip_low"], m["clip_high"]) == pytest.approx(want)


# ----------------------------------------------------------------------------- MU > 1
class PlainEngine:
    """The calls the training loop makes of a DeepSpeed engine, on a plain model and AdamW."""

    def __init__(self, model, lr):
        self.module, self.device = model, torch.device("cpu")
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def __call__(self, **kw):
        return self.module(**kw)

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()
        return self

    def backward(self, loss):
        loss.backward()

    def set_gradient_accumulation_boundary(self, last):
        self.boundary = last

    def get_lr(self):
        return [group["lr"] for group in self.opt.param_groups]

    def step(self):
        self.steps = getattr(self, "steps", 0) + 1
        self.opt.step()
        self.opt.zero_grad()


def batch_for(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49152, (4, 12), generator=g)  # (B, P+Tc) prompt 6, completion 6
    attn = torch.ones_like(ids)
    with torch.no_grad():
        ref = completion_logps(
            model,
            ids,
            attn,
            6,
            0.7,
            chunk=grpo.fast_paths.LOGP_CHUNK,
            from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
        )  # (B, Tc)
    return grpo.Batch(
        input_ids=ids,
        attention_mask=attn,
        mask=torch.ones(4, 6, dtype=torch.bool),
        ref_logps=ref,
        pi_old_logps=None,
        pi_old_rows=None,
        normalizer=None,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
    )


@pytest.fixture
def fresh_model(tokenizer):
    from transformers import LlamaForCausalLM

    from conftest import tiny_config

    torch.manual_seed(0)
    # the size these thresholds were set on
    return LlamaForCausalLM(tiny_config(tokenizer, head_dim=16))


def test_the_default_step_is_the_plain_grpo_step_bit_for_bit(fresh_model):
    """Every variant off by default (GSPO, LoRA, LOSS_TYPE, TIS without vLLM rows, MASK_TRUNCATED):
    policy_loss gives the loss and gradient of the GRPO step as it read before any variant existed,
    its lines verbatim here."""
    assert (
        grpo.GSPO,
        grpo.lora.LORA_RANK,
        grpo.LOSS_TYPE,
        grpo.vllm_engine.USE_VLLM,
        grpo.MASK_TRUNCATED,
    ) == (False, 0, "grpo", False, False)
    b = batch_for(fresh_model)
    # (4, 6) pi_old away from the weights now ...
    b.pi_old_logps = b.ref_logps - 0.05 * torch.arange(6.0)
    b.pi_old_logps[1] = 7.0  # ... but for one row trained on-policy, whose values must not count
    b.pi_old_rows = torch.tensor([True, False, True, True])
    b.mask[2, 4:] = False
    params = list(fresh_model.parameters())
    loss, _ = grpo.choose_parts().loss(PlainEngine(fresh_model, lr=0.0), replace(b, normalizer=4.0))
    grads = torch.autograd.grad(loss, params)

    logps = completion_logps(
        fresh_model,
        b.input_ids,
        b.attention_mask,
        6,
        grpo.TEMPERATURE,
        shared_prefix=grpo.fast_paths.SHARED_PREFIX,
        chunk=grpo.fast_paths.LOGP_CHUNK,
        from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
    )  # (B, T)
    mask, pad = b.mask.bool(), logps.detach()
    gen = torch.where(mask & b.pi_old_rows[:, None], b.pi_old_logps, pad)
    ref = torch.where(mask, b.ref_logps, pad)
    ratio = torch.exp(logps - gen)
    adv = b.advantages[:, None]
    surrogate = torch.min(
        ratio * adv, torch.clamp(ratio, 1 - grpo.CLIP_EPS, 1 + grpo.CLIP_EPS_HIGH) * adv
    )
    per_token = -(surrogate - grpo.BETA * grpo.k3(ref, logps))
    plain = objectives.masked_mean(per_token, mask).sum() / 4.0
    assert torch.equal(loss, plain)
    assert all(torch.equal(g, p) for g, p in zip(grads, torch.autograd.grad(plain, params)))


def test_mu_two_reuses_the_batch_with_a_real_ratio(fresh_model, monkeypatch):
    """train_step with MU = 2: two passes over the same batch, two optimizer steps; the second
    pass's ratio measures how far the first step moved, and the step's metrics are the passes'
    mean."""
    monkeypatch.setattr(grpo, "MU", 2)
    engine = PlainEngine(fresh_model, lr=1e-2)
    b = batch_for(fresh_model)
    passes, real = [], grpo.choose_parts().loss  # one batch: one policy_loss a pass
    counted = lambda e, batch: passes.append(real(e, batch)) or passes[-1]  # noqa: E731
    m = grpo.train_step(engine, [replace(b, pi_old_logps=b.ref_logps)],
                        loss_of=counted)  # pi_old = the weights now
    passes = [metrics for _, metrics in passes]
    assert len(passes) == 2 and engine.steps == 2
    first, second = passes
    assert first["ratio_drift"] < 1e-5 and first["clip_low"] == first["clip_high"] == 0
    assert second["ratio_drift"] > 1e-2  # the ratio now measures how far the first step moved
    assert second["kl"] > first["kl"]
    assert m["ratio_drift"] == pytest.approx((first["ratio_drift"] + second["ratio_drift"]) / 2)
    assert m["lr"] == pytest.approx(1e-2) and m["fwd_bwd_s"] > 0 and m["optim_s"] > 0


def test_a_micro_batch_repeated_with_share_zero_adds_no_gradient_and_no_metric(fresh_model):
    """What a rank with fewer micro-batches runs to keep ZeRO-2's reductions in step with the
    others."""
    # a loss that is not 0
    b = replace(batch_for(fresh_model), advantages=torch.tensor([1.0, 0.5, 0.2, 0.1]))
    loss, m = grpo.choose_parts().loss(
        PlainEngine(fresh_model, lr=1e-2), replace(b, share=0.0, token_share=0.0)
    )
    loss.backward()
    assert (
        loss.item() == 0
        and {"loss", "kl", "clip_low"} <= set(m)
        and all(v == 0 for v in m.values())
    )
    assert all(p.grad is not None and p.grad.abs().max() == 0 for p in fresh_model.parameters())
    real, _ = grpo.choose_parts().loss(PlainEngine(fresh_model, lr=1e-2), b)  # the same, share 1
    real.backward()
    assert real.item() != 0 and any(p.grad.abs().max() > 0 for p in fresh_model.parameters())


def test_train_step_with_mu_two_fixes_pi_old_before_the_first_update(fresh_model, monkeypatch):
    b = batch_for(fresh_model)
    results = {}
    for mu in (1, 2):
        torch.manual_seed(0)
        model = type(fresh_model)(fresh_model.config)
        model.load_state_dict(fresh_model.state_dict())
        monkeypatch.setattr(grpo, "MU", mu)
        engine = PlainEngine(model, lr=1e-2)
        batch = grpo.prepare_batch(engine, b, fills=grpo.fills_for_run())  # MU > 1: pi_old fixed
        assert (batch.pi_old_logps is None) == (mu == 1)
        assert batch.pi_old_rows is None  # none given, or (MU > 1) every row's now
        results[mu] = (grpo.train_step(engine, [batch]), model)  # main's steps 6-7
        assert engine.steps == mu
    assert results[1][0]["ratio_drift"] == 0.0  # one on-policy pass: ratio exactly 1
    assert results[2][0]["ratio_drift"] > 5e-3  # the second pass sees pi / pi_old != 1
    moved_once = sum(
        (p - q).abs().sum() for p, q in zip(results[1][1].parameters(), fresh_model.parameters())
    )
    moved_twice = sum(
        (p - q).abs().sum() for p, q in zip(results[2][1].parameters(), fresh_model.parameters())
    )
    assert moved_twice > 1.5 * moved_once  # two optimizer steps, not one


# ------------------------------------------------------------------------- MASK_TRUNCATED, keep_all
@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir
    ).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def short_rollout(
    tiny_policy, monkeypatch, masked, keep_all=False, max_new_tokens=8, with_pi_old=False
):
    model, tok = tiny_policy
    monkeypatch.setattr(grpo, "MASK_TRUNCATED", masked)
    monkeypatch.setattr(grpo, "NUM_PRE_Q", 4)
    cfg = GenerationConfig(
        do_sample=True,
        temperature=grpo.TEMPERATURE,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id],
    )
    torch.manual_seed(3)
    questions = [
        {"question": f"What is {a} + {a + 1}?", "gold": str(2 * a + 1)} for a in range(1, 9)
    ]
    m = Counter()
    scored = grpo.scored_groups(
        model,
        tok,
        questions,
        parts=grpo.choose_parts(),
        eos_ids=[tok.eos_token_id],
        gen_config=cfg,
        llm=None,
        # steps 2-4 as the trainer runs them
        keep_all=keep_all,
        with_pi_old=with_pi_old,
        seconds=m,
    )
    # as main() does
    m.update(sample_stats(scored.records, 4, [fn.__name__ for fn, _ in grpo.REWARDS]))
    return scored.groups, m


def test_mask_truncated_removes_cut_answers_from_the_loss(tiny_policy, monkeypatch):
    eos = tiny_policy[1].eos_token_id
    for masked in (False, True):
        groups, stats = short_rollout(tiny_policy, monkeypatch, masked)
        assert 0 < stats["truncated"] < 1  # 8 tokens cut the tag answers, not the bare numbers
        rows = [
            (t["input_ids"][i, meta["plen"] :].tolist(), t["completion_mask"][i])
            for t, meta in groups
            for i in range(len(t["input_ids"]))
        ]
        cut = [m for completion, m in rows if eos not in completion]
        done = [m for completion, m in rows if eos in completion]
        assert cut and done
        if masked:
            assert all(not m.any() for m in cut)  # no token of a cut answer is trained on
        else:
            assert all(m.all() for m in cut)
        assert all(m.any() for m in done)


def test_keep_all_packs_groups_without_reward_variance(tiny_policy, monkeypatch):
    groups, stats = short_rollout(tiny_policy, monkeypatch, False, max_new_tokens=24)
    all_groups, _ = short_rollout(tiny_policy, monkeypatch, False, keep_all=True, max_new_tokens=24)
    equal = round(stats["zero_var_groups"] * 8)  # groups whose answers all scored the same
    assert equal > 0 and len(groups) == 8 - equal
    assert all(set(meta) <= set(META_FIELDS) for _, meta in all_groups)  # every field declared once
    assert len(all_groups) == 8
    assert 0 <= stats["reward_std"] and stats["max_length"] >= stats["length"] > 0


# ------------------------------------------------------------------ pi_old_logps only where needed
def test_pi_old_logps_are_computed_only_when_asked_and_equal_the_sampling_weights(
    tiny_policy, monkeypatch
):
    """MU = 1 packs no pi_old_logps (no forward: ratio exp(x - x.detach())); MU > 1, workers and
    REGROUP ask for them, and they are the sampling weights' log-probs of the sampled tokens."""
    calls = []
    real = grpo.fast_paths.completion_logps
    monkeypatch.setattr(
        grpo.fast_paths, "completion_logps", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    plain, m = short_rollout(tiny_policy, monkeypatch, False, max_new_tokens=16)
    assert plain and not calls and all("pi_old_logps" not in t for t, _ in plain)  # no forward ran
    with_gen, _ = short_rollout(
        tiny_policy, monkeypatch, False, max_new_tokens=16, with_pi_old=True
    )
    assert calls == [1] and all(
        t["pi_old_logps"].shape == t["completion_mask"].shape for t, _ in with_gen
    )
    model = tiny_policy[0]
    for t, meta in with_gen:
        ids = t["input_ids"]
        with torch.no_grad():
            want = real(
                model,
                ids,
                torch.ones_like(ids),
                ids.shape[1] - meta["plen"],
                grpo.TEMPERATURE,
                chunk=128,
                from_hidden=True,
            )
        assert torch.allclose(
            t["pi_old_logps"][t["completion_mask"]], want[t["completion_mask"]], atol=1e-5
        )


def test_on_policy_rows_need_no_pi_old_logps_for_the_same_loss_and_gradient():
    """Without pi_old_logps (None, or rows outside pi_old_rows that a batch mixes in) the ratio is 1
    with
    the policy gradient: the same as passing the current log-probs as pi_old. Rows with pi_old_logps
    keep theirs."""
    torch.manual_seed(9)
    logps = (-torch.rand(4, 5)).requires_grad_()
    ref, adv, mask = -torch.rand(4, 5), torch.tensor([1.0, -1.0, 0.5, 2.0]), torch.rand(4, 5) > 0.2
    stale = logps.detach() + torch.randn(4, 5) * 0.3  # rows 2-3: groups from an older policy
    # rows 0-1: this rank's own groups (junk values)
    mixed = torch.cat([torch.full((2, 5), 5.0), stale[2:]])
    rows = torch.tensor([False, False, True, True])
    explicit = torch.cat([logps.detach()[:2], stale[2:]])
    from test_grpo_math import naive_gradient, naive_loss

    results = []
    for g, r, pi_old in ((None, None, logps.detach()), (mixed, rows, explicit)):
        loss = torch_loss(
            logps=logps,
            ref_logps=ref,
            pi_old_logps=g,
            pi_old_rows=r,
            advantages=adv,
            mask=mask,
            beta=0.04,
            clip_eps=0.2,
        )
        grad = torch.autograd.grad(loss, logps)[0]
        # The reference shares no code: the plain-Python loss with pi_old given outright (the
        # current log-probs where none came), and its finite differences with pi_old held fixed.
        plain = [t.tolist() for t in (logps.detach(), ref, pi_old, adv, mask)]
        assert loss.item() == pytest.approx(naive_loss(*plain, 0.04, 0.2), rel=1e-6)
        assert torch.allclose(grad.double(), naive_gradient(*plain, 0.04, 0.2), atol=1e-5)
        results.append(loss.item())
    assert results[0] != pytest.approx(results[1], rel=1e-3)  # the stale rows do change the loss


def test_skip_pi_old_logps_gives_the_plain_paths_loss_and_gradient(tiny_policy, monkeypatch):
    """SKIP_PI_OLD = False is the plain path (a forward of the sampling weights gives pi_old);
    the shortcut skips that forward. Steps 2-6 of one MU = 1 step without REGROUP (with_pi_old as
    main's set-up decides it, pi_old_for_run): the constant alone decides, and the loss and
    gradient are the same either way."""
    model, tok = tiny_policy
    monkeypatch.setattr(grpo, "MU", 1)
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for skip in (True, False):
        monkeypatch.setattr(grpo.fast_paths, "SKIP_PI_OLD", skip)
        groups, _ = short_rollout(tiny_policy, monkeypatch, False, max_new_tokens=16,
                                  with_pi_old=grpo.pi_old_for_run(regroup=False))
        assert groups and all(("pi_old_logps" in t) != skip for t, _ in groups)
        g = torch.Generator().manual_seed(5)
        for t, _ in groups:  # what the server would add
            t["ref_logps"] = -torch.rand(t["completion_mask"].shape, generator=g)  # (G, T)
        engine = PlainEngine(model, lr=0.0)
        batch = grpo.collate(groups, tok.pad_token_id)
        loss, _ = grpo.choose_parts().loss(engine, grpo.prepare_batch(engine, batch))
        out[skip] = loss.item(), torch.autograd.grad(loss, params)
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-5, abs=1e-7)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out[True][1], out[False][1]))
    assert any(a.abs().max() > 1e-4 for a in out[True][1])  # a real gradient, not two zeros


# ---------------------------------------------------------------------------- REGROUP on the server
def upload(url, tensors, meta):
    r = requests.post(url + "/upload", data=encode_batch(tensors, meta), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_regroup_mixes_uploads_of_one_question_into_a_group_with_variance(model):
    server, httpd, url = start(model, regroup=True)
    try:
        a, meta = group(G=4, plen=5, tc=3, seed=1, version=2)
        b, _ = group(G=4, plen=5, tc=6, seed=2)
        b["input_ids"][:, :5] = a["input_ids"][0, :5]  # the same question, a longer answer
        a["scores"], b["scores"] = torch.zeros(4), torch.ones(4)  # each upload alone: no signal
        other, other_meta = group(G=4, plen=5, tc=3, seed=3)
        other["scores"] = torch.ones(4)
        # for a reward model
        texts = {"a": [f"a{i}" for i in range(4)], "b": [f"b{i}" for i in range(4)]}
        assert upload(url, a, {**meta, "completions": texts["a"]})["groups"] == 0
        assert upload(url, other, other_meta)["groups"] == 0  # another question does not mix in
        assert requests.get(url + "/get", timeout=10).status_code == 204
        assert upload(url, b, {**meta, "version": 5, "completions": texts["b"]})["groups"] == 1
        tensors, out_meta = pull(url)
        assert tensors["input_ids"].shape == (4, 5 + 6) and tensors["ref_logps"].shape == (4, 6)
        assert tensors["scores"].unique().numel() == 2  # both rewards in the group
        # rewards alone: the trainer computes the advantages of a regrouped group (step 4)
        assert "advantages" not in tensors
        sent = {
            tuple(r[m].tolist())
            for r, m in zip(tensors["input_ids"][:, 5:], tensors["completion_mask"])
        }
        pooled = {tuple(r.tolist()) for r in a["input_ids"][:, 5:]} | {
            tuple(r.tolist()) for r in b["input_ids"][:, 5:]
        }
        assert sent <= pooled  # real answers, padding masked out
        for j, (row, m, lp) in enumerate(
            zip(tensors["input_ids"], tensors["completion_mask"], tensors["pi_old_logps"])
        ):
            # each answer keeps its own old log-probs ...
            src, name = (a, "a") if m.sum() == 3 else (b, "b")
            i = next(i for i in range(4) if torch.equal(src["input_ids"][i, 5:], row[5:][m]))
            assert torch.equal(lp[m], src["pi_old_logps"][i])
            assert out_meta["completions"][j] == texts[name][i]  # ... and its own text
        assert out_meta["version"] == 2 and out_meta["regrouped"]  # the stalest answer's policy
        assert (
            server.pool.regrouped == 1 and sum(len(p) for p in server.pool.pools.values()) == 4 + 4
        )
        assert requests.get(url + "/health", timeout=10).json()["regroup"] is True
    finally:
        stop(server, httpd)


def test_regroup_keeps_a_questions_images_and_pools_other_images_apart():
    """Issue 58: an upload with images failed (its image fields were indexed per row: a 500 on the
    server) and the pool keyed on the prompt's ids alone, so the same text showing another image
    would have mixed in. A question is its prompt and its images: the group sent out carries
    them."""
    from features.regroup import RegroupPool
    from features.vision import pack_images

    pool = RegroupPool(64, 16)
    red = pack_images([b"the bytes of a red picture"])
    blue = pack_images([b"the bytes of a blue one", b"and a second"])

    def upload_of(seed, reward, images):  # four answers to the one text, showing `images`
        tensors, meta = group(G=4, plen=5, tc=3, seed=seed)
        tensors["input_ids"][:, :5] = torch.arange(5)  # the same prompt ids every time
        tensors["scores"] = torch.full((4,), reward)
        return {**tensors, **images}, meta

    assert pool.add(*upload_of(1, 0.0, red)) is None  # equal rewards: nothing to send yet
    assert pool.add(*upload_of(2, 1.0, blue)) is None  # another picture: another question
    tensors, meta = pool.add(*upload_of(3, 1.0, red))  # the red question's second upload
    assert tensors["scores"].unique().numel() == 2 and meta["regrouped"]
    assert torch.equal(tensors["image_bytes"], red["image_bytes"])
    assert torch.equal(tensors["image_ends"], red["image_ends"])
    assert len(pool.pools) == 2  # red's leftovers and blue's four, apart


def test_without_regroup_every_upload_is_one_group(model):
    server, httpd, url = start(model)
    try:
        t, meta = group(G=4)
        t["scores"] = torch.zeros(4)
        assert upload(url, t, meta)["groups"] == 1
        assert torch.equal(pull(url)[0]["scores"], t["scores"])
        assert requests.get(url + "/health", timeout=10).json()["regroup"] is False
    finally:
        stop(server, httpd)


@pytest.mark.slow
def test_regroup_runs_without_the_trainer_or_the_rewards(tiny_model_dir):
    """The server process never imports the trainer (nor rewards, math-verify): REGROUP makes a new
    group of the answers and rewards it was sent, with features/ alone (its advantages are the
    trainer's to compute)."""
    import subprocess
    import sys

    from conftest import ROOT

    code = f"""
import os, sys, torch
os.environ["REGROUP"] = "1"
import ref_server
from transformers import AutoModelForCausalLM
server = ref_server.RefServer(AutoModelForCausalLM.from_pretrained({tiny_model_dir!r}), "tiny")
# 4 answers to one question (the same 5 prompt tokens), all with the same reward
def answers(reward):
    ids = torch.cat([torch.arange(5).repeat(4, 1), torch.randint(0, 49152, (4, 3))], 1)
    return dict(input_ids=ids, completion_mask=torch.ones(4, 3, dtype=torch.bool),
                advantages=torch.zeros(4), scores=torch.full((4,), reward),
                pi_old_logps=-torch.rand(4, 3))
a, b, meta = answers(0.0), answers(1.0), dict(plen=5, temperature=1.0)
assert ref_server.REGROUP and server.pool is not None
assert server.pool.add(a, meta) is None
tensors, out_meta = server.pool.add(b, meta)
assert out_meta["regrouped"] and tensors["scores"].unique().numel() == 2
assert "advantages" not in tensors
loaded = sorted(m for m in sys.modules if m in ("grpo_ref_split", "rewards", "math_verify"))
print("loaded:", loaded)
"""
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "loaded: []" in run.stdout


def test_sampling_ignores_the_models_own_generation_config(tiny_model_dir, tmp_path):
    """A model that ships repetition_penalty, top_k, top_p, min_p and no_repeat_ngram_size (as
    Qwen2.5-Instruct ships some of them): the trainer's samples must still be softmax(logits / T)
    and its greedy evaluation plain argmax. The same checks fail on the model as loaded."""
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path / "opinionated"
    shutil.copytree(tiny_model_dir, folder)
    GenerationConfig(
        do_sample=True,
        temperature=1.7,
        repetition_penalty=1.3,
        top_k=3,
        top_p=0.5,
        min_p=0.2,
        no_repeat_ngram_size=2,
        eos_token_id=2,
        pad_token_id=2,
    ).save_pretrained(folder)
    model, tok, eos_ids, gen_config = grpo.load_policy(str(folder), torch.device("cpu"))
    enc = grpo.encode_prompts(
        tok, [{"question": "What is 2 + 3?"}, {"question": "What is 11 + 7?"}]
    )

    def mismatches(model, sample_config, greedy_config):
        torch.manual_seed(0)
        out = model.generate(
            **enc, generation_config=sample_config, output_scores=True, return_dict_in_generate=True
        )
        completion = out.sequences[:, enc.input_ids.shape[1] :]  # (B, T)
        mask = grpo.completion_mask(completion, eos_ids)  # (B, T)
        scores = torch.stack(out.scores, 1)  # (B, T, V) what the sampler drew from
        # (B, T)
        drawn = torch.log_softmax(scores, -1).gather(-1, completion[..., None]).squeeze(-1)
        attn = torch.cat([enc.attention_mask, torch.ones_like(completion)], 1)
        with torch.no_grad():
            want = completion_logps(
                model,
                out.sequences,
                attn,
                completion.shape[1],
                grpo.TEMPERATURE,
                chunk=grpo.fast_paths.LOGP_CHUNK,
                from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
            )  # (B, T)
        sample_gap = (drawn - want)[mask].abs().max().item()
        greedy = model.generate(**enc, generation_config=greedy_config)  # (B, P+T)
        with torch.no_grad():
            # (B, L, V)
            logits = model(input_ids=greedy, attention_mask=torch.ones_like(greedy)).logits
        g = greedy[:, enc.input_ids.shape[1] :]  # (B, T)
        # (B, T) plain argmax, teacher-forced
        argmax = logits[:, enc.input_ids.shape[1] - 1 : -1].argmax(-1)
        greedy_diff = (g != argmax)[grpo.completion_mask(g, eos_ids)].sum().item()
        return sample_gap, greedy_diff

    greedy_config = GenerationConfig(
        do_sample=False, max_new_tokens=24, pad_token_id=tok.pad_token_id, eos_token_id=eos_ids
    )  # what evaluate() builds
    sample_config = GenerationConfig(**{**gen_config.to_diff_dict(), "max_new_tokens": 24})
    gap, diff = mismatches(model, sample_config, greedy_config)
    assert gap < 1e-4 and diff == 0
    # its own generation_config fills the gaps
    raw = AutoModelForCausalLM.from_pretrained(folder).eval()
    raw_gap, raw_diff = mismatches(raw, sample_config, greedy_config)
    assert raw_gap > 1e-2 or raw_diff > 0


# ----------------------------------------------------------------------------- REWARDS
def test_score_sums_the_weighted_rewards_and_logs_each_by_name(monkeypatch):
    texts = [
        "<think> 3 + 4 </think><answer>7</answer>",
        "<think> 3 + 4 </think><answer>8</answer>",
        "<think> 7",
    ]
    golds, questions = ["7", "7", "7"], ["What is 3 + 4?"] * 3
    total, each = rewards.score(grpo.REWARDS, texts, golds, questions)
    # the defaults, by hand
    assert total == [2.0 * 1 + 1.0 * 1, 2.0 * 0 + 1.0 * 1, 2.0 * 1 + 1.0 * 0]
    assert each == {"reward_correct": [1.0, 0.0, 1.0], "reward_format": [1.0, 1.0, 0.0]}

    def reward_short(completion, gold, question):  # a third reward is one more pair
        return -len(completion) / 100

    monkeypatch.setattr(grpo, "REWARDS", grpo.REWARDS + [(reward_short, 0.5)])
    longer, each = rewards.score(grpo.REWARDS, texts, golds, questions)
    want = [t - 0.5 * len(x) / 100 for t, x in zip(total, texts)]
    assert longer == pytest.approx(want) and each["reward_short"] == [-len(x) / 100 for x in texts]

    import numpy as np

    def reward_numpy(completion, gold, question):  # numpy's floats are numbers too
        return np.float64(0.25)

    monkeypatch.setattr(grpo, "REWARDS", [(reward_numpy, 2.0)])
    assert rewards.score(grpo.REWARDS, texts, golds, questions)[0] == [0.5] * 3


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda c, g, q: 1 / 0, "raised ZeroDivisionError"),
        (lambda c, g, q: float("nan"), "returned nan, not a finite number"),
        (lambda c, g, q: "1.0", "returned '1.0', not a finite number"),
        (lambda c, g, q: None, "returned None, not a finite number"),
    ],
)
def test_a_broken_reward_stops_the_run_naming_it_and_the_completion(monkeypatch, bad, message):
    bad.__name__ = "reward_broken"
    monkeypatch.setattr(grpo, "REWARDS", [(bad, 1.0)])
    with pytest.raises(SystemExit, match=f"reward reward_broken {message}") as e:
        rewards.score(grpo.REWARDS, ["<think> 12 </think><answer>12</answer>"], ["12"], ["q"])
    assert "<think> 12 </think><answer>12</answer>" in str(e.value)


def test_functions_cannot_be_set_from_the_environment_unless_the_file_names_their_module(
    monkeypatch,
):
    """The trainer passes functions={"REWARDS": rewards, ...} (tests/test_tools.py); a file that
    does not gets the old refusal, not a list of strings where functions belong."""
    from features.env_overrides import apply_env_overrides

    monkeypatch.setenv("REWARDS", "[]")
    with pytest.raises(
        SystemExit, match="REWARDS cannot be set from the environment; edit it in x.py"
    ):
        apply_env_overrides({"REWARDS": [(len, 1.0)]}, "x.py")


def test_sample_metrics_cover_every_rollout_of_the_step(monkeypatch):
    """A step that re-sampled after all-equal groups reports both rollouts' answers, not only the
    last one's."""
    monkeypatch.setattr(grpo, "NUM_PRE_Q", 2)
    # all right
    first = [
        dict(reward=3.0, reward_correct=1.0, reward_format=1.0, length=10, truncated=False)
    ] * 4
    second = [
        dict(reward=r, reward_correct=c, reward_format=1.0, length=n, truncated=n == 64)
        for r, c, n in [(3.0, 1.0, 12), (1.0, 0.0, 64), (1.0, 0.0, 20), (1.0, 0.0, 22)]
    ]
    stats = sample_stats(first + second, grpo.NUM_PRE_Q, ["reward_correct", "reward_format"])
    assert stats["reward"] == pytest.approx(18 / 8) and stats["reward_correct"] == pytest.approx(
        5 / 8
    )
    assert stats["reward_format"] == 1.0 and stats["truncated"] == pytest.approx(1 / 8)
    assert stats["length"] == pytest.approx((40 + 118) / 8) and stats["max_length"] == 64
    # groups (3,3) (3,3) (3,1) (1,1): std 0, 0, 1.41, 0
    assert stats["reward_std"] == pytest.approx(2**0.5 / 4)
    assert (
        sample_stats(
            second,
            2,
            # the last rollout alone: what was logged before
            ["reward_correct"],
        )["reward_correct"]
        == 0.25
    )


def test_the_reward_models_mean_score_is_a_metric_of_the_step():
    m = Counter(fwd_bwd_s=1.0, optim_s=0.5)
    answers, adv = [dict(reward=1.0, length=3, truncated=False)] * 8, {"advantages": torch.zeros(4)}
    groups = [
        (adv, {"version": 4, "reward_model_mean": 0.2}),
        (adv, {"version": 4, "reward_model_mean": 0.6}),
    ]
    out = step_metrics(
        m, groups, answers, step=5, attempts=1, began=clock(), group_size=4, reward_names=[]
    )
    assert (
        out["reward_model"] == pytest.approx(0.4)
        and out["staleness"] == 0
        and out["train_s"] == 1.5
    )
    plain = Counter(fwd_bwd_s=1.0, optim_s=0.5)
    assert "reward_model" not in step_metrics(
        plain,
        [(adv, {})],
        answers,
        step=1,
        attempts=1,
        began=clock(),
        group_size=4,
        reward_names=[],
    )
