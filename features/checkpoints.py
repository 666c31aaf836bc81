"""Log: checkpoints (the run's output) and resume from them: OUTPUT_DIR/step_N holds the weights
(transformers format), DeepSpeed's optimizer and scheduler state, and each rank's RNG state, so
RESUME=1 continues a run bit for bit.

    RESUME=1 deepspeed --num_gpus 1 grpo_ref_split.py          # from the newest complete step_N
"""
import json
import os
import re
import shutil
import sys

import torch

from features import env_overrides, zero2
from features.vllm_engine import push_weights

SAVE_STEPS = 10  # OUTPUT_DIR/step_N every this many steps and at the end; 0 = at the end only
KEEP_CHECKPOINTS = 2  # newest step_N folders kept; each holds the weights and AdamW's moments
RESUME = False  # True = continue from the newest step_N: weights, optimizer, step, data position
env_overrides.apply_env_overrides(globals(), "features/checkpoints.py")


def due(step: int, *, last_step: int) -> bool:
    """Whether step_N is saved after `step`: every SAVE_STEPS and at the last step."""
    return step == last_step or (SAVE_STEPS > 0 and step % SAVE_STEPS == 0)


def checkpoints(output_dir):
    """Complete output_dir/step_N folders, oldest first (a half-written one is still step_N.tmp)."""
    if not os.path.isdir(output_dir):
        return []
    steps = sorted(int(n[5:]) for n in os.listdir(output_dir) if re.fullmatch(r"step_\d+", n))
    return [os.path.join(output_dir, f"step_{n}") for n in steps]


def refuse_to_overwrite(output_dir, resume: bool):
    """A fresh run (not resume) stops, changing nothing, where an earlier run left checkpoints: its
    keep limit would delete them."""
    if not resume and checkpoints(output_dir):
        sys.exit(
            f"{output_dir}/ holds checkpoints of an earlier run (newest "
            f"{checkpoints(output_dir)[-1]}); "
            "nothing was changed. Continue that run with RESUME=1, or start a new one in another "
            "OUTPUT_DIR"
        )


def save_checkpoint(engine, tokenizer, step, rng, rank, *, output_dir, keep, lora, settings=None):
    """output_dir/step_N: transformers weights (load on their own; with LoRA the adapters only,
    which peft loads onto MODEL_PATH), DeepSpeed state (with LoRA the adapters' weights and
    optimizer state), each rank's RNG, and `settings` ({name: value} that a resume must keep) as
    settings.json, readable before any model loads (newest_settings).

    Every rank writes into step_N.tmp; rank 0 renames it once all are done, so a step_N folder
    is always complete, and then deletes all but the newest `keep`.
    """
    folder = os.path.join(output_dir, f"step_{step}")
    tmp = folder + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        engine.module.save_pretrained(tmp)  # ZeRO-2 keeps full weights on every rank
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, SETTINGS_FILE), "w") as f:
            json.dump(settings or {}, f)
    torch.distributed.barrier()
    # weights + this rank's optimizer
    engine.save_checkpoint(
        tmp,
        tag="deepspeed",
        client_state={"step": step},
        # shard; not a second copy of the frozen base
        exclude_frozen_parameters=lora,
    )
    rng_state = {
        "python": rng.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.empty(0),
    }
    # the data position and sampling stream
    torch.save(rng_state, os.path.join(tmp, f"rng_rank{rank}.pt"))
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)
        for old in checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old)
    torch.distributed.barrier()


SETTINGS_FILE = "settings.json"  # in step_N: the settings a resume must keep


def newest_settings(output_dir) -> tuple:
    """(the settings the newest complete checkpoint of output_dir saved, its folder): (None, "")
    without a checkpoint, ({}, folder) for one saved before settings were."""
    found = checkpoints(output_dir)
    if not found:
        return None, ""
    path = os.path.join(found[-1], SETTINGS_FILE)
    if not os.path.exists(path):
        return {}, found[-1]
    with open(path) as f:
        saved = json.load(f)
    if not isinstance(saved, dict):
        sys.exit(f"{path} holds no settings object: the checkpoint is damaged")
    return saved, found[-1]


def resume(engine, rng, rank, *, output_dir, lora, llm=None):
    """Load the newest complete checkpoint (weights, optimizer, RNG), and push its weights into
    USE_VLLM's engine `llm` (it started from MODEL_PATH); returns its step, 0 if none."""
    found = checkpoints(output_dir)
    if not found:
        print(
            f"[rank {rank}] RESUME: no step_N checkpoint in {output_dir}/, starting from step 1",
            flush=True,
        )
        return 0
    folder = found[-1]
    rng_file = os.path.join(folder, f"rng_rank{rank}.pt")
    if not os.path.exists(os.path.join(folder, "deepspeed")) or not os.path.exists(rng_file):
        sys.exit(
            f"{folder} has no DeepSpeed state for rank {rank}: it was saved by an older version or "
            "with "
            "fewer ranks; resume with the same --num_gpus, or load its weights with MODEL_PATH "
            "instead"
        )
    # weights, optimizer and scheduler state
    _, client = engine.load_checkpoint(
        folder,
        tag="deepspeed",
        # LoRA: the frozen base is not in it
        load_module_strict=not lora,
    )
    zero2.replay_cpu_adam_steps(engine)  # OFFLOAD_OPTIMIZER: bit for bit, as the uninterrupted run
    # the rate of the step it stopped at, whatever the optimizer state held
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.step(engine.lr_scheduler.last_batch_iteration)
    state = torch.load(rng_file, weights_only=True)
    rng.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"].numel():
        torch.cuda.set_rng_state(state["cuda"])
    if llm is not None:
        push_weights(llm, engine.module)
    print(f"[rank {rank}] resumed from {folder} (step {client['step']})", flush=True)
    return client["step"]
