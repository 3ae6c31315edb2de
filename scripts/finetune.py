"""Fine-tune a model with a parallelism strategy from the config ladder (thin entry point: `hfdist finetune`).

    accelerate launch scripts/finetune.py --config fsdp_hybrid.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml scripts/finetune.py --lora

`python scripts/finetune.py --help` lists the options.
"""

import sys

from hfdist.cli.finetune import run_finetune
from hfdist.console import leave

if __name__ == "__main__":
    # A hand-over starts this script again in each rank.
    leave(run_finetune(sys.argv[1:], [__file__]))
