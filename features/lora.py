"""LoRA (LORA_RANK > 0, peft): small adapters train while the model's own weights stay frozen, and
with REF_FROM_BASE the reference log-probs come from the same model with its adapters switched off
(no server).

    LORA_RANK=16 deepspeed --num_gpus 1 grpo_ref_split.py
"""
import os
import shutil

import torch

from features import env_overrides
from features.vision import vision_tower

LORA_RANK = 0  # adapter rank; 0 = full fine-tuning. 16 is common
LORA_ALPHA = 32  # the adapters' update is scaled by LORA_ALPHA / LORA_RANK
LORA_TARGETS = "all-linear"  # peft's target_modules: every linear layer but the head, or a regex
REF_FROM_BASE = True  # LoRA: reference log-probs from the base (adapters off) here; no server
env_overrides.apply_env_overrides(globals(), "features/lora.py")


def own_reference() -> bool:
    """Whether the trainer takes reference log-probs from its own base (LoRA with REF_FROM_BASE)
    instead of a reference server."""
    return LORA_RANK > 0 and REF_FROM_BASE


def add_lora(model, *, rank, alpha, targets, seed, quiet=False):
    """The model with LoRA adapters (peft) on `targets`, the only parameters that train (rank 0: the
    model as it is). B starts at 0, so the policy starts as the model itself; A's random start is
    drawn from `seed` alone, the same on every rank."""
    if rank == 0:
        return model
    from peft import LoraConfig, get_peft_model

    if targets == "all-linear" and hasattr(model, "model") and vision_tower(model) is not None:
        targets = language_linears(model)  # a vision-language model: its language model's only
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(model, config)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if os.environ.get("RANK", "0") == "0" and not quiet:
        print(
            f"LoRA rank {rank}: {n:,} trainable parameters of {total:,} ({100 * n / total:.2f}%)",
            flush=True,
        )
    return model


def language_linears(model) -> list:
    """The full names of a vision-language model's linear layers in its language model (not the
    vision tower, the connector or the LM head): LoRA's "all-linear" there, as EasyR1 and TRL adapt
    VLMs."""
    decoder = model.get_decoder()  # the language model (Idefics3's text_model, Qwen2-VL's ...)
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    return [
        f"{prefix}.{name}"
        for name, module in decoder.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]


def load_adapters(model, path):
    """A LoRA checkpoint (adapters only, saved by the trainer) put onto its base `model`."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, path)


def merged_state_dict(model) -> dict:
    """The weights of the policy as a plain model: with LoRA, each adapted layer's W + (B @ A) x
    alpha / rank (peft's merge, computed aside, so training goes on with the adapters), under the
    base model's parameter names."""
    if not hasattr(model, "get_base_model"):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {
        f"{name}.weight": layer.get_delta_weight(layer.active_adapters[0])
        for name, layer in base.named_modules()
        if isinstance(layer, LoraLayer)
    }
    merged = {}
    for name, w in base.state_dict().items():
        if "lora_" not in name:
            name = name.replace(".base_layer", "")
            merged[name] = w + deltas[name].to(w.dtype) if name in deltas else w
    return merged


def save_merged(model, tokenizer, output_dir, rank):
    """At the end of a LoRA run: output_dir/merged, the base with the adapters merged in, which
    from_pretrained loads without peft (and vLLM serves). A model without adapters has nothing to
    merge: nothing is written."""
    if not hasattr(model, "get_base_model"):
        return
    if rank == 0:
        folder = os.path.join(output_dir, "merged")
        shutil.rmtree(folder + ".tmp", ignore_errors=True)
        model.get_base_model().save_pretrained(folder + ".tmp", state_dict=merged_state_dict(model))
        tokenizer.save_pretrained(folder + ".tmp")
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(folder + ".tmp", folder)
    torch.distributed.barrier()


def reference_from_base(engine, batch, current_logps) -> None:
    """REF_FROM_BASE: the batch's reference log-probs are its base model's (adapters off), put in
    before step 6 (the trainer's prepare_batch calls it when main chose it)."""
    batch.ref_logps = base_logps(engine, current_logps)  # (B, T)


def base_logps(engine, logps):
    """What logps() computes with the adapters switched off: the base model's log-probs, the
    reference of REF_FROM_BASE, from the weights this process already holds."""
    with engine.module.disable_adapter():
        return logps()
