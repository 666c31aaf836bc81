"""The GRPO math: advantages, the completion mask, log-probs and the clipped loss."""
import json
import math

import pytest
import torch

from features.fast_paths import chunked_logps
from features.wire import decode_batch, encode_batch
from grpo_ref_split import advantages_in_groups, collate, completion_mask, global_count, k3
from objectives import masked_mean
from reference_loss import torch_loss
from rewards import make_arithmetic, score, split_held_out


# ----------------------------------------------------------------------------- advantages
def test_group_advantages_by_hand():
    adv = advantages_in_groups(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 4)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]: sum of squares 1 over n - 1 = 3
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 2
    assert adv[:4].tolist() == pytest.approx(
        [expected[0], expected[1], expected[1], expected[0]], rel=1e-6
    )
    assert adv[4:].tolist() == [0.0] * 4  # an all-equal group carries no signal


def test_group_advantages_are_per_group():
    """Two groups of two, 100 apart: each is relative to its own mean and std, by hand. [0, 10]:
    mean 5, unbiased std sqrt((25 + 25) / 1) = 7.0711; [100, 110] the same. A batch-wide mean would
    give -55 ... 55."""
    adv = advantages_in_groups(torch.tensor([0.0, 10.0, 100.0, 110.0]), 2)
    a = 5 / (math.sqrt(50) + 1e-4)
    assert adv.tolist() == pytest.approx([-a, a, -a, a], rel=1e-6)


@pytest.mark.parametrize("n, g", [(6, 4), (3, 2)])
def test_group_advantages_refuse_rewards_that_do_not_split_into_groups(n, g):
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        advantages_in_groups(torch.ones(n), g)


def test_a_group_of_one_has_advantage_zero():
    """Pure distillation's groups of one (NUM_PRE_Q = 1): no other answer to compare with, so no
    reward signal, A = 0 (not a NaN from a std over one value)."""
    assert advantages_in_groups(torch.tensor([3.0, -1.0]), 1).tolist() == [0.0, 0.0]


def test_group_advantages_of_no_rewards_are_none():
    assert advantages_in_groups(torch.ones(0), 2).shape == (0,)


# ----------------------------------------------------------------------------- completion mask
def test_completion_mask_keeps_the_eos_when_pad_equals_eos():
    eos = 2  # SmolLM2: pad == eos == <|im_end|> == 2
    ids = torch.tensor(
        [
            [5, 6, 2, 2, 2],  # stopped at position 2, then padded with the same token
            [5, 6, 7, 8, 9],  # never stopped: every token counts
            [2, 2, 2, 2, 2],  # stopped at once: the EOS alone is trained
            [5, 2, 7, 2, 2],  # only the first EOS ends it
        ]
    )
    assert completion_mask(ids, eos).int().tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
    ]
    assert (completion_mask(ids, eos) != (ids != eos)).any()  # the wrong test would differ


def test_completion_mask_with_several_eos_ids():
    ids = torch.tensor([[5, 9, 1, 1], [5, 1, 9, 1]])
    assert completion_mask(ids, [9, 1]).int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]


# ----------------------------------------------------------------------------- per-token log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_per_token_logps_value_and_gradient_match_log_softmax(temperature):
    torch.manual_seed(0)
    full = torch.randn(3, 9, 37, dtype=torch.float64).float().requires_grad_()  # (B, L, V)
    ids = torch.randint(0, 37, (3, 6))  # (B, T)
    view = full[:, 2:-1]  # a strided view, as the trainer slices completion logits
    got = chunked_logps(view, ids, temperature, chunk=128)
    want = torch.log_softmax(view / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-6)
    w = torch.randn(3, 6)
    (g_got,) = torch.autograd.grad((got * w).sum(), full)
    (g_want,) = torch.autograd.grad((want * w).sum(), full)
    assert torch.allclose(g_got, g_want, atol=1e-6)
    assert g_got[:, :2].abs().max() == 0 and g_got[:, -1].abs().max() == 0  # outside the view


