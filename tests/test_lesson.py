"""Issue 37's lesson: the plain definitions in grpo_ref_split.py equal the fast paths the default
runs (value and gradient), and the rules a reader relies on hold (line widths and budgets, one-way
imports, quiet libraries).

    bash scripts/test.sh -k lesson
"""
import ast
import glob
import logging
import os
import subprocess
import sys

import pytest
import torch

import grpo_ref_split as grpo
from conftest import ROOT, free_port, tiny_config
from features import quiet

READ_BY_PEOPLE = ("grpo_ref_split.py", "ref_server.py", "rewards.py", "grpo_loss_triton.py")
# The feature modules a default step enters (python bench/lesson_path.py lists them), and the
# evaluation every EVAL_STEPS steps.
ON_A_DEFAULT_STEP = ("features/fast_paths.py", "features/wire.py", "features/run_log.py",
                     "features/http_server.py", "features/retry.py", "features/question_sampler.py",
                     "features/evaluation.py", "features/vision.py")


@pytest.fixture
def left_padded(tokenizer):
    """A tiny Llama and 2 groups of 3 rows: prompts of different lengths (left-padded), then 5
    answer tokens."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(tokenizer)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 400, (n,), generator=g) for n in (6, 4)]
    rows, masks = [], []
    for prompt in prompts:
        for _ in range(3):
            answer = torch.randint(5, 400, (5,), generator=g)
            pad = 6 - len(prompt)
            rows.append(torch.cat([torch.full((pad,), tokenizer.pad_token_id), prompt, answer]))
            masks.append(
                torch.cat(
                    [
                        torch.zeros(pad, dtype=torch.long),
                        torch.ones(len(prompt) + 5, dtype=torch.long),
                    ]
                )
            )
    return model, torch.stack(rows), torch.stack(masks)


def gradient_gap(got, want) -> float:
    """|got - want| / |want| over all parameters' gradients together. Two paths that add the same
    fp32 terms in other orders (a log-softmax over V = 49,152, chunks, a shared prompt) round
    differently, by about sqrt(V) x 2**-24 ~ 1.3e-5 of the gradient's size, and by processor (AVX2
    and AVX-512 sum differently): held to 1e-4 of the norm. Element by element, a gradient near 0
    can differ by more than any relative tolerance."""
    gap = sum(((g - w) ** 2).sum() for g, w in zip(got, want)) ** 0.5
    size = sum((w**2).sum() for w in want) ** 0.5
    return (gap / size).item()


@pytest.mark.parametrize("fast", [True, False])
def test_the_servers_reference_log_probs_are_the_lessons_definition(left_padded, fast):
    """One definition of a token's log-prob: ref_server.py's reference_logps (its default fast
    paths, or all of them off) gives the trainer's per_token_logps on the same rows, at the same
    temperature; at another temperature it would not."""
    import ref_server

    model, ids, attn = left_padded
    switches = dict(shared_prefix=fast, logp_from_hidden=fast, logp_chunk=128 if fast else 0)
    server = ref_server.RefServer(model, "tiny", ref_micro_batch=2, **switches)
    with torch.no_grad():
        want = grpo.per_token_logps(model, ids[:3], attn[:3], 5)  # (3, 5) the first group's
    got = server.reference_logps(ids[:3], ids.shape[1] - 5, grpo.TEMPERATURE)  # (3, 5)
    # the same fp32 sums in another order (chunks, a shared prompt): a few ulps of values near 10
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    other = server.reference_logps(ids[:3], ids.shape[1] - 5, 1.0)
    assert (other - want).abs().max() > 1e-3


def test_the_plain_log_probs_equal_the_default_fast_path_in_value_and_gradient(
    left_padded, monkeypatch
):
    """per_token_logps (logits -> log_softmax(logits / T) -> gather) against what the default runs:
    one forward of each shared prompt, chunks of the LM head from hidden states
    (features/fast_paths.py)."""
    model, ids, attn = left_padded
    params = [p for p in model.parameters()]
    # a loss that weighs every token
    weights = torch.randn(6, 5, generator=torch.Generator().manual_seed(2))
    for name in ("SHARED_PREFIX", "LOGP_FROM_HIDDEN"):
        assert getattr(grpo.fast_paths, name)  # the default runs the fast path
    fast = grpo.logps_for_run()(model, ids, attn, 5)  # (6, 5)
    fast_grads = torch.autograd.grad((fast * weights).sum(), params)
    for name, off in (("SHARED_PREFIX", False), ("LOGP_FROM_HIDDEN", False), ("LOGP_CHUNK", 0)):
        monkeypatch.setattr(grpo.fast_paths, name, off)
    plain = grpo.logps_for_run()(model, ids, attn, 5)  # every fast path off: the definition
    assert torch.equal(plain, grpo.per_token_logps(model, ids, attn, 5))
    plain_grads = torch.autograd.grad((plain * weights).sum(), params)
    torch.testing.assert_close(fast, plain, rtol=0, atol=2e-5)
    assert gradient_gap(fast_grads, plain_grads) <= 1e-4
    monkeypatch.setattr(grpo, "TEMPERATURE", 1.0)  # the temperature is every log-prob's
    assert (grpo.per_token_logps(model, ids, attn, 5) - plain).abs().max() > 1e-3


def test_with_every_fast_path_off_the_lessons_definition_is_what_trains(left_padded, monkeypatch):
    """The loss asks for the entropy too; with SHARED_PREFIX, LOGP_FROM_HIDDEN and LOGP_CHUNK off,
    per_token_logps still computes what it needs: features/fast_paths.py made to fail, a step's loss
    and gradient come, equal to the default's fast path, and the entropy metric is the
    definition's."""
    model, ids, attn = left_padded
    batch = grpo.Batch(
        input_ids=ids,
        attention_mask=attn,
        mask=torch.ones(6, 5, dtype=torch.bool),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]),
        ref_logps=torch.full((6, 5), -3.0),
        pi_old_logps=None,
        pi_old_rows=None,
        normalizer=6.0,
    )
    params = list(model.parameters())
    fast_loss, fast_m = grpo.choose_parts().loss(model, batch)
    fast_grads = torch.autograd.grad(fast_loss, params)
    for name, off in (("SHARED_PREFIX", False), ("LOGP_FROM_HIDDEN", False), ("LOGP_CHUNK", 0)):
        monkeypatch.setattr(grpo.fast_paths, name, off)

    def broken(*args, **kwargs):
        raise AssertionError("features/fast_paths.py ran with every fast path off")

    monkeypatch.setattr(grpo.fast_paths, "completion_logps", broken)
    loss, m = grpo.choose_parts().loss(model, batch)
    grads = torch.autograd.grad(loss, params)
    assert any(g.abs().sum() > 0 for g in grads)
    torch.testing.assert_close(loss, fast_loss, rtol=0, atol=2e-5)
    assert gradient_gap(grads, fast_grads) <= 1e-4
    _, entropy = grpo.per_token_logps(model, ids, attn, 5, with_entropy=True)
    assert m["entropy"] == pytest.approx(entropy.mean().item(), rel=1e-5)
    assert m["entropy"] == pytest.approx(fast_m["entropy"], rel=1e-4)


