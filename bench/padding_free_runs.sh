#!/usr/bin/env bash
# bench/RESULTS.md's padding-free rows: the step of bench_padding_free.py on the demo's answers and
# on GSM8K's at MAX_NEW_TOKENS 256 and 512 (each a run's completions.jsonl, as padding_share.py's
# docstring makes them): the step's four groups; GSM8K's with gradient checkpointing, as its runs
# needed on a 24 GiB CPU machine in fp32. Each step's lengths kept in bench/results/ for the GPU's
# part7 (bench/gpu_checks.sh).
#   DEMO=/tmp/demo GSM256=/tmp/gsm256 GSM512=/tmp/gsm512 bash bench/padding_free_runs.sh
set -eu
PY=${PY:-.venv/bin/python}
if [ -z "${SKIP_DEMO:-}" ]; then
  QUESTIONS=4 STEPS_FILE=bench/results/padding_free_demo.json \
    $PY bench/bench_padding_free.py "${DEMO:-/tmp/demo}/completions.jsonl"
fi
QUESTIONS=4 GRADIENT_CHECKPOINTING=1 STEPS_FILE=bench/results/padding_free_gsm256.json \
  $PY bench/bench_padding_free.py "${GSM256:-/tmp/gsm256}/completions.jsonl"
QUESTIONS=4 GRADIENT_CHECKPOINTING=1 STEPS_FILE=bench/results/padding_free_gsm512.json \
  $PY bench/bench_padding_free.py "${GSM512:-/tmp/gsm512}/completions.jsonl"
