#!/usr/bin/env bash
# GRPO on questions that need the image, on this CPU (docs/vision.md): the SmolVLM-shaped model made
# from the embedded SmolLM2-135M (scripts/make_vision_model.py: a random vision encoder and
# connector, then LLaVA's first stage, a caption pass with the language model frozen: "Which colours
# are in the image?" -> both colours in a random order), then GRPO on a question the captions never
# answer: "What colour is the larger shape?" (two squares of 4 colours, placed so that where a
# square sits says nothing about its size: chance 25% for a colour at random, 50% for one of the two
# in the image). Per seed, 30 steps of 4 questions x 8 answers
# against `python ref_server.py` holding the same model (BETA 0.04), held-out greedy accuracy every
# 10 steps on 128 images never trained on. RUNS: "aligned" (the above) and "unaligned" (the same
# GRPO from the random vision side, ALIGN_STEPS=0: the control); "aligned_vllm" is "aligned" with
# USE_VLLM=1 (vLLM samples with the images; run it beside "aligned" to compare times). Each run's
# metrics.jsonl and wall seconds go to $RESULTS as it ends, with the controls of its step 30
# (bench/vision_controls.py: colour- and position-swapped twins, shuffled and blank images); a run
# already there is skipped. Then bench/vision_report.py prints the tables.
#   bash bench/run_vision_demo.sh                        # aligned s42 s43, unaligned s42
#   RUNS="aligned aligned_vllm" SEEDS=42 RESULTS=/tmp/side bash bench/run_vision_demo.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
command -v nvidia-smi > /dev/null || export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
OUT=${OUT:-/tmp/vision_demo}
RESULTS=${RESULTS:-bench/results}
RUNS=${RUNS:-aligned unaligned}
SEEDS=${SEEDS:-42 43}
export SYSTEM_PROMPT="Answer inside <answer> </answer> tags."  # the caption pass's and GRPO's
export THINK_PREFILL="<answer>"
mkdir -p "$OUT" "$RESULTS"
server=""
trap '[ -n "$server" ] && kill $server 2>/dev/null; wait 2>/dev/null || true' EXIT
for run in $RUNS; do
  use_vllm=0
  [ "$run" = aligned_vllm ] && use_vllm=1
  model="$OUT/model_${run%_vllm}"  # aligned_vllm trains the aligned model
  if [ ! -e "$model/config.json" ]; then
    steps=300
    [ "$run" = unaligned ] && steps=0
    echo "=== the model: scripts/make_vision_model.py, ALIGN_STEPS=$steps -> $model"
    start=$(date +%s)
    VISION_MODEL_DIR="$model" ALIGN_STEPS=$steps ALIGN_BATCH=8 \
      python scripts/make_vision_model.py > "$OUT/model_$run.log" 2>&1
    echo $(( $(date +%s) - start )) > "$RESULTS/vision_model_${run}_wall_s"
    [ -e "$model/caption_losses.json" ] \
      && cp "$model/caption_losses.json" "$RESULTS/vision_caption_losses.json"
  fi
  for seed in $SEEDS; do
    name="vision_${run}_s$seed"
    if [ -e "$RESULTS/${name}_wall_s" ]; then echo "$name done: skipped"; continue; fi
    if [ "$run" = unaligned ] && [ "$seed" != "$(echo $SEEDS | cut -d' ' -f1)" ]; then continue; fi
    dir="$OUT/${run}_s$seed"
    rm -rf "$dir"
    log="$OUT/${run}_s${seed}_server.log"
    echo "=== $run, seed $seed -> $dir"
    start=$(date +%s)
    MODEL_PATH="$model" python ref_server.py > "$log" 2>&1 &
    server=$!
    until grep -q "server ready" "$log"; do
      kill -0 $server 2>/dev/null || { tail -20 "$log" >&2; exit 1; }
      sleep 1
    done
    # A run whose rollouts never give a group with different rewards stops (MAX_ROLLOUTS): kept
    # as its result, the trainer's last line in ${name}_stopped; any other failure stops the script.
    if ! MODEL_PATH="$model" DATASET=shapes REWARDS='[["reward_word", 1.0]]' EXAMPLE=null \
      MAX_NEW_TOKENS=8 LR=2e-5 EVAL_SIZE=128 SAVE_STEPS=30 SEED="$seed" OUTPUT_DIR="$dir" \
      USE_VLLM=$use_vllm \
      deepspeed --log_level error --num_gpus 1 --master_port "${MASTER_PORT:-29500}" \
      grpo_ref_split.py > "$OUT/${run}_s${seed}.log" 2>&1; then
      grep -a "rollouts in a row" "$OUT/${run}_s${seed}.log" | tail -1 > "$RESULTS/${name}_stopped"
      [ -s "$RESULTS/${name}_stopped" ] || { tail -20 "$OUT/${run}_s${seed}.log" >&2; exit 1; }
    fi
    kill $server
    wait $server 2>/dev/null || true
    server=""
    cp "$dir/metrics.jsonl" "$RESULTS/${name}_metrics.jsonl"
    echo $(( $(date +%s) - start )) > "$RESULTS/${name}_wall_s"
    if [ -e "$dir/step_30/config.json" ]; then  # the controls: does the policy read the image?
      python bench/vision_controls.py "$dir/step_30" "$seed" | tail -1 \
        > "$RESULTS/${name}_controls.json"
    fi
    rm -rf "$dir"/step_*
  done
done
.venv/bin/python bench/vision_report.py "$RESULTS"
