"""The memory plan (features/memory_plan.py) for the seed's configurations: Qwen2.5-3B, Qwen2.5-7B
and Qwen2.5-VL-3B (EasyR1's geometry3k model, its vision tower counted; their config.json files in
bench/configs/, no weights), on one 80 GB trainer GPU and on 8, GSM8K-sized prompts (256 tokens) and
answers (512), 4 questions x 8 answers per rank and step.

    python bench/memory_plans.py          # a few seconds; prints one line per setting

Figures are the plan's, not measurements; bench/bench_memory_plan.py measures the plan on this CPU.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GPU_BYTES = 80 * 10**9
SETTINGS = {  # name: (Setting's changes, LoRA rank)
    "full fine-tuning": ({}, 0),
    "+ GRADIENT_CHECKPOINTING, TRAIN_MICRO_BATCH=1": (
        {"gradient_checkpointing": True, "train_micro_batch": 1},
        0,
    ),
    "+ OFFLOAD_OPTIMIZER": (
        {"gradient_checkpointing": True, "train_micro_batch": 1, "offload_optimizer": True},
        0,
    ),
    "LORA_RANK=16 (checkpointing, micro-batches)": (
        {"gradient_checkpointing": True, "train_micro_batch": 1},
        16,
    ),
    "8 GPUs (checkpointing, micro-batches)": (
        {"gradient_checkpointing": True, "train_micro_batch": 1, "ranks": 8, "ranks_per_node": 8},
        0,
    ),
}


def main():
    from features import memory_plan

    gib = memory_plan.GIB
    print(
        f"{'model':<14}{'setting':<48}{'trainer GPU':>12}{'CPU':>8}{'server':>8}  verdict (80 GB)"
    )
    for model in ("qwen2.5-3b", "qwen2.5-7b", "qwen2.5-vl-3b"):
        for name, (changes, lora_rank) in SETTINGS.items():
            path = os.path.join(ROOT, "bench", "configs", model)
            shape = memory_plan.model_shape(path, lora_rank=lora_rank)
            setting = memory_plan.Setting(
                lora_rank=lora_rank, prompt_tokens=256, max_new_tokens=512, **changes
            )
            rows = memory_plan.plan(shape, setting, GPU_BYTES)
            total = rows[-1]
            print(
                f"{model:<14}{name:<48}{total.trainer / gib:>12.1f}{total.cpu / gib:>8.1f}"
                f"{total.server / gib:>8.1f}  {memory_plan.verdict(rows, GPU_BYTES)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
