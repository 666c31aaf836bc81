"""Fused Triton GRPO loss vs the PyTorch path on a GPU: forward+backward time and peak memory.

    # needs a CUDA GPU; B=8, T=1024, V in {32768, 151936}, bf16 logits
    python bench/bench_kernel.py

Prints the ratios measured side by side in one run and writes bench/results/kernel.json. Without
a GPU it stops with a message (the CPU memory comparison is bench/bench_logprob_memory.py).
"""
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
B = 8  # answers in the batch
T = 1024  # tokens per answer
VOCABS = (32768, 151936)  # vocabulary sizes timed: Mistral's and Qwen2.5's
REPEATS = 10  # timed forward+backward passes per setting


def run(fn, logits):
    """(ms per forward+backward, peak extra bytes) of fn(logits) -> loss."""
    for _ in range(2):  # warm-up: Triton compiles on the first call
        fn(logits).backward()
        logits.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        fn(logits).backward()
        logits.grad = None
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPEATS, torch.cuda.max_memory_allocated() - base


def main():
    if not torch.cuda.is_available():
        sys.exit(
            "bench_kernel.py needs a CUDA GPU and found none. On CPU, run "
            "bench/bench_logprob_memory.py."
        )
    from grpo_loss_triton import grpo_loss_triton

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from reference_loss import torch_loss  # the trainer's PyTorch loss with the kernel's keywords
    from features.fast_paths import chunked_logps

    results = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "B": B,
        "T": T,
        "runs": [],
    }
    for V in VOCABS:
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(
            B, T, V, device="cuda", dtype=torch.bfloat16, generator=g
        ).requires_grad_()
        ids = torch.randint(0, V, (B, T), device="cuda", generator=g)
        ref, gen = (
            -torch.rand(B, T, device="cuda", generator=g),
            -torch.rand(B, T, device="cuda", generator=g),
        )
        adv, mask = (
            torch.randn(B, device="cuda", generator=g),
            torch.ones(B, T, dtype=torch.bool, device="cuda"),
        )
        args = dict(
            ref_logps=ref, pi_old_logps=gen, advantages=adv, mask=mask, beta=0.04, clip_eps=0.2
        )
        torch_ms, torch_mem = run(
            lambda x: torch_loss(logps=chunked_logps(x, ids, 0.7, chunk=128), **args), logits
        )
        triton_ms, triton_mem = run(
            lambda x: grpo_loss_triton(logits=x, completion_ids=ids, temperature=0.7, **args),
            logits,
        )
        row = dict(
            V=V,
            torch_ms=torch_ms,
            triton_ms=triton_ms,
            torch_peak_bytes=torch_mem,
            triton_peak_bytes=triton_mem,
            speedup=torch_ms / triton_ms,
            memory_ratio=torch_mem / max(triton_mem, 1),
        )
        results["runs"].append(row)
        print(
            f"V={V}: PyTorch path {torch_ms:.2f} ms, {torch_mem / 2**30:.2f} GiB | Triton "
            f"{triton_ms:.2f} ms, {triton_mem / 2**30:.2f} GiB | {row['speedup']:.2f}x faster, "
            f"{row['memory_ratio']:.2f}x less memory"
        )
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "kernel.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
