"""Fused GRPO loss in Triton: from the policy logits to the loss and back in one pass each way.

The PyTorch path (grpo_ref_split.grpo_loss and reduce_loss; tests/reference_loss.py with these
keywords) is the reference; this kernel computes the same value and gradient but reads each row
of logits once with an online logsumexp and fuses the ratio, clip, k3 KL and loss per token into
that program. Its backward recomputes the softmax from the saved per-row logsumexp and writes
d(logits) directly (into the logits' own storage with inplace_backward=True), so no (B, T, V)
fp32 buffer is ever made.

Used by the trainer when USE_TRITON = True (a GPU). On CPU it runs under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/test_triton.py   # set before this module is imported
"""

import os

# Triton 3.9 warns at every compile unless this is set; "1" keeps its current default (fused FMAs).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK_V = 1024  # vocabulary columns per inner-loop iteration (a multiple of 32; V need not be)


@triton.jit
def _grpo_fwd_kernel(
    logits_ptr,
    stride_lb,
    stride_lt,
    stride_lv,  # (B, T, V) any strides, fp32 or bf16
    ids_ptr,
    ref_ptr,
    pi_old_ptr,
    vllm_ptr,
    adv_ptr,
    weight_ptr,  # ids, ref, pi_old, vllm, weight: contiguous (B, T)
    pi_old_rows_ptr,
    vllm_rows_ptr,  # (B,) 1.0 where a row carries pi_old_logps / vllm_logps, 0.0 where not
    loss_ptr,
    logp_ptr,
    lse_ptr,
    dcoef_ptr,
    ent_ptr,  # outputs, contiguous fp32 (B, T); adv above is (B,)
    T,
    V,
    beta,
    clip_low,
    clip_high,
    inv_temperature,
    tis_cap,
    HAS_PI_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_TIS: tl.constexpr,
    TIS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64 before any stride product: B*T*V passes 2^31
    b = row // T
    t = row % T
    weight = tl.load(weight_ptr + row)
    if weight != 0.0:  # padding after the EOS costs nothing
        base = logits_ptr + b * stride_lb + t * stride_lt
        m = -float("inf")  # running max, a float from the start (the compiler rejects an int start)
        s = 0.0  # running sum of exp(x - m)
        sx = 0.0  # running sum of exp(x - m) * x: the entropy is lse - sx / s
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = (
                tl.load(base + cols * stride_lv, mask=cols < V, other=-float("inf")).to(tl.float32)
                * inv_temperature
            )
            m_new = tl.maximum(m, tl.max(x, 0))
            e = tl.exp(x - m_new)
            s = s * tl.exp(m - m_new) + tl.sum(e, 0)
            sx = sx * tl.exp(m - m_new) + tl.sum(
                e * tl.where(cols < V, x, 0.0), 0
            )  # 0 x -inf would be NaN
            m = m_new
        lse = m + tl.log(s)
        token = tl.load(ids_ptr + row)
        logp = tl.load(base + token * stride_lv).to(tl.float32) * inv_temperature - lse
        old = logp  # pi_old: the trainer's own log-prob where no pi_old_logps came (on-policy)
        if HAS_PI_OLD:  # a row without pi_old_logps is trained on-policy: ratio 1
            given = tl.load(pi_old_ptr + row)
            old = tl.where(tl.load(pi_old_rows_ptr + b) != 0.0, given, logp)
        ratio = tl.exp(logp - old)  # on-policy: exp(logp - logp.detach()), 1 with gradient logp's
        tis = (
            1.0 + 0.0 * logp
        )  # truncated importance weight min(pi_old / pi_vllm, cap), a constant
        if HAS_TIS:
            vllm = tl.load(vllm_ptr + row)
            sampled = tl.load(vllm_rows_ptr + b) != 0.0
            rho = tl.where(sampled, tl.exp(old - vllm), 1.0 + 0.0 * logp)
            if TIS_MASK:  # token_mask: 0 outside [1 / cap, cap], as objectives.mismatch_weights
                tis = tl.where((rho >= 1.0 / tis_cap) & (rho <= tis_cap), rho, 0.0)
            else:  # token_truncate
                tis = tl.minimum(rho, tis_cap)
        adv = tl.load(adv_ptr + b)
        unclipped = ratio * adv
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high) * adv
        if HAS_REF:
            d = tl.load(ref_ptr + row) - logp
        else:  # BETA = 0: no reference model, no KL term (d = 0 makes both KL terms exactly 0)
            d = 0.0 * logp
        kl = tl.exp(d) - d - 1.0
        loss = -(tis * tl.minimum(unclipped, clipped) - beta * kl)
        # d loss / d logp: the surrogate passes tis * ratio * A unless the clipped branch is the
        # smaller
        # one (then the clamp is flat there); the KL term adds beta * (1 - exp(d)).
        dsurr = tl.where(unclipped <= clipped, tis * unclipped, 0.0)
        tl.store(loss_ptr + row, loss)
        tl.store(logp_ptr + row, logp)
        tl.store(lse_ptr + row, lse)
        tl.store(dcoef_ptr + row, -dsurr + beta * (1.0 - tl.exp(d)))
        tl.store(ent_ptr + row, lse - sx / s)
    else:
        tl.store(ent_ptr + row, 0.0)
        tl.store(loss_ptr + row, 0.0)
        tl.store(logp_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        tl.store(dcoef_ptr + row, 0.0)


@triton.jit
def _grpo_bwd_kernel(
    logits_ptr,
    stride_lb,
    stride_lt,
    stride_lv,  # (B, T, V) as in forward
    grad_ptr,
    stride_gb,
    stride_gt,
    stride_gv,  # (B, T, V) output; may be the logits' own storage
    ids_ptr,
    lse_ptr,
    dlogp_ptr,  # contiguous (B, T)
    T,
    V,
    inv_temperature,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    base = logits_ptr + b * stride_lb + t * stride_lt
    gbase = grad_ptr + b * stride_gb + t * stride_gt
    dlogp = tl.load(dlogp_ptr + row)
    if dlogp != 0.0:
        lse = tl.load(lse_ptr + row)
        token = tl.load(ids_ptr + row)
        scale = dlogp * inv_temperature
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = (
                tl.load(base + cols * stride_lv, mask=cols < V, other=0.0).to(tl.float32)
                * inv_temperature
            )
            p = tl.exp(x - lse)  # softmax, recomputed: nothing of size V was saved
            g = (tl.where(cols == token, 1.0, 0.0) - p) * scale
            tl.store(gbase + cols * stride_gv, g.to(grad_ptr.dtype.element_ty), mask=cols < V)
    else:  # masked row: exact zeros (its lse is 0, and exp(x - 0) * 0 could be inf * 0 = NaN)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(
                gbase + cols * stride_gv,
                tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty),
                mask=cols < V,
            )


