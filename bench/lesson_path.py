"""What a reader must read to follow one default training step: the lines it runs, per file.

    python bench/lesson_path.py                  # the embedded model, every constant at its default
    LINES=1 python bench/lesson_path.py          # also every line counted, file by file
    MODEL_PATH=some/folder python bench/lesson_path.py   # another model (the tests' tiny one)

It starts ref_server.py's server in this process, runs the trainer for three steps and records, by
line coverage (sys.settrace on the trainer's thread and the server's threads), every line of this
project (not tests/ or bench/) that runs during step 2 (main()'s loop among them), and apart the
lesson's lines that run before step 1 (main()'s set-up: check_settings, choose_parts, the loading),
read once. A line counts with the whole statement it belongs to (a call spread over four lines is
four lines); a compound statement (if, for, with, def) counts its header, and an entered function
its signature; the docstrings of the lesson's functions entered, step or set-up, are counted apart
(they hold the formulas a reader reads). Beside them it counts the definitions the step uses: each
module constant (UPPER_CASE) and each class named on a line that ran, and the plain definition that
a faster equal stands in for (per_token_logps). Comments are what a reader may read, not must.

Each module of features/ whose code runs must say in its docstring's first line which kind it is,
"Faster equal:" (computes what a lesson function defines, tested equal), "Guard:" (checks and
bounds) or "Log:" (metrics and output); one that says none stops the count. A features/ module that
is only read (a switch constant such as TOOLS, a class named in a test) is listed apart. Each call
from the lesson's files into another module of the project (features/, objectives.py,
environments.py) that runs, in the step or the set-up, must carry a comment naming its kind (faster
equal, guard, log, set-up or a variant) on its statement or on its function's `def` line; a call
without one is listed, and the count exits 1.
The last line reads `must read: N lines in the lesson's files (step s, set-up u, docstrings d); M
lines in features/ (faster equal a, guard b, log c)`.
"""
import ast
import functools
import io
import os
import sys
import tempfile
import threading
import tokenize
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = ("tests", "bench", ".venv")  # folders whose code is not the product
LESSON = ("grpo_ref_split.py", "rewards.py", "ref_server.py")  # the lesson's files
KINDS = {"Faster equal:": "faster equal", "Guard:": "guard", "Log:": "log"}  # docstring tags
# What a call's comment may name: a module's kind, or what the lesson calls it for
CALL_KINDS = ("faster equal", "guard", "log", "set-up", "a variant")
# The plain definitions a default step's faster equals are tested equal to: a reader reads them in
# place of the fast path (file: its functions), counted whole but for their docstrings.
DEFINITIONS = {"grpo_ref_split.py": ("per_token_logps",)}
LINES = os.environ.get("LINES", "0") == "1"  # 1: list every line counted


@functools.lru_cache(maxsize=None)  # asked at every call and line the trace sees
def project_file(filename: str) -> str | None:
    """The path relative to ROOT of a project file, or None (a library, a test, a bench)."""
    path = Path(filename)
    if not path.is_absolute() or ROOT not in path.parents:
        return None
    relative = path.relative_to(ROOT)
    return None if relative.parts[0] in SKIPPED else str(relative)


class LineRecorder:
    """A trace function: the project lines that run while `recording` is set (the step), and apart
    the lines of the trainer's main() that run outside it (its set-up, read once)."""

    def __init__(self):
        self.recording = False
        self.ran = defaultdict(set)  # file -> line numbers that ran in the recorded step
        self.entered = defaultdict(set)  # file -> first lines of the functions entered in it
        self.set_up = defaultdict(set)  # file -> lines that ran before step 1 (the set-up)
        self.set_up_entered = defaultdict(set)  # file -> first lines of functions entered then
        self.before_step_1 = True  # until the loop's first step begins

    def __call__(self, frame, event, arg):
        name = project_file(frame.f_code.co_filename)
        if name is None:
            return None
        return self.local

    def local(self, frame, event, arg):
        name = project_file(frame.f_code.co_filename)
        if event != "line":
            return self.local
        if self.recording:
            self.ran[name].add(frame.f_lineno)
            self.entered[name].add(frame.f_code.co_firstlineno)
        elif self.before_step_1 and frame.f_code.co_name != "<module>":
            self.set_up[name].add(frame.f_lineno)
            self.set_up_entered[name].add(frame.f_code.co_firstlineno)
        return self.local


