"""Make the SmolVLM-shaped demo model (features/vision_demo.py): Idefics3 with the embedded
SmolLM2-135M as its language model and a random vision encoder and connector, then the caption pass
that aligns them (LLaVA's first stage, the language model frozen). Any constant below can be set by
an environment variable of its name:

    python scripts/make_vision_model.py                       # -> VISION_MODEL_DIR
    ALIGN_STEPS=0 python scripts/make_vision_model.py         # the random model, unaligned
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rewards  # noqa: E402  (the repository's root is on the path only now)
from features import env_overrides, vision_demo  # noqa: E402
from features.embedded_model import resolve_model_path  # noqa: E402

VISION_MODEL_DIR = "output/vision_model"  # where the model and its processor are written
SEED = 0  # the vision encoder's and connector's random start, and the caption batches
ALIGN_STEPS = 300  # caption-pass steps (AdamW, batch ALIGN_BATCH); 0 = leave it random
ALIGN_BATCH = 16  # captions per step
ALIGN_LR = 1e-3  # the vision side's learning rate (its weights start random)
ALIGN_QUESTIONS = 4000  # distinct captioned images drawn from (seeded apart from the task's)
SYSTEM_PROMPT = "Answer inside <answer> </answer> tags."  # the GRPO run's: set it the same there
THINK_PREFILL = "<answer>"  # opens the assistant turn, as the trainer's THINK_PREFILL does
env_overrides.apply_env_overrides(globals(), "make_vision_model.py")


def main():
    folder = vision_demo.build(resolve_model_path(""), VISION_MODEL_DIR, seed=SEED)
    print(f"built {folder}", flush=True)
    if ALIGN_STEPS:
        rows = rewards.make_shapes(ALIGN_QUESTIONS, seed=SEED + 10_000, captions=True)
        losses = vision_demo.align(folder, rows, steps=ALIGN_STEPS, batch=ALIGN_BATCH,
                                   lr=ALIGN_LR, seed=SEED, system_prompt=SYSTEM_PROMPT,
                                   prefill=THINK_PREFILL)
        with open(os.path.join(folder, "caption_losses.json"), "w") as f:
            json.dump(losses, f)
    print(f"done: {folder}", flush=True)


if __name__ == "__main__":
    main()
