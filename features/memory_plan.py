"""Guard: the memory plan, what one training setting holds on each trainer GPU, in the CPU memory of
its machine and on the reference server's GPU, from the model's config alone (no weights are
loaded) and the trainer's constants. The trainer prints it at start-up and stops before loading the
model when the setting cannot fit the device it sees.

    python features/memory_plan.py                    # the embedded model at the demo's settings
    MODEL_PATH=Qwen/Qwen2.5-7B-Instruct BF16=1 GPU_GB=80 RANKS=1 OFFLOAD_OPTIMIZER=1 \
        GRADIENT_CHECKPOINTING=1 TRAIN_MICRO_BATCH=1 python features/memory_plan.py

The model states (weights, gradients, AdamW's moments and fp32 master weights) come from DeepSpeed's
own ZeRO-2 estimate. The activations come from tracing one forward of the model on PyTorch's meta
device (shapes only, no memory) and adding up what autograd saves for backward, so any architecture
transformers builds is counted as it is. What the plan leaves out: the CUDA context and the cuBLAS
and NCCL workspaces, the caching allocator's fragmentation, and the few tensors of the loss itself.
A plan above the whole device stops the trainer; one above FIT_SHARE of it may not fit
(bench/bench_memory_plan.py measures the plan against a step's peak). """
import dataclasses
import json
import os
import sys

import torch

from features import env_overrides

MEMORY_PLAN = True  # print what each device will hold and stop if it cannot fit; False = skip it
env_overrides.apply_env_overrides(globals(), "features/memory_plan.py")


# a plan above this share of a device "may not fit": it has run below measured peaks
FIT_SHARE = 0.75
GIB = 2**30


@dataclasses.dataclass
class ModelShape:
    """What the plan needs of a model, read from its config."""
    params: int  # every parameter, tied ones once
    trainable: int  # what AdamW steps: params, or the LoRA adapters' parameters
    layers: int  # decoder layers
    hidden: int  # the residual stream's width
    kv_width: int  # key/value heads x head size: the KV cache per token per layer is 2 x this
    vocab: int  # the LM head's outputs
    saved_per_token: float  # bytes autograd keeps for backward per token per layer (training dtype)
    saved_per_token_fp32: float  # the same in fp32 (CPU training)


@dataclasses.dataclass
class Setting:
    """A trainer setting, each field named as the trainer's constant it comes from."""
    ranks: int = 1  # trainer processes (one GPU each)
    ranks_per_node: int = 1  # trainer processes on one machine: they share its CPU memory
    bf16: bool = True  # GPUs train in bf16; CPU ranks in fp32
    offload_optimizer: bool = False  # OFFLOAD_OPTIMIZER
    lora_rank: int = 0  # LORA_RANK
    lora_targets: str = "all-linear"  # LORA_TARGETS
    gradient_checkpointing: bool = False  # GRADIENT_CHECKPOINTING
    q_batch_size: int = 4  # Q_BATCH_SIZE: groups per rank per step
    train_micro_batch: int = 0  # TRAIN_MICRO_BATCH: groups per forward+backward, 0 = all
    num_pre_q: int = 8  # NUM_PRE_Q
    prompt_tokens: int = 128  # the longest prompt, in tokens
    max_new_tokens: int = 64  # MAX_NEW_TOKENS
    logp_chunk: int = 128  # LOGP_CHUNK, 0 = all tokens at once
    logp_from_hidden: bool = True  # LOGP_FROM_HIDDEN
    shared_prefix: bool = True  # SHARED_PREFIX: a group's prompt runs once
    padding_free: bool = False  # PADDING_FREE: rows packed, no padding (features/packing.py)
    pack_tokens: int = 0  # PACK_TOKENS: tokens in one packed row at most, 0 = the longest row
    use_vllm: bool = False  # USE_VLLM
    vllm_gpu_memory: float = 0.3  # VLLM_GPU_MEMORY: the share of the GPU vLLM takes
    vllm_cpu_kv_gb: float = 1.0  # VLLM_CPU_KV_GB: on CPU, vLLM's KV cache beside its own weights
    reduce_bucket_size: int = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size
    distill_coef: float = 0.0  # DISTILL_COEF: > 0, the server holds a teacher the plan cannot size
    freeze_vision: bool = False  # FREEZE_VISION: a vision-language model's tower does not train
    tower_saved: int = 0  # bytes one row's images save in the tower's training forward (traced)


