"""Peak extra memory of per-token log-probs + GRPO loss, forward and backward, on CPU.

Compares the toolkit's PyTorch path (ref_server.per_token_logps: logsumexp kept per token,
softmax recomputed per sequence in backward) with a naive full log_softmax, each variant in its
own process (peak RSS above the RSS once the logits exist), and prints the ratios:

    python bench/bench_logprob_memory.py            # B=8, T=512, V in {49152, 151936}; ~40 s here

Figures go to bench/results/logprob_memory.json. The gradient of the logits (B, T, V) is made
by every variant and is counted: it is what the next layer needs.
"""
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T = 8, 512
VOCABS = (49152, 151936)

CHILD = """
import resource, sys, time, torch
sys.path.insert(0, {root!r})
from grpo_ref_split import grpo_loss
from ref_server import per_token_logps
torch.manual_seed(0)
B, T, V, variant = {B}, {T}, {V}, {variant!r}
logits = torch.randn(B, T, V).requires_grad_()  # (B, T, V) fp32, as the LM head hands them over
ids = torch.randint(0, V, (B, T))
ref, gen = -torch.rand(B, T), -torch.rand(B, T)
adv, mask = torch.randn(B), torch.ones(B, T, dtype=torch.bool)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.time()
if variant == "naive":
    logps = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[..., None]).squeeze(-1)  # (B, T)
else:
    logps = per_token_logps(logits, ids, 0.7)  # (B, T)
loss = grpo_loss(logps, ref, gen, adv, mask, 0.04, 0.2)
fwd = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
loss.backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((fwd - base) * 1024, (peak - base) * 1024, time.time() - t, B * T * V * 4)
"""


def measure(V, variant):
    code = CHILD.format(root=ROOT, B=B, T=T, V=V, variant=variant)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    fwd, peak, seconds, logits_bytes = out.stdout.split()
    return dict(fwd_extra_bytes=int(fwd), fwd_bwd_extra_bytes=int(peak), seconds=float(seconds),
                logits_bytes=int(logits_bytes))


def main():
    results = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores", "B": B, "T": T, "runs": []}
    gib = 2**30
    for V in VOCABS:
        row = {"V": V, **{v: measure(V, v) for v in ("pytorch_path", "naive")}}
        p, n = row["pytorch_path"], row["naive"]
        row["fwd_ratio"] = n["fwd_extra_bytes"] / max(p["fwd_extra_bytes"], 1)
        row["fwd_bwd_ratio"] = n["fwd_bwd_extra_bytes"] / max(p["fwd_bwd_extra_bytes"], 1)
        results["runs"].append(row)
        print(f"V={V}: logits {p['logits_bytes'] / gib:.2f} GiB | extra peak, forward: naive {n['fwd_extra_bytes'] / gib:.2f} "
              f"GiB vs ours {p['fwd_extra_bytes'] / gib:.3f} GiB ({row['fwd_ratio']:.1f}x less) | forward+backward: naive "
              f"{n['fwd_bwd_extra_bytes'] / gib:.2f} GiB vs ours {p['fwd_bwd_extra_bytes'] / gib:.2f} GiB "
              f"({row['fwd_bwd_ratio']:.1f}x less) | time naive {n['seconds']:.1f} s, ours {p['seconds']:.1f} s", flush=True)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "logprob_memory.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
