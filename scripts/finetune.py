"""Fine-tune a model with a parallelism strategy from the config ladder (thin entry point: `hfdist finetune`).

    accelerate launch scripts/finetune.py --config fsdp_hybrid.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml scripts/finetune.py --lora

`python scripts/finetune.py --help` lists the options.
"""

import sys

from hfdist.cli.finetune import exit_after_run, run_finetune

if __name__ == "__main__":
    # A hand-over starts this script again in each rank.
    exit_after_run(run_finetune(sys.argv[1:], [__file__]))
