#!/usr/bin/env bash
# What a session lent a GPU runs (no registry there: the missing packages travel as wheels in .whl/,
# SmolLM2's config and tokenizer in .gpu/; its weights are random, which is enough for these
# checks):
#   bash bench/gpu_checks.sh part1   # Triton tests on the compiled kernels, bench_kernel.py
#   bash bench/gpu_checks.sh part2   # a bf16 ZeRO-2 gradient three ways, bench_logprob_memory.py
#   bash bench/gpu_checks.sh part3   # the bf16 gradient, LOGP_FROM_HIDDEN on and off, against fp32
#   bash bench/gpu_checks.sh part4   # bf16 CUDA weights over the weight channel; the plan's verdict
#   bash bench/gpu_checks.sh part5   # vLLM for a tiny Qwen2.5-VL (needs vllm, torchvision in .whl/)
#   bash bench/gpu_checks.sh part6   # the Triton tests compiled; every loss variant on the GPU in
#                                    # fp32 and bf16 against the CPU; bench_kernel.py (no DeepSpeed)
#   bash bench/gpu_checks.sh part7   # padding-free against padded (bench_padding_free.py) in bf16
#                                    # on the three steps' lengths in bench/results/, sdpa and, if
#                                    # flash_attn is in .whl/, flash-attention's varlen kernel
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
if [ "$1" = part1 ]; then
  nvidia-smi -L
  python3 -c "import torch, triton, transformers as t, deepspeed as d
print(torch.__version__, triton.__version__, t.__version__, d.__version__)"
  python3 -m pytest -q -p no:cacheprovider tests/test_triton.py 2>&1 | tail -8
  python3 bench/bench_kernel.py && cp bench/results/kernel.json "$OUT"/
elif [ "$1" = part7 ]; then
  nvidia-smi -L
  python3 -m pytest -q -p no:cacheprovider tests/test_packing.py 2>&1 | tail -3
  for steps in demo gsm256 gsm512; do
    DEVICE=cuda MODEL=.gpu RANDOM_WEIGHTS=1 python3 bench/bench_padding_free.py \
      bench/results/padding_free_$steps.json 2>&1 | tee -a "$OUT"/padding_free.txt
    if python3 -c "import flash_attn" 2>/dev/null; then
      DEVICE=cuda MODEL=.gpu RANDOM_WEIGHTS=1 ATTENTION=flash_attention_2 \
        python3 bench/bench_padding_free.py bench/results/padding_free_$steps.json 2>&1 \
        | tee -a "$OUT"/padding_free.txt
    fi
  done
elif [ "$1" = part6 ]; then
  nvidia-smi -L
  python3 -m pytest -q -p no:cacheprovider tests/test_triton.py 2>&1 | tail -8
  python3 bench/gpu_loss_variants.py 2>&1 | tee "$OUT"/loss_variants.txt
  python3 bench/bench_kernel.py && cp bench/results/kernel.json "$OUT"/
elif [ "$1" = part5 ]; then
  # Issue 58: vLLM samples a tiny Qwen2.5-VL with images at the log-probs the trainer computes and
  # follows its pushes (the CPU checks stop at vLLM's expansion rule: no torchvision there).
  python3 -c "from features import vision_demo
vision_demo.build_qwen('.gpu', '/tmp/qwen25', seed=0, kind='qwen2_5_vl')"
  python3 tests/vllm_vision_checks.py /tmp/qwen25 2>&1 | tail -5
elif [ "$1" = part4 ]; then
  python3 - <<'PY'
# A bf16 CUDA policy published, fetched, checked and swapped into a bf16 CUDA worker; a corrupted
# version refused with the worker untouched; the memory plan's verdict against this host's RAM.
import hashlib, socket, time, torch, transformers
from features import memory_plan, weight_sync
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                               tie_word_embeddings=True)
torch.manual_seed(0)
policy = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
worker = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
pub = weight_sync.start_publisher(policy, 1, rank=0, every=1, host="127.0.0.1", port=port, token="")
f = weight_sync.WeightFetcher(f"http://127.0.0.1:{port}", "", 0, poll_s=0.05,
                              max_bytes=weight_sync.weights_budget(worker),
                              check=lambda t: weight_sync.check_weights(worker, t))
start = time.time()
while (got := f.take()) is None:
    time.sleep(0.01)
weight_sync.swap_in(worker, got[1])
same = all(torch.equal(a, b) for a, b in zip(policy.parameters(), worker.parameters()))
print(f"bf16 on {torch.cuda.get_device_name()}: version {got[0]} fetched, checked and swapped in "
      f"{time.time() - start:.2f} s, {len(pub.current[1]) / 2**20:.1f} MiB, equal: {same}")
