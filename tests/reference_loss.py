"""The PyTorch loss of a batch with grpo_loss_triton's keywords, composed from the lesson's math as
policy_loss composes it: pi_old (pi_old_everywhere), vLLM's mismatch weights (objectives.py), the
per-token loss (the lesson's grpo_loss; with weights or GSPO objectives.variant_token_loss, which
is grpo_loss with them), reduce_loss. The Triton tests and benches compare the kernel with it; the
loss tests call it with hand values.

    python -m pytest tests/test_triton.py        # TRITON_INTERPRET=1 is set there on CPU
"""
from grpo_ref_split import grpo_loss, pi_old_everywhere, reduce_loss, reference_kl
from objectives import TIS_MODES, mismatch_weights, variant_token_loss


def torch_loss(*, logps, ref_logps, pi_old_logps, advantages, mask, beta, clip_eps,
               clip_eps_high=None, loss_type="grpo", max_tokens=1, normalizer=None,
               pi_old_rows=None, vllm_logps=None, vllm_rows=None, tis_cap=0.0,
               tis_mode="token_truncate", gspo=False):
    """The scalar loss: the keywords of grpo_loss_triton (and of the trainer's loss before it was
    split)."""
    if tis_mode not in TIS_MODES:
        raise ValueError(f"loss_type and tis_mode: tis_mode {tis_mode!r} is not one of {TIS_MODES}")
    mask = mask.bool()  # (B, T)
    old = pi_old_everywhere(logps, pi_old_logps, pi_old_rows, mask)  # (B, T)
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    loss = dict(logps=logps, pi_old_logps=old, advantages=advantages, mask=mask, beta=beta,
                clip_eps=clip_eps, clip_eps_high=clip_eps_high)
    weights = None
    if vllm_logps is not None and tis_cap > 0:
        weights = mismatch_weights(old, vllm_logps, vllm_rows, mask, mode=tis_mode, cap=tis_cap)
    if weights is None and not gspo:  # the lesson's own
        per_token = grpo_loss(ref_logps=ref_logps, **loss)  # (B, T)
    else:
        per_token = variant_token_loss(kl=reference_kl(ref_logps, logps, mask), weights=weights,
                                       gspo=gspo, **loss)  # (B, T)
    return reduce_loss(
        per_token, mask, loss_type=loss_type, normalizer=normalizer, max_tokens=max_tokens
    )
