"""Which files and lines a reader follows in one default training step (issue 47's count).

    python bench/lesson_path.py          # the embedded model, every constant at its default
    FUNCTIONS=1 python bench/lesson_path.py   # also each function entered, with its lines

It starts ref_server.py's server in this process, runs the trainer for two steps and records
every function of this project (not tests/ or bench/) that is entered during step 2, on the
trainer's thread or the server's. A function counts with all its lines (docstring included,
from its `def` to its last line); main() counts whole, since the loop lives in it; nested
functions count once inside their parent. It prints the lines per file and the totals.
"""
import os
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = ("tests", "bench", ".venv")  # folders whose code is not the product
FUNCTIONS = os.environ.get("FUNCTIONS", "0") == "1"  # 1: list each function entered too


def is_project_file(filename: str) -> bool:
    path = Path(filename)
    if not path.is_absolute() or ROOT not in path.parents:
        return False
    return path.relative_to(ROOT).parts[0] not in SKIPPED


def function_lines(code) -> range:
    last = max((line for _, _, line in code.co_lines() if line is not None),
               default=code.co_firstlineno)
    return range(code.co_firstlineno, last + 1)


class PathRecorder:
    """A profile hook that keeps the code objects entered while `recording` is set."""

    def __init__(self):
        self.recording = False
        self.entered = set()

    def __call__(self, frame, event, arg):
        if self.recording and event == "call" and is_project_file(frame.f_code.co_filename):
            self.entered.add(frame.f_code)
        return None

    def lines_per_file(self) -> dict:
        lines = defaultdict(set)
        for code in self.entered:
            lines[code.co_filename].update(function_lines(code))
        return {str(Path(name).relative_to(ROOT)): len(seen) for name, seen in lines.items()}


def main():
    out = tempfile.mkdtemp(prefix="lesson_path_")
    os.environ.update(ALL_STEPS="2", EVAL_STEPS="0", SAVE_STEPS="0", OUTPUT_DIR=out,
                      REF_SERVER="http://127.0.0.1:59885", PORT="59885")
    sys.path.insert(0, str(ROOT))
    recorder = PathRecorder()
    threading.setprofile(recorder)  # before the server's threads start
    sys.setprofile(recorder)
    import ref_server
    from transformers import AutoModelForCausalLM
    from features.embedded_model import resolve_model_path
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("")).eval()
    server = ref_server.RefServer(model.requires_grad_(False), "embedded")
    stop = ref_server.serve(server, "127.0.0.1", 59885)
    import grpo_ref_split as trainer
    rollout = trainer.rollout
    log_step = trainer.log_step

    def rollout_recorded(*args, **kwargs):
        recorder.recording = kwargs.get("step") == 2
        return rollout(*args, **kwargs)

    def log_step_recorded(*args, **kwargs):
        result = log_step(*args, **kwargs)
        recorder.recording = False
        return result

    trainer.rollout = rollout_recorded
    trainer.log_step = log_step_recorded
    try:
        trainer.main()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        stop()
    recorder.entered.add(trainer.main.__code__)  # the loop itself
    per_file = recorder.lines_per_file()
    print(f"{'file':<32} lines on a default step's path")
    for name, count in sorted(per_file.items(), key=lambda item: -item[1]):
        print(f"{name:<32} {count}")
    print(f"{'total':<32} {sum(per_file.values())} lines in {len(per_file)} files")
    if FUNCTIONS:
        for code in sorted(recorder.entered, key=lambda c: (c.co_filename, c.co_firstlineno)):
            name = Path(code.co_filename).relative_to(ROOT)
            print(f"{name}:{code.co_firstlineno} {code.co_qualname} {len(function_lines(code))}")


if __name__ == "__main__":
    main()
