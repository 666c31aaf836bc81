#!/usr/bin/env bash
# On-policy distillation against GRPO on this CPU (docs/distillation.md): the student is the
# embedded SmolLM2-135M, the teacher the demo's own GRPO-trained step_30 (trained first, by
# scripts/run_demo.sh, if $TEACHER_DIR holds none; TEACHER_STEP=60 trains and takes a 60-step
# run's last checkpoint, a stronger teacher). Three runs per seed, each the demo's 30 steps
# (vLLM, 4 questions x 8 answers, held-out greedy accuracy every 5 steps), back to back:
#   grpo      the default: rewards, a reference server, BETA 0.04
#   opd       pure distillation: a TEACHER=1 server, DISTILL_COEF=1, REWARDS weighed 0, BETA 0
#   grpo_opd  both: the default rewards plus DISTILL_COEF=1 against the teacher, BETA 0
#   grpo_opd_matched  both, the teacher term sized to the group term each batch (DISTILL_SCALE)
#   grpo_opd_none     both, SCALE_REWARDS none: the rewards' own scale (0 to 2) beside the teacher
#   grpo_opd_first    the teacher alone until its KL is TEACHER_FIRST_KL=0.05 or less, then both
#   grpo_opd_wrong    both, the teacher's term only on answers rewarded under 2 (DISTILL_BELOW=2:
#                     the wrong ones; KDRL's reward-guided mask)
#   grpo_opd_handoff  the teacher alone for the first TEACHER_STEPS=10 steps, then the rewards
#                     alone with a fresh AdamW and DYNAMIC_SAMPLING: distillation, then RL
#   grpo_ds   the default with DYNAMIC_SAMPLING from step 1 and no teacher: the hand-off's baseline
# WORDINGS=1 also asks each run's last checkpoint the held-out sums in wordings training never uses
# (bench/probe_wordings.py, WORDING_SEEDS "0 1"), into $RESULTS/<run>_wordings.txt.
# Each run's metrics.jsonl and wall seconds go to $RESULTS as it ends; a run already there is
# skipped, so the script can be stopped and started again. Then bench/distill_report.py prints the
# table and draws bench/results/distill_curves.png.
# The recipe (issue 60): pure OPD stopped at step STOP_AT of the 30, three ways to spend the same
# 32 answers a step:
#   opd           4 questions x 8 answers, LOSS_TYPE grpo (the defaults)
#   opd_wide      32 questions x 1 answer
#   opd_wide_sum  32 x 1 with LOSS_TYPE dr_grpo (every token weighs the same: tinker, SkyRL)
#   bash bench/run_distill.sh                      # 6 runs, about 15 min each on 2 CPU cores
#   RUNS="opd" SEEDS=42 bash bench/run_distill.sh
#   TEACHER_DIR=output/distill_teacher60 TEACHER_STEP=60 RUNS="opd grpo_opd" SEEDS=42 \
#     EVAL_SIZE=512 RESULTS=bench/results/distill_teacher60 bash bench/run_distill.sh
#   RUNS="opd opd_wide opd_wide_sum" SEEDS="42 43 44" STOP_AT=5 EVAL_SIZE=512 \
#     RESULTS=bench/results/distill_recipe bash bench/run_distill.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
. bench/run_record.sh
command -v nvidia-smi > /dev/null || export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
OUT=${OUT:-/tmp/distill}
RESULTS=${RESULTS:-bench/results}
RUNS=${RUNS:-grpo opd grpo_opd}
SEEDS=${SEEDS:-42 43}
TEACHER_DIR=${TEACHER_DIR:-output/distill_teacher}  # the demo's OUTPUT_DIR, trained if empty
TEACHER_STEP=${TEACHER_STEP:-30}  # the teacher is its step_$TEACHER_STEP, of a run that long
teacher="$TEACHER_DIR/step_$TEACHER_STEP"
WORDINGS=${WORDINGS:-0}
STOP_AT=${STOP_AT:-0}  # > 0: stop each run once its held-out evaluation at this step is written
export EVAL_SIZE=${EVAL_SIZE:-128}  # held-out questions: 512 tells 3 points apart, 128 cannot
mkdir -p "$OUT" "$RESULTS"
# EVAL_SIZE also sets what trains: the dataset's last EVAL_SIZE questions are held out and the rest
# train. A teacher trained with another EVAL_SIZE has trained on some of the student's held-out
# questions, so the teacher's folder records its EVAL_SIZE and a different one is refused.
needs_teacher=0
for run in $RUNS; do
  case $run in grpo|grpo_ds) ;; *) needs_teacher=1 ;; esac
done
if [ "$needs_teacher" = 1 ] && [ ! -e "$teacher/config.json" ]; then
  echo "=== the teacher: the demo's GRPO, $TEACHER_STEP steps -> $TEACHER_DIR"
  ALL_STEPS=$TEACHER_STEP OUTPUT_DIR="$TEACHER_DIR" bash scripts/run_demo.sh \
    > "$OUT/teacher.log" 2>&1
  echo "$EVAL_SIZE" > "$TEACHER_DIR/eval_size"
fi
teacher_eval_size=$(cat "$TEACHER_DIR/eval_size" 2>/dev/null || echo "not recorded")
if [ "$needs_teacher" = 1 ] && [ "$teacher_eval_size" != "$EVAL_SIZE" ]; then
  echo "the teacher in $TEACHER_DIR was trained with EVAL_SIZE $teacher_eval_size, these runs" \
       "hold out $EVAL_SIZE: it may have trained on the student's held-out questions. Train it" \
       "with this EVAL_SIZE (an empty TEACHER_DIR), or, if it was, echo $EVAL_SIZE >" \
       "$TEACHER_DIR/eval_size" >&2
  exit 1