@dataclasses.dataclass
class Row:
    """One line of the plan: bytes on a trainer GPU, the trainer machine's CPU, the server's GPU."""
    what: str
    trainer: int = 0
    cpu: int = 0
    server: int = 0


def saved_bytes_per_token(model) -> float:
    """Bytes autograd saves per token per layer in one training forward of `model` (on the meta
    device).

    The meta device runs attention's plain path, which also saves the (heads, T, T) weights; GPUs
    and PyTorch's CPU attention do not. Tracing two lengths and extrapolating to length 0 keeps only
    the per-token part, which is what flash and memory-efficient attention save. """
    # peft: its base's config; a VLM: its LM's
    layers = model.config.get_text_config().num_hidden_layers
    per_token = []
    for length in (64, 128):
        ids = torch.zeros(1, length, dtype=torch.long, device="meta")  # (1, length)
        saved = saved_bytes(lambda: model.get_decoder()(input_ids=ids), model)
        per_token.append(saved / (length * layers))
    return 2 * per_token[0] - per_token[1]  # the line through both, at length 0


def saved_bytes(run, model) -> int:
    """Bytes autograd saves while run() does one training forward of `model`'s parts, weights
    left out (each storage once)."""
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in weights:  # a weight is not an activation
            saved[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(saved.values())


def tower_saved_bytes(model_path: str, pixels: dict, *, dtype, tower_trains=True,
                      connector_trains=True) -> int:
    """Bytes autograd saves when one training row's images (`pixels`, the processor's) go through
    the vision tower and connector of the model at model_path. Traced on this CPU in real
    arithmetic (the tower's own ops read the pixels' values, which the meta device cannot): the
    tower built from its config with 1 and then 2 layers, random weights, the second layer's bytes
    extrapolated to its depth. A frozen part (FREEZE_VISION: the tower; LoRA: both) saves nothing
    for backward. Without gradient checkpointing: with it, an upper bound."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from features import vision

    config = AutoConfig.from_pretrained(model_path)
    depth_name = "depth" if hasattr(config.vision_config, "depth") else "num_hidden_layers"
    depth = getattr(config.vision_config, depth_name)
    traced = []
    for layers in (1, 2):
        setattr(config.vision_config, depth_name, layers)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype,
                                                            attn_implementation="sdpa")
        language_model = model.get_decoder()
        for part in model.model.children():  # the tower and connector, with real weights
            if part is not language_model:
                part.to_empty(device="cpu")
                for weight in part.parameters():
                    torch.nn.init.normal_(weight, std=0.02)
                    weight.requires_grad_(connector_trains)
        for weight in vision.vision_tower(model).parameters():
            weight.requires_grad_(tower_trains)
        model.train()
        inputs = {name: value.to(dtype) if value.is_floating_point() else value
                  for name, value in pixels.items()}
        traced.append(saved_bytes(lambda: vision.image_features(model, inputs), model))
    return traced[0] + (depth - 1) * (traced[1] - traced[0])


def model_shape(model_path: str, *, lora_rank=0, lora_targets="all-linear",
                freeze_vision=False) -> ModelShape:
    """The ModelShape of a hub id or local folder: its config.json only, the model built on the meta
    device (LoRA's adapters by peft, as the trainer adds them). A vision-language model counts its
    vision tower and connector in the weights, and in what trains unless LoRA (the language model's
    layers) or freeze_vision leaves them out; its layers, widths and activations are its language
    model's (the tower's activations, per row of images, are Setting.tower_saved, traced by
    tower_saved_bytes)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from features import lora, vision

    config = AutoConfig.from_pretrained(model_path)
    is_vision = vision.model_type(model_path) is not None
    auto = AutoModelForImageTextToText if is_vision else AutoModelForCausalLM
    traced = {}
    for dtype in (torch.bfloat16, torch.float32):
        with torch.device("meta"):
            model = auto.from_config(config, dtype=dtype, attn_implementation="sdpa")
            storages = {p.untyped_storage()._cdata: p.numel() for p in model.parameters()}
            params = sum(storages.values())  # a tied weight counts once
            if lora_rank > 0:  # a frozen layer saves less for backward: trace the adapted model
                model = lora.add_lora(
                    model,
                    rank=lora_rank,
                    alpha=2 * lora_rank,
                    targets=lora_targets,
                    seed=0,
                    quiet=True,
                )
        if freeze_vision and is_vision:
            vision.freeze_tower(model)
        model.train()
        traced[dtype] = saved_bytes_per_token(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = config.get_text_config()  # a vision-language model's language model; else itself
    heads = config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(
        params=params,
        trainable=trainable,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        kv_width=kv_heads * head_size,
        vocab=config.vocab_size,
        saved_per_token=traced[torch.bfloat16],
        saved_per_token_fp32=traced[torch.float32],
    )


def model_states(shape: ModelShape, s: Setting) -> Row:
    """Weights, gradients and AdamW's state. bf16: DeepSpeed's ZeRO-2 estimate for the trained
    parameters (2 bytes of weights each, and 18 split over the ranks: bf16 and fp32 gradients, fp32
    master weights, two moments; or all but the weights in CPU memory with offload), and 2 bytes for
    each frozen one. fp32 (CPU): 4 bytes of weights and 16 split over the ranks (gradients, a master
    copy, the moments), DeepSpeed having no estimate for it."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    frozen = shape.params - shape.trainable
    nodes = max(1, s.ranks // s.ranks_per_node)
    if not s.bf16:
        split = 16 * shape.trainable // s.ranks
        if s.offload_optimizer:
            return Row(
                "weights, gradients, AdamW (fp32)", 4 * shape.params, split * s.ranks_per_node
            )
        return Row("weights, gradients, AdamW (fp32)", 4 * shape.params + split)
    cpu, gpu = estimate_zero2_model_states_mem_needs(
        shape.trainable, s.ranks_per_node, nodes, cpu_offload=s.offload_optimizer
    )
    # DeepSpeed's CPU figure: AdamW's state with offload, else each rank's fp32 copy as it loads
    return Row("weights, gradients, AdamW (DeepSpeed's estimate)", gpu + 2 * frozen, cpu)


def step_tokens(s: Setting) -> int:
    """Tokens in one forward+backward: a micro-batch's groups (SHARED_PREFIX: each prompt once)."""
    groups = s.train_micro_batch or s.q_batch_size
    prompts = groups if s.shared_prefix else groups * s.num_pre_q
    return prompts * s.prompt_tokens + groups * s.num_pre_q * s.max_new_tokens


def plan(shape: ModelShape, s: Setting, device_bytes: int) -> list:
    """The plan's rows; the last is the total, a trainer GPU's being its peak."""
    item = 2 if s.bf16 else 4
    per_token = shape.saved_per_token if s.bf16 else shape.saved_per_token_fp32
    tokens = step_tokens(s)
    states = model_states(shape, s)
    bucket = s.reduce_bucket_size  # a GPU's caching allocator reserves all of it
    if not s.bf16:  # the CPU maps only the pages the gradients are written to
        bucket = min(bucket, shape.trainable)
    rows = [states, Row("gradient bucket (reduce_bucket_size)", bucket * item)]
    if s.gradient_checkpointing:  # each layer's input, and one layer's activations in backward
        kept = tokens * (shape.layers * shape.hidden * item + per_token)
    else:
        kept = tokens * shape.layers * per_token
    what = f"activations of {tokens:,} tokens"
    longest_row = s.prompt_tokens + s.max_new_tokens
    if s.padding_free and s.pack_tokens > longest_row:  # packed rows longer than a padded row's
        packed_rows = -(-tokens // s.pack_tokens)
        kept += packed_rows * s.pack_tokens**2  # their block-causal masks, a byte a pair
        what += f" (packed: {packed_rows} rows' masks of {s.pack_tokens:,}^2)"
    if s.tower_saved:  # every completion row runs its question's images through the tower
        image_rows = (s.train_micro_batch or s.q_batch_size) * s.num_pre_q
        kept += image_rows * s.tower_saved
        what += f" and {image_rows} rows' images"
    rows.append(Row(what, int(kept)))
    completion_tokens = (s.train_micro_batch or s.q_batch_size) * s.num_pre_q * s.max_new_tokens
    logit_tokens = min(s.logp_chunk or completion_tokens, completion_tokens)
    if not s.logp_from_hidden:
        logit_tokens = completion_tokens
    # logits, their fp32 log-softmax and its gradient
    rows.append(Row(f"logits of {logit_tokens:,} tokens", logit_tokens * shape.vocab * (item + 8)))
    sequences = s.q_batch_size * s.num_pre_q
    cache = (
        2 * shape.layers * shape.kv_width * item * sequences * (s.prompt_tokens + s.max_new_tokens)
    )
    if s.use_vllm and s.bf16:
        rows.append(Row("vLLM (VLLM_GPU_MEMORY)", int(s.vllm_gpu_memory * device_bytes)))
    elif s.use_vllm:  # CPU: its own fp32 copy of the weights and VLLM_CPU_KV_GB of cache
        vllm_bytes = 4 * shape.params + int(s.vllm_cpu_kv_gb * GIB)
        rows.append(Row("vLLM (its weights, VLLM_CPU_KV_GB)", vllm_bytes))
    else:  # generation comes before the step, so only the larger of the two counts
        rows.append(Row("generation KV cache (before the step)", cache))
    server_tokens = s.num_pre_q * (s.prompt_tokens + s.max_new_tokens)
    server = (
        2 * shape.params + server_tokens * per_token + min(server_tokens, 128) * shape.vocab * 8
    )
    what = "reference server: bf16 weights, one group's forward"
    if s.distill_coef:  # the teacher's config is not known before the handshake
        what = "teacher server, sized as the student (bf16)"
    rows.append(Row(what, server=int(server)))
    held = states.trainer + rows[1].trainer  # from the first step to the end
    step = rows[2].trainer + rows[3].trainer  # during a forward+backward
    peak = held + max(step, cache)  # generation comes before the step
    if s.use_vllm:  # vLLM holds its share the whole run
        peak = held + step + rows[4].trainer
    fp32_weights = 4 * shape.params  # each rank loads them on its CPU, then its GPU, then casts
    loading = Row(
        "loading: fp32 weights before DeepSpeed casts them",
        fp32_weights,
        fp32_weights * s.ranks_per_node,
    )
    rows.append(loading)
    cpu = max(states.cpu, loading.cpu)
    if not s.bf16:  # CPU ranks: what is offloaded lives in the same RAM as the rank's own share
        peak += states.cpu // s.ranks_per_node
    rows.append(Row("total", max(peak, loading.trainer), cpu, int(server)))
    return rows


def verdict(rows, device_bytes: int, cpu_bytes=None) -> str:
    """ "fits", "may not fit" or "does not fit", for the trainer's device and, given cpu_bytes (a
    GPU machine's RAM), for the CPU column too: AdamW's state with OFFLOAD_OPTIMIZER lives there.
    The plan has fallen below a step's measured peak (bench/RESULTS.md), so only a plan above the
    whole device (or RAM) is sure not to fit."""
    total = rows[-1]
    shares = [total.trainer / device_bytes]
    if cpu_bytes:
        shares.append(total.cpu / cpu_bytes)
    if max(shares) > 1:
        return "does not fit"
    if max(shares) > FIT_SHARE:
        return "may not fit"
    return "fits"


def table(rows, device_bytes: int, device_name: str, cpu_bytes=None) -> str:
    """The plan as text, with its verdict for the device (and the RAM, given cpu_bytes)."""
    lines = [f"{'memory plan (GiB)':<52}{'trainer':>9}{'CPU':>9}{'server':>9}"]
    for r in rows:
        lines.append(
            f"{r.what:<52}{r.trainer / GIB:>9.2f}{r.cpu / GIB:>9.2f}{r.server / GIB:>9.2f}"
        )
    share = rows[-1].trainer / device_bytes
    ram = ""
    if cpu_bytes:
        ram_share = rows[-1].cpu / cpu_bytes
        ram = f", CPU {ram_share:.0%} of the machine's RAM ({cpu_bytes / GIB:.1f} GiB)"
    lines.append(
        f"{verdict(rows, device_bytes, cpu_bytes)}: {share:.0%} of {device_name} "
        f"({device_bytes / GIB:.1f} GiB){ram}; it fits below {FIT_SHARE:.0%}"
    )
    return "\n".join(lines)


def free_ram() -> int:
    """Bytes of this machine's available RAM (MemAvailable)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def device_seen(ranks_per_node: int):
    """(bytes, name) of the memory one trainer rank may use: its GPU, or its share of the free
    RAM."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        props = torch.cuda.get_device_properties(local)
        return props.total_memory, props.name
    free = free_ram()
    if ranks_per_node == 1:
        return free, "this machine's free RAM"
    return free // ranks_per_node, f"1/{ranks_per_node} of this machine's free RAM"


def check(model_path: str, s: Setting, *, prompt, questions):
    """Print the plan (rank 0) and stop every rank, before any weight loads, if it does not fit.
    Fills in what the launcher and the device say (ranks, bf16) and the prompt's length:
    prompt(tokenizer, question) (the task's) of the longest of the first 256 questions."""
    from transformers import AutoTokenizer

    from features import vision

    longest = max(questions[:256], key=lambda q: len(q["question"]))

    s.ranks = int(os.environ.get("WORLD_SIZE", "1"))
    s.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    s.bf16 = torch.cuda.is_available()  # the trainer's rule: bf16 on GPUs, fp32 on CPU
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if vision.model_type(model_path):  # its image tokens count in the prompt
            tokenizer = vision.load_processor(model_path)
        prompt_text = prompt(tokenizer, longest)
        encoded = tokenizer([prompt_text], **vision.image_kwargs([longest]),
                            add_special_tokens=False, return_tensors="pt")
        s.prompt_tokens = len(encoded["input_ids"][0])
        pixels = {name: value for name, value in encoded.items()
                  if torch.is_tensor(value) and name not in ("input_ids", "attention_mask")}
        if pixels:  # the longest question's images, as one training row holds them
            dtype = torch.bfloat16 if s.bf16 else torch.float32
            s.tower_saved = tower_saved_bytes(model_path, pixels, dtype=dtype,
                                              tower_trains=not (s.freeze_vision or s.lora_rank),
                                              connector_trains=not s.lora_rank)
        shape = model_shape(
            model_path,
            lora_rank=s.lora_rank,
            lora_targets=s.lora_targets,
            freeze_vision=s.freeze_vision,
        )
    except Exception as e:  # a model the meta device cannot build: train without a plan, and say so
        print(
            f"memory plan skipped: {model_path} could not be planned ({type(e).__name__}: {e})",
            file=sys.stderr,
            flush=True,
        )
        return
    device_bytes, name = device_seen(s.ranks_per_node)
    cpu_bytes = free_ram() if s.bf16 else None  # on CPU ranks the trainer column counts it already
    rows = plan(shape, s, device_bytes)
    if os.environ.get("RANK", "0") == "0":
        print(table(rows, device_bytes, name, cpu_bytes), flush=True)
    if verdict(rows, device_bytes, cpu_bytes) == "does not fit":
        short = name if rows[-1].trainer > device_bytes else "this machine's RAM (the CPU column)"
        sys.exit(
            f"the memory plan above does not fit {short}: set OFFLOAD_OPTIMIZER=1 (GPU) or "
            "0 (RAM), LORA_RANK, GRADIENT_CHECKPOINTING=1 or TRAIN_MICRO_BATCH=1 "
            "(docs/gpus.md), or use more ranks or machines"
        )


def setting_for_run(
    *, q_batch_size, num_pre_q, max_new_tokens, distill_coef, ds_config_path
) -> Setting:
    """The trainer's Setting: the keywords are its constants of those names; every feature's own
    constants are read from its module (LoRA, the fast paths, ZeRO-2's, vLLM's, vision's)."""
    from features import fast_paths, lora, packing, vision, vllm_engine, zero2

    setting = Setting(
        offload_optimizer=zero2.OFFLOAD_OPTIMIZER,
        lora_rank=lora.LORA_RANK,
        lora_targets=lora.LORA_TARGETS,
        gradient_checkpointing=zero2.GRADIENT_CHECKPOINTING,
        q_batch_size=q_batch_size,
        train_micro_batch=zero2.TRAIN_MICRO_BATCH,
        num_pre_q=num_pre_q,
        max_new_tokens=max_new_tokens,
        logp_chunk=fast_paths.LOGP_CHUNK,
        logp_from_hidden=fast_paths.LOGP_FROM_HIDDEN,
        shared_prefix=fast_paths.SHARED_PREFIX,
        padding_free=packing.PADDING_FREE,
        pack_tokens=packing.PACK_TOKENS,
        use_vllm=vllm_engine.USE_VLLM,
        vllm_gpu_memory=vllm_engine.VLLM_GPU_MEMORY,
        vllm_cpu_kv_gb=vllm_engine.VLLM_CPU_KV_GB,
        distill_coef=distill_coef,
        freeze_vision=vision.FREEZE_VISION,
    )
    bucket = reduce_bucket_size(ds_config_path)
    if bucket is not None:
        setting.reduce_bucket_size = bucket
    return setting


def reduce_bucket_size(ds_config_path):
    """zero_optimization.reduce_bucket_size of the DeepSpeed config at ds_config_path, or None."""
    if not ds_config_path or not os.path.exists(ds_config_path):
        return None
    with open(ds_config_path) as f:
        bucket = json.load(f).get("zero_optimization", {}).get("reduce_bucket_size")
    return None if bucket is None else int(float(bucket))


def setting_from(constants) -> Setting:
    """A Setting from the environment's text (os.environ: `python -m features.memory_plan`), each
    field read from its UPPER_CASE name, BF16 for the dtype; absent names keep the default."""
    setting = Setting()
    for field in dataclasses.fields(Setting):
        value = constants.get(field.name.upper())
        if value is None:
            continue
        if isinstance(value, str) and isinstance(field.default, bool):  # environment text
            value = value.lower() in ("1", "true")
        elif isinstance(value, str):
            value = type(field.default)(value)
        setattr(setting, field.name, value)
    bucket = reduce_bucket_size(constants.get("DS_CONFIG"))  # the DeepSpeed config may set it
    if bucket is not None:
        setting.reduce_bucket_size = bucket
    return setting


def main():
    from features.embedded_model import resolve_model_path

    setting = setting_from(os.environ)
    model_path = resolve_model_path(os.environ.get("MODEL_PATH", ""))
    shape = model_shape(
        model_path,
        lora_rank=setting.lora_rank,
        lora_targets=setting.lora_targets,
        freeze_vision=setting.freeze_vision,
    )
    gpu_gb = float(os.environ.get("GPU_GB", "80"))
    device_bytes = int(gpu_gb * 10**9)
    cpu_bytes = int(float(os.environ.get("CPU_GB", "0")) * 10**9) or None  # checked when given
    print(f"{shape.params:,} parameters, {shape.trainable:,} trained; {setting}")
    rows = plan(shape, setting, device_bytes)
    print(table(rows, device_bytes, f"one {gpu_gb:g} GB GPU", cpu_bytes))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