class _GRPOLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, ref_logps, pi_old_logps, advantages, mask, beta, clip_eps,
                clip_eps_high, loss_type, max_tokens, temperature, inplace, normalizer,
                vllm_logps, tis_cap, tis_mode, pi_old_rows, vllm_rows):
        B, T, V = logits.shape
        mask = mask.float()  # (B, T)
        if (
            loss_type == "dapo"
        ):  # (B, T) each token's share of the loss, as in grpo_ref_split.grpo_loss
            weight = mask / (mask.sum().clamp(min=1) if normalizer is None else normalizer)
        elif loss_type == "dr_grpo":  # every token the same, / (completions x max_tokens)
            weight = mask / ((B if normalizer is None else normalizer) * max_tokens)
        else:
            weight = (
                mask
                / mask.sum(-1, keepdim=True).clamp(min=1)
                / (B if normalizer is None else normalizer)
            )
        ids = ids.contiguous()  # (B, T)
        ref = (
            mask if ref_logps is None else ref_logps.float().contiguous()
        )  # (B, T) unread when None
        pi_old = (
            ref if pi_old_logps is None else pi_old_logps.float().contiguous()
        )  # (B, T) unread when None
        has_tis = vllm_logps is not None and tis_cap > 0
        vllm = vllm_logps.float().contiguous() if has_tis else ref  # (B, T) unread without TIS
        every = torch.ones(
            B, dtype=torch.float32, device=logits.device
        )  # (B,) no marks given: every row carries them
        pi_old_rows = every if pi_old_rows is None else pi_old_rows.float().contiguous()  # (B,)
        vllm_rows = every if vllm_rows is None else vllm_rows.float().contiguous()  # (B,)
        loss_tok, logp, lse, dcoef, entropy = (
            torch.empty(B, T, dtype=torch.float32, device=logits.device) for _ in range(5)
        )
        _grpo_fwd_kernel[(B * T,)](
            logits,
            *logits.stride(),
            ids,
            ref,
            pi_old,
            vllm,
            advantages.float().contiguous(),
            weight.contiguous(),
            pi_old_rows,
            vllm_rows,
            loss_tok,
            logp,
            lse,
            dcoef,
            entropy,
            T,
            V,
            float(beta),
            float(clip_eps),
            float(clip_eps_high),
            1.0 / float(temperature),
            float(tis_cap),
            HAS_PI_OLD=pi_old_logps is not None,
            HAS_REF=ref_logps is not None,
            HAS_TIS=has_tis,
            TIS_MASK=tis_mode == "token_mask",
            BLOCK=BLOCK_V,
        )
        ctx.save_for_backward(logits, ids, lse, dcoef * weight)
        ctx.inv_temperature = 1.0 / float(temperature)
        ctx.inplace = inplace
        ctx.mark_non_differentiable(logp, entropy)
        return (loss_tok * weight).sum(), logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        logits, ids, lse, dcoef = ctx.saved_tensors
        B, T, V = logits.shape
        dlogp = (dcoef * grad_loss).contiguous()  # (B, T)
        grad = logits if ctx.inplace else torch.empty_like(logits)  # (B, T, V)
        _grpo_bwd_kernel[(B * T,)](
            logits,
            *logits.stride(),
            grad,
            *grad.stride(),
            ids,
            lse,
            dlogp,
            T,
            V,
            ctx.inv_temperature,
            BLOCK=BLOCK_V,
        )
        return grad, *[None] * 18