def test_inplace_backward_through_a_real_lm_head_gives_the_same_weight_gradients(model):
    """The trainer's path: completion_logits (LM head on completion positions only) then
    chunked_logps with the gradient written over the logits, in chunks smaller than T."""
    from features.fast_paths import completion_logits

    torch.manual_seed(4)
    ids = torch.randint(0, 49152, (2, 20))  # (B, L) the last 12 are the completion
    attn = torch.ones_like(ids)
    w = torch.randn(2, 12)
    grads, values = {}, {}
    for inplace in (False, True):
        model.zero_grad()
        logits = completion_logits(model, ids, attn, 12)  # (B, 12, V)
        # (B, 12) 3 chunks a row
        lp = chunked_logps(logits, ids[:, -12:], 0.7, chunk=5, inplace_backward=inplace)
        (lp * w).sum().backward()
        grads[inplace] = {n: p.grad.clone() for n, p in model.named_parameters()}
        values[inplace] = lp.detach()
    model.zero_grad()
    with torch.no_grad():
        full = model(input_ids=ids).logits  # (B, L, V) every position: the plain way
    # (B, 12)
    want = torch.log_softmax(full[:, 7:19] / 0.7, -1).gather(-1, ids[:, 8:, None]).squeeze(-1)
    assert torch.allclose(values[False], want, atol=1e-5) and torch.equal(
        values[False], values[True]
    )
    for n in grads[False]:
        assert torch.allclose(grads[True][n], grads[False][n], atol=1e-7), n
    assert any(g.abs().sum() > 0 for g in grads[True].values())


def plain_logps(logits, ids, temperature):
    """The definition, written here: log softmax(logits / T) at each id (B, T)."""
    logp_all = torch.log_softmax(logits.float() / temperature, -1)  # (B, T, V)
    return logp_all.gather(-1, ids[..., None]).squeeze(-1)  # (B, T)


@pytest.mark.parametrize("chunk", [0, 3, 128])
def test_chunked_per_token_logps_match_the_plain_definition(chunk):
    """chunked_logps (chunked, in-place backward) against the definition (log_softmax, gather);
    LOGP_CHUNK = 0 is a whole row at a time."""
    torch.manual_seed(5)
    ids = torch.randint(0, 301, (3, 7))  # (B, T)
    w = torch.randn(3, 7)
    base = torch.randn(3, 7, 301) * 3  # (B, T, V)
    values, grads = [], []
    for fn in (
        lambda z: chunked_logps(z, ids, 0.7, chunk=chunk, inplace_backward=True),
        lambda z: plain_logps(z, ids, 0.7),
    ):
        leaf = base.clone().requires_grad_()
        logits = leaf * 1.0  # not a leaf, as the LM head's output: in place may overwrite it
        lp = fn(logits)
        (lp * w).sum().backward()
        values.append(lp.detach())
        grads.append(leaf.grad)
    assert torch.allclose(values[0], values[1], atol=1e-6)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert grads[1].abs().sum() > 0


@pytest.mark.parametrize("chunk", [0, 5, 128])
def test_hidden_logps_match_the_plain_definition_in_value_and_both_gradients(chunk):
    """Chunks of 5 cross the rows' ends (B x T = 21 tokens); the LM-head weight gets its gradient
    summed over the chunks; 0 = one chunk."""
    from features.fast_paths import hidden_logps

    torch.manual_seed(6)
    h0, w0 = torch.randn(3, 7, 16), torch.randn(301, 16) / 2  # (B, T, H), (V, H)
    ids, w = torch.randint(0, 301, (3, 7)), torch.randn(3, 7)  # (B, T) each
    results = []
    for fn in (
        lambda h, wt, i, t: hidden_logps(h, wt, i, t, chunk=chunk),
        lambda h, wt, i, t: plain_logps(h @ wt.T, i, t),
    ):
        hidden, weight = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        lp = fn(hidden, weight, ids, 0.7)  # (B, T)
        (lp * w).sum().backward()
        results.append((lp.detach(), hidden.grad, weight.grad))
    for got, want in zip(*results):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert results[1][2].abs().sum() > 0


