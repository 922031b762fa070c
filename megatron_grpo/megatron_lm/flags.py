"""GRPO's flags on Megatron-LM's own parser, and the settings read back from its args.

The names are the project's (``--grpo``, ``--grpo-<field>``, ``--grpo-offload-<field>``, from the
config dataclasses) plus ``--grpo-metrics-file``. None collides with Megatron-LM's
reinforcement-learning flags of Group Relative Policy Optimization (``--grpo-group-size``,
``--grpo-kl-beta``, ...): tests/megatron_lm/test_flags.py checks it on
Megatron-LM's real parser.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.offload.config import OffloadConfig
from megatron_grpo.training.arguments import add_section, validate_grpo


@dataclass
class RunnerSettings:
    """What the runner adds to a Megatron-LM run besides GRPO's own settings."""

    FLAG_PREFIX = "grpo-"

    metrics_file: Optional[str] = None
    """Write one JSON record per training iteration to this file (rank 0 of the last pipeline
    stage): loss, step time, wire bytes counted per collective, and with --grpo the tier map
    and decisions. Works with GRPO on or off, so two runs compare from Megatron-LM's own loop."""


SECTIONS = (("grpo", GRPOConfig, "GRPO: gradient-aware resource partitioning (not the RL algorithm)"),
            ("offload", OffloadConfig, "GRPO memory tier"),
            ("runner", RunnerSettings, "GRPO runner"))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add GRPO's groups to ``parser`` (Megatron-LM's, from add_megatron_arguments)."""
    for section, cls, title in SECTIONS:
        add_section(parser, section, cls(), cls.FLAG_PREFIX, title)
    return parser


def settings(args, world_size: Optional[int] = None) -> tuple:
    """(GRPOConfig, OffloadConfig, RunnerSettings) from Megatron-LM's parsed ``args``; raises
    ConfigError naming the flag for a value out of range."""
    out = []
    for section, cls, _ in SECTIONS:
        sub = cls()
        for key, value in vars(args).items():
            if key.startswith(section + "."):
                setattr(sub, key.split(".", 1)[1], value)
        out.append(sub)
    grpo, offload, runner = out
    validate_grpo(grpo, offload, world_size)
    return grpo, offload, runner
