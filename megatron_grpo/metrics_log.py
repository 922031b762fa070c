"""Former name of megatron_grpo.training.metrics_log, kept for one release: importing it warns
(DeprecationWarning) and gives that module."""

import megatron_grpo.training.metrics_log  # noqa: F401  (what this name now gives)
from megatron_grpo import _moved

_moved(__name__)