# ------------------------------------------------------------------------- rules a reader relies on
@pytest.mark.parametrize("name", READ_BY_PEOPLE + ON_A_DEFAULT_STEP)
def test_lines_people_read_have_no_backslash_continuations(name):
    lines = open(os.path.join(ROOT, name)).read().splitlines()
    continued = [i + 1 for i, line in enumerate(lines) if line.rstrip().endswith("\\")]
    assert not continued, f"{name}: backslash continuations {continued}"


def project_code_files() -> list:
    """Every file of code in the project: the Python and shell files at the top, in features/,
    scripts/, bench/, tests/ and .ci/ (not .venv/ or downloads)."""
    folders = ("", "features", "scripts", "bench", "tests", ".ci")
    found = []
    for folder in folders:
        here = os.path.join(ROOT, folder)
        found += [os.path.join(folder, name) for name in sorted(os.listdir(here))
                  if name.endswith((".py", ".sh")) or folder == ".ci" and name == "run"]
    return found


def test_every_line_of_code_fits_in_100_columns():
    """Issue 57: features/, scripts/, bench/ and tests/ too, not only the lesson's files."""
    files = project_code_files()
    assert "features/wire.py" in files and "tests/test_lesson.py" in files
    assert "scripts/run_demo.sh" in files and "bench/lesson_path.py" in files
    wide = []
    for name in files:
        lines = open(os.path.join(ROOT, name)).read().splitlines()
        wide += [f"{name}:{i + 1}" for i, line in enumerate(lines) if len(line) > 100]
    assert not wide, f"lines over 100 columns: {wide[:20]} ({len(wide)} in all)"


