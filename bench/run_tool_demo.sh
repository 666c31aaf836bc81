#!/usr/bin/env bash
# The tool-use demo: one seeded run on the mixed task (DATASET=arithmetic_mixed: half of the questions with operands
# 100..999) with the calculator (TOOLS, the worked call of bench/tool_prompt.json, a call costing 0.25) and the same
# run without it (the project's prompt), back to back; then bench/tool_demo_report.py prints the table and the curve.
#   bash bench/run_tool_demo.sh           # ~45 min on 2 CPU cores with vLLM; OUT=/tmp/tool_demo by default
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/tool_demo}
export DATASET=arithmetic_mixed REWARDS='[["reward_correct", 2.0], ["reward_format", 1.0], ["reward_tool_cost", 0.25]]'
prompt() {  # a constant of bench/tool_prompt.json as its environment variable reads it (a list as JSON)
  python3 -c "import json, sys; v = json.load(open('bench/tool_prompt.json'))[sys.argv[1]]
print(v if isinstance(v, str) else json.dumps(v))" "$1"
}
for run in tools plain; do
  if [ -e "$OUT/$run" ]; then echo "$OUT/$run exists: move it away or set OUT" >&2; exit 1; fi
  start=$(date +%s)
  if [ "$run" = tools ]; then
    TOOLS='["calculator"]' SYSTEM_PROMPT="$(prompt SYSTEM_PROMPT)" EXAMPLE="$(prompt EXAMPLE)" \
      OUTPUT_DIR="$OUT/$run" bash scripts/run_demo.sh
  else
    OUTPUT_DIR="$OUT/$run" bash scripts/run_demo.sh
  fi
  echo $(( $(date +%s) - start )) > "$OUT/$run/wall_s"
done
.venv/bin/python bench/tool_demo_report.py "$OUT"
