#!/usr/bin/env bash
# The GPU suite in one command (benchmarks/gpu/suite.py): on the GPUs visible, in parts of under 9 minutes that
# resume where the last stopped. Run it again until it says done; --list shows the parts, --dry-run the CPU stand-in.
#   bash benchmarks/gpu/run.sh            # writes results/<gpu>/gpu_suite.md, .json, gpu_suite_commands.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
exec "$PYTHON" benchmarks/gpu/suite.py "$@"