def test_the_lesson_holds_its_own_settings_and_no_namespace_is_handed_out():
    """The trainer's top holds the GRPO knobs (at most 40 settable constants); each optional
    feature's settings live in its own module. `globals()` appears only in a module's call that sets
    its own constants from the environment: no module reads another's settings by string key."""
    source = open(os.path.join(ROOT, "grpo_ref_split.py")).read()
    tree = ast.parse(source)
    override = next(n.lineno for n in tree.body if "apply_env_overrides" in ast.unparse(n))
    settable = [
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign) and n.lineno < override
        for t in n.targets
        if isinstance(t, ast.Name) and t.id.isupper()
    ]
    assert 30 <= len(settable) <= 40, settable
    for name in ("USE_VLLM", "LORA_RANK", "TOOLS", "SHARED_PREFIX", "EVAL_STEPS", "GENONLY"):
        assert name not in settable
    paths = glob.glob(os.path.join(ROOT, "*.py"))
    paths += glob.glob(os.path.join(ROOT, "features", "*.py"))
    handed = []
    for path in paths:
        for number, line in enumerate(open(path).read().splitlines(), 1):
            own_call = "apply_env_overrides(globals()" in line and not line.lstrip().startswith("#")
            if "globals()" in line and not own_call:
                handed.append(f"{os.path.basename(path)}:{number}")
    assert handed == [], handed


def test_the_training_loop_reads_as_the_seven_steps():
    """main()'s loop over steps stays short enough to read at once and names its steps; the steps
    it calls steps_1_to_5 name theirs."""
    source = open(os.path.join(ROOT, "grpo_ref_split.py")).read()
    tree = ast.parse(source)
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    loop = next(
        n
        for n in ast.walk(functions["main"])
        if isinstance(n, ast.For) and getattr(n.target, "id", "") == "step"
    )
    assert loop.end_lineno - loop.lineno + 1 <= 46
    text = ast.get_source_segment(source, loop)
    for step in ("1-5.", "6-7."):
        assert step in text
    text = ast.get_source_segment(source, functions["steps_1_to_5"])
    for step in ("1. draw", "2-4.", "5. upload"):
        assert step in text
    main = functions["main"]
    assert main.end_lineno - main.lineno + 1 <= 90


# The functions of the seven steps (README's "One GRPO step"), the loop's own helpers among them:
# the functions main's set-up hands the steps by default (choose_parts), and those they call.
STEP_FUNCTIONS = ("load_dataset", "draw_questions", "keep_no_outcomes", "question_prompt",
                  "encode_prompts", "decode", "sample_completions", "generate", "score_completions",
                  "group_advantages", "varied_groups", "scored_groups", "pack_groups",
                  "group_tensors", "upload_and_pull", "drop_untrainable", "steps_1_to_5", "collate",
                  "prepare_batch", "fixed_pi_old", "one_batch", "batches_of", "grpo_terms",
                  "policy_loss", "train_step")
