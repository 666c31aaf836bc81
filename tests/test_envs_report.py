"""bench/envs_report.py's comparison of the mixed run against the runs alone at equal questions
per environment (issue 88 item 6), on metrics written here.

    python -m pytest tests/test_envs_report.py -q
"""
import json
import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import envs_report  # noqa: E402  (bench/ is not a package)


def write_metrics(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_mixed_is_set_against_alone_at_the_step_that_saw_as_many_questions(tmp_path, capsys):
    """Six mixed steps give arithmetic 2/3 of each step's completions (4 steps' worth) and the
    task 1/3 (2 steps' worth): arithmetic alone is read at its step 4, the task alone at step 2,
    whatever their last steps say."""
    mixed = [{"step": 0, "eval_reward_correct_arithmetic": 0.1, "eval_reward_correct_rg_t": 0.2}]
    mixed += [{"step": s, "share_arithmetic": 2 / 3, "share_rg_t": 1 / 3} for s in range(1, 7)]
    mixed += [{"step": 6, "eval_reward_correct_arithmetic": 0.5, "eval_reward_correct_rg_t": 0.6}]
    write_metrics(tmp_path / "envs_mix_s7_metrics.jsonl", mixed)
    for run, tag in (("arithmetic", "arithmetic"), ("rg", "rg_t")):
        alone = [{"step": s, f"eval_reward_correct_{tag}": s / 10} for s in (0, 2, 4, 6)]
        write_metrics(tmp_path / f"envs_{run}_s7_metrics.jsonl", alone)
    runs = envs_report.runs_in([str(tmp_path)])
    envs_report.equal_questions([str(tmp_path)], runs, envs_report.success_metrics(runs))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| arithmetic | 7 | 4.0 | 50.0 | 4 | 40.0 |",
                        "| rg_t | 7 | 2.0 | 60.0 | 2 | 20.0 |"]
