"""``python -m megatron_grpo.megatron_lm SCRIPT [Megatron-LM flags] [--grpo ...]``."""

import sys

from megatron_grpo.megatron_lm.runner import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