# The lesson's helpers that read the variants' selectors, so a test on them is a variant's branch.
VARIANT_SWITCHES = ("advantage_variant_on", "loss_variant_on", "rescaled_at_step")
# The branches on a setting still inside the step functions, each with why it stays: none. The
# prompt's own constants are the lesson's (build_prompt is not among the steps' functions above,
# and reads them).
BRANCHES_LEFT = {}


def lesson_tree():
    return ast.parse(open(os.path.join(ROOT, "grpo_ref_split.py")).read())


def variant_constants() -> set:
    """The menu's selectors (grpo_ref_split.py's constants under "The menu of variants") and every
    setting of objectives.py."""
    import objectives

    source = open(os.path.join(ROOT, "grpo_ref_split.py")).read().splitlines()
    start = next(i for i, line in enumerate(source) if line.startswith("# The menu of variants"))
    end = next(i for i in range(start + 1, len(source)) if source[i].startswith("#"))
    menu = {line.split("=")[0].strip() for line in source[start + 1 : end]}
    own = {name for name in vars(objectives) if name.isupper()}
    return menu | own


def settings_branches() -> dict:
    """{step function: the tests of its branches that read a setting (an UPPER_CASE name, here or
    in a module, or a VARIANT_SWITCHES call)}, from the lesson's source."""
    functions = {f.name: f for f in lesson_tree().body if isinstance(f, ast.FunctionDef)}
    found = {}
    for name in STEP_FUNCTIONS:
        for node in ast.walk(functions[name]):
            if not isinstance(node, (ast.If, ast.IfExp, ast.While)):
                continue
            read = {m.id for m in ast.walk(node.test) if isinstance(m, ast.Name)}
            read |= {m.attr for m in ast.walk(node.test) if isinstance(m, ast.Attribute)}
            if any(r.isupper() and len(r) > 1 for r in read) or read & set(VARIANT_SWITCHES):
                found.setdefault(name, []).append(f"{node.lineno}: {ast.unparse(node.test)}")
    return found


def test_the_steps_choose_nothing_main_chose_once():
    """Issue 87: main's set-up (choose_parts) picks each part of a step once; the steps' functions
    call what they were handed and branch on no setting, but for the ones BRANCHES_LEFT names
    (printed with -s). A new branch on a setting inside a step fails here."""
    found = settings_branches()
    for name, tests in found.items():
        print(f"{name}: " + "; ".join(tests))
    assert {name: len(tests) for name, tests in found.items()} == {
        name: len(tests) for name, tests in BRANCHES_LEFT.items()}


def test_each_part_main_hands_the_steps_is_the_lessons_own_by_default(monkeypatch):
    """choose_parts with every constant at its default: the lesson's plain functions, or the fast
    paths that are on by default (the log-probs, the shared prompt), each tested equal elsewhere."""
    parts = grpo.choose_parts()
    task = parts.task
    assert task.load is grpo.load_dataset and task.draw is grpo.draw_questions
    assert task.prompt is grpo.question_prompt and task.score is grpo.score_completions
    assert task.rewards == (("reward_correct", 2.0), ("reward_format", 1.0))
    assert task.answer_held_out is None  # greedy (features/evaluation.greedy_answers)
    assert parts.record is grpo.keep_no_outcomes and parts.advantages is grpo.group_advantages
    assert parts.has_signal is grpo.varied_groups and parts.rescale is grpo.as_sampled
    assert parts.upload_meta == {}
    assert parts.loss.func is grpo.policy_loss and parts.loss.keywords["terms"] is grpo.grpo_terms
    assert parts.batches.func is grpo.batches_of and "split" not in parts.batches.keywords
    assert parts.batches.keywords["prepare"].keywords["fills"] == ()  # one pass, nothing to fix
    assert parts.rollout.func is grpo.fast_paths.shared_rollout  # SHARED_PREFIX, the default
    for name, off in (("SHARED_PREFIX", False), ("LOGP_FROM_HIDDEN", False), ("LOGP_CHUNK", 0)):
        monkeypatch.setattr(grpo.fast_paths, name, off)
    plain = grpo.choose_parts()
    assert plain.rollout is grpo.sample_completions and plain.logps_of is grpo.per_token_logps
    assert plain.loss.keywords["logps_of"] is grpo.per_token_logps