LOSS_TYPES = ("grpo", "dapo", "dr_grpo")  # grpo_ref_split's LOSS_TYPE: all three
TIS_MODES = (
    "token_truncate",
    "token_mask",
)  # of its TIS_MODE: the per-token ones; a sequence's ratio needs a 2nd pass


def grpo_loss_triton(
    *,
    logits,
    completion_ids,
    ref_logps,
    pi_old_logps,
    advantages,
    mask,
    beta,
    clip_eps,
    clip_eps_high=None,
    loss_type="grpo",
    max_tokens=1,
    temperature=1.0,
    return_logps=False,
    return_entropy=False,
    inplace_backward=False,
    normalizer=None,
    pi_old_rows=None,
    vllm_logps=None,
    vllm_rows=None,
    tis_cap=0.0,
    tis_mode="token_truncate",
):
    """The GRPO loss of grpo_ref_split.grpo_loss, computed from logits (B, T, V) in one kernel; the
    same keywords.

    logits[:, t] predicts completion_ids[:, t] (a strided view such as full[:, plen-1:-1] is read in
    place, never copied); ref_logps, pi_old_logps, mask (B, T); advantages (B,); pi_old_logps=None,
    or a row outside pi_old_rows (B,) bool, means ratio = 1 (on-policy); ref_logps=None (only with
    beta=0)
    drops the KL term. vllm_logps count on the rows in vllm_rows (None: every row).
    return_logps=True also returns the per-token log-probs (B, T), detached, for logging KL and clip
    fraction; return_entropy=True also the (B, T) entropy of each token's distribution (0 on masked
    ones), from the same pass. inplace_backward=True writes d(logits) over the logits: saves a (B,
    T, V) buffer, and the caller must not read those logits afterwards. tis_mode: token_truncate or
    token_mask; sequence_* raise.
    """
    if logits.dim() != 3 or logits.shape[:2] != completion_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match "
            f"completion_ids {tuple(completion_ids.shape)}"
        )
    if ref_logps is None and beta != 0:
        raise ValueError("ref_logps=None needs beta=0 (the KL term needs reference log-probs)")
    if loss_type not in LOSS_TYPES or tis_mode not in TIS_MODES or not max_tokens:
        raise ValueError(
            f"grpo_loss_triton supports loss_type in {LOSS_TYPES} (got {loss_type!r}), tis_mode in "
            f"{TIS_MODES} (got {tis_mode!r}; sequence modes need a completion's tokens before "
            f"any token's gradient: use the PyTorch loss) and max_tokens >= 1 (got {max_tokens})"
        )
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    loss, logps, entropy = _GRPOLoss.apply(logits, completion_ids, ref_logps, pi_old_logps,
                                           advantages, mask, beta, clip_eps, clip_eps_high,
                                           loss_type,
                                           max_tokens, temperature, inplace_backward, normalizer,
                                           vllm_logps, tis_cap, tis_mode, pi_old_rows, vllm_rows)
    extra = ([logps] if return_logps else []) + ([entropy] if return_entropy else [])
    return (loss, *extra) if extra else loss


