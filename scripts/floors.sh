#!/usr/bin/env bash
# The dependency floors as pip constraints (name==floor), from hfdist/requirements/*.txt: what CI installs
# (scripts/setup.sh under HFDIST_FLOORS=1, which .ci/run sets), so the floors are the versions the suite exercises.
set -euo pipefail
cd "$(dirname "$0")/.."
sed -n 's/^\([A-Za-z0-9_.-]\{1,\}\)>=\([^,;# ]\{1,\}\).*/\1==\2/p' hfdist/requirements/*.txt
