"""Step seconds and peak memory of the policy's forward and backward, padded against packed
(PADDING_FREE, features/packing.py), side by side in one run, on answer lengths a real run wrote.

    python bench/bench_padding_free.py output/completions.jsonl [more completions.jsonl ...]
    REPEATS=3 QUESTIONS=4 python bench/bench_padding_free.py /tmp/demo/completions.jsonl \
        /tmp/gsm256/completions.jsonl /tmp/gsm512/completions.jsonl

For each file: the step with the most groups that train (their rewards differ), QUESTIONS of them,
each prompt as the trainer builds it and each answer as long as the model wrote it (random tokens:
the cost does not depend on which). The batch is laid out by the trainer's collate, then each
path runs step 6's forward and backward of the log-probs (completion_logps as the trainer's
logps_of calls it: from the hidden states, LOGP_CHUNK tokens at a time) on the embedded model in
fp32. Four paths: full rows and the shared prefix, each padded and packed. Each (path, repeat)
runs in a fresh process, the paths interleaved within each repeat, so the machine's noise falls
on all of them alike; peak memory is the process's peak resident size above its size before the
step. The ratios are packed over padded, of the medians.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

REPEATS = int(os.environ.get("REPEATS", "3"))  # fresh processes per path
QUESTIONS = int(os.environ.get("QUESTIONS", "4"))  # groups in the step measured (Q_BATCH_SIZE)
PATHS = {  # name: (SHARED_PREFIX, PADDING_FREE)
    "full rows, padded": (False, False),
    "full rows, packed": (False, True),
    "shared prefix, padded": (True, False),
    "shared prefix, packed": (True, True),
}


def step_lengths(path: str) -> list:
    """[(question, [answer lengths])] of the step with the most groups that train, QUESTIONS of
    them."""
    from padding_share import step_groups

    import grpo_ref_split as grpo

    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = step_groups(records, grpo.NUM_PRE_Q)
    trained = {step: [(q, lengths) for q, lengths, trains in groups if trains]
               for step, groups in steps.items()}
    step = max(trained, key=lambda s: (len(trained[s]), s))
    if not trained[step]:
        sys.exit(f"{path}: no step has a group that trains")
    return trained[step][:QUESTIONS]


def one_run(lengths_file: str, path_name: str) -> dict:
    """In a fresh process: the model, the batch, one forward and backward; seconds and bytes."""
    import torch

    import grpo_ref_split as grpo
    from features import fast_paths
    from features.embedded_model import resolve_model_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    shared_prefix, padding_free = PATHS[path_name]
    with open(lengths_file) as f:
        groups_lengths = json.load(f)
    model_path = resolve_model_path(grpo.MODEL_PATH)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
    groups = []
    for question, lengths in groups_lengths:
        prompt = tokenizer(grpo.build_prompt(tokenizer, question), add_special_tokens=False,
                           return_tensors="pt").input_ids[0]  # (plen,)
        longest = max(lengths)
        answers = torch.randint(100, 20000, (len(lengths), longest))  # (G, t)
        mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]  # (G, t)
        tensors = dict(input_ids=torch.cat([prompt.expand(len(lengths), -1), answers], 1),
                       completion_mask=mask, advantages=torch.randn(len(lengths)),
                       rewards=torch.zeros(len(lengths)))
        groups.append((tensors, {"plen": len(prompt)}))
    batch = grpo.collate(groups, tokenizer.pad_token_id or 0)
    T = batch.mask.shape[1]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux: KiB)
    start = time.perf_counter()
    logps = fast_paths.completion_logps(model, batch.input_ids, batch.attention_mask, T,
                                        grpo.TEMPERATURE, shared_prefix=shared_prefix,
                                        chunk=fast_paths.LOGP_CHUNK, from_hidden=True,
                                        padding_free=padding_free)  # (B, T)
    (logps * batch.advantages[:, None] * batch.mask).sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    rows = batch.input_ids.shape[0]
    return dict(seconds=seconds, peak_bytes=peak, rows=rows, columns=batch.input_ids.shape[1],
                real_tokens=int(batch.attention_mask.sum()))


def main(paths: list):
    import tempfile

    print(f"{REPEATS} repeats, {QUESTIONS} groups a step; each (path, repeat) a fresh process")
    for path in paths:
        lengths = step_lengths(path)
        answers = [n for _, group in lengths for n in group]
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(lengths, f)
        runs = {name: [] for name in PATHS}
        for _ in range(REPEATS):
            for name in PATHS:  # interleaved: the machine's noise falls on every path alike
                out = subprocess.run([sys.executable, __file__, "--one", f.name, name],
                                     capture_output=True, text=True, check=True)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        os.unlink(f.name)
        first = runs["full rows, padded"][0]
        print(f"\n{path}: {len(answers)} answers, lengths {min(answers)}-{max(answers)} (mean "
              f"{sum(answers) / len(answers):.0f}); padded {first['rows']} x {first['columns']} "
              f"= {first['rows'] * first['columns']:,} tokens, {first['real_tokens']:,} real")
        print(f"{'path':<24}{'step s (median, each)':<34}{'peak GiB (median)':>18}")
        medians = {}
        for name, results in runs.items():
            seconds = [r["seconds"] for r in results]
            peak = statistics.median(r["peak_bytes"] for r in results) / 2**30
            medians[name] = (statistics.median(seconds), peak)
            each = ", ".join(f"{s:.2f}" for s in seconds)
            print(f"{name:<24}{medians[name][0]:>6.2f} ({each}){'':<4}{peak:>12.2f}")
        for kind in ("full rows", "shared prefix"):
            padded = medians[f"{kind}, padded"]
            packed = medians[f"{kind}, packed"]
            print(f"{kind}: packed / padded  step {packed[0] / padded[0]:.2f}x  "
                  f"peak memory {packed[1] / max(padded[1], 1e-9):.2f}x")


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        print(json.dumps(one_run(sys.argv[2], sys.argv[3])))
    else:
        main(sys.argv[1:])