def batch_loss(engine, batch, *, temperature, beta, clip_eps, clip_eps_high, loss_type,
                max_tokens):
    """The trainer's USE_TRITON step 6 of a Batch (grpo_ref_split.py), from its completion logits in
    one fused pass: (loss, logps, entropy, pi_old, metrics only this path adds), the (B, T) tensors
    detached, for the step's metrics. d(logits) is written over the logits, which nothing reads
    afterwards. The keywords are the trainer's constants of the same names; SHARED_PREFIX and
    USE_VLLM (features/), TIS_CAP and TIS_MODE (objectives.py) are read from their modules. pi_old
    and vLLM's weights for the metrics follow the kernel's own rule, in PyTorch."""
    import objectives
    from features import fast_paths, run_log, vllm_engine

    T = batch.mask.shape[1]
    logits = fast_paths.completion_logits(engine, batch.input_ids, batch.attention_mask, T,
                                          fast_paths.SHARED_PREFIX,
                                          padding_free=fast_paths.packing.PADDING_FREE)  # (B, T, V)
    loss, logps, entropy = grpo_loss_triton(
        logits=logits, completion_ids=batch.input_ids[:, -T:], temperature=temperature,
        return_logps=True, return_entropy=True, inplace_backward=True, ref_logps=batch.ref_logps,
        pi_old_logps=batch.pi_old_logps, pi_old_rows=batch.pi_old_rows,
        advantages=batch.advantages, mask=batch.mask, normalizer=batch.normalizer,
        vllm_logps=batch.extra.vllm_logps, vllm_rows=batch.extra.vllm_rows, beta=beta,
        clip_eps=clip_eps, clip_eps_high=clip_eps_high, loss_type=loss_type, max_tokens=max_tokens,
        tis_cap=objectives.TIS_CAP, tis_mode=objectives.TIS_MODE)  # logps (B, T) detached
    mask = batch.mask.bool()  # (B, T)
    old = logps  # (B, T) pi_old: the current weights' own (ratio 1), but where pi_old_logps given
    if batch.pi_old_logps is not None:
        given = mask if batch.pi_old_rows is None else mask & batch.pi_old_rows[:, None]  # (B, T)
        old = torch.where(given, batch.pi_old_logps, logps)  # (B, T)
    extra = {}  # vLLM's gap and masked share
    if vllm_engine.USE_VLLM:
        weights = None  # (B, T) vLLM's mismatch pi_old / pi_vllm (TIS_MODE), as the kernel weighs
        if batch.extra.vllm_logps is not None and objectives.TIS_CAP:
            weights = objectives.mismatch_weights(old, batch.extra.vllm_logps,
                                                  batch.extra.vllm_rows, mask,
                                                  mode=objectives.TIS_MODE,
                                                  cap=objectives.TIS_CAP)
        extra = run_log.vllm_metrics(batch, pi_old_logps=old, weights=weights)
    return loss, logps, entropy, old, extra