def test_log_probs_from_hidden_states_give_the_models_gradient_with_tied_embeddings(model):
    """completion_logps with LOGP_FROM_HIDDEN on and off, full rows and the shared prompt: the same
    log-probs and the same gradient on every parameter, the tied embedding / LM-head weight
    included."""
    from features.fast_paths import completion_logps

    # tied, as SmolLM2
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    torch.manual_seed(4)
    prompt = torch.randint(0, 49152, (1, 9)).expand(3, -1)  # (G, P) one group
    ids = torch.cat([prompt, torch.randint(0, 49152, (3, 11))], 1)  # (G, L)
    w = torch.randn(3, 11)
    out = {}
    for hidden in (False, True):
        for shared in (False, True):
            model.zero_grad()
            lp = completion_logps(
                model,
                ids,
                torch.ones_like(ids),
                11,
                0.7,
                shared_prefix=shared,
                chunk=7,
                from_hidden=hidden,
            )  # (G, 11)
            (lp * w).sum().backward()
            out[hidden, shared] = (
                lp.detach(),
                {n: p.grad.clone() for n, p in model.named_parameters()},
            )
    base_lp, base_grads = out[False, False]
    for key, (lp, grads) in out.items():
        assert torch.allclose(lp, base_lp, atol=1e-5), key
        for n, g in base_grads.items():
            assert (grads[n] - g).abs().max() <= 1e-5 * max(g.abs().max(), 1e-8), (key, n)
    assert base_grads["model.embed_tokens.weight"].abs().sum() > 0


def test_log_probs_from_hidden_states_refuse_a_model_whose_logits_are_not_the_plain_head(
    model, monkeypatch
):
    from features.fast_paths import lm_head_weight

    monkeypatch.setattr(model.config, "final_logit_softcapping", 30.0, raising=False)  # as Gemma 2
    with pytest.raises(ValueError, match="final_logit_softcapping.*LOGP_FROM_HIDDEN = False"):
        lm_head_weight(model)


def test_negative_chunk_and_micro_batch_sizes_are_refused(monkeypatch):
    import grpo_ref_split as grpo
    from features.fast_paths import hidden_logps

    with pytest.raises(ValueError, match="LOGP_CHUNK = -1"):
        hidden_logps(
            torch.zeros(1, 2, 4), torch.zeros(5, 4), torch.zeros(1, 2, dtype=torch.long), chunk=-1
        )
    # not an empty loop leaving logps uninitialised
    with pytest.raises(ValueError, match="LOGP_CHUNK = -1"):
        chunked_logps(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), chunk=-1)
    monkeypatch.setattr(grpo.zero2, "TRAIN_MICRO_BATCH", -2)
    with pytest.raises(ValueError, match="TRAIN_MICRO_BATCH = -2"):
        grpo.check_settings()  # refused at start


def test_per_token_logps_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="do not match"):
        chunked_logps(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.long), chunk=128)


# ----------------------------------------------------------------------------- the loss
def naive_loss(logps, ref, gen, adv, mask, beta, eps):
    """The same formula written token by token in plain Python floats."""
    total = 0.0
    for b in range(len(logps)):
        num = den = 0.0
        for t in range(len(logps[b])):
            if not mask[b][t]:
                continue
            r = math.exp(logps[b][t] - gen[b][t])
            surr = min(r * adv[b], min(max(r, 1 - eps), 1 + eps) * adv[b])
            d = ref[b][t] - logps[b][t]
            num += -(surr - beta * (math.exp(d) - d - 1))
            den += 1
        total += num / max(den, 1)
    return total / len(logps)


