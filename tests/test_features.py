"""The feature modules' branches a user hits that a whole run rarely shows: checkpoints refused on
resume, the run log's files kept aside, TensorBoard's purge, a worker whose checkpoint vanished, the
settings check, REGROUP's limits, prompts without the example or the prefill, questions from a JSONL
file, environment values."""
import ast
import glob
import json
import os
import random
import re
import subprocess
import sys
import types

import pytest
import torch

import grpo_ref_split as grpo
from conftest import ROOT, group
from features import checkpoints, env_overrides, run_log, worker
from features.env_overrides import apply_env_overrides
from features.regroup import RegroupPool
from rewards import load_questions


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("missing, rank", [("deepspeed", 0), ("rng_rank1.pt", 1)])
def test_resume_refuses_a_checkpoint_without_deepspeed_or_this_ranks_rng_state(
    tmp_path, missing, rank
):
    """An older checkpoint (no DeepSpeed state), or one saved with fewer ranks (no RNG state for
    this rank): a clear message, nothing loaded."""
    folder = tmp_path / "step_4"
    (folder / "deepspeed").mkdir(parents=True)
    torch.save({}, folder / "rng_rank0.pt")
    if missing == "deepspeed":
        os.rmdir(folder / "deepspeed")

    class NoEngine:  # resume must stop before it touches the engine
        def __getattr__(self, name):
            raise AssertionError(f"the engine was used: {name}")

    with pytest.raises(
        SystemExit, match=f"step_4 has no DeepSpeed state for rank {rank}.*same --num_gpus"
    ):
        checkpoints.resume(NoEngine(), random.Random(0), rank, output_dir=str(tmp_path), lora=False)


def test_a_fresh_run_is_refused_only_where_a_run_left_checkpoints(tmp_path):
    checkpoints.refuse_to_overwrite(str(tmp_path / "none"), resume=False)  # nothing there: fine
    (tmp_path / "step_2.tmp").mkdir()  # a half-written one is no checkpoint
    checkpoints.refuse_to_overwrite(str(tmp_path), resume=False)
    (tmp_path / "step_2").mkdir()
    checkpoints.refuse_to_overwrite(str(tmp_path), resume=True)  # resuming is what it is for
    with pytest.raises(SystemExit, match="holds checkpoints of an earlier run"):
        checkpoints.refuse_to_overwrite(str(tmp_path), resume=False)


