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
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev]"
# DeepSpeed JIT-compiles its CPU ops (Adam, async I/O, shared-memory comm) on first use: minutes (6.5 measured on
# 2 cores) that would otherwise stall the first ZeRO run. Build them now, into ~/.cache/torch_extensions. GPU hosts
# build the CUDA variants on first use (they need the CUDA toolkit; hfdist checks NVMe offload's before launch).
.venv/bin/python - <<'PY' 2>&1 | grep '^setup:' || true
import torch
if torch.cuda.is_available():
    raise SystemExit(0)
from deepspeed.accelerator import get_accelerator
for name in ("CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder"):
    builder = get_accelerator().create_op_builder(name)
    try:
        builder.load(verbose=False)
        print(f"setup: DeepSpeed op {builder.NAME} built")
    except Exception as exc:  # a missing libaio only affects zero3_offload_nvme; the run reports it
        print(f"setup: DeepSpeed op {builder.NAME} not built ({type(exc).__name__}: {exc})")
PY
echo "setup: ready: $(.venv/bin/python -c 'import torch, transformers, accelerate, deepspeed, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__, "deepspeed", deepspeed.__version__, "peft", peft.__version__)' 2>/dev/null | tail -1)"
