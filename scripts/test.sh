#!/usr/bin/env bash
# The test command of the README: set up, then run every test (about 10 minutes on 2 CPU cores).
#   bash scripts/test.sh            # extra arguments go to pytest, e.g. -k server
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python -m pytest tests -v --durations=10 "$@"