class SourceFile:
    """One file's statements, module definitions and comments, from its source."""

    def __init__(self, name: str):
        self.name = name
        self.text = (ROOT / name).read_text()
        self.lines = self.text.splitlines()
        self.tree = ast.parse(self.text)
        self.spans = {}  # line -> (first, last) of the statement (or header) it belongs to
        self.functions = {}  # first line -> (first, last) of the signature
        self.names = {}  # first line -> the function's name
        self.docstrings = set()  # lines of docstrings
        for node in ast.walk(self.tree):
            self._add(node)
        self.constants = {}  # module constant -> its line
        self.classes = {}  # class -> (first, last) without its docstring
        self.imported = {}  # name -> (module file, name there)
        for node in self.tree.body:
            self._define(node)
        self.comments = {row: text for row, text in comments(self.text)}
        self.kind = kind_of(self.tree)

    def _add(self, node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                self.docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            self.functions[node.lineno] = (first, node.body[0].lineno - 1)
            self.names[node.lineno] = node.name
        if not isinstance(node, ast.stmt):
            return
        body = getattr(node, "body", None)
        last = node.end_lineno
        if isinstance(body, list) and body:  # a compound statement: its header
            last = max(node.lineno, body[0].lineno - 1)
        for row in range(node.lineno, last + 1):
            span = self.spans.get(row)
            if span is None or span[1] - span[0] > last - node.lineno:  # the innermost
                self.spans[row] = (node.lineno, last)

    def _define(self, node):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.isupper():
                    self.constants[target.id] = node.lineno
        if isinstance(node, ast.ClassDef):
            body = node.body[1:] if ast.get_docstring(node) else node.body
            rows = {node.lineno}
            for item in body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue  # a method counts when it runs
                rows.update(range(item.lineno, item.end_lineno + 1))
            self.classes[node.name] = sorted(rows)
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                self.imported[alias.asname or alias.name] = (module_file(node.module, alias.name),
                                                             alias.name)
        if isinstance(node, ast.Import):
            for alias in node.names:
                self.imported[alias.asname or alias.name] = (module_file(alias.name), None)


def module_file(module: str, name: str | None = None) -> str | None:
    """The project file of `module` (or of the module `module.name` when that is one)."""
    if name is not None and (ROOT / module.replace(".", "/") / f"{name}.py").exists():
        return f"{module.replace('.', '/')}/{name}.py"
    path = ROOT / (module.replace(".", "/") + ".py")
    return str(path.relative_to(ROOT)) if path.exists() else None


def comments(text: str) -> list:
    """(row, text) of each comment in a source."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [(token.start[0], token.string) for token in tokens if token.type == tokenize.COMMENT]


def kind_of(tree) -> str | None:
    """The kind a module's docstring's first line declares (KINDS), or None."""
    first = (ast.get_docstring(tree) or "").splitlines()[:1]
    return next((kind for tag, kind in KINDS.items() if first and first[0].startswith(tag)), None)


def imported_module(source: SourceFile, alias: str) -> str | None:
    """The project file of the module `alias` names in `source` (import x / from y import x)."""
    target = source.imported.get(alias)
    if target and target[0] and (target[1] is None or target[0].endswith(f"/{target[1]}.py")):
        return target[0]
    return None


def names_read(source: SourceFile, rows: set) -> list:
    """(file, name) of each module-level name read on `rows`: a bare name (this file's, or one
    imported from a project file), or module.NAME of an imported project module."""
    found = []
    for node in ast.walk(source.tree):
        if getattr(node, "lineno", None) not in rows:
            continue
        if isinstance(node, ast.Name) and node.id in source.imported:
            found.append(source.imported[node.id])
        elif isinstance(node, ast.Name):
            found.append((source.name, node.id))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = imported_module(source, node.value.id)
            if module:
                found.append((module, node.attr))
    return found


def span_rows(source: SourceFile, row: int) -> tuple:
    """range() bounds of the statement (or compound header) that line `row` belongs to."""
    first, last = source.spans.get(row, (row, row))
    return first, last + 1


class Count:
    """The lines a reader must read, per file, and the calls into features/ without a kind."""

    def __init__(self, recorder: LineRecorder):
        self.sources = {}
        self.read = defaultdict(set)  # file -> line numbers a reader must read
        self.entered = recorder.entered  # file -> first lines of the functions entered
        self.set_up = defaultdict(set)  # lesson file -> lines of the set-up not in the step
        self.docstrings = defaultdict(set)  # lesson file -> docstring lines of entered functions
        for name in LESSON:
            source = self.source(name)
            ran = recorder.set_up.get(name, ())
            rows = {r for row in ran for r in range(*span_rows(source, row))}
            for start in recorder.set_up_entered.get(name, ()):
                if start in source.functions:
                    first, last = source.functions[start]
                    rows.update(range(first, last + 1))
            self.set_up[name] = rows - source.docstrings
            entered = set(recorder.entered.get(name, ()))
            entered |= set(recorder.set_up_entered.get(name, ()))
            for node in ast.walk(source.tree):
                if isinstance(node, ast.FunctionDef) and node.lineno in entered:
                    doc = node.body[0]
                    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                        self.docstrings[name].update(range(doc.lineno, doc.end_lineno + 1))
        self.switches = defaultdict(set)  # features/ files only read: their constants' lines
        for name, rows in recorder.ran.items():
            source = self.source(name)
            for row in rows:
                self.read[name].update(r for r in range(*span_rows(source, row))
                                       if r not in source.docstrings)
            for start in recorder.entered[name]:
                if start in source.functions:
                    first, last = source.functions[start]
                    self.read[name].update(range(first, last + 1))
        for name, functions in DEFINITIONS.items():
            source = self.source(name)
            for node in source.tree.body:
                if isinstance(node, ast.FunctionDef) and node.name in functions:
                    rows = range(node.lineno, node.end_lineno + 1)
                    self.read[name].update(r for r in rows if r not in source.docstrings)
        for name in list(self.read):
            self.add_definitions(name)

    def source(self, name: str) -> SourceFile:
        if name not in self.sources:
            self.sources[name] = SourceFile(name)
        return self.sources[name]

    def add_definitions(self, name: str):
        """The constants and classes named on the lines `name` ran, wherever they are defined."""
        source = self.source(name)
        for where, defined in names_read(source, self.read[name] - source.docstrings):
            if where is None or project_file(str(ROOT / where)) is None:
                continue
            home = self.source(where)
            read_here = where in LESSON or home.kind is not None  # else a module not entered
            if defined in home.constants:
                rows = {home.constants[defined]}
            elif defined in home.classes:
                rows = set(home.classes[defined])
            else:
                continue
            (self.read if read_here else self.switches)[where].update(rows)

    def unkinded(self) -> list:
        """'file (functions)' of each features/ module whose code runs on the path without a
        declared kind."""
        found = []
        for name in self.read:
            source = self.source(name)
            if name.startswith("features/") and source.kind is None:
                functions = sorted(source.names[row] for row in self.entered[name]
                                   if row in source.names)
                found.append(f"{name} ({', '.join(functions) or 'its classes or constants'})")
        return found

    def calls_without_a_kind(self) -> list:
        """'file:line name' of each call from the lesson's files into another project module
        (features/, objectives.py, environments.py), in the step or the set-up, whose statement,
        and whose function's def line, carry no comment naming its kind (CALL_KINDS)."""
        missing = []
        for name in LESSON:
            source = self.source(name)
            rows = self.read.get(name, set()) | self.set_up.get(name, set())
            defs = {}  # a line inside a function -> that function's def line
            for node in ast.walk(source.tree):
                if isinstance(node, ast.FunctionDef):
                    defs.update({row: node.lineno
                                 for row in range(node.lineno, node.end_lineno + 1)
                                 if row not in defs or defs[row] < node.lineno})
            for node in ast.walk(source.tree):
                if not isinstance(node, ast.Call) or node.lineno not in rows:
                    continue
                target = called_module(source, node.func)
                if target is None or target == name or target in LESSON:
                    continue
                first, last = source.spans.get(node.lineno, (node.lineno, node.end_lineno))
                said = " ".join(source.comments.get(r, "") for r in range(first, last + 1))
                def_first, def_last = source.functions.get(defs.get(node.lineno, 0), (0, -1))
                said += " ".join(source.comments.get(r, "") for r in range(def_first, def_last + 1))
                if not any(kind in said.lower() for kind in CALL_KINDS):
                    missing.append(f"{name}:{node.lineno} {ast.unparse(node.func)}")
        return missing


def called_module(source: SourceFile, func) -> str | None:
    """The project file a call's function lives in: module.f or a name imported from there."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return imported_module(source, func.value.id)
    if isinstance(func, ast.Name) and func.id in source.imported:
        return source.imported[func.id][0]
    return None


def run_two_steps(recorder: LineRecorder):
    """Steps 1 to 3 of the trainer with a server in this process; step 2's lines recorded (step 3,
    the last, saves a checkpoint: step 2 is a step as most of a run's are)."""
    out = tempfile.mkdtemp(prefix="lesson_path_")
    port = int(os.environ.get("PORT", "59885"))  # the tests pass a free one
    os.environ.update(ALL_STEPS="3", EVAL_STEPS="0", SAVE_STEPS="0", OUTPUT_DIR=out,
                      REF_SERVER=f"http://127.0.0.1:{port}", PORT=str(port))
    sys.path.insert(0, str(ROOT))
    threading.settrace(recorder)  # before the server's threads start
    sys.settrace(recorder)
    import ref_server
    import grpo_ref_split as trainer
    from features.embedded_model import resolve_model_path
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(trainer.MODEL_PATH)).eval()
    server = ref_server.RefServer(model.requires_grad_(False), "lesson_path")
    stop = ref_server.serve(server, "127.0.0.1", port)
    steps = trainer.steps_1_to_5

    def steps_recorded(*args, **kwargs):  # step 2 from its first draw to step 3's
        recorder.before_step_1 = False  # the set-up is over
        recorder.recording = kwargs.get("step") == 2
        return steps(*args, **kwargs)

    trainer.steps_1_to_5 = steps_recorded
    try:
        trainer.main()
    finally:
        sys.settrace(None)
        threading.settrace(None)
        stop()


