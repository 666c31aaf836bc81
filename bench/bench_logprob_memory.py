"""Peak extra memory of per-token log-probs + GRPO loss, forward and backward, on CPU.

Three ways to get log softmax(logits / T)[id] from an LM head's logits (B, T, V), each in its own
process (peak RSS above the RSS once the logits exist):
  naive         torch.log_softmax over the whole batch, then gather
  per-row loop  the same, one sequence at a time (autograd still keeps every row's output)
  ours          grpo_common.per_token_logps as the trainer calls it: a logsumexp per token,
                softmax recomputed LOGP_CHUNK tokens at a time, gradient written over the logits

    python bench/bench_logprob_memory.py            # B=8, T=512, V in {49152, 151936}; ~2 minutes here

Figures go to bench/results/logprob_memory.json.
"""
import json
import os
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
from grpo_common import per_token_logps
torch.manual_seed(0)
B, T, V, variant = {B}, {T}, {V}, {variant!r}
hidden = torch.randn(B, T, 64).requires_grad_()  # (B, T, H) a small LM head, so the logits are not a leaf
head = (torch.randn(64, V) / 8).requires_grad_()  # (H, V)
logits = hidden @ head  # (B, T, V) fp32
ids = torch.randint(0, V, (B, T))
ref, gen = -torch.rand(B, T), -torch.rand(B, T)
adv, mask = torch.randn(B), torch.ones(B, T, dtype=torch.bool)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.time()
if variant == "naive":
    logps = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[..., None]).squeeze(-1)  # (B, T)
elif variant == "loop":
    logps = torch.stack([torch.log_softmax(logits[b] / 0.7, -1).gather(-1, ids[b, :, None]).squeeze(-1)
                         for b in range(B)])  # (B, T)
else:
    logps = per_token_logps(logits, ids, 0.7, inplace_backward=True)  # (B, T)
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
        row = {"V": V, **{v: measure(V, v) for v in ("ours", "naive", "loop")}}
        o = row["ours"]
        print(f"V={V}: logits {o['logits_bytes'] / gib:.2f} GiB; extra peak, forward | forward+backward:")
        for v in ("naive", "loop", "ours"):
            r = row[v]
            row[f"fwd_ratio_{v}"] = r["fwd_extra_bytes"] / max(o["fwd_extra_bytes"], 1)
            row[f"fwd_bwd_ratio_{v}"] = r["fwd_bwd_extra_bytes"] / max(o["fwd_bwd_extra_bytes"], 1)
            print(f"  {v:6s} {r['fwd_extra_bytes'] / gib:6.3f} GiB ({row[f'fwd_ratio_{v}']:5.1f}x ours) | "
                  f"{r['fwd_bwd_extra_bytes'] / gib:6.3f} GiB ({row[f'fwd_bwd_ratio_{v}']:5.1f}x ours) | "
                  f"{r['seconds']:.1f} s",
                  flush=True)
        results["runs"].append(row)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "logprob_memory.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
