#!/usr/bin/env bash
# The dependency floors as pip constraints (name==floor), from hfdist/requirements/*.txt: what CI installs
# (scripts/setup.sh under HFDIST_FLOORS=1, which .ci/run sets), so the floors are the versions the suite exercises.
set -euo pipefail
cd "$(dirname "$0")/.."
# name[extras]>=floor... -> name==floor (constraints take no extras)
sed -n 's/^\([A-Za-z0-9_.-]\{1,\}\)\(\[[^]]*\]\)\{0,1\}>=\([^,;# ]\{1,\}\).*/\1==\3/p' hfdist/requirements/*.txt