def main():
    recorder = LineRecorder()
    run_two_steps(recorder)
    count = Count(recorder)
    unkinded = count.unkinded()
    if unkinded:
        sys.exit(f"a default step enters {', '.join(unkinded)}, whose docstring's first line "
                 f"declares none of {', '.join(KINDS)}")
    print(f"{'file':<34} {'kind':<13} lines a reader must read on a default step")
    order = sorted(count.read, key=lambda name: (name not in LESSON, -len(count.read[name])))
    for name in order:
        kind = "lesson" if name in LESSON else count.source(name).kind or "other"
        print(f"{name:<34} {kind:<13} {len(count.read[name])}")
        if LINES:
            lines = count.source(name).lines
            for row in sorted(count.read[name]):
                print(f"    {row:5d}  {lines[row - 1]}")
    for name, rows in sorted(count.switches.items()):
        switches = ", ".join(count.source(name).lines[row - 1].split("=")[0].strip()
                             for row in sorted(rows) if "=" in count.source(name).lines[row - 1]
                             or count.source(name).lines[row - 1].startswith("class "))
        print(f"{name:<34} {'switch read':<13} {len(rows)} ({switches})")
    set_up = {name: count.set_up[name] - count.read.get(name, set()) for name in LESSON}
    docstrings = {name: count.docstrings[name] for name in LESSON}
    print(f"{'set-up before step 1, read once':<34} {'lesson':<13} "
          f"{sum(len(rows) for rows in set_up.values())}")
    print(f"{'docstrings of the functions entered':<34} {'lesson':<13} "
          f"{sum(len(rows) for rows in docstrings.values())}")
    other = [name for name in count.read if name not in LESSON and not name.startswith("features/")]
    if other:
        print(f"outside the lesson and features/: {', '.join(other)}")
    missing = count.calls_without_a_kind()
    for call in missing:
        print(f"call out of the lesson without its kind in a comment: {call}")
    step = sum(len(count.read[name]) for name in LESSON if name in count.read)
    read_once = sum(len(rows) for rows in set_up.values())
    documented = sum(len(rows) for rows in docstrings.values())
    by_kind = defaultdict(int)
    for name in count.read:
        if name.startswith("features/"):
            by_kind[count.source(name).kind] += len(count.read[name])
    features = sum(by_kind.values())
    print(f"must read: {step + read_once + documented} lines in the lesson's files (step {step}, "
          f"set-up {read_once}, docstrings {documented}); {features} lines in features/ "
          f"(faster equal {by_kind['faster equal']}, guard {by_kind['guard']}, "
          f"log {by_kind['log']})")
    if missing:
        sys.exit(1)


if __name__ == "__main__":
    main()
