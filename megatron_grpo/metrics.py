"""Former name of megatron_grpo.training.metrics, kept for one release: importing it warns
(DeprecationWarning) and gives that module."""

import megatron_grpo.training.metrics  # noqa: F401  (what this name now gives)
from megatron_grpo import _moved

_moved(__name__)
