#!/usr/bin/env bash
# Environments on this CPU (docs/environments.md): the demo's 30 steps (vLLM, 4 questions x 8
# completions, held-out greedy accuracy every 5 steps) on three environments at once and on each
# alone:
#   mix         the arithmetic task, $RG_TASK (reasoning-gym) and the number-guessing game that
#               scripts/guess_number_env.py serves with OpenEnv, weights 1 : 1 : 1
#   arithmetic  the arithmetic task alone (ENVIRONMENTS [["arithmetic", 1]])
#   rg          $RG_TASK alone
#   guess       the game alone
# Each run's last checkpoint is also asked $UNSEEN_TASK, a reasoning-gym task no run trains on, as
# the base model is (bench/probe_environment.py): does anything transfer?
# Each run's metrics.jsonl and wall seconds go to $RESULTS as it ends; a run already there is
# skipped, so the script can be stopped and started again.
#   bash bench/run_envs.sh                          # 12 runs, seeds 42 43 44
#   RUNS=mix SEEDS=42 ALL_STEPS=2 EVAL_STEPS=1 bash bench/run_envs.sh   # a smoke run
# Beside another run: PORT (the server's), REF_SERVER, MASTER_PORT and GUESS_PORT apart.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
. bench/run_record.sh
command -v nvidia-smi > /dev/null || export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
OUT=${OUT:-/tmp/envs}
RESULTS=${RESULTS:-bench/results/envs}
RUNS=${RUNS:-mix arithmetic rg guess}
SEEDS=${SEEDS:-42 43 44}
# A task the base model sometimes gets right, so its groups differ and GRPO has a signal (probed
# with bench/probe_environment.py; the figures, and the tasks it never got right, in RESULTS.md).
# Sums of two numbers of 1-2 digits: sums of three stayed near where they began, alone too.
sums='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'
RG_TASK=${RG_TASK:-"[\"rg:chain_sum\", 1.0, $sums]"}
# Products of 1-2 digit numbers, which no run trains on: neither solved nor hopeless at the start.
UNSEEN_TASK=${UNSEEN_TASK:-'["rg:products", 1.0, {"min_digits": 1, "max_digits": 2}]'}
GUESS_PORT=${GUESS_PORT:-8011}  # the game: 1..8 in two guesses (its defaults, GUESS_MAX and _TURNS)
export ALL_STEPS=${ALL_STEPS:-30} EVAL_STEPS=${EVAL_STEPS:-5}
guess="[\"openenv:http://127.0.0.1:$GUESS_PORT\", 1.0, {\"reward_weights\": {\"solved\": 2.0}}]"
mkdir -p "$OUT" "$RESULTS"
# probe FILE LOG CHECKPOINT: $UNSEEN_TASK's score for CHECKPOINT ("" = the base model) at $seed.
# It goes to FILE.part, renamed when whole: a probe that dies, or a report read while one runs,
# never finds a half-written score under FILE's name.
probe() {
  CHECKPOINT="$3" ENVIRONMENTS="[$UNSEEN_TASK]" SEED="$seed" python bench/probe_environment.py \
    > "$1.part" 2> "$2"
  mv "$1.part" "$1"
}
server=""
game=""
trap '[ -n "$server" ] && kill $server 2>/dev/null; [ -n "$game" ] && kill $game 2>/dev/null;
      wait 2>/dev/null || true' EXIT
GUESS_PORT=$GUESS_PORT python scripts/guess_number_env.py > "$OUT/guess_server.log" 2>&1 &
game=$!
for seed in $SEEDS; do
  for run in $RUNS; do
    name="envs_${run}_s$seed"
    if [ -e "$RESULTS/${name}_wall_s" ]; then echo "$name done: skipped"; continue; fi
    case $run in
      mix) setting="[[\"arithmetic\", 1.0], $RG_TASK, $guess]" ;;
      arithmetic) setting='[["arithmetic", 1.0]]' ;;
      rg) setting="[$RG_TASK]" ;;
      guess) setting="[$guess]" ;;
      *) echo "unknown run $run: mix, arithmetic, rg or guess" >&2; exit 1 ;;
    esac
    dir="$OUT/${run}_s$seed"
    rm -rf "$dir"
    log="$OUT/${run}_s${seed}_server.log"
    echo "=== $run, seed $seed: ENVIRONMENTS=$setting -> $dir"
    start=$(date +%s)
    python ref_server.py > "$log" 2>&1 &
    server=$!
    until grep -q "server ready" "$log"; do
      kill -0 $server 2>/dev/null || { tail -20 "$log" >&2; exit 1; }
      sleep 1
    done
    ENVIRONMENTS="$setting" SEED="$seed" OUTPUT_DIR="$dir" USE_VLLM=1 SAVE_STEPS=0 \
      deepspeed --log_level error --num_gpus 1 --master_port "${MASTER_PORT:-29500}" \
      grpo_ref_split.py > "$OUT/${run}_s${seed}.log" 2>&1 ||
      { tail -20 "$OUT/${run}_s${seed}.log" >&2; exit 1; }
    record_run $server "$dir" "$name" "$start"
    server=""
    last=$(ls -d "$dir"/step_* 2>/dev/null | sort -V | tail -1)
    if [ ! -e "$RESULTS/unseen_base_s$seed.json" ]; then  # the base model, once per seed
      probe "$RESULTS/unseen_base_s$seed.json" "$OUT/unseen_base_s$seed.log" ""
    fi
    if [ -n "$last" ]; then
      probe "$RESULTS/${name}_unseen.json" "$OUT/${run}_s${seed}_unseen.log" "$last"
    fi
    rm -rf "$dir"/step_*  # the checkpoint (about 2 GB)
  done
done
echo "results in $RESULTS"
