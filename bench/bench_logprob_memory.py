"""Peak memory and time of per-token log-probs + GRPO loss, forward and backward, from the LM head's
input.

Three ways to get log softmax(hidden @ W.T / T)[id], each measured in its own process (extra peak
above the memory once hidden states (B, T, H) and head W (V, H) exist: RSS on CPU,
max_memory_allocated on a GPU):
  naive    logits = hidden @ W.T, then torch.log_softmax and gather (the definition) logits
  LOGP_FROM_HIDDEN = False: the whole logits, then features/fast_paths.chunked_logps (softmax
           recomputed LOGP_CHUNK tokens at a time, the gradient written over the logits)
  chunked  LOGP_FROM_HIDDEN = True: features/fast_paths.hidden_logps, LOGP_CHUNK tokens of logits at
  a time
A variant is skipped where it would not fit (naive ~3x, logits ~1.3x the fp32/bf16 logits).
Then the time of chunked against logits, alternating in one process, for each LOGP_CHUNK in CHUNKS.

    # CPU: fp32, H=64; ~10 minutes here. On a GPU: bf16, H=896
    python bench/bench_logprob_memory.py
    # other sizes; CHUNKS= skips the timing
    H=64 LOGP_CHUNK=1024 CHUNKS= python bench/bench_logprob_memory.py

Figures go to bench/results/logprob_memory.json (_gpu on a GPU, then _H64 etc. for what the
environment set). """
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = torch.cuda.is_available()
B = 8
SHAPES = [
    tuple(map(int, s.split("x")))  # (T, V) pairs, e.g. SHAPES=1024x49152,4096x151936
    for s in os.environ.get("SHAPES", "1024x49152,1024x151936,4096x49152,4096x151936").split(",")
]
H = int(os.environ.get("H", 896 if GPU else 64))  # hidden size; 896 = Qwen2.5-0.5B's (V 151936)
# (T, V) where the two paths are timed side by side
TIME_SHAPE = (4096, 151936) if GPU else (1024, 49152)
MEMORY_CHUNK = int(os.environ.get("LOGP_CHUNK", 128))  # LOGP_CHUNK of the memory runs
# timed
CHUNKS = [
    int(c) for c in os.environ.get("CHUNKS", "128,512,1024" if GPU else "128").split(",") if c
]
REPEATS = 5 if GPU else 3

CHILD = """
import json, resource, sys, time, torch
sys.path.insert(0, {root!r})
from features.fast_paths import hidden_logps, chunked_logps
sys.path.insert(0, {root!r} + "/tests")
from reference_loss import torch_loss  # the trainer's PyTorch loss with the kernel's keywords
gpu = torch.cuda.is_available()
dev, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
B, T, V, H, variants, repeats = {B}, {T}, {V}, {H}, {variants!r}, {repeats}
chunk = {chunk}
g = torch.Generator(device=dev).manual_seed(0)
hidden = torch.randn(B, T, H, device=dev, generator=g).to(dtype).requires_grad_()  # (B, T, H)
head = (torch.randn(V, H, device=dev, generator=g) / H**0.5).to(dtype).requires_grad_()  # (V, H)
ids = torch.randint(0, V, (B, T), device=dev, generator=g)  # (B, T)
ref = -torch.rand(B, T, device=dev, generator=g)  # (B, T)
gen = -torch.rand(B, T, device=dev, generator=g)  # (B, T)
adv = torch.randn(B, device=dev, generator=g)  # (B,)
mask = torch.ones(B, T, dtype=torch.bool, device=dev)  # (B, T)

def logps(variant):
    if variant == "chunked":
        return hidden_logps(hidden, head, ids, 0.7, chunk=chunk)  # (B, T)
    logits = hidden @ head.T  # (B, T, V)
    if variant == "naive":
        logp_all = torch.log_softmax(logits.float() / 0.7, -1)  # (B, T, V)
        return logp_all.gather(-1, ids[..., None]).squeeze(-1)  # (B, T)
    return chunked_logps(logits, ids, 0.7, chunk=chunk, inplace_backward=True)  # (B, T)

def memory():
    if gpu:
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def step(variant):
    loss = torch_loss(logps=logps(variant), ref_logps=ref, pi_old_logps=gen, advantages=adv,
                      mask=mask, beta=0.04, clip_eps=0.2)
    loss.backward()
    hidden.grad = head.grad = None

if len(variants) == 1:  # memory: one pass in a fresh process
    if gpu:
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = memory()
    step(variants[0])
    print(json.dumps(dict(extra_bytes=memory() - base)))
else:  # time: the variants alternate, after one warm-up each
    seconds = {{v: [] for v in variants}}
    for r in range(repeats + 1):
        for v in variants:
            if gpu:
                torch.cuda.synchronize()
            t = time.perf_counter()
            step(v)
            if gpu:
                torch.cuda.synchronize()
            if r:
                seconds[v].append(time.perf_counter() - t)
    print(json.dumps({{v: sorted(s)[len(s) // 2] for v, s in seconds.items()}}))
"""


