"""The fused Triton GRPO loss against the PyTorch path, under Triton's CPU interpreter, plus an
ahead-of-time compile for Hopper (sm_90) that catches the type errors the interpreter skips."""
import os
import subprocess
import sys
import textwrap

import torch

# on a GPU these tests run the compiled kernels
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before the kernel module is imported

import pytest  # noqa: E402

from conftest import ROOT  # noqa: E402
from grpo_loss_triton import BLOCK_V, grpo_loss_triton  # noqa: E402
from reference_loss import torch_loss  # noqa: E402
from features.fast_paths import chunked_logps  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error")


def case(B, T, V, dtype=torch.float32, seed=0, scale=3.0):
    """Logits as a strided view of a bigger tensor (as the trainer slices them), and data that puts
    tokens in every clip case: ratio above and below the band, with positive and negative A."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(B, T + 3, V, generator=g) * scale).to(DEVICE, dtype).requires_grad_()
    logits = full[:, 2:-1]  # (B, T, V) non-contiguous
    ids = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    with torch.no_grad():
        lp = chunked_logps(logits, ids, 1.0, chunk=128)
    gen = lp + torch.randn(B, T, generator=g).to(DEVICE) * 0.5
    ref = lp + torch.randn(B, T, generator=g).to(DEVICE) * 0.3
    adv = torch.randn(B, generator=g).to(DEVICE) * 2
    adv[0], adv[-1] = 1.5, -1.5
    mask = (torch.rand(B, T, generator=g) > 0.25).to(DEVICE)
    mask[:, 0] = True
    return full, logits, ids, ref, gen, adv, mask


def both(full, logits, ids, ref, gen, adv, mask, temperature, beta=0.04, eps=0.2, **kw):
    args = dict(
        ref_logps=ref, pi_old_logps=gen, advantages=adv, mask=mask, beta=beta, clip_eps=eps, **kw
    )
    loss_t, logps_t = grpo_loss_triton(
        logits=logits, completion_ids=ids, temperature=temperature, return_logps=True, **args
    )
    (grad_t,) = torch.autograd.grad(loss_t, full)
    logps = chunked_logps(logits, ids, temperature, chunk=128)
    loss_p = torch_loss(logps=logps, **args)
    (grad_p,) = torch.autograd.grad(loss_p, full)
    return (loss_t, logps_t, grad_t), (loss_p, logps.detach(), grad_p)


def padded_case():
    """Padding whose token is nearly impossible (logp about -100) against ref and gen logps of 0
    there: exp overflows to inf, and inf x 0 = NaN if the loss multiplies by the mask instead of
    selecting."""
    full, logits, ids, ref, gen, adv, mask = case(2, 5, 37, seed=7)
    mask[1, 3:] = False
    with torch.no_grad():
        full[1, 2 + 3 :, :] = 0.0
        full[1, 2 + 3 :, 0] = 100.0  # every padded position predicts token 0 ...
        ids[1, 3:] = 1  # ... and the padding token is 1: logp ~ -100
    ref, gen = ref.clone(), gen.clone()
    ref[1, 3:], gen[1, 3:] = 0.0, 0.0
    return full, logits, ids, ref, gen, adv, mask


def test_rows_without_pi_old_logps_train_on_policy_like_the_pytorch_path():
    """A batch that mixes this rank's own groups (no pi_old_logps: row 0 outside pi_old_rows, its
    values
    junk that must not count) with older ones."""
    full, logits, ids, ref, gen, adv, mask = case(3, 5, 300, seed=21)
    gen = gen.clone()
    gen[0] = 1e3
    rows = torch.tensor([False, True, True], device=DEVICE)
    (lt, _, gt), (lp, _, gp) = both(full, logits, ids, ref, gen, adv, mask, 0.7, pi_old_rows=rows)
    assert torch.isfinite(lt) and torch.isfinite(gt).all()
    assert abs(lt.item() - lp.item()) <= 1e-5 * max(1.0, abs(lp.item())) and torch.allclose(
        gt, gp, atol=1e-5
    )


def test_padding_with_a_very_negative_log_prob_gives_a_finite_loss_and_gradient():
    full, logits, ids, ref, gen, adv, mask = padded_case()
    assert chunked_logps(logits, ids, 1.0, chunk=128).detach()[1, 3:].max() < -90
    (lt, _, gt), (lp, _, gp) = both(full, logits, ids, ref, gen, adv, mask, 1.0)
    assert (
        torch.isfinite(lt)
        and torch.isfinite(lp)
        and torch.isfinite(gt).all()
        and torch.isfinite(gp).all()
    )
    assert abs(lt.item() - lp.item()) <= 1e-5 * max(1.0, abs(lp.item())) and torch.allclose(
        gt, gp, atol=1e-5
    )
    assert gp[1, 2 + 3 : -1].abs().max() == 0  # padding passes no gradient


@pytest.mark.parametrize(
    "B, T, V", [(2, 3, 37), (3, 5, 2500), (2, 4, BLOCK_V), (1, 6, 2 * BLOCK_V + 1)]
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_gen", [True, False])
def test_fp32_value_and_gradient_equal_the_pytorch_path(B, T, V, temperature, with_gen):
    full, logits, ids, ref, gen, adv, mask = case(B, T, V, seed=V + B)
    gen = gen if with_gen else None
    (lt, lpt, gt), (lp, lpp, gp) = both(full, logits, ids, ref, gen, adv, mask, temperature)
    assert abs(lt.item() - lp.item()) <= 1e-5 * max(1.0, abs(lp.item()))
    assert torch.allclose(lpt[mask], lpp[mask], atol=1e-5)
    assert torch.allclose(gt, gp, atol=1e-5, rtol=1e-5)
    assert gt[:, :2].abs().max() == 0 and gt[:, -1].abs().max() == 0  # outside the view: untouched


def test_all_four_clip_cases_occur_and_match():
    full, logits, ids, ref, gen, adv, mask = case(4, 16, 300, seed=11)
    ratio = torch.exp(chunked_logps(logits, ids, chunk=128).detach() - gen)
    pos, neg = (adv > 0)[:, None], (adv < 0)[:, None]
    for region in (
        (ratio > 1.2) & pos,
        (ratio > 1.2) & neg,
        (ratio < 0.8) & pos,
        (ratio < 0.8) & neg,
    ):
        assert (region & mask).any()
    (lt, _, gt), (lp, _, gp) = both(full, logits, ids, ref, gen, adv, mask, 1.0)
    assert torch.allclose(gt, gp, atol=1e-5, rtol=1e-5) and abs(lt.item() - lp.item()) < 1e-5


def test_bf16_logits():
    full, logits, ids, ref, gen, adv, mask = case(2, 5, 1500, dtype=torch.bfloat16, seed=3)
    (lt, lpt, gt), (lp, lpp, gp) = both(full, logits, ids, ref, gen, adv, mask, 0.7)
    assert gt.dtype == torch.bfloat16
    assert abs(lt.item() - lp.item()) < 1e-5  # both read the same bf16 values into fp32
    assert torch.allclose(lpt[mask], lpp[mask], atol=1e-5)
    # bf16 rounding of the stored gradient
    assert torch.allclose(gt.float(), gp.float(), atol=1e-4, rtol=1e-2)


def test_masked_rows_get_exact_zero_gradient_even_with_huge_logits():
    full, logits, ids, ref, gen, adv, mask = case(2, 4, 600, seed=5)
    mask[1, 2:] = False
    with torch.no_grad():
        # a skipped row's stored lse is 0: exp(1e4 - 0) would be inf, inf * 0 = NaN
        full[1, 2 + 2 :] = 1e4
    loss, _ = grpo_loss_triton(
        logits=logits,
        completion_ids=ids,
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=0.04,
        clip_eps=0.2,
        return_logps=True,
    )
    (g,) = torch.autograd.grad(loss, full)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert (g[1, 4:5] == 0).all() and (g[1, 2 + 2 : -1] == 0).all()
    assert g[0].abs().sum() > 0


def test_inplace_backward_writes_the_gradient_over_the_logits():
    full, logits, ids, ref, gen, adv, mask = case(2, 5, 700, seed=7)
    (_, _, want), _ = both(full, logits, ids, ref, gen, adv, mask, 1.0)
    # its own storage, to watch it being overwritten
    leaf = full.detach().clone()[:, 2:-1].requires_grad_()
    loss = grpo_loss_triton(
        logits=leaf,
        completion_ids=ids,
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=0.04,
        clip_eps=0.2,
        inplace_backward=True,
    )
    loss.backward()
    assert torch.allclose(leaf.grad, want[:, 2:-1], atol=1e-5)
    # The kernel wrote d(logits) into the logits' own storage (no (B, T, V) buffer of its own):
    assert torch.allclose(leaf.detach(), want[:, 2:-1], atol=1e-5)


@pytest.mark.parametrize(
    "clip_eps_high, loss_type, with_ref, normalizer",
    [
        (0.6, "grpo", True, None),
        (0.2, "dapo", True, None),
        (0.6, "dapo", False, None),
        (0.2, "grpo", True, 5.5),
        (0.2, "dapo", True, 17.0),
        (0.2, "dr_grpo", True, None),
        (0.2, "dr_grpo", True, 5.5),
    ],
)
def test_variants_equal_the_pytorch_path(clip_eps_high, loss_type, with_ref, normalizer):
    full, logits, ids, ref, gen, adv, mask = case(3, 7, 1100, seed=13)
    beta = 0.04 if with_ref else 0.0
    ref = ref if with_ref else None
    kw = dict(clip_eps_high=clip_eps_high, loss_type=loss_type, normalizer=normalizer, max_tokens=9)
    lt = grpo_loss_triton(
        logits=logits,
        completion_ids=ids,
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=beta,
        clip_eps=0.2,
        temperature=1.0,
        **kw,
    )
    (gt,) = torch.autograd.grad(lt, full)
    lp = torch_loss(
        logps=chunked_logps(logits, ids, 1.0, chunk=128),
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=beta,
        clip_eps=0.2,
        **kw,
    )
    (gp,) = torch.autograd.grad(lp, full)
    assert abs(lt.item() - lp.item()) < 1e-5 and torch.allclose(gt, gp, atol=1e-5, rtol=1e-5)
    plain = torch_loss(
        logps=chunked_logps(logits, ids, 1.0, chunk=128),
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=beta,
        clip_eps=0.2,
    )
    assert abs(plain.item() - lp.item()) > 1e-4  # the variant changed the loss


@pytest.mark.parametrize(
    "with_gen, tis_mode",
    [
        (True, "token_truncate"),
        (False, "token_truncate"),
        (True, "token_mask"),
        (False, "token_mask"),
    ],
)
def test_truncated_importance_sampling_equals_the_pytorch_path(with_gen, tis_mode):
    """vLLM's own log-probs (vllm_logps) weight each token's surrogate by min(pi_old /
    pi_sampler, cap), or (token_mask) by the ratio inside [1 / cap, cap] and 0 outside; a row
    outside vllm_rows (sampled by the trainer; its values junk) weighs 1. Some weights are cut at
    the cap or masked."""
    full, logits, ids, ref, gen, adv, mask = case(3, 6, 900, seed=5)
    gen = gen if with_gen else None
    with torch.no_grad():
        noise = torch.randn(3, 6, generator=torch.Generator().manual_seed(1)).to(DEVICE)  # (3, 6)
        sampler = chunked_logps(logits, ids, 0.7, chunk=128) + noise
    sampler[2] = -50.0
    kw = dict(
        vllm_logps=sampler,
        vllm_rows=torch.tensor([True, True, False], device=DEVICE),
        tis_cap=1.5,
        tis_mode=tis_mode,
    )
    lt = grpo_loss_triton(
        logits=logits,
        completion_ids=ids,
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=0.04,
        clip_eps=0.2,
        temperature=0.7,
        **kw,
    )
    (gt,) = torch.autograd.grad(lt, full)
    lp = torch_loss(
        logps=chunked_logps(logits, ids, 0.7, chunk=128),
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=0.04,
        clip_eps=0.2,
        **kw,
    )
    (gp,) = torch.autograd.grad(lp, full)
    assert abs(lt.item() - lp.item()) < 1e-5 and torch.allclose(gt, gp, atol=1e-5, rtol=1e-5)
    plain = torch_loss(
        logps=chunked_logps(logits, ids, 0.7, chunk=128),
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=0.04,
        clip_eps=0.2,
    )
    assert abs(plain.item() - lp.item()) > 1e-4  # the weights changed the loss


def test_sequence_mismatch_modes_are_refused_and_entropy_equals_the_pytorch_path():
    full, logits, ids, ref, gen, adv, mask = case(2, 5, 700, seed=9)
    kw = dict(
        logits=logits,
        completion_ids=ids,
        ref_logps=ref,
        pi_old_logps=gen,
        advantages=adv,
        mask=mask,
        beta=0.04,
        clip_eps=0.2,
        temperature=0.7,
    )
    for mode in ("sequence_truncate", "sequence_mask"):
        with pytest.raises(ValueError, match="sequence modes need a completion's tokens"):
            grpo_loss_triton(vllm_logps=ref, tis_cap=2.0, tis_mode=mode, **kw)
    loss, logps, entropy = grpo_loss_triton(return_logps=True, return_entropy=True, **kw)
    want_logps, want = chunked_logps(logits.detach(), ids, 0.7, chunk=0, with_entropy=True)
    assert torch.allclose(entropy[mask], want[mask], atol=1e-4) and (entropy[~mask] == 0).all()
    assert torch.allclose(logps[mask], want_logps[mask], atol=1e-5)
    assert grpo_loss_triton(return_entropy=True, **kw)[1].shape == (2, 5)  # (loss, entropy) alone


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="do not match"):
        grpo_loss_triton(
            logits=torch.zeros(2, 3, 5),
            completion_ids=torch.zeros(2, 4, dtype=torch.long),
            ref_logps=None,
            pi_old_logps=None,
            advantages=None,
            mask=None,
            beta=0.0,
            clip_eps=0.2,
        )


AOT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import warnings
    warnings.simplefilter("error")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import grpo_loss_triton as K

    target = GPUTarget("cuda", 90, 32)  # Hopper: what the real compiler checks, no GPU needed
    for dt in ("fp32", "bf16"):
        common = dict(logits_ptr="*" + dt, stride_lb="i64", stride_lt="i64", stride_lv="i64",
                      ids_ptr="*i64")
        fwd = dict(common, ref_ptr="*fp32", pi_old_ptr="*fp32", vllm_ptr="*fp32", adv_ptr="*fp32",
                   weight_ptr="*fp32", pi_old_rows_ptr="*fp32", vllm_rows_ptr="*fp32",
                   loss_ptr="*fp32", logp_ptr="*fp32", lse_ptr="*fp32", dcoef_ptr="*fp32",
                   ent_ptr="*fp32", T="i32", V="i32", beta="fp32", clip_low="fp32",
                   clip_high="fp32", inv_temperature="fp32",
                   tis_cap="fp32", HAS_PI_OLD="constexpr", HAS_REF="constexpr", HAS_TIS="constexpr",
                   TIS_MASK="constexpr", BLOCK="constexpr")
        for has_pi_old, has_ref, has_tis, tis_mask in ((True, True, False, False),
                                                    (False, True, True, False),
                                                    (True, False, True, True)):
            consts = {{"HAS_PI_OLD": has_pi_old, "HAS_REF": has_ref, "HAS_TIS": has_tis,
                       "TIS_MASK": tis_mask, "BLOCK": K.BLOCK_V}}
            k = triton.compile(ASTSource(K._grpo_fwd_kernel, fwd, consts), target=target)
            assert "cubin" in k.asm and k.asm["cubin"], "no cubin"
        bwd = dict(common, grad_ptr="*" + dt, stride_gb="i64", stride_gt="i64", stride_gv="i64",
                   ids_ptr="*i64", lse_ptr="*fp32", dlogp_ptr="*fp32", T="i32", V="i32",
                   inv_temperature="fp32", BLOCK="constexpr")
        source = ASTSource(K._grpo_bwd_kernel, bwd, {{"BLOCK": K.BLOCK_V}})
        k = triton.compile(source, target=target)
        assert k.asm["cubin"]
    print("compiled 8 kernels for sm_90")
""")


