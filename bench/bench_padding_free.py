"""Step seconds and peak memory of the policy's forward and backward, padded against packed
(PADDING_FREE, features/packing.py), side by side in one run, on answer lengths a real run wrote.

    python bench/bench_padding_free.py output/completions.jsonl [more completions.jsonl ...]
    bash bench/padding_free_runs.sh   # RESULTS' rows: the demo's, GSM8K's at 256 and 512 tokens

For each file: the step with the most groups that train (their rewards differ), QUESTIONS of
them, each prompt as long as the trainer builds it and each answer as long as the model wrote it
(random tokens: the cost does not depend on which; STEPS_FILE keeps the lengths for another
machine). The batch is laid out by the trainer's collate, then each
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
DEVICE = os.environ.get("DEVICE", "cpu")  # "cuda": bf16 on the GPU, peak = max_memory_allocated
MODEL = os.environ.get("MODEL", "")  # a folder with config and tokenizer; "" = the embedded model
RANDOM_WEIGHTS = os.environ.get("RANDOM_WEIGHTS", "0") == "1"  # 1 = MODEL's config, random weights
ATTENTION = os.environ.get("ATTENTION", "sdpa")  # flash_attention_2: its varlen kernel, full rows
STEPS_FILE = os.environ.get("STEPS_FILE", "")  # write the step's [(prompt, [answers])] here
GRADIENT_CHECKPOINTING = os.environ.get("GRADIENT_CHECKPOINTING", "0") == "1"  # as the trainer's
QUESTIONS = int(os.environ.get("QUESTIONS", "4"))  # groups in the step measured (Q_BATCH_SIZE)
PATHS = {  # name: (SHARED_PREFIX, PADDING_FREE)
    "full rows, padded": (False, False),
    "full rows, packed": (False, True),
    "shared prefix, padded": (True, False),
    "shared prefix, packed": (True, True),
}


def step_lengths(path: str) -> list:
    """[(prompt tokens, [answer lengths])] of the step with the most groups that train, QUESTIONS
    of them; a .json file (STEPS_FILE's format) gives them as they are."""
    from padding_share import step_groups

    import grpo_ref_split as grpo
    from features.embedded_model import resolve_model_path
    from transformers import AutoTokenizer

    if path.endswith(".json"):
        with open(path) as f:
            return json.load(f)
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = step_groups(records, grpo.NUM_PRE_Q)
    trained = {step: [(q, lengths) for q, lengths, trains in groups if trains]
               for step, groups in steps.items()}
    step = max(trained, key=lambda s: (len(trained[s]), s))
    if not trained[step]:
        sys.exit(f"{path}: no step has a group that trains")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(grpo.MODEL_PATH))
    return [(len(tokenizer(grpo.build_prompt(tokenizer, q), add_special_tokens=False).input_ids),
             lengths) for q, lengths in trained[step][:QUESTIONS]]


def one_run(lengths_file: str, path_name: str) -> dict:
    """In a fresh process: the model, the batch, one forward and backward; seconds and bytes."""
    import torch

    import grpo_ref_split as grpo
    from features import fast_paths
    from features.embedded_model import resolve_model_path
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    shared_prefix, padding_free = PATHS[path_name]
    with open(lengths_file) as f:
        groups_lengths = json.load(f)
    model_path = MODEL or resolve_model_path(grpo.MODEL_PATH)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    attention = ATTENTION
    if shared_prefix and padding_free:  # its 4-D mask: flash-attention takes none
        attention = "sdpa"
    if RANDOM_WEIGHTS:
        config = AutoConfig.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                     attn_implementation=attention)
    model = model.to(DEVICE).train()
    if GRADIENT_CHECKPOINTING:  # as the trainer with GRADIENT_CHECKPOINTING=1 (features/zero2.py)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    groups = []
    for plen, lengths in groups_lengths:
        prompt = torch.randint(100, 20000, (plen,))  # (plen,) the cost does not read the tokens
        longest = max(lengths)
        answers = torch.randint(100, 20000, (len(lengths), longest))  # (G, t)
        mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]  # (G, t)
        tensors = dict(input_ids=torch.cat([prompt.expand(len(lengths), -1), answers], 1),
                       completion_mask=mask, advantages=torch.randn(len(lengths)),
                       scores=torch.zeros(len(lengths)))
        groups.append((tensors, {"plen": len(prompt)}))
    batch = grpo.on_device(grpo.collate(groups, tokenizer.pad_token_id or 0), DEVICE)
    T = batch.mask.shape[1]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux: KiB)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    logps = fast_paths.completion_logps(model, batch.input_ids, batch.attention_mask, T,
                                        grpo.TEMPERATURE, shared_prefix=shared_prefix,
                                        chunk=fast_paths.LOGP_CHUNK, from_hidden=True,
                                        padding_free=padding_free)  # (B, T)
    (logps * batch.advantages[:, None] * batch.mask).sum().backward()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    if DEVICE == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    rows = batch.input_ids.shape[0]
    return dict(seconds=seconds, peak_bytes=peak, rows=rows, columns=batch.input_ids.shape[1],
                real_tokens=int(batch.attention_mask.sum()))


def main(paths: list):
    import tempfile

    print(f"{REPEATS} repeats, {QUESTIONS} groups a step, on {DEVICE} ({ATTENTION}), gradient "
          f"checkpointing {GRADIENT_CHECKPOINTING}; each (path, repeat) a fresh process")
    for path in paths:
        lengths = step_lengths(path)
        if STEPS_FILE:  # the step's lengths, for a run elsewhere (a GPU's, bench/gpu_checks.sh)
            with open(STEPS_FILE, "w") as out:
                json.dump(lengths, out)
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
