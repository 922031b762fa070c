"""GRPO's flags on Megatron-LM's real parser (0.19.2): no name collides with Megatron-LM's own,
among them its Group Relative Policy Optimization flags (--grpo-group-size, ...)."""

import os
import subprocess
import sys

from lm_harness import REPO

PROBE = """
import argparse
from megatron.training.arguments import add_megatron_arguments
from megatron_grpo.megatron_lm import flags
parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
theirs = {o for a in parser._actions for o in a.option_strings if o.startswith("--grpo")}
flags.add_arguments(parser)  # argparse raises ArgumentError on any name already taken
args = parser.parse_args(["--grpo", "--grpo-group-size", "4", "--grpo-compress", "all"])
print(sorted(theirs))
print(getattr(args, "grpo.enabled"), args.grpo_group_size, getattr(args, "grpo.compress"))
"""


def test_grpo_flags_join_megatron_lm_parser_without_a_collision(megatron_lm_path):
    env = dict(os.environ, PYTHONPATH=megatron_lm_path, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs, parsed = proc.stdout.strip().splitlines()[-2:]
    assert "'--grpo-group-size'" in theirs and "'--grpo-kl-beta'" in theirs
    assert parsed == "True 4 all"
