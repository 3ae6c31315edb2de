"""Run rungs of the ladder side by side and write the comparison matrix (thin entry point: `hfdist compare`).

    python scripts/compare.py                       # every shipped rung, embedded default, results/<hardware>/
    python scripts/compare.py --configs ddp fsdp_full_shard zero3 --lora --max-steps 30
"""

import shlex
import sys

from hfdist.report.compare import build_parser, run_comparison

if __name__ == "__main__":
    sys.exit(run_comparison(build_parser().parse_args(sys.argv[1:]),
                            "python scripts/compare.py " + shlex.join(sys.argv[1:])))
