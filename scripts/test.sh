#!/usr/bin/env bash
# The test command of the README (and of .ci/run): set up, then run every test; bench/RESULTS.md says how long.
#   bash scripts/test.sh                 # extra arguments go to pytest, e.g. -k server
#   bash scripts/test.sh -m "not slow"   # the quick subset: no DeepSpeed launches, vLLM engines or server processes
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python -m pytest tests -v --durations=10 "$@"
