"""Settings that cannot work, refused before any model loads, with what to set instead; settings that work
but are likely a mistake, warned. The trainer calls check_settings first thing in main().

    TIS_CAP=1 deepspeed --num_gpus 1 grpo_ref_split.py      # stops at once: the cap must be above 1
"""
import sys

from features import checkpoints, env_overrides
from features.run_log import check_tensorboard


def check_settings(*, output_dir, resume, choices, use_triton, gspo, tis_mode, tis_cap, tensorboard,
                   clip_eps, clip_eps_high, loss_type):
    """Stop on settings that cannot work together or an output_dir that holds another run; warn on GSPO
    settings it was not made for. choices: {constant: (its value, its options)}."""
    checkpoints.refuse_to_overwrite(output_dir, resume)  # KEEP_CHECKPOINTS would delete another run's
    values = {name: value for name, (value, _) in choices.items()}
    env_overrides.check_choices(values, **{name: options for name, (_, options) in choices.items()})
    if use_triton and (gspo or tis_mode.startswith("sequence_")):  # they need a whole answer's tokens
        sys.exit("USE_TRITON has no per-answer ratio (GSPO, TIS_MODE sequence_*): set those off, or USE_TRITON=0")
    if tis_cap < 0 or 0 < tis_cap <= 1:  # at <= 1 the mask modes drop every token, truncation shrinks all
        sys.exit(f"TIS_CAP = {tis_cap}: the importance weights' cap must be above 1 (2.0 is common), or 0 = off")
    check_tensorboard(tensorboard)
    if gspo and max(clip_eps, clip_eps_high) > 0.01:  # an answer's mean drift is far smaller than a token's
        print(f"warning: GSPO with CLIP_EPS {clip_eps} will hardly ever clip (the paper: 3e-4 / 4e-4)",
              file=sys.stderr)
    if gspo and loss_type != "grpo":  # each answer's one ratio would count once per token (TRL warns too)
        print(f"warning: GSPO with LOSS_TYPE {loss_type!r} weighs each answer's sequence loss by its length; "
              'GSPO is defined with LOSS_TYPE "grpo"', file=sys.stderr)