with torch.no_grad():
    next(policy.parameters()).view(-1)[0] = float("nan")
weight_sync.publish_every(pub, policy, 2, 1)
time.sleep(3)
pairs = list(zip(policy.parameters(), worker.parameters()))[1:]  # all but the NaN one
print(f"a NaN version: refused {f.counts['refused']}, worker still version-1 weights: "
      f"{all(torch.equal(a, b) for a, b in pairs)}")
f.stop(); pub.stop()
shape = memory_plan.model_shape("bench/configs/qwen2.5-7b")
setting = memory_plan.Setting(offload_optimizer=True, gradient_checkpointing=True,
                              train_micro_batch=1, max_new_tokens=512, prompt_tokens=256)
gpu = torch.cuda.get_device_properties(0).total_memory
rows = memory_plan.plan(shape, setting, gpu)
print(memory_plan.table(rows, gpu, torch.cuda.get_device_name(), memory_plan.free_ram()))
PY
elif [ "$1" = part3 ]; then
  python3 - <<'PY'
# Is the bf16 gap between LOGP_FROM_HIDDEN on and off rounding? Both against the same step in fp32.
import sys, torch, transformers
sys.path.insert(0, "tests")
import grpo_ref_split as grpo
from zero2_gradient import rank_groups
from test_variants import PlainEngine
tok = transformers.AutoTokenizer.from_pretrained(".gpu")
torch.manual_seed(0)
config = transformers.AutoConfig.from_pretrained(".gpu")
fp32 = transformers.AutoModelForCausalLM.from_config(config).cuda()
groups = rank_groups(fp32, tok, 0)

def grads(model, hidden):
    grpo.fast_paths.LOGP_FROM_HIDDEN = hidden
    model.zero_grad()
    engine = PlainEngine(model, lr=0.0)  # the engine calls the loss makes, on a plain model
    engine.device = torch.device("cuda")
    for part in grpo.batches_of(engine, groups, tok.pad_token_id):
        grpo.policy_loss(engine, part)[0].backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters()}

def rel(a, b):
    gap = sum(((a[n] - b[n]) ** 2).sum() for n in a)
    return (gap / sum((a[n] ** 2).sum() for n in a)).item() ** 0.5

ref = grads(fp32, False)
print(f"fp32: hidden vs logits path, relative L2 {rel(ref, grads(fp32, True)):.2e}")
bf16 = fp32.to(torch.bfloat16)
lo, hi = grads(bf16, False), grads(bf16, True)
print(f"bf16 vs fp32, relative L2: logits path {rel(ref, lo):.2e}, hidden path {rel(ref, hi):.2e}; "
      f"bf16 hidden vs bf16 logits {rel(lo, hi):.2e}")
PY
else
  python3 - <<'PY'
import torch, transformers
cfg = transformers.AutoConfig.from_pretrained(".gpu")
torch.manual_seed(0)
# random SmolLM2-135M weights
transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(".gpu")
PY
  for v in "logits LOGP_FROM_HIDDEN=0" "hidden LOGP_FROM_HIDDEN=1" "triton USE_TRITON=1"; do
    set -- $v
    env MODEL_PATH=.gpu MU=2 $2 deepspeed --num_gpus 1 tests/zero2_gradient.py "$OUT/$1.pt" \
      >"$OUT/$1.log" 2>&1 || tail -25 "$OUT/$1.log"
  done
  python3 - "$OUT" <<'PY'
import sys, torch
d = {k: torch.load(f"{sys.argv[1]}/{k}.pt") for k in ("logits", "hidden", "triton")}

def compare(a, b, what):
    scale = max(g.float().abs().max() for g in a.values())
    worst = max((g.float() - b[n].float()).abs().max() for n, g in a.items()) / scale
    gap = sum(((g.float() - b[n].float()) ** 2).sum() for n, g in a.items())
    rel = (gap / sum((g.float() ** 2).sum() for g in a.values())) ** 0.5
    print(f"bf16 ZeRO-2 gradient, {what}: max |diff| / max |grad| = {worst:.2e}, "
          f"relative L2 = {rel:.2e}")

base = d["logits"][1, 0]["grads"]  # shared prompt, all groups at once
for k in ("hidden", "triton"):
    compare(base, d[k][1, 0]["grads"], f"{k} vs logits path")
for micro in (1, 2):
    compare(d["hidden"][1, 0]["grads"], d["hidden"][1, micro]["grads"],
            f"micro-batches of {micro} vs all at once")
PY
  python3 bench/bench_logprob_memory.py && cp bench/results/logprob_memory_gpu.json "$OUT"/
fi
