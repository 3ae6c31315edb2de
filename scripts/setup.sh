#!/usr/bin/env bash
# Set up hfdist in ./.venv on a fresh machine: torch first (pinned, so pip never picks another build), then the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# ZeRO-3 NVMe offload compiles DeepSpeed's async_io op against libaio; install it where we can.
if ! ldconfig -p 2>/dev/null | grep -q 'libaio\.so '; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq libaio-dev >/dev/null
  else
    echo "setup: libaio-dev is missing (needed by zero3_offload_nvme only); install it with your package manager" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# HFDIST_FLOORS=1 (CI: .ci/run): every dependency at exactly its floor (hfdist/requirements/*.txt), so the floors
# are what the suite exercises; otherwise pip picks the newest releases the requirements allow.
CONSTRAINTS=()
if [ "${HFDIST_FLOORS:-0}" = 1 ]; then
  bash scripts/floors.sh > .venv/floors.txt
  CONSTRAINTS=(-c .venv/floors.txt)
fi
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"}
.venv/bin/python -m pip install -q -e ".[dev]" ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"}
# pip compiles what it installs, but not an editable install's sources: where PYTHONDONTWRITEBYTECODE is set (as on
# the machine these scripts were measured on) every process, each rank of each launch, compiles hfdist again on import
# (0.12 s of CPU each, measured; the test suite starts several hundred).
.venv/bin/python -m compileall -q hfdist tests > /dev/null
# DeepSpeed JIT-compiles its ops on first use: minutes that would otherwise stall the first ZeRO run. Build the ones
# this host's rungs use now (CPU and GPU hosts alike: cpu_adam for zero3_offload_cpu everywhere), into
# ~/.cache/torch_extensions.
.venv/bin/python scripts/prebuild_deepspeed_ops.py 2>&1 | grep '^setup:' || true
echo "setup: ready: $(.venv/bin/python -c 'import torch, transformers, accelerate, deepspeed, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__, "deepspeed", deepspeed.__version__, "peft", peft.__version__)' 2>/dev/null | tail -1)"