def test_grpo_loss_by_hand_single_token():
    # ratio e^0.5 = 1.6487 > 1.2 with A = +1: clipped to 1.2; KL with d = -0.2: e^-0.2 + 0.2 - 1
    logps, gen, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.tensor([[-1.2]])
    loss = torch_loss(
        logps=logps,
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=torch.tensor([1.0]),
        mask=torch.ones(1, 1, dtype=torch.bool),
        beta=0.1,
        clip_eps=0.2,
    )
    assert loss.item() == pytest.approx(-(1.2 - 0.1 * (math.exp(-0.2) + 0.2 - 1)), rel=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_grpo_loss_matches_naive_formula_in_all_clip_cases(seed):
    torch.manual_seed(seed)
    B, T = 6, 7
    logps = -torch.rand(B, T) * 3  # (B, T)
    gen = logps + torch.randn(B, T) * 0.4  # ratios on both sides of the clip band
    ref = logps + torch.randn(B, T) * 0.3
    adv = torch.tensor([1.5, -1.5, 0.7, -0.2, 0.0, 2.0])  # positive and negative
    mask = torch.rand(B, T) > 0.3
    mask[:, 0] = True
    got = torch_loss(
        logps=logps,
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=0.04,
        clip_eps=0.2,
    ).item()
    want = naive_loss(
        logps.tolist(), ref.tolist(), gen.tolist(), adv.tolist(), mask.tolist(), 0.04, 0.2
    )
    assert got == pytest.approx(want, rel=1e-5)
    ratio = torch.exp(logps - gen)
    assert ((ratio > 1.2) & (adv[:, None] > 0)).any() and ((ratio < 0.8) & (adv[:, None] < 0)).any()


def naive_gradient(logps, ref, gen, adv, mask, beta, eps, h=1e-6):
    """d naive_loss / d logps by central finite differences: a reference that shares no code with
    grpo_loss."""
    grad = [[0.0] * len(row) for row in logps]
    for b in range(len(logps)):
        for t in range(len(logps[b])):
            plus, minus = [list(row) for row in logps], [list(row) for row in logps]
            plus[b][t] += h
            minus[b][t] -= h
            grad[b][t] = (
                naive_loss(plus, ref, gen, adv, mask, beta, eps)
                - naive_loss(minus, ref, gen, adv, mask, beta, eps)
            ) / (2 * h)
    return torch.tensor(grad, dtype=torch.float64)


def test_grpo_loss_gradient_matches_finite_differences_of_the_plain_formula():
    torch.manual_seed(1)
    B, T = 4, 5
    logps = (-torch.rand(B, T) * 2).double().requires_grad_()
    gen, ref = (
        (logps.detach() + torch.randn(B, T) * 0.3),
        (logps.detach() + torch.randn(B, T) * 0.3),
    )
    adv, mask = torch.randn(B).double(), torch.rand(B, T) > 0.2
    (g,) = torch.autograd.grad(
        torch_loss(
            logps=logps,
            ref_logps=ref,
            pi_old_logps=gen,
            advantages=adv,
            mask=mask,
            beta=0.04,
            clip_eps=0.2,
        ),
        logps,
    )
    # Clipped tokens pass no policy gradient, only the KL term's: finite differences of the
    # plain-Python loss.
    num = naive_gradient(
        logps.tolist(), ref.tolist(), gen.tolist(), adv.tolist(), mask.tolist(), 0.04, 0.2
    )
    assert torch.allclose(g, num, atol=1e-6)
    assert (g[~mask] == 0).all()  # masked tokens get no gradient


def test_pi_old_logps_none_is_the_on_policy_gradient():
    torch.manual_seed(2)
    logps = (-torch.rand(3, 4)).requires_grad_()
    adv = torch.tensor([1.0, -2.0, 0.5])
    mask = torch.ones(3, 4, dtype=torch.bool)
    loss = torch_loss(
        logps=logps,
        ref_logps=logps.detach(),
        pi_old_logps=None,
        advantages=adv,
        mask=mask,
        beta=0.0,
        clip_eps=0.2,
    )
    assert loss.item() == pytest.approx(-adv.mean().item(), rel=1e-6)  # ratio 1: loss = -mean(A)
    (g,) = torch.autograd.grad(loss, logps)
    assert torch.allclose(g, -adv[:, None].expand(3, 4) / (4 * 3))  # d/dlogp of -A r / (T B), r = 1


def test_score_refuses_answers_that_do_not_line_up_with_the_questions():
    """zip would score the first 16 of 128 answers and average those: evaluation once reported 87.5%
    so."""

    with pytest.raises(ValueError, match="16 completions for 128 gold answers"):
        score([], ["<answer>1</answer>"] * 16, ["1"] * 128, ["q"] * 128)


def test_truncated_importance_sampling_weights_each_token_by_hand():
    """Rows 0-1 sampled by vLLM (vllm_logps), row 2 by the trainer (not in vllm_rows; its
    values there are junk that must not count): on-policy, pi_old is logp itself, so the weight is
    min(exp(logp - sampler), cap) and the loss -w A per token; with pi_old_logps, pi_old is gen."""
    logps = torch.tensor([[-1.0, -0.5], [-1.0, -0.2], [-0.3, -0.4]], requires_grad=True)  # (3, 2)
    sampler = torch.tensor([[-1.5, -0.5], [-2.0, -0.1], [-9.0, -9.0]])  # (3, 2)
    rows = torch.tensor([True, True, False])
    adv, mask = torch.tensor([1.0, -2.0, 0.5]), torch.ones(3, 2, dtype=torch.bool)
    # exp(1) = 2.72 is cut to 2
    w = torch.tensor([[math.exp(0.5), 1.0], [2.0, math.exp(-0.1)], [1.0, 1.0]])
    loss = torch_loss(
        logps=logps,
        ref_logps=None,
        pi_old_logps=None,
        advantages=adv,
        mask=mask,
        beta=0.0,
        clip_eps=0.2,
        vllm_logps=sampler,
        vllm_rows=rows,
        tis_cap=2.0,
    )
    assert loss.item() == pytest.approx(-(w * adv[:, None]).mean().item(), rel=1e-6)
    (g,) = torch.autograd.grad(loss, logps)
    # ratio 1 on-policy: d(-w A r)/dlogp = -w A, mean of 2 x 3
    assert torch.allclose(g, -w * adv[:, None] / 6)
    off = torch_loss(
        logps=logps,
        ref_logps=None,
        pi_old_logps=None,
        advantages=adv,
        mask=mask,
        beta=0.0,
        clip_eps=0.2,
        vllm_logps=sampler,
        vllm_rows=rows,
        tis_cap=0.0,
    )
    assert off.item() == pytest.approx(-adv.mean().item(), rel=1e-6)  # tis_cap = 0: no correction
    gen = torch.full((3, 2), -1.0)  # pi_old given: weight exp(gen - sampler), ratio exp(logp - gen)
    with_gen = torch_loss(
        logps=logps,
        ref_logps=None,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=0.0,
        clip_eps=10.0,
        vllm_logps=sampler,
        vllm_rows=rows,
        tis_cap=2.0,
    ).item()
    w_gen = torch.where(rows[:, None], torch.exp(gen - sampler), 1.0).clamp(max=2.0)
    assert with_gen == pytest.approx(
        -(w_gen * torch.exp(logps - gen) * adv[:, None]).mean().item(), rel=1e-6
    )


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_padding_with_logp_minus_100_leaves_loss_and_gradient_finite(loss_type):
    """k3 on padding with logp = -100 against ref 0 overflows (exp(100) is inf in fp32); the padding
    must not matter at all: the same loss and gradient as with harmless padding."""
    torch.manual_seed(3)
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    ref, gen, adv = -torch.rand(2, 4), -torch.rand(2, 4), torch.tensor([1.0, -1.0])
    results = []
    for pad_logp in (-100.0, -1.0):
        logps = -torch.rand(2, 4, generator=torch.Generator().manual_seed(4))
        logps[~mask] = pad_logp
        logps.requires_grad_()
        pad_ref, pad_gen = ref.clone(), gen.clone()
        pad_ref[~mask], pad_gen[~mask] = 0.0, 0.0
        loss = torch_loss(
            logps=logps,
            ref_logps=pad_ref,
            pi_old_logps=pad_gen,
            advantages=adv,
            mask=mask,
            beta=0.04,
            clip_eps=0.2,
            loss_type=loss_type,
            max_tokens=4,
        )
        (g,) = torch.autograd.grad(loss, logps)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        results.append((loss.item(), g))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6) and torch.allclose(
        results[0][1], results[1][1]
    )
    assert (results[0][1][~mask] == 0).all()
    assert (
        masked_mean(torch.tensor([[1.0, float("inf")]]), torch.tensor([[True, False]])).item()
        == 1.0
    )


