"""Faster equal: micro-batches whose gradients add up to the one batch's, with the DeepSpeed ZeRO-2
plumbing: the process group, the config file with the trainer's own settings put in (one source of
truth for each), the engine, counts over ranks (the loss normalizer, micro-batches every rank runs),
and on CPU ranks the cleanup of DeepSpeed's shared-memory files.

    deepspeed --num_gpus 1 grpo_ref_split.py         # setup_deepspeed() there calls setup
"""
import contextlib
import dataclasses
import json
import os
import socket
import sys

import torch

from features import env_overrides

TRAIN_MICRO_BATCH = 0  # groups per forward+backward, gradients added up; 0 = all at once (fastest)
GRADIENT_CHECKPOINTING = False  # recompute activations in backward: one more forward, less memory
OFFLOAD_OPTIMIZER = False  # True = AdamW's state and fp32 weights in CPU memory, stepped there
env_overrides.apply_env_overrides(globals(), "features/zero2.py")


SET_BY_TRAINER = (
    "lr (LR), bf16 (on GPUs, not on CPU), the scheduler's total_num_steps (ALL_STEPS x MU) and "
    "zero_optimization.offload_optimizer (OFFLOAD_OPTIMIZER)"
)


def ds_config(path, *, lr, bf16, total_steps, offload_optimizer=False) -> dict:
    """The DeepSpeed config at `path` with SET_BY_TRAINER filled in; a file that sets any of them
    itself is refused, so no value there is silently overwritten. offload_optimizer: ZeRO-Offload,
    AdamW's two moments and the fp32 master weights held and stepped in CPU memory by DeepSpeed's
    CPU Adam (pinned on GPUs for fast copies)."""
    with open(path) as f:
        config = json.load(f)
    scheduler = config.get("scheduler", {}).get("params", {})
    if (
        "lr" in config["optimizer"].get("params", {})
        or "bf16" in config
        or "total_num_steps" in scheduler
    ):
        sys.exit(
            f"{path} sets one of {SET_BY_TRAINER}: grpo_ref_split.py sets those; remove them from "
            f"{path}"
        )
    config["optimizer"].setdefault("params", {})["lr"] = lr
    config["bf16"] = {"enabled": bf16}
    if "scheduler" in config:  # DeepSpeed's own; it counts optimizer steps
        config["scheduler"]["params"]["total_num_steps"] = total_steps
    if offload_optimizer:
        if "offload_optimizer" in config["zero_optimization"]:
            sys.exit(
                f"{path} sets offload_optimizer: OFFLOAD_OPTIMIZER sets it; remove it from {path}"
            )
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": bf16}
        # torch's AdamW steps on the GPU; DeepSpeedCPUAdam on the CPU
        for name in ("torch_adam", "fused"):
            config["optimizer"]["params"].pop(name, None)
    return config


def replay_cpu_adam_steps(engine):
    """After a resume with OFFLOAD_OPTIMIZER: bring DeepSpeed's CPU Adam's C++ step counter to the
    saved step.

    The C++ optimizer keeps beta1^t and beta2^t by multiplying once per step, but a fresh process
    that meets step t computes pow(beta, t), which rounds differently in the last bit, so the
    resumed run would drift from the uninterrupted one by about 1e-7. Calls on empty tensors walk
    the counter through 1..t the way the uninterrupted run did; they touch no weight."""
    cpu_adam = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    if not hasattr(cpu_adam, "ds_opt_adam"):  # not DeepSpeedCPUAdam: torch's AdamW needs nothing
        return
    steps = [state["step"] for state in cpu_adam.state.values() if "step" in state]
    if not steps:
        return
    group = cpu_adam.param_groups[0]
    beta1, beta2 = group["betas"]
    empty = torch.empty(0, dtype=torch.float32)
    for step in range(1, int(max(steps)) + 1):
        cpu_adam.ds_opt_adam.adam_update(
            cpu_adam.opt_id,
            step,
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            group["bias_correction"],
            empty,
            empty,
            empty,
            empty,
        )


def remove_shm_names(rank):
    """DeepSpeed's CPU all-reduce maps a /dev/shm file per rank and never deletes it: runs pile them
    up in RAM. Once every rank has mapped its file, the name can go (the memory lives until the
    process exits)."""
    torch.distributed.barrier()
    with contextlib.suppress(FileNotFoundError):
        os.remove(
            f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{rank}"
        )