# ----------------------------------------------------------------------------- the run log
def test_a_fresh_run_sets_an_earlier_runs_files_aside_and_a_resumed_one_keeps_its_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in (1, 2, 3)))
    os.utime(path, (1_700_000_000, 1_700_000_000))
    with run_log.open_jsonl(str(tmp_path), "metrics.jsonl") as f:  # a fresh run
        f.write("new\n")
    # the earlier run, kept whole
    assert (tmp_path / "metrics.1700000000.jsonl").read_text().count("\n") == 3
    assert path.read_text() == "new\n"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    # resumed from step_2
    with run_log.open_jsonl(str(tmp_path), "metrics.jsonl", resumed_step=2) as f:
        f.write(json.dumps({"step": 3}) + "\n")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_tensorboard_drops_the_steps_a_resumed_run_redoes(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = run_log.RunLog(str(tmp_path), ["reward_correct"], tensorboard=True)
    for step in (1, 2, 3, 4):
        first.write(step, {"loss": float(step)})
    first.close()
    resumed = run_log.RunLog(str(tmp_path), ["reward_correct"], resumed_step=2, tensorboard=True)
    for step in (3, 4):
        resumed.write(step, {"loss": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (4, 40.0),
    ]


def test_tensorboard_missing_stops_before_any_model_loads(monkeypatch):
    import importlib

    real = importlib.import_module
    monkeypatch.setattr(
        importlib,
        "import_module",
        lambda name: (
            (_ for _ in ()).throw(ImportError("no module"))
            if name == "torch.utils.tensorboard"
            else real(name)
        ),
    )
    run_log.check_tensorboard(False)  # off: not even looked for
    with pytest.raises(SystemExit, match="TENSORBOARD=1 needs the tensorboard package"):
        run_log.check_tensorboard(True)


def test_step_metrics_count_dropped_groups_and_answers_over_every_rollout():
    m = {"fwd_bwd_s": 1.0, "optim_s": 0.25}
    # 2 rollouts x 4 groups of 2: 3 all-equal
    rewards = [1, 1, 2, 2, 0, 0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2]
    answers = [dict(reward=float(r), length=5, truncated=False) for r in rewards]
    groups = [
        ({"advantages": torch.zeros(2)}, {"version": 3}),
        ({"advantages": torch.zeros(2)}, {"version": 1}),
    ]
    out = run_log.step_metrics(
        m, groups, answers, step=4, attempts=2, began=0.0, group_size=2, reward_names=[]
    )
    assert out["zero_var_groups"] == 3 / 8  # 3 of the 2 x 4 groups sampled, read from the answers
    assert (out["rollouts"], out["completions_generated"], out["completions_trained"]) == (2, 16, 4)
    assert out["staleness"] == (0 + 2) / 2 and out["groups"] == 2 and out["train_s"] == 1.25
    assert out["reward"] == pytest.approx(sum(rewards) / 16)  # sample_stats over both rollouts


def test_gspo_with_a_token_sized_clip_warns(monkeypatch, capfd, tmp_path):
    monkeypatch.setattr(grpo, "OUTPUT_DIR", str(tmp_path))
    monkeypatch.setattr(grpo, "GSPO", True)
    grpo.check_settings()
    assert "warning: GSPO with CLIP_EPS 0.2 will hardly ever clip" in capfd.readouterr().err
    monkeypatch.setattr(grpo, "CLIP_EPS", 3e-4)
    monkeypatch.setattr(grpo, "CLIP_EPS_HIGH", 4e-4)
    grpo.check_settings()
    assert "warning" not in capfd.readouterr().err


# ---------------------------------------------------------------------------- the generation worker
class Stop(Exception):
    pass


class FakeClient:
    """The server as a worker sees it: room always, every upload recorded; the third upload ends the
    test."""

    def __init__(self):
        self.uploads = []

    def health(self, *policy_and_mismatch, teacher=False):
        return {"pending": 0, "ready_workers": 0, "regroup": False, "reward_model": ""}

    def upload(self, groups, **tags):
        self.uploads.append(tags)
        if len(self.uploads) == 3:
            raise Stop


def test_a_worker_keeps_its_version_when_a_new_checkpoint_vanishes_as_it_loads(tmp_path, capfd):
    """The trainer's keep limit deleted step_N while the worker read it (OSError): the worker says
    so, keeps generating with the weights it has, and picks up the next checkpoint that does
    load."""
    (tmp_path / "step_2").mkdir()
    loads = []

    def load(path, device):
        loads.append(os.path.basename(str(path)))
        if path.endswith("step_2"):
            (tmp_path / "step_2").rmdir()
            (tmp_path / "step_3").mkdir()  # the trainer saved the next one meanwhile
            raise OSError("No such file or directory")
        return (
            ("model", "tokenizer", [2], None)
            if path == "base"
            else (f"model of {path}", "tokenizer", [2], None)
        )

    def rollout(model, tokenizer, drawn, *, eos_ids, gen_config, llm, keep_all, seconds):
        return types.SimpleNamespace(groups=[({}, {})], records=[{"reward": 1.0}])

    client = FakeClient()
    with pytest.raises(Stop):
        worker.run_worker(
            load,
            rollout,
            client,
            questions=["q1", "q2"],
            q_batch_size=1,
            first="base",
            seed=0,
            start_llm=None,
            output_dir=str(tmp_path),
            max_queued=8,
            allow_mismatch=False,
        )
    out = capfd.readouterr().out
    assert "could not load" in out and "step_2" in out and "keeping version 0" in out
    assert loads == ["base", "step_2", "step_3"] and [u["version"] for u in client.uploads] == [
        0,
        3,
        3,
    ]


def test_a_worker_refuses_to_feed_trainers_that_never_read_the_server():
    with pytest.raises(SystemExit, match="trainers never read from the server"):
        worker.run_worker(
            None,
            None,
            None,
            questions=[],
            q_batch_size=1,
            first="",
            seed=0,
            start_llm=None,
            output_dir="",
            max_queued=1,
            allow_mismatch=False,
            trainers_read_server=False,
        )


# ----------------------------------------------------------------------------- REGROUP's limits
def test_regroup_keeps_the_newest_answers_per_question_and_forgets_the_stalest_question():
    pool = RegroupPool(pool_size=6, questions=2)
    tensors, meta = group(G=4, plen=5, tc=3, seed=1)
    tensors["scores"] = torch.zeros(4)
    assert pool.add(tensors, meta) is None  # all equal: pooled
    again = {**tensors, "input_ids": tensors["input_ids"].clone()}
    assert pool.add(again, meta) is None
    assert sum(len(p) for p in pool.pools.values()) == 6  # 8 answers, the oldest 2 dropped
    others = [group(G=4, plen=5, tc=3, seed=s) for s in (2, 3)]  # two more questions
    for t, m in others:
        t["scores"] = torch.zeros(4)
        assert pool.add(t, m) is None
    assert len(pool.pools) == 2  # the first question, least recently uploaded, forgotten: it held 6
    assert [len(p) for p in pool.pools.values()] == [4, 4] and pool.regrouped == 0


# ------------------------------------------------------------------ prompts, questions, environment
def test_build_prompt_without_the_example_or_the_prefill(tokenizer, monkeypatch):
    with_all = grpo.build_prompt(tokenizer, "What is 2 + 2?")
    assert with_all.endswith("<think>") and "What is 3 + 4?" in with_all
    monkeypatch.setattr(grpo, "EXAMPLE", None)
    zero_shot = grpo.build_prompt(tokenizer, "What is 2 + 2?")
    assert "What is 3 + 4?" not in zero_shot and zero_shot.endswith("<think>")
    monkeypatch.setattr(grpo, "THINK_PREFILL", "")
    bare = grpo.build_prompt(tokenizer, "What is 2 + 2?")
    assert bare == zero_shot[: -len("<think>")]  # nothing appended after the assistant header
    # and nothing put back
    assert grpo.decode(tokenizer, torch.tensor([tokenizer.encode(" 4")])) == [" 4"]


def test_questions_from_a_jsonl_file_and_a_clear_error_on_a_bad_line(tmp_path):
    path = tmp_path / "qs.jsonl"
    path.write_text(
        '{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}\n\n'
        '{"question": "How many?", "answer": "#### 1,000"}\n'
    )
    assert load_questions(str(path), 0) == [
        {"question": "What is 1 + 1?", "gold": "2"},
        {"question": "How many?", "gold": "1000"},
    ]
    path.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    with pytest.raises(
        ValueError, match="qs.jsonl:2: need a JSON object with 'question' and 'answer'"
    ):
        load_questions(str(path), 0)


def test_env_overrides_read_lists_and_tuples_as_json_and_refuse_a_bad_boolean(monkeypatch):
    ns = {"EXAMPLE": ("q", "a"), "TARGETS": ["a"], "FLAG": False}
    monkeypatch.setenv("EXAMPLE", '["What?", "That."]')
    monkeypatch.setenv("TARGETS", '["q_proj", "v_proj"]')
    apply_env_overrides(ns, "x.py")
    assert ns["EXAMPLE"] == ("What?", "That.") and ns["TARGETS"] == ["q_proj", "v_proj"]
    monkeypatch.setenv("EXAMPLE", "null")
    apply_env_overrides(ns, "x.py")
    assert ns["EXAMPLE"] is None
    ns["EXAMPLE"] = ("q", "a")
    monkeypatch.setenv("EXAMPLE", "[not json")
    with pytest.raises(SystemExit, match="EXAMPLE='\\[not json': not a valid tuple"):
        apply_env_overrides(ns, "x.py")
    monkeypatch.delenv("EXAMPLE")
    monkeypatch.setenv("FLAG", "maybe")
    with pytest.raises(SystemExit, match="FLAG='maybe': not a valid bool.*1/0/true/false"):
        apply_env_overrides(ns, "x.py")


def test_only_a_files_own_constants_are_settings(monkeypatch):
    """STD_EPS=0.5 used to change the trainer's imported copy of features.advantages.STD_EPS but not
    the module's, so two functions held equal by the tests differed. An imported constant named in
    the environment stops at start, naming it (ref_server.py's MAX_RANKS, features/wire.py's); the
    file's own constants still take their variable (STD_EPS is now the lesson's own)."""
    for name, module in (("MAX_RANKS", "ref_server"),):
        run = subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            cwd=ROOT,
            text=True,
            env={**os.environ, name: "3"},
            capture_output=True,
            timeout=120,
        )
        assert run.returncode != 0 and f"{name} is not a setting of {module}.py" in run.stderr
    assert env_overrides.own_constants(vars(grpo)) >= {"ALL_STEPS", "BETA", "REWARDS"}
    assert "STD_EPS" in env_overrides.own_constants(vars(grpo))


def documented_constants() -> dict:
    """{module file: [constant names]} as docs/constants.md lists them, under each "## `file`"."""
    listed = {}
    current = None
    for line in open(os.path.join(ROOT, "docs", "constants.md")).read().splitlines():
        heading = re.match(r"## `([\w/]+\.py)`", line)
        if heading:
            current = listed.setdefault(heading.group(1), [])
        elif current is not None and line.startswith("| `"):
            first = line.split("|")[1]
            current += re.findall(r"`([A-Z][A-Z0-9_]*)`", first)
    return listed


def code_files() -> list:
    """The project's own code: the top-level modules, features/ and scripts/ (no tests, bench/)."""
    files = glob.glob(os.path.join(ROOT, "*.py"))
    files += glob.glob(os.path.join(ROOT, "features", "*.py"))
    return files + glob.glob(os.path.join(ROOT, "scripts", "*.py"))


def reads_of(path) -> tuple:
    """(bare names read in the file, `module.NAME` pairs read in it), from its NAME tokens (no
    comments, no strings), each module-level `NAME = ...` that defines a constant left out."""
    import io
    import tokenize

    bare = set()
    dotted = set()
    previous = []  # the last two significant tokens
    for token in tokenize.generate_tokens(io.StringIO(open(path).read()).readline):
        if token.type == tokenize.NAME:
            defines = token.start[1] == 0 and token.line.startswith(f"{token.string} =")
            if not defines:
                bare.add(token.string)
            after_dot = len(previous) == 2 and previous[1].string == "."
            if after_dot and previous[0].type == tokenize.NAME:
                dotted.add((previous[0].string, token.string))
        prefix = re.match(r"[A-Za-z]*", token.string).group(0).lower()
        if token.type == tokenize.STRING and "f" in prefix:  # an f-string's fields read names too
            for field in re.findall(r"\{([^{}]*)\}", token.string):
                bare.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", field))
        if token.type in (tokenize.NAME, tokenize.OP):
            previous = (previous + [token])[-2:]
    return bare, dotted


def test_every_documented_constant_is_read_by_some_code():
    """Issue 87: question_sampler.py's MAX_ROLLOUTS and worker.py's MAX_STALENESS were settings of
    their modules that nothing read (the lesson's own did the work), and rewards.EQUATION_SIGNS was
    unused: editing them changed nothing. Each constant docs/constants.md lists, and each constant
    of a module that reads its constants from the environment, is read by some code: its own
    module's, or another's as module.NAME."""
    reads = {os.path.relpath(path, ROOT): reads_of(path) for path in code_files()}
    settable = {}  # {file: its UPPER_CASE module-level names}, for files with an override call
    for file in reads:
        source = open(os.path.join(ROOT, file)).read()
        if "apply_env_overrides(globals()" in source:
            settable[file] = [target.id for node in ast.parse(source).body
                              if isinstance(node, ast.Assign) for target in node.targets
                              if isinstance(target, ast.Name) and target.id.isupper()]
    listed = documented_constants()
    assert "features/question_sampler.py" in settable and "grpo_ref_split.py" in settable
    unread = []
    for file in sorted(set(listed) | set(settable)):
        module = os.path.basename(file)[:-3]
        for name in set(listed.get(file, [])) | set(settable.get(file, [])):
            own = name in reads[file][0]
            elsewhere = any((module, name) in dotted for _, dotted in reads.values())
            if not (own or elsewhere):
                unread.append(f"{file}: {name}")
    assert unread == [], f"settings nothing reads: {unread}"


def changed_value(value):
    """A value of the same type as `value` that differs from it, as the environment spells it; None
    for a constant that holds functions or names (REWARDS, TOOLS: their own test)."""
    if isinstance(value, bool):
        return str(int(not value))
    if isinstance(value, (int, float)):
        return str(value + 1)
    if isinstance(value, str):
        return value + "_changed"
    if isinstance(value, tuple):
        return json.dumps(["a changed question?", "its answer"])
    return None


def test_every_documented_constant_is_set_by_its_environment_variable():
    """Issue 79: features/vision.py defined MIN_PIXELS and four more under its override call, so
    their variables were ignored without a word while docs/constants.md called them settable. Each
    constant the page lists, in each module, set from the environment in a child process, reads back
    as set."""
    import importlib

    listed = documented_constants()
    assert {"grpo_ref_split.py", "objectives.py", "ref_server.py"} <= set(listed)
    assert "features/vision.py" in listed
    assert "MIN_PIXELS" in listed["features/vision.py"]
    batches = [{}]  # {module: {name: raw}}, a name with one raw value per batch (one child each)
    for file, names in listed.items():
        module = file[:-3].replace("/", ".")
        defaults = vars(importlib.import_module(module))
        missing = [name for name in names if name not in defaults]
        assert not missing, f"docs/constants.md lists {missing} under {file}, which has none"
        wanted = {name: changed_value(defaults[name]) for name in names}
        wanted = {name: raw for name, raw in wanted.items() if raw is not None}
        batch = next(b for b in batches + [{}] if all(
            raw == env.get(name, raw) for env in b.values() for name, raw in wanted.items()))
        if batch not in batches:
            batches.append(batch)
        batch[module] = wanted
    for batch in batches:
        environment = {name: raw for wanted in batch.values() for name, raw in wanted.items()}
        plan = {module: sorted(wanted) for module, wanted in batch.items()}  # what to read back
        code = ("import importlib, json; print(json.dumps({m: {n: repr(getattr("
                "importlib.import_module(m), n)) for n in names} for m, names in "
                + repr(plan) + ".items()}))")
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                             text=True, timeout=300, env={**os.environ, **environment})
        assert run.returncode == 0, run.stderr[-2000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        for module, wanted in batch.items():
            defaults = vars(importlib.import_module(module))
            unchanged = [name for name in wanted if got[module][name] == repr(defaults[name])]
            assert not unchanged, f"{module}: {unchanged} ignore their environment variables"


# ----------------------------------------------------------------------------- ds_config.json
def test_ds_config_gets_the_trainers_settings_and_refuses_to_hold_them_itself(tmp_path):
    """One source of truth: LR, bf16 and the schedule's length come from grpo_ref_split.py; a config
    file that sets any of them is refused, naming them, instead of being silently overwritten."""
    from conftest import ROOT
    from features.zero2 import ds_config

    shipped = os.path.join(ROOT, "ds_config.json")
    config = ds_config(shipped, lr=3e-6, bf16=False, total_steps=60)
    assert config["optimizer"]["params"]["lr"] == 3e-6 and config["bf16"] == {"enabled": False}
    assert config["scheduler"]["params"]["total_num_steps"] == 60
    with open(shipped) as f:
        raw = json.load(f)
    for where, extra in (
        ("optimizer", {"lr": 1e-3}),
        (None, {"bf16": {"enabled": True}}),
        ("scheduler", {"total_num_steps": 5}),
    ):
        bad = json.loads(json.dumps(raw))
        (bad[where]["params"] if where else bad).update(extra)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match="sets one of lr \\(LR\\), bf16.*remove them"):
            ds_config(str(path), lr=3e-6, bf16=False, total_steps=60)
