"""Two machines, played on this one: two `deepspeed --no_ssh` launchers (node ranks 0 and 1, one CPU
rank each, the master on loopback, gloo) train one model against one reference server."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, free_port, metrics, params, trainer_env


def test_two_nodes_train_the_same_weights_and_reduce_their_metrics(
    server, tiny_model_dir, tmp_path
):
    hostfile = tmp_path / "hostfile"
    # names only: --no_ssh never connects to them
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port, out = free_port(), tmp_path / "out"
    env = trainer_env(tiny_model_dir, server.url, out, ALL_STEPS=3, EVAL_STEPS=0)
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    nodes = [
        subprocess.Popen(
            [
                deepspeed,
                "--hostfile",
                str(hostfile),
                "--no_ssh",
                "--node_rank",
                str(node),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "grpo_ref_split.py",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    # node 1's rank 1 does not print
    assert "step    3 | loss" in logs[0] and "step    1 | loss" not in logs[1]
    # node b runs global rank 1
    assert "node_rank=1" in logs[1] and "{'node-a': [0], 'node-b': [1]}" in logs[1]

    lines, _ = metrics(out)
    assert [m["step"] for m in lines] == [1, 2, 3]
    # after every step both nodes hold the same weights
    assert all(m["max_weight_gap"] == 0.0 for m in lines)
    # Metrics are means over both nodes' ranks: the reward metric is the mean of each rank's answers
    # of the step (every rollout it sampled, 2 questions x 4 answers each), which completions.jsonl
    # holds for both.
    answers = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    for m in lines:
        ranks = [
            [a["reward"] for a in answers if a["step"] == m["step"] and a["rank"] == r]
            for r in (0, 1)
        ]
        # node 1's answers reached rank 0's file
        assert len(ranks[1]) >= 8 and len(ranks[1]) % 8 == 0
        assert m["reward"] == pytest.approx(sum(sum(x) / len(x) for x in ranks) / 2, abs=1e-5)
    trained = params(out / "step_3")
    start = params(tiny_model_dir)
    assert any((trained[k] != start[k]).any() for k in start)
