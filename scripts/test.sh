#!/usr/bin/env bash
# The test command of the README (and of .ci/run): set up, then run every test.
# bench/RESULTS.md says how long.
#   bash scripts/test.sh                 # extra arguments go to pytest, e.g. -k server
#   bash scripts/test.sh -m "not slow"   # the quick subset: no DeepSpeed launches, vLLM engines
#                                        # or server processes
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# Two pytest-xdist workers: many tests wait on launches and servers, and each worker gets its share
# of the cores (tests/conftest.py). Each file runs on one worker, so a module-scoped fixture (a run,
# a server, an engine) is made once. `-n 0` runs them in one process. docs/tests.md says where the
# time goes.
python -m pytest tests -n 2 --dist loadfile -v --durations=10 "$@"