def child(T, V, variants, chunk=128, repeats=1):
    code = CHILD.format(
        root=ROOT, B=B, T=T, V=V, H=H, variants=list(variants), chunk=chunk, repeats=repeats
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def fits(variant, logits_bytes):
    """Whether a variant's (B, T, V) buffers fit, with room to spare."""
    need = {"naive": 3.2, "logits": 1.4, "chunked": 0.0}[variant] * logits_bytes
    free = (
        torch.cuda.mem_get_info()[0]
        if GPU
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    )
    return need < 0.9 * free


def main():
    gib = 2**30
    elem = 2 if GPU else 4  # bytes per value: bf16 on a GPU, float32 on the CPU
    machine = torch.cuda.get_device_name() if GPU else f"{os.cpu_count()} CPU cores"
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "B": B,
        "H": H,
        "LOGP_CHUNK": MEMORY_CHUNK,
        "dtype": "bf16" if GPU else "fp32",
        "memory": [],
        "time": [],
    }
    print(
        f"{machine}: B={B}, H={H}, {results['dtype']}, LOGP_CHUNK={MEMORY_CHUNK}; extra peak "
        "memory of forward+backward:",
        flush=True,
    )
    for T, V in SHAPES:
        fp32_logits = B * T * V * 4
        row = {"T": T, "V": V, "fp32_logits_bytes": fp32_logits}
        for variant in ("chunked", "logits", "naive"):
            if fits(variant, B * T * V * elem):
                row[variant] = child(T, V, [variant], chunk=MEMORY_CHUNK)["extra_bytes"]
        row["fp32_logits_over_chunked"] = fp32_logits / row["chunked"]
        results["memory"].append(row)
        shown = " | ".join(
            f"{v} {row[v] / gib:6.2f} GiB" if v in row else f"{v} (does not fit)"
            for v in ("naive", "logits", "chunked")
        )
        print(
            f"  T={T:5d} V={V:6d}: {shown} | full fp32 logits {fp32_logits / gib:5.2f} GiB = "
            f"{row['fp32_logits_over_chunked']:.0f}x chunked",
            flush=True,
        )
    T, V = TIME_SHAPE
    print(
        f"time of forward+backward at T={T}, V={V} (median of {REPEATS}, alternating):", flush=True
    )
    for chunk in CHUNKS:
        s = child(T, V, ["logits", "chunked"], chunk=chunk, repeats=REPEATS)
        results["time"].append(
            {"T": T, "V": V, "LOGP_CHUNK": chunk, **s, "ratio": s["chunked"] / s["logits"]}
        )
        print(
            f"  LOGP_CHUNK={chunk:5d}: logits {s['logits']:.3f} s, chunked {s['chunked']:.3f} s = "
            f"{s['chunked'] / s['logits']:.2f}x",
            flush=True,
        )
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    name = (
        "logprob_memory"
        + ("_gpu" if GPU else "")
        + "".join(f"_{k}{os.environ[k]}" for k in ("H", "LOGP_CHUNK") if k in os.environ)
        + ".json"
    )
    with open(os.path.join(ROOT, "bench", "results", name), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