def _rank_gradient(rank, world, port, data, loss_type, normalize, results):
    """One gloo rank: its share of the answers, the loss, then DeepSpeed's gradient average over
    ranks."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    # 5 answers on rank 0, 2 on rank 1
    rows = [slice(0, 5), slice(5, 7)][rank] if world == 2 else slice(0, 7)
    x, ref, gen, adv, mask = (t[rows] for t in data)
    # a weight every rank shares
    w = torch.ones(x.shape[1], dtype=torch.float64, requires_grad=True)
    normalizer = global_count([mask], token_mean=loss_type == "dapo") if normalize else None
    torch_loss(
        logps=x * w,
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=0.04,
        clip_eps=0.2,
        loss_type=loss_type,
        max_tokens=4,
        normalizer=normalizer,
    ).backward()
    dist.all_reduce(w.grad)
    results.put((rank, (w.grad / world).tolist()))
    dist.destroy_process_group()


def run_ranks(target, world, *args):
    """`world` forked gloo ranks, each running target(rank, world, port, *args, results); {rank:
    what it put}."""
    import multiprocessing as mp

    from conftest import free_port

    ctx, port = mp.get_context("fork"), free_port()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(r, world, port, *args, results)) for r in range(world)
    ]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return out


def gradient_over_ranks(world, loss_type, normalize):
    g = torch.Generator().manual_seed(8)
    mask = torch.rand(7, 4, generator=g) > 0.3
    mask[:, 0] = True
    data = (
        -torch.rand(7, 4, generator=g, dtype=torch.float64) * 2,
        -torch.rand(7, 4, generator=g).double(),
        -torch.rand(7, 4, generator=g).double(),
        torch.randn(7, generator=g).double(),
        mask,
    )
    grads = run_ranks(_rank_gradient, world, data, loss_type, normalize)
    assert all(grads[r] == grads[0] for r in grads)  # the same averaged gradient on every rank
    return torch.tensor(grads[0])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_two_ranks_with_unequal_batches_give_the_gradient_of_one_rank_holding_all(loss_type):
    one = gradient_over_ranks(1, loss_type, normalize=True)
    two = gradient_over_ranks(2, loss_type, normalize=True)
    assert torch.allclose(one, two, atol=1e-12), (one, two)
    # each rank dividing by its own count
    own_counts = gradient_over_ranks(2, loss_type, normalize=False)
    assert not torch.allclose(one, own_counts, atol=1e-3)


def test_k3_is_zero_at_the_reference_and_positive_elsewhere():
    x = torch.linspace(-3, 0, 7)
    assert k3(x, x).abs().max() == 0
    assert (k3(x, x + 0.3) > 0).all() and (k3(x, x - 0.3) > 0).all()
    # empty row: no NaN
    assert masked_mean(torch.ones(2, 3), torch.zeros(2, 3)).tolist() == [0.0, 0.0]


# ------------------------------------------------------------------------- wire format and batching
def test_encode_decode_round_trip_is_exact():
    tensors = dict(
        input_ids=torch.randint(0, 100, (3, 7)),
        completion_mask=torch.rand(3, 4) > 0.5,
        advantages=torch.randn(3),
        pi_old_logps=torch.randn(3, 4),
    )
    meta = {"plen": 3, "temperature": 0.7, "note": "ünïcode"}
    back, back_meta = decode_batch(encode_batch(tensors, meta))
    assert back_meta == meta
    assert back.keys() == tensors.keys()
    for k in tensors:
        assert back[k].dtype == tensors[k].dtype and torch.equal(back[k], tensors[k])


def test_collate_aligns_groups_of_different_lengths():
    g1 = dict(
        input_ids=torch.tensor([[1, 2, 3, 10, 11], [1, 2, 3, 12, 13]]),
        completion_mask=torch.ones(2, 2, dtype=torch.bool),
        advantages=torch.tensor([1.0, -1.0]),
        scores=torch.tensor([3.0, 0.0]),
        ref_logps=torch.full((2, 2), -1.0),
        pi_old_logps=torch.full((2, 2), -2.0),
    )
    g2 = dict(
        input_ids=torch.tensor([[4, 20, 21, 22]]),
        completion_mask=torch.tensor([[True, True, False]]),
        advantages=torch.tensor([0.5]),
        scores=torch.tensor([2.0]),
        ref_logps=torch.full((1, 3), -3.0),
    )
    b = collate([(g1, {"plen": 3}), (g2, {"plen": 1})], pad_id=0)
    assert b.input_ids.tolist() == [
        [1, 2, 3, 10, 11, 0],
        [1, 2, 3, 12, 13, 0],
        [0, 0, 4, 20, 21, 22],
    ]
    # each answer attended up to its last trained token (wire.completion_attention): row 2's last
    # token trains nothing, and no earlier token attends it
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0]]
    assert b.mask.int().tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 0]]
    assert b.ref_logps[2].tolist() == [-3.0] * 3 and b.ref_logps[0].tolist() == [-1.0, -1.0, 0.0]
    # a group sent without pi_old_logps: on-policy (ratio 1)
    assert b.pi_old_rows.tolist() == [True, True, False]
    assert b.pi_old_logps[0].tolist()[:2] == [-2.0, -2.0]
    assert b.pi_old_logps[2].tolist() == [0.0] * 3
    assert b.extra.vllm_logps is None and b.extra.vllm_rows is None  # no row has them
    only_g2 = collate([(g2, {"plen": 1})], pad_id=0)
    assert only_g2.pi_old_logps is None and only_g2.pi_old_rows is None
    alone = collate([(g1, {"plen": 3})], pad_id=0)
    assert alone.pi_old_logps.tolist() == [[-2.0, -2.0], [-2.0, -2.0]]
    assert b.advantages.tolist() == [1.0, -1.0, 0.5]


# ----------------------------------------------------------------------------- curves
def test_plot_curves_draws_each_metric(tmp_path):
    import numpy as np
    from PIL import Image

    from features.curves import plot_curves

    path = tmp_path / "metrics.jsonl"
    path.write_text(
        json.dumps({"step": 0, "eval_reward_correct": 0.1, "eval_reward_format": 0.0})
        + "\n"
        + "".join(
            json.dumps(
                {
                    "step": s,
                    "reward": s / 10,
                    "reward_format": s / 20,
                    "reward_correct": 0.5,
                    "kl": s / 100,
                    "loss": 0.0,
                }
            )
            + "\n"
            for s in range(1, 11)
        )
        + json.dumps({"step": 10, "eval_reward_correct": 0.4, "eval_reward_format": 0.2})
        + "\n"
    )
    png, panels = plot_curves(str(path), ["reward_correct", "reward_format"])
    assert png == str(tmp_path / "curves.png")
    # the panels' titles, in order
    assert list(panels) == ["reward", "reward_correct", "reward_format", "kl"]
    # the series itself, drawn
    assert panels["reward"] == (list(range(1, 11)), [s / 10 for s in range(1, 11)])
    assert panels["kl"] == (list(range(1, 11)), [s / 100 for s in range(1, 11)])
    assert panels["reward_format"][1] == [s / 20 for s in range(1, 11)]
    with Image.open(png) as f:
        img = f.convert("L")
    assert img.size == (1600, 320)
    quarters = [img.crop((400 * i, 40, 400 * (i + 1), 280)) for i in range(4)]
    # a drawn line and axes in every panel
    assert all(len(np.unique(np.asarray(q))) > 10 for q in quarters)


def test_plot_curves_rejects_files_without_the_metrics(tmp_path):
    from features.curves import plot_curves

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "other.jsonl").write_text('{"step": 1, "loss": 0.1}\n')
    for name in ("empty.jsonl", "other.jsonl"):
        with pytest.raises(ValueError, match="need JSON lines with step, reward"):
            plot_curves(str(tmp_path / name), ["reward_correct"])


# ----------------------------------------------------------------------------- data
def test_arithmetic_task_is_seeded_and_in_gsm8k_format():
    a, b = make_arithmetic(50, 20, seed=3), make_arithmetic(50, 20, seed=3)
    assert a == b and a != make_arithmetic(50, 20, seed=4)
    for row in a:
        x, y = (int(v) for v in row["answer"].split("=")[0].split("+"))
        assert 1 <= x <= 20 and 1 <= y <= 20 and row["answer"].endswith(f"#### {x + y}")
        assert str(x) in row["question"] and str(y) in row["question"]


def test_held_out_questions_never_appear_in_training():
    # many repeats, as in the built-in task
    qs = [{"question": f"q{i % 30}", "gold": str(i)} for i in range(100)]
    train, held = split_held_out(qs, 10)
    assert held == qs[-10:]
    assert not {q["question"] for q in train} & {q["question"] for q in held}
    assert len(train) == 60  # held-out texts q0..q9 each appeared 3 times among the first 90
    with pytest.raises(ValueError, match="EVAL_SIZE=100"):
        split_held_out(qs, 100)


def _rank_weight_gap(rank, world, port, nudge, results):
    """One gloo rank of two holding a small model; rank 1's weights nudged by `nudge`; weight_gap's
    answer."""
    import torch.distributed as dist

    from features.run_log import weight_gap

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    # the same weights on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    if rank == 1:
        with torch.no_grad():
            model[1].bias[0] += nudge
    results.put((rank, weight_gap(model)))
    dist.destroy_process_group()


@pytest.mark.parametrize("nudge", [0.0, 1e-3, 0.5])
def test_weight_gap_shows_ranks_that_hold_different_weights(nudge):
    """max_weight_gap is 0 only when every rank holds rank 0's weights: a rank whose weights drifted
    by `nudge` in one parameter reports that difference (in float64, so even 1e-3 is read exactly
    enough)."""
    gaps = run_ranks(_rank_weight_gap, 2, nudge)
    assert gaps[0] == 0.0  # rank 0 against itself
    assert gaps[1] == pytest.approx(nudge, rel=1e-4, abs=1e-9)