# what `deepspeed` sets
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def one_process_without_launcher():
    """`python grpo_ref_split.py` with no launcher: the rank variables of a world of one (a free
    local port), so DeepSpeed starts one process instead of looking for MPI (which fails without
    mpi4py), as `python train.py` runs nanoGPT. A launcher's variables are never touched."""
    if any(name in os.environ for name in LAUNCHER_VARIABLES):
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    print(
        "no launcher: one process (`deepspeed grpo_ref_split.py` runs one per GPU)",
        file=sys.stderr,
        flush=True,
    )


def init_distributed(cuda: bool):
    """(rank, device) after DeepSpeed's process group is up: NCCL on GPUs, gloo on CPU ranks."""
    import deepspeed

    one_process_without_launcher()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = torch.distributed.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    torch.cuda.set_device(device) if cuda else remove_shm_names(rank)
    return rank, device


def initialize(model, config, gradient_checkpointing=False):
    """The ZeRO-2 engine over the model's trainable parameters (LoRA: the adapters only), its first
    step's rate set; gradient_checkpointing: activations recomputed in backward (non-reentrant:
    works with frozen inputs and LoRA)."""
    import deepspeed

    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    # its rate for the first step is set only at its first step()
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.step(0)
    return engine


def setup(load_policy, *, model_path, seed, ds_config_path, lr, optimizer_steps):
    """(engine, tokenizer, eos_ids, gen_config, rank, device): the trainer's policy under ZeRO-2:
    load_policy(model_path, device) its loader, LoRA and FREEZE_VISION from their modules, this
    module's OFFLOAD_OPTIMIZER and GRADIENT_CHECKPOINTING; optimizer_steps for the schedule."""
    from features import lora, vision

    cuda = torch.cuda.is_available()
    rank, device = init_distributed(cuda)
    torch.manual_seed(seed + rank)
    model, tokenizer, eos_ids, gen_config = load_policy(model_path, device)
    model = lora.add_lora(
        model, rank=lora.LORA_RANK, alpha=lora.LORA_ALPHA, targets=lora.LORA_TARGETS, seed=seed
    )  # LORA_RANK 0: unchanged
    if vision.FREEZE_VISION:  # a vision-language model's tower stays as it is
        vision.freeze_tower(model)
    # CPU ranks train in fp32 (bf16 is slow and lossy there); the scheduler counts optimizer steps.
    config = ds_config(
        ds_config_path,
        lr=lr,
        bf16=cuda,
        total_steps=optimizer_steps,
        offload_optimizer=OFFLOAD_OPTIMIZER,
    )
    engine = initialize(model, config, GRADIENT_CHECKPOINTING)
    return engine, tokenizer, eos_ids, gen_config, rank, device


def check_micro_batch(size: int) -> None:
    """Guard: TRAIN_MICRO_BATCH counts groups; a negative one is refused (at start too)."""
    if size < 0:
        raise ValueError(
            f"TRAIN_MICRO_BATCH = {size}: need groups per micro-batch >= 1, or 0 = all"
        )


def micro_batches(engine, groups, as_batch, prepare, *, size, count) -> list:
    """The step's groups as batches of `size` groups (TRAIN_MICRO_BATCH; 0 = all at once),
    as_batch(groups)'d and prepare(engine, batch, normalizer)'d (the trainer's batches_of hands
    them); count(masks): the normalizer of the step's (B, T) masks (the trainer's global_count).
    Each holds the whole step's loss normalizer, so their gradients add up to the one big batch's,
    and its share of the step's completions and tokens (for the metrics). ZeRO-2 reduces gradients
    in every backward, so every rank must run as many: a rank with fewer repeats its last
    micro-batch with share 0 (its loss x 0)."""
    check_micro_batch(size)
    size = size or len(groups)
    parts = [as_batch(groups[i : i + size]) for i in range(0, len(groups), size)]
    normalizer = count([p.mask.to(engine.device) for p in parts])
    rows, tokens = sum(len(p.mask) for p in parts), sum(int(p.mask.sum()) for p in parts)
    parts = [
        dataclasses.replace(
            prepare(engine, p, normalizer),
            share=len(p.mask) / rows,
            token_share=int(p.mask.sum()) / max(tokens, 1),
        )
        for p in parts
    ]
    most = torch.tensor(len(parts), device=engine.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    repeat = dataclasses.replace(parts[-1], share=0.0, token_share=0.0)
    return parts + [repeat] * (int(most) - len(parts))
