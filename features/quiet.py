"""Log: other libraries' notices off (the trainer's VERBOSE = False): DeepSpeed's INFO lines and two
notices that say nothing wrong, transformers' loading bars and notices, vLLM's FutureWarnings.
Warnings and errors still show; VERBOSE = True shows everything. C++ notices (NUMA binding) are out
of reach.

    VERBOSE=1 bash scripts/run_demo.sh        # every library's notices, as they come
"""
import logging
import warnings

from features import env_overrides

VERBOSE = False  # True = other libraries' notices and loading bars; False = their warnings only
env_overrides.apply_env_overrides(globals(), "features/quiet.py")


# DeepSpeed warns of these on every CPU run; neither says anything is wrong.
HARMLESS = ("Setting accelerator to CPU",  # no GPU: this machine has none
            # its own __init__
            "Attempting to get learning rate from scheduler before it has started")


class DropHarmless(logging.Filter):
    """Drops records whose message starts with one of HARMLESS."""

    def filter(self, record):
        return not str(record.msg).startswith(HARMLESS)


def quiet_libraries(verbose: bool) -> None:
    """Raise the libraries' log levels to WARNING, hide their progress bars, unless verbose."""
    if verbose:
        return
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # "loading weights", generation-config notices
    transformers_logging.disable_progress_bar()  # "Loading weights: 100%|...", once per model
    for name in ("DeepSpeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, DropHarmless) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(DropHarmless())
    warnings.filterwarnings("ignore", category=FutureWarning)  # vLLM's about torch's reduce_op
