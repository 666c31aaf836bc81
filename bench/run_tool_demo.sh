#!/usr/bin/env bash
# The tool-use demo: seeded runs on the mixed task (DATASET=arithmetic_mixed: half of the questions
# with operands 100..999) with the calculator (TOOLS, the worked call of bench/tool_prompt.json) and
# a call costing 0.25, and the same run without it (the project's prompt), back to back; then
# bench/tool_demo_report.py prints the table and draws the curve. The calculator runs use
# SCALE_REWARDS=none: Dr. GRPO's unscaled advantages keep the cost's scale, where group scaling
# turned it into a large advantage for the rare answer that skipped the call.
#   bash bench/run_tool_demo.sh     # 10-20 min a run on 2 CPU cores with vLLM; OUT=/tmp/tool_demo
#   RUNS=tools SEED=43 OUT=/tmp/tool_s43 bash bench/run_tool_demo.sh   # another seed: _s43
#   RUNS="tools_group tools_free" bash bench/run_tool_demo.sh   # group scaling; free calls too
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/tool_demo}
RUNS=${RUNS:-tools plain}
export DATASET=arithmetic_mixed
# a constant of bench/tool_prompt.json as its environment variable reads it (a list as JSON)
prompt() {
  python3 -c "import json, sys; v = json.load(open('bench/tool_prompt.json'))[sys.argv[1]]
print(v if isinstance(v, str) else json.dumps(v))" "$1"
}
rewards() {
  echo "[[\"reward_correct\", 2.0], [\"reward_format\", 1.0], [\"reward_tool_cost\", $1]]"
}
for run in $RUNS; do
  if [ -e "$OUT/$run" ]; then echo "$OUT/$run exists: move it away or set OUT" >&2; exit 1; fi
  start=$(date +%s)
  case $run in
    # the last two are the settings the demo ran before (group scaling)
    tools|tools_group|tools_free)
      cost=$([ "$run" = tools_free ] && echo 0.0 || echo 0.25)
      scale=$([ "$run" = tools ] && echo none || echo group)
      TOOLS='["calculator"]' SYSTEM_PROMPT="$(prompt SYSTEM_PROMPT)" EXAMPLE="$(prompt EXAMPLE)" \
        SCALE_REWARDS="$scale" REWARDS="$(rewards "$cost")" OUTPUT_DIR="$OUT/$run" \
          bash scripts/run_demo.sh ;;
    plain)
      REWARDS="$(rewards 0.25)" OUTPUT_DIR="$OUT/$run" bash scripts/run_demo.sh ;;
    *) echo "unknown run $run: tools, tools_group, tools_free or plain" >&2; exit 1 ;;
  esac
  echo $(( $(date +%s) - start )) > "$OUT/$run/wall_s"
done
.venv/bin/python bench/tool_demo_report.py "$OUT" "${SEED:+_s$SEED}"  # a seed names its copies
