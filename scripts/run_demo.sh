#!/usr/bin/env bash
# The main job of the README: set up, start the reference server, train, stop the server.
#   bash scripts/run_demo.sh
#   ALL_STEPS=5 bash scripts/run_demo.sh      # settings pass through the environment
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# Quiet unless VERBOSE=1: DeepSpeed is told it runs on CPU (no "unable to detect"), and the one-time
# conversion of the embedded model prints one line, not the loaders' progress bars.
command -v nvidia-smi > /dev/null || export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
[ "${VERBOSE:-0}" = 1 ] && QUIET=0 || QUIET=1
TQDM_DISABLE=$QUIET python -c "import os; from features.quiet import quiet_libraries as q
q(not $QUIET)
from features.embedded_model import resolve_model_path as r; r(os.environ.get('MODEL_PATH', ''))"
python ref_server.py > ref_server.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
# A server that dies at start: say so, don't wait.
until grep -q "reference server ready" ref_server.log; do
  if ! kill -0 $server 2>/dev/null; then
    echo "ref_server.py exited at start; ref_server.log:" >&2
    tail -20 ref_server.log >&2
    exit 1
  fi
  sleep 1
done
NUM_GPUS=${NUM_GPUS:-1}  # CPU here: 1 rank; on a GPU machine leave --num_gpus out to use them all
# vLLM generates the demo's rollouts: 0.85x transformers' step time here
# (bench/bench_step_anatomy.py, COMPARE=vllm)
# the launcher's notices ("no hostfile") only with VERBOSE=1
[ "${VERBOSE:-0}" = 1 ] && LOG_LEVEL=info || LOG_LEVEL=error
USE_VLLM=${USE_VLLM:-1} deepspeed --log_level "$LOG_LEVEL" --num_gpus "$NUM_GPUS" grpo_ref_split.py
