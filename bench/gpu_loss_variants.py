"""Every loss variant of the trainer's step 6 (policy_loss) on a GPU: the objectives, the
aggregations, GSPO, the high-entropy mask, the teacher's terms (sampled, discounted, matched,
top-k, on the wrong answers only), DeepSeek-V3.2's corrections, vLLM's mismatch weights and the
fused Triton loss. Each runs on one batch of a tiny random Llama three ways: fp32 on the CPU (the
reference), fp32 on the GPU, and bf16 on the GPU. It prints the loss and the gradient's relative
L2 gap to the reference. What a CPU cannot show: a tensor left on the wrong device, a kernel that
compiles only for a real GPU, a variant that loses precision in bf16. Without a GPU it compares
bf16 with fp32 on the CPU.

    python bench/gpu_loss_variants.py          # bench/gpu_checks.sh part6 on a lent GPU
"""
import sys
from dataclasses import replace

import torch
import transformers

sys.path.insert(0, ".")
import grpo_ref_split as grpo  # noqa: E402
from features import fast_paths, teacher_mix, vllm_engine  # noqa: E402
from features.variant_fields import BatchExtras  # noqa: E402

VOCAB = 49152  # SmolLM2's vocabulary: the logits' width the fused loss tiles
ANSWERS = 8  # rows of the batch: two groups of four
PROMPT = 6  # prompt tokens of each row
ANSWER = 10  # answer tokens of each row, some of them padding
TOP_K = 4  # the teacher's likeliest tokens for DISTILL_TOP_K

# name: the settings it changes, each at the home module that holds it
VARIANTS = {
    "clip (default)": {},
    "cispo": {"OBJECTIVE": "cispo"},
    "sapo": {"OBJECTIVE": "sapo"},
    "gmpo": {"OBJECTIVE": "gmpo"},
    "dapo tokens": {"LOSS_TYPE": "dapo"},
    "dr_grpo": {"LOSS_TYPE": "dr_grpo"},
    "gspo": {"GSPO": True, "CLIP_EPS": 3e-4, "CLIP_EPS_HIGH": 4e-4},
    "top entropy 0.2": {"TOP_ENTROPY_QUANTILE": 0.2},
    "kl bias + delta": {"KL_BIAS_CORRECTION": True, "OFF_POLICY_DELTA": 0.05},
    "tis token_mask": {"TIS_MODE": "token_mask"},
    "teacher": {"DISTILL_COEF": 1.0, "BETA": 0.0},
    "teacher discount": {"DISTILL_COEF": 1.0, "BETA": 0.0, "DISTILL_DISCOUNT": 0.9},
    "teacher matched": {"DISTILL_COEF": 1.0, "BETA": 0.0, "DISTILL_SCALE": "matched"},
    "teacher below 2": {"DISTILL_COEF": 1.0, "BETA": 0.0, "DISTILL_BELOW": 2.0},
    "teacher top-k": {"DISTILL_COEF": 1.0, "BETA": 0.0, "DISTILL_TOP_K": TOP_K},
    "triton": {"USE_TRITON": True},
    "triton dapo": {"USE_TRITON": True, "LOSS_TYPE": "dapo"},
    "triton dr_grpo": {"USE_TRITON": True, "LOSS_TYPE": "dr_grpo"},
    "triton tis mask": {"USE_TRITON": True, "TIS_MODE": "token_mask"},
    "triton clip 0.28": {"USE_TRITON": True, "CLIP_EPS_HIGH": 0.28},
}
HOMES = {"TIS_MODE": vllm_engine, "USE_TRITON": fast_paths, "DISTILL_BELOW": teacher_mix}


class Engine:
    """The calls policy_loss makes of a DeepSpeed engine, on a plain model."""

    def __init__(self, model, device):
        self.module = model
        self.device = device

    def __call__(self, **inputs):
        return self.module(**inputs)

    def train(self):
        self.module.train()