def test_the_variants_math_lives_in_objectives_not_in_the_lesson():
    """No CISPO, SAPO, GMPO, GSPO, RLOO, pass@k, GDPO, teacher or token-selection function in the
    lesson; each is objectives.py's."""
    import objectives

    defined = [f.name for f in lesson_tree().body if isinstance(f, ast.FunctionDef)]
    variants = ("cispo", "sapo", "gmpo", "gspo", "rloo", "passk", "gdpo", "distill", "topk",
                "entropy", "off_policy", "mismatch", "whiten", "scale_to_step")
    assert [name for name in defined if any(v in name for v in variants)] == []
    for name in ("cispo_surrogate", "sapo_surrogate", "gmpo_surrogate", "policy_log_ratio",
                 "rloo_advantages", "passk_advantages", "gdpo_advantages", "distill_advantages",
                 "topk_reverse_kl", "high_entropy_mask", "off_policy_mask", "mismatch_weights"):
        assert callable(getattr(objectives, name))


def test_pi_old_has_one_name_and_sampler_one_meaning():
    """Issue 78: pi_old is pi_old_logps in code, on the wire and in the metrics (not gen_logps,
    old_logps or behaviour_logps); "sampler" is the question sampler alone (vLLM's log-probs are
    vllm_logps)."""
    retired = {"gen_logps", "old_logps", "behaviour_logps", "sampler_logps", "gen_rows",
               "sampler_rows", "sampler_gap", "gen_logps_s"}
    found = []
    for name in project_code_files():
        if not name.endswith(".py") or name.startswith(("tests/", "bench/")):
            continue
        tree = ast.parse(open(os.path.join(ROOT, name)).read())
        words = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        words |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
        words |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        words |= {n.value for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        found += [f"{name}: {word}" for word in sorted(words & retired)]
    assert found == []


def test_the_counter_refuses_a_module_without_a_kind_and_finds_a_call_without_a_comment():
    """bench/lesson_path.py's rules on a recorded path written by hand: a line of features/tools.py
    (whose docstring declares no kind) is refused; a line of features/wire.py (a guard) counts as
    a guard's; a call into features/ on a lesson line without its kind in a comment is listed."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import lesson_path

    def recorded(ran):
        recorder = lesson_path.LineRecorder()
        for name, rows in ran.items():
            recorder.ran[name].update(rows)
        return lesson_path.Count(recorder)

    tools_source = lesson_path.SourceFile("features/tools.py")
    calculator = next(row for row, name in tools_source.names.items() if name == "calculator")
    body = min(row for row in tools_source.spans  # the function's first line of code
               if row > calculator and row not in tools_source.docstrings)
    count = recorded({"features/tools.py": {body}})
    assert count.read["features/tools.py"]
    assert [line.split()[0] for line in count.unkinded()] == ["features/tools.py"]
    assert lesson_path.SourceFile("features/wire.py").kind == "guard"
    trainer = lesson_path.SourceFile("grpo_ref_split.py")
    call = next(i + 1 for i, line in enumerate(trainer.lines)
                if "wire.encode_batch(" in line)  # commented "guard" in the lesson
    assert recorded({"grpo_ref_split.py": {call}}).calls_without_a_kind() == []
    plain = next(i + 1 for i, line in enumerate(trainer.lines) if "run_log.weight_gap(" in line)
    count = recorded({"grpo_ref_split.py": {plain}})
    assert count.calls_without_a_kind() == []  # "log" said on its line
    trainer.comments.clear()  # the same lines with their comments gone
    count.sources["grpo_ref_split.py"] = trainer
    assert count.calls_without_a_kind() == [f"grpo_ref_split.py:{plain} run_log.weight_gap"]


@pytest.mark.slow
def test_the_lesson_path_counts_a_default_step_and_every_call_says_its_kind(tiny_model_dir):
    """bench/lesson_path.py on the tiny model (the default step's code path, small sizes): it runs
    to its last line, enters no features/ module that declares no kind and no variant's file, and
    finds every call from the lesson into features/ commented with its kind."""
    env = {**os.environ, "MODEL_PATH": tiny_model_dir, "Q_BATCH_SIZE": "2", "NUM_PRE_Q": "4",
           "MAX_NEW_TOKENS": "16", "PORT": str(free_port())}  # a fixed port may be taken
    run = subprocess.run([sys.executable, "bench/lesson_path.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    last = lines[-1]
    assert last.startswith("must read: ") and "lines in the lesson's files (step " in last
    assert "(faster equal " in last and ", guard " in last and ", log " in last
    table = "\n".join(lines)
    for name in ("grpo_ref_split.py", "ref_server.py", "rewards.py", "features/fast_paths.py",
                 "features/wire.py", "features/run_log.py"):
        assert f"\n{name} " in "\n" + table
    assert "objectives.py" not in table and "teacher_mix" not in table
    assert "without its kind" not in table
    assert ", set-up " in last and ", docstrings " in last


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("rewards", ("features", "grpo_ref_split", "ref_server")),  # the task stands alone
        # the server never imports the trainer or the task
        ("ref_server", ("grpo_ref_split", "rewards")),
    ],
)
def test_imports_run_one_way(module, forbidden):
    code = (
        f"import sys; import {module}; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_no_feature_module_imports_the_trainer():
    for name in os.listdir(os.path.join(ROOT, "features")):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(ROOT, "features", name)).read())
            imported = {
                alias.name
                for node in ast.walk(tree)
                if isinstance(node, ast.Import)
                for alias in node.names
            }
            imported |= {
                node.module
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module
            }
            assert "grpo_ref_split" not in imported, name


def test_quiet_raises_the_libraries_log_levels_unless_verbose():
    from transformers.utils import logging as transformers_logging

    deepspeed_logger = logging.getLogger("DeepSpeed")
    before = (transformers_logging.get_verbosity(), deepspeed_logger.level)
    try:
        transformers_logging.set_verbosity_info()
        deepspeed_logger.setLevel(logging.INFO)
        quiet.quiet_libraries(verbose=True)  # VERBOSE: everything, as it comes
        assert (
            transformers_logging.get_verbosity() == logging.INFO
            and deepspeed_logger.level == logging.INFO
        )
        quiet.quiet_libraries(verbose=False)
        assert (
            transformers_logging.get_verbosity() == logging.ERROR
            and deepspeed_logger.level == logging.WARNING
        )
    finally:
        transformers_logging.set_verbosity(before[0])
        deepspeed_logger.setLevel(before[1])
        transformers_logging.enable_progress_bar()


@pytest.mark.parametrize("name", READ_BY_PEOPLE)
def test_no_local_name_shadows_the_files_functions_or_modules_and_no_nested_conditionals(name):
    tree = ast.parse(open(os.path.join(ROOT, name)).read())
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    top |= {
        (a.asname or a.name).split(".")[0]
        for n in tree.body
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    }
    shadows = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            names = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
            names |= {
                n.id
                for n in ast.walk(fn)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
            shadows += [f"{fn.name}: {n}" for n in sorted(names & top)]
    nested = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.IfExp)
        and any(c is not n and isinstance(c, ast.IfExp) for c in ast.walk(n))
    ]
    assert not shadows and not nested, (
        f"{name}: shadowing {shadows}, nested conditional expressions {nested}"
    )
