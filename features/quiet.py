"""Other libraries' notices off (the trainer's VERBOSE = False): DeepSpeed's INFO lines, transformers'
loading bars and notices, vLLM's FutureWarnings. Their warnings and errors still show; VERBOSE = True
shows everything.

    VERBOSE=1 bash scripts/run_demo.sh        # every library's notices, as they come
"""
import logging
import warnings


def quiet_libraries(verbose: bool) -> None:
    """Raise the libraries' log levels to WARNING and hide their progress bars, unless verbose."""
    if verbose:
        return
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # "loading weights", generation-config notices
    transformers_logging.disable_progress_bar()  # "Loading weights: 100%|...", once per model
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)  # vLLM's about torch's reduce_op
