#!/usr/bin/env bash
# The objectives comparison: the demo (scripts/run_demo.sh: 30 steps, vLLM, the reference server)
# with each setting below and two seeds, back to back, pass@4 at every held-out evaluation
# (EVAL_SAMPLES=4). Each run's metrics.jsonl and wall time are copied to $RESULTS as it finishes; a
# run already there is skipped, so the script can be stopped and started again (in a later session
# too). Then bench/objectives_report.py prints the table.
#   bash bench/run_objectives.sh     # 10 runs, 20-30 min each on 2 CPU cores; OUT=/tmp/objectives
#   RUNS="default dynamic" SEEDS=42 bash bench/run_objectives.sh
#   RUNS="mu2 cispo sapo gmpo" SEEDS="42 43 44" bash bench/run_objectives.sh   # issue 59
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/objectives}
RESULTS=${RESULTS:-bench/results}
RUNS=${RUNS:-default flat dynamic difficulty dr_grpo}
SEEDS=${SEEDS:-42 43}
export EVAL_SAMPLES=${EVAL_SAMPLES:-4}
mkdir -p "$OUT" "$RESULTS"
for seed in $SEEDS; do
  for run in $RUNS; do
    dir="$OUT/${run}_s$seed"
    if [ -e "$RESULTS/objectives_${run}_s${seed}_wall_s" ]; then
      echo "${run}_s$seed done: skipped"
      continue
    fi
    rm -rf "$dir"
    case $run in
      default) settings=() ;;
      dynamic) settings=(DYNAMIC_SAMPLING=1) ;;
      difficulty) settings=(SAMPLER=difficulty) ;;
      dr_grpo) settings=(LOSS_TYPE=dr_grpo SCALE_REWARDS=none) ;;
      # a constant LR, the default until 2026-11-25
      flat) settings=(DS_CONFIG=bench/ds_config_flat.json) ;;
      # the pass before step 1 counts in the wall time
      learnability) settings=(SAMPLER=learnability PASS_RATE_QUESTIONS=256) ;;
      learn_dynamic) settings=(SAMPLER=learnability PASS_RATE_QUESTIONS=256 DYNAMIC_SAMPLING=1) ;;
      # The objectives of 2025-26 (issue 59, docs/loss.md). At MU = 1 every token's ratio is 1 and
      # the four surrogates take the same gradient, so they compare at MU = 2, beside PPO's clip.
      mu2) settings=(MU=2) ;;
      # CISPO as its paper, TRL and verl run it (issue 79): one token mean, the weight capped at 5
      # (CISPO_MAX_RATIO). The "cispo" results of 2026-11-27/28 ran before: answer means, cap 1.2.
      cispo|cispo_paper) settings=(OBJECTIVE=cispo LOSS_TYPE=dapo MU=2) ;;
      sapo) settings=(OBJECTIVE=sapo MU=2) ;;
      gmpo) settings=(OBJECTIVE=gmpo MU=2) ;;
      rloo) settings=(ADVANTAGE=rloo) ;;
      reinforce_pp) settings=(ADVANTAGE=reinforce_pp_baseline) ;;
      passk) settings=(ADVANTAGE=passk) ;;
      gdpo) settings=(REWARD_NORM=normalize_then_sum) ;;
      top_entropy) settings=(TOP_ENTROPY_QUANTILE=0.2) ;;
      *) echo "unknown run $run: default, flat, dynamic, difficulty, dr_grpo, learnability," \
              "learn_dynamic, mu2, cispo, cispo_paper, sapo, gmpo, rloo, reinforce_pp, passk," \
              "gdpo or top_entropy" >&2; exit 1 ;;
    esac
    echo "=== $run, seed $seed: ${settings[*]:-the defaults} -> $dir"
    start=$(date +%s)
    env "${settings[@]}" SEED="$seed" OUTPUT_DIR="$dir" bash scripts/run_demo.sh \
      > "$OUT/${run}_s$seed.log" 2>&1
    cp "$dir/metrics.jsonl" "$RESULTS/objectives_${run}_s${seed}_metrics.jsonl"
    if [ -e "$dir/pass_rates.json" ]; then  # the pass's answers count as generated ones too
      cp "$dir/pass_rates.json" "$RESULTS/objectives_${run}_s${seed}_pass_rates.json"
    fi
    echo $(( $(date +%s) - start )) > "$RESULTS/objectives_${run}_s${seed}_wall_s"
    rm -rf "$dir"/step_*  # the checkpoints (about 2 GB each): ten runs' would fill the disk
  done
done
.venv/bin/python bench/objectives_report.py "$RESULTS"