def tiny_model(seed=0):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def make_batch(model) -> grpo.Batch:
    """Two groups of four answers, padding in some rows, pi_old and vLLM's log-probs a little off
    the model's own (ratios away from 1, some past the clip), a teacher's log-probs and top-k."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ANSWERS, PROMPT + ANSWER), generator=g)  # (B, L)
    mask = torch.ones(ANSWERS, ANSWER, dtype=torch.bool)  # (B, T)
    for row, length in enumerate([10, 7, 10, 3, 9, 10, 5, 8]):
        mask[row, length:] = False
    with torch.no_grad():
        own = grpo.per_token_logps(model, ids, torch.ones_like(ids), ANSWER)  # (B, T)
    noise = torch.randn(ANSWERS, ANSWER, generator=g)  # (B, T)
    return grpo.Batch(
        input_ids=ids, attention_mask=torch.ones_like(ids), mask=mask,
        advantages=torch.tensor([1.2, -0.4, 0.3, -1.1, 0.8, -0.8, 0.0, 0.5]),
        ref_logps=own + 0.2 * noise,
        pi_old_logps=own + 0.15 * torch.randn(ANSWERS, ANSWER, generator=g),
        pi_old_rows=torch.ones(ANSWERS, dtype=torch.bool),
        normalizer=float(ANSWERS),
        extra=BatchExtras(
            scores=torch.tensor([3.0, 0.0, 2.0, 1.0, 3.0, 1.0, 2.0, 3.0]),
            vllm_logps=own + 0.1 * torch.randn(ANSWERS, ANSWER, generator=g),
            vllm_rows=torch.ones(ANSWERS, dtype=torch.bool),
            teacher_logps=own - 0.5 * torch.rand(ANSWERS, ANSWER, generator=g),
            teacher_topk_ids=torch.randint(0, VOCAB, (ANSWERS, ANSWER, TOP_K), generator=g),
            teacher_topk_logps=-3 * torch.rand(ANSWERS, ANSWER, TOP_K, generator=g),
        ),
    )


def run(model, batch, settings, device, dtype):
    """(loss, {name: gradient in fp32 on the CPU}) of policy_loss with `settings` in force."""
    saved = {}
    for name, value in settings.items():
        home = HOMES.get(name, grpo)
        saved[name] = getattr(home, name)
        setattr(home, name, value)
    try:
        copy = tiny_model()
        copy.load_state_dict(model.state_dict())
        copy = copy.to(device, dtype)
        b = grpo.on_device(batch, device)
        if not settings.get("DISTILL_COEF"):
            b = replace(b, extra=replace(b.extra, teacher_logps=None, teacher_topk_ids=None,
                                         teacher_topk_logps=None))
        if settings.get("DISTILL_COEF"):
            b = replace(b, ref_logps=None)
        if settings.get("LOSS_TYPE") == "dapo":  # dapo divides by the step's answer tokens
            b = replace(b, normalizer=float(batch.mask.sum()))
        loss, _ = grpo.choose_parts().loss(Engine(copy, torch.device(device)), b)
        loss.backward()
        grads = {n: p.grad.float().cpu() for n, p in copy.named_parameters()}
        return loss.item(), grads
    finally:
        for name, value in saved.items():
            setattr(HOMES.get(name, grpo), name, value)


def gap(grads, reference):
    """The relative L2 distance of one gradient from another, over every parameter."""
    diff = sum(((grads[n] - reference[n]) ** 2).sum() for n in reference)
    size = sum((g**2).sum() for g in reference.values())
    return (diff / size).sqrt().item()


def main():
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    print(f"device: {torch.cuda.get_device_name() if gpu else 'CPU only'}; torch "
          f"{torch.__version__}, transformers {transformers.__version__}")
    model = tiny_model()
    batch = make_batch(model)
    print(f"{'variant':<18} {'loss cpu fp32':>14} {device + ' fp32':>14} {'gap':>9} "
          f"{device + ' bf16':>14} {'gap':>9}")
    for name, settings in VARIANTS.items():
        if settings.get("USE_TRITON") and not gpu:
            print(f"{name:<18} skipped: the fused loss runs compiled on a GPU only here")
            continue
        try:
            reference_settings = {k: v for k, v in settings.items() if k != "USE_TRITON"}
            ref_loss, ref_grads = run(model, batch, reference_settings, "cpu", torch.float32)
            loss32, grads32 = run(model, batch, settings, device, torch.float32)
            loss16, grads16 = run(model, batch, settings, device, torch.bfloat16)
        except Exception as error:  # noqa: BLE001 (a report: every variant gets its line)
            print(f"{name:<18} FAILED: {type(error).__name__}: {str(error)[:200]}")
            continue
        print(f"{name:<18} {ref_loss:>14.6f} {loss32:>14.6f} {gap(grads32, ref_grads):>9.1e} "
              f"{loss16:>14.6f} {gap(grads16, ref_grads):>9.1e}")


if __name__ == "__main__":
    main()
