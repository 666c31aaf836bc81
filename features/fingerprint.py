"""A model's fingerprint: short hashes of its config and a sample of its weights, so that a trainer
can check the reference server holds the very model its policy starts from (ref_server.py's /health
sends it).

    python -c "from features.fingerprint import model_fingerprint"      # used by both; runs nothing
"""
import hashlib
import json

import torch

# The config fields that make two models the same network (not its dtype, path or versions).
FINGERPRINT_CONFIG = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rope_parameters",
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
    "hidden_act",
)


def model_fingerprint(model) -> dict:
    """{"config", "weights"}: short hashes that tell whether two processes hold the same model.

    Weights: 4096 evenly spaced values of the first two and last two parameters, rounded to bf16, so
    a bf16 reference server and an fp32 trainer that loaded the same checkpoint agree. Cheap for 7B.
    A LoRA model (peft) is fingerprinted by its base: the weights under the adapters, under their
    own names."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = {k: v for k, v in sorted(model.config.to_dict().items()) if k in FINGERPRINT_CONFIG}
    weights = hashlib.sha256()
    params = [
        (name.replace(".base_layer", ""), p)
        for name, p in model.named_parameters()
        if "lora_" not in name
    ]
    for name, p in params[:2] + params[-2:]:
        flat = p.detach().flatten()
        k = min(4096, flat.numel())
        # ints: exact
        sample = flat[torch.arange(k, device=flat.device) * (flat.numel() - 1) // max(k - 1, 1)]
        weights.update(f"{name}{tuple(p.shape)}".encode())
        weights.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return {
        "config": hashlib.sha256(json.dumps(config, default=str).encode()).hexdigest()[:16],
        "weights": weights.hexdigest()[:16],
    }


def vocab_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary itself, every token string with its id (added tokens too): two
    tokenizers with the same hash give the same ids the same text. A size alone would not tell."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda pair: pair[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]