fi
server=""
trap '[ -n "$server" ] && kill $server 2>/dev/null; wait 2>/dev/null || true' EXIT
for seed in $SEEDS; do
  for run in $RUNS; do
    name="distill_${run}_s$seed"
    if [ -e "$RESULTS/${name}_wall_s" ]; then echo "$name done: skipped"; continue; fi
    no_rewards='[["reward_correct", 0.0], ["reward_format", 0.0]]'
    case $run in
      grpo) served=(TEACHER=0 MODEL_PATH=) trained=() ;;
      grpo_ds) served=(TEACHER=0 MODEL_PATH=) trained=(DYNAMIC_SAMPLING=1) ;;
      opd) served=(TEACHER=1 MODEL_PATH="$teacher")
           trained=(DISTILL_COEF=1 BETA=0 REWARDS="$no_rewards") ;;
      opd_wide) served=(TEACHER=1 MODEL_PATH="$teacher")
                trained=(DISTILL_COEF=1 BETA=0 REWARDS="$no_rewards" NUM_PRE_Q=1 Q_BATCH_SIZE=32) ;;
      opd_wide_sum) served=(TEACHER=1 MODEL_PATH="$teacher")
                    trained=(DISTILL_COEF=1 BETA=0 REWARDS="$no_rewards" NUM_PRE_Q=1
                             Q_BATCH_SIZE=32 LOSS_TYPE=dr_grpo) ;;
      grpo_opd) served=(TEACHER=1 MODEL_PATH="$teacher")
                trained=(DISTILL_COEF=1 BETA=0) ;;
      grpo_opd_matched) served=(TEACHER=1 MODEL_PATH="$teacher")
                        trained=(DISTILL_COEF=1 BETA=0 DISTILL_SCALE=matched) ;;
      grpo_opd_none) served=(TEACHER=1 MODEL_PATH="$teacher")
                     trained=(DISTILL_COEF=1 BETA=0 SCALE_REWARDS=none) ;;
      grpo_opd_first) served=(TEACHER=1 MODEL_PATH="$teacher")
                      trained=(DISTILL_COEF=1 BETA=0 TEACHER_FIRST_KL=0.05) ;;
      grpo_opd_wrong) served=(TEACHER=1 MODEL_PATH="$teacher")
                      trained=(DISTILL_COEF=1 BETA=0 DISTILL_BELOW=2) ;;
      grpo_opd_handoff) served=(TEACHER=1 MODEL_PATH="$teacher")
                        trained=(DISTILL_COEF=1 BETA=0 TEACHER_STEPS=10 DYNAMIC_SAMPLING=1) ;;
      *) echo "unknown run $run: grpo, grpo_ds, opd, opd_wide, opd_wide_sum, grpo_opd," \
              "grpo_opd_matched, grpo_opd_none, grpo_opd_first, grpo_opd_wrong or" \
              "grpo_opd_handoff" >&2; exit 1 ;;
    esac
    dir="$OUT/${run}_s$seed"
    rm -rf "$dir"
    log="$OUT/${run}_s${seed}_server.log"
    echo "=== $run, seed $seed: server ${served[*]}, trainer ${trained[*]:-the defaults} -> $dir"
    start=$(date +%s)
    env "${served[@]}" python ref_server.py > "$log" 2>&1 &
    server=$!
    until grep -q "server ready" "$log"; do
      kill -0 $server 2>/dev/null || { tail -20 "$log" >&2; exit 1; }
      sleep 1
    done
    # its own process group, so that STOP_AT can stop the launcher, the rank and vLLM together
    setsid env "${trained[@]}" SEED="$seed" OUTPUT_DIR="$dir" USE_VLLM=1 EVAL_STEPS=5 SAVE_STEPS=0 \
      deepspeed --log_level error --num_gpus 1 grpo_ref_split.py > "$OUT/${run}_s${seed}.log" 2>&1 &
    trainer=$!
    if [ "$STOP_AT" -gt 0 ]; then
      until grep -q "\"step\": $STOP_AT, \"eval_" "$dir/metrics.jsonl" 2>/dev/null; do
        kill -0 $trainer 2>/dev/null || break
        sleep 5
      done
      kill -TERM -- -$trainer 2>/dev/null || true
    fi
    wait $trainer || [ "$STOP_AT" -gt 0 ] || { tail -20 "$OUT/${run}_s${seed}.log" >&2; exit 1; }
    if [ "$STOP_AT" -gt 0 ] && ! grep -q "\"step\": $STOP_AT, \"eval_" "$dir/metrics.jsonl"; then
      echo "$name stopped before step $STOP_AT's evaluation:" >&2
      tail -20 "$OUT/${run}_s${seed}.log" >&2
      exit 1
    fi
    record_run $server "$dir" "$name" "$start"
    server=""
    last=$(ls -d "$dir"/step_* 2>/dev/null | sort -V | tail -1)
    if [ "$WORDINGS" = 1 ] && [ -n "$last" ]; then
      CHECKPOINT="$last" SEED="$seed" WORDING_SEEDS="0 1" .venv/bin/python bench/probe_wordings.py \
        > "$RESULTS/${name}_wordings.txt" 2> "$OUT/${run}_s${seed}_wordings.log"
    fi
    rm -rf "$dir"/step_*  # the checkpoint (about 2 GB): six runs' would fill the disk
  done
done
.venv/bin/python bench/distill_report.py "$RESULTS"
