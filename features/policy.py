"""Loading the policy: a transformers causal LM (or a LoRA checkpoint onto its base) whose sampling
comes from the trainer's constants alone, so that its samples are exactly softmax(logits /
TEMPERATURE).

    # the trainer, workers and benches call it
    python -c "import torch; from features.policy import load_for_sampling"
"""
import os

import torch

from features import vision
from features.lora import load_adapters


def load_for_sampling(path, device, *, base_path, temperature, max_new_tokens,
                      attn_implementation=None):
    """(model, tokenizer, eos_ids, gen_config) with plain sampling: what every log-prob assumes. A
    LoRA checkpoint (adapters only, adapter_config.json) is loaded onto base_path. A vision-language
    model comes with its processor in the tokenizer's place (features/vision.py).
    attn_implementation: a causal LM's (features/packing.attention_implementation); None = the
    default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    adapters = os.path.exists(os.path.join(path, "adapter_config.json"))
    weights_path = base_path if adapters else path
    if vision.model_type(weights_path):
        model, tokenizer = vision.load(weights_path, device)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(weights_path, dtype=torch.float32,
                                                     attn_implementation=attn_implementation)
        model = model.to(device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = load_adapters(model, path) if adapters else model
    eos_ids = model.generation_config.eos_token_id
    eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [tokenizer.eos_token_id])
    # generate() fills every setting left unset from the model's own generation_config
    # (Qwen2.5-Instruct: repetition_penalty 1.05, top_k 20, top_p 0.8), and its samples are then not
    # softmax(logits / T), the distribution every log-prob assumes. So the model keeps none:
    # sampling comes from the arguments alone.
    model.generation_config = GenerationConfig(
        bos_token_id=model.generation_config.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    gen_config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_ids,
    )
    return model, tokenizer, eos_ids, gen_config
