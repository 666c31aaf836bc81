"""The PyTorch loss of a batch with grpo_loss_triton's keywords, composed from grpo_ref_split's math
as policy_loss composes it: pi_old (old_logps), vLLM's mismatch weights, the per-token grpo_loss,
reduce_loss. The Triton tests and benches compare the kernel with it; the loss tests call it with
hand values.

    python -m pytest tests/test_triton.py        # TRITON_INTERPRET=1 is set there on CPU
"""
from features.vllm_engine import TIS_MODES, mismatch_weights
from grpo_ref_split import grpo_loss, pi_old_logps, reduce_loss


def torch_loss(*, logps, ref_logps, gen_logps, advantages, mask, beta, clip_eps, clip_eps_high=None,
               loss_type="grpo", max_tokens=1, normalizer=None, gen_rows=None, sampler_logps=None,
               sampler_rows=None, tis_cap=0.0, tis_mode="token_truncate", gspo=False):
    """The scalar loss: the keywords of grpo_loss_triton (and of the trainer's loss before it was
    split)."""
    if tis_mode not in TIS_MODES:
        raise ValueError(f"loss_type and tis_mode: tis_mode {tis_mode!r} is not one of {TIS_MODES}")
    mask = mask.bool()  # (B, T)
    old = pi_old_logps(logps, gen_logps, gen_rows, mask)  # (B, T)
    weights = None
    if sampler_logps is not None and tis_cap > 0:
        weights = mismatch_weights(
            old, sampler_logps, sampler_rows, mask, mode=tis_mode, cap=tis_cap
        )
    per_token = grpo_loss(
        logps=logps,
        old_logps=old,
        ref_logps=ref_logps,
        advantages=advantages,
        mask=mask,
        beta=beta,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps if clip_eps_high is None else clip_eps_high,
        weights=weights,
        gspo=gspo,
    )  # (B, T)
    return reduce_loss(
        per_token, mask, loss_type=loss_type, normalizer=normalizer, max_tokens=max_tokens
    )
