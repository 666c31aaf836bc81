"""bench/envs_report.py's comparison of the mixed run against the runs alone at equal questions
per environment (issue 88 item 6), on metrics written here.

    python -m pytest tests/test_envs_report.py -q
"""
import json
import os
import sys

import pytest

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


def test_a_probe_file_without_a_score_stops_the_report_with_its_name(tmp_path, capsys):
    """An empty probe file (a probe killed mid-write by an older bench/run_envs.sh) is named, not
    a JSONDecodeError's traceback, and a whole one beside it is still read as before."""
    (tmp_path / "unseen_base_s7.json").write_text(json.dumps({"eval_reward_correct": 0.5}))
    envs_report.unseen([str(tmp_path)])
    assert "| base | 7 | 50.0 |" in capsys.readouterr().out
    (tmp_path / "envs_mix_s7_unseen.json").write_text("")
    with pytest.raises(SystemExit) as stopped:
        envs_report.unseen([str(tmp_path)])
    assert "envs_mix_s7_unseen.json holds no probe's score" in str(stopped.value)