def test_kernels_compile_ahead_of_time_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", AOT.format(root=ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiled 8 kernels for sm_90" in run.stdout


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_tool_tokens_masked_out_equal_the_same_batch_with_them_removed(loss_type):
    """TOOLS: the toolkit's <result> tokens are masked out of the kernel's loss; it must equal the
    loss of the batch with those columns removed by hand (value, and the gradient of every token the
    model wrote)."""
    full, logits, ids, ref, gen, adv, _ = case(2, 7, 300, seed=5)
    tool = torch.zeros(2, 7, dtype=torch.bool, device=DEVICE)
    tool[0, 2:4], tool[1, 1:2] = True, True  # a result inside each answer
    keep = ~tool
    args = dict(advantages=adv, beta=0.04, clip_eps=0.2, loss_type=loss_type, max_tokens=7)
    loss = grpo_loss_triton(
        logits=logits,
        completion_ids=ids,
        temperature=0.7,
        ref_logps=ref,
        pi_old_logps=gen,
        mask=keep,
        **args,
    )
    (grad,) = torch.autograd.grad(loss, full)
    # the model's positions, 5 and 6 of them
    cols = [keep[i].nonzero().squeeze(1) for i in range(2)]
    short = torch.zeros(2, 6, 300, device=DEVICE).requires_grad_()
    with torch.no_grad():
        short_logits = torch.stack(
            [torch.cat([logits[i, c], logits[i, : 6 - len(c)]]) for i, c in enumerate(cols)]
        )
    short_ids = torch.stack(
        [torch.cat([ids[i, c], ids[i, : 6 - len(c)]]) for i, c in enumerate(cols)]
    )
    pick = lambda x: torch.stack(
        [torch.cat([x[i, c], x[i, : 6 - len(c)]]) for i, c in enumerate(cols)]
    )  # noqa: E731
    short_mask = (
        torch.arange(6, device=DEVICE)[None, :]
        < torch.tensor([len(c) for c in cols], device=DEVICE)[:, None]
    )
    loss_short = grpo_loss_triton(
        logits=short + short_logits,
        completion_ids=short_ids,
        temperature=0.7,
        ref_logps=pick(ref),
        pi_old_logps=pick(gen),
        mask=short_mask,
        **args,
    )
    (grad_short,) = torch.autograd.grad(loss_short, short)
    assert abs(loss.item() - loss_short.item()) < 1e-6
    for i, c in enumerate(cols):
        assert torch.allclose(grad[i, 2:-1][c], grad_short[i, : len(c)], atol=1e-6)
        assert grad[i, 2:-1][tool[i]].abs().max() == 0  # nothing flows into the toolkit's tokens
